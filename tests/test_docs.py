"""The documentation: the site builds with `mkdocs build --strict`, and every Python snippet in README.md and
docs/ runs.

The snippets of one page run in order in one namespace, so a page sets up `model`, `data`, ... once, in a block
of its own. A block right after `<!-- requires cuda -->` is skipped without CUDA; one right after
`<!-- not run: REASON -->` is never run (a `pip install`, a script that needs several processes).

Importing torch costs seconds, so one runner process imports it once and forks a fresh child per page: each
page runs alone, with its own working directory, and a CPU memory cap or a changed default set by one page
never reaches another.
"""

import glob
import json
import os
import re
import select
import subprocess
import sys
import textwrap
from dataclasses import asdict, dataclass
from typing import List, Optional

import pytest

from helpers import REPO

PAGE_TIMEOUT_S = 60

FENCE = re.compile(r"^```(\S*)[^\n]*\n(.*?)^```[ \t]*$", re.M | re.S)
MARKER = re.compile(r"<!--\s*(requires cuda|not run:(.*?))\s*-->", re.S)


@dataclass
class Snippet:
    line: int  # the line of the page where the code starts (after the fence)
    code: str
    cuda: bool  # skipped without CUDA
    not_run: Optional[str]  # the reason it is never run


def snippets(text: str) -> List[Snippet]:
    """The ```python blocks of a Markdown page, with the marker comment right before each (if any)."""
    found = []
    for match in FENCE.finditer(text):
        if match.group(1) != "python":
            continue
        before = text[: match.start()].rstrip()
        comment = before[before.rfind("<!--") :] if before.endswith("-->") else ""
        marker = MARKER.fullmatch(comment)
        cuda = bool(marker) and marker.group(1) == "requires cuda"
        not_run = marker.group(2).strip() if marker and marker.group(2) is not None else None
        if marker and not cuda and not not_run:
            raise ValueError(f"a `not run:` marker needs a reason: {comment}")
        line = text.count("\n", 0, match.start(2)) + 1
        found.append(Snippet(line, match.group(2), cuda, not_run))
    return found


def pages() -> List[str]:
    docs = sorted(glob.glob(os.path.join(REPO, "docs", "**", "*.md"), recursive=True))
    return [os.path.relpath(path, REPO) for path in [os.path.join(REPO, "README.md"), *docs]]


def pages_with_snippets() -> List[str]:
    return [page for page in pages() if snippets(read(page))]


def read(page: str) -> str:
    with open(os.path.join(REPO, page), encoding="utf-8") as file:
        return file.read()


# Runs in a fresh interpreter: imports torch once, then per request (a JSON line: the page, its snippets, a
# working directory) forks a child that runs the page's snippets in one namespace, and answers with a JSON line.
RUNNER = r"""
import json, os, signal, sys, time, traceback
import torch, torch.distributed, torch.nn.functional, torch.optim, torch.utils.data, toma
torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)  # the first optimizer imports torch._dynamo: 2 s
try:
    import matplotlib.pyplot  # the history plot's import, once for every page
except ImportError:
    pass
import gc
gc.collect()
gc.freeze()  # toma collects garbage after each OOM: over the pages' objects only, not torch's

def run_page(request):
    os.chdir(request["cwd"])
    namespace = {"__name__": "__main__"}
    for snippet in request["snippets"]:
        where = f"{request['page']}:{snippet['line']}"
        if snippet["not_run"] is not None:
            print(f"[{where}] not run: {snippet['not_run']}", flush=True)
            continue
        if snippet["cuda"] and not torch.cuda.is_available():
            print(f"[{where}] skipped: needs CUDA", flush=True)
            continue
        print(f"[{where}] running", flush=True)
        started = time.perf_counter()
        code = compile("\n" * (snippet["line"] - 1) + snippet["code"], request["page"], "exec")
        exec(code, namespace)
        print(f"[{where}] ran in {time.perf_counter() - started:.2f} s", flush=True)

for line in sys.stdin:
    request = json.loads(line)
    log = os.path.join(request["cwd"], "output.txt")
    pid = os.fork()
    if pid == 0:
        status = 1
        try:
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            run_page(request)
            status = 0
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(status)
    deadline = time.monotonic() + request["timeout"]
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            answer = {"returncode": os.waitstatus_to_exitcode(status), "timed_out": False}
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            answer = {"returncode": -9, "timed_out": True}
            break
        time.sleep(0.02)
    with open(log, encoding="utf-8", errors="replace") as file:
        answer["output"] = file.read()
    print(json.dumps(answer), flush=True)
"""


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("docs-runner")
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), MPLBACKEND="Agg")
    env.pop("TOMA_SIZES", None)
    process = subprocess.Popen(
        [sys.executable, "-c", RUNNER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        cwd=cwd,
    )
    yield process
    process.stdin.close()
    process.wait(timeout=30)


def run_page(runner, page: str, cwd) -> dict:
    request = {"page": page, "snippets": [asdict(s) for s in snippets(read(page))], "cwd": str(cwd)}
    runner.stdin.write(json.dumps(dict(request, timeout=PAGE_TIMEOUT_S)) + "\n")
    runner.stdin.flush()
    # The runner answers once the page's child is done or killed at PAGE_TIMEOUT_S; more means it hangs itself.
    ready, _, _ = select.select([runner.stdout], [], [], PAGE_TIMEOUT_S + 120)
    assert ready, "the snippet runner does not answer"
    answer = runner.stdout.readline()
    assert answer, "the snippet runner died"
    return json.loads(answer)


@pytest.mark.slow
@pytest.mark.parametrize("page", pages_with_snippets())
def test_every_python_snippet_of_the_page_runs(runner, page, tmp_path):
    result = run_page(runner, page, tmp_path)
    assert not result["timed_out"], f"{page} did not finish within {PAGE_TIMEOUT_S} s:\n{result['output']}"
    assert result["returncode"] == 0, f"a snippet of {page} failed:\n{result['output']}"


@pytest.mark.slow
def test_a_failing_snippet_fails_its_page(runner, tmp_path):
    """The runner is able to fail: an error in a later block fails the page, naming the line."""
    page = tmp_path / "page.md"
    page.write_text(
        "# A page\n\n```python\nx = 1\n```\n\nText.\n\n<!-- not run: a reason -->\n```python\nraise SystemExit(3)\n"
        "```\n\n<!-- requires cuda -->\n```python\nimport torch\ntorch.zeros(1, device='cuda')\n```\n\n"
        "```python\nassert x == 2, 'x is not 2'\n```\n",
        encoding="utf-8",
    )
    result = run_page(runner, str(page), tmp_path)
    assert result["returncode"] == 1 and "x is not 2" in result["output"], result
    assert f'File "{page}", line 21' in result["output"], result["output"]
    assert "not run: a reason" in result["output"]


def test_snippet_markers_are_read():
    text = textwrap.dedent(
        """\
        ```python
        a = 1
        ```
        <!-- requires cuda -->
        ```python
        b = 2
        ```

        <!-- not run: needs two processes -->

        ```python
        c = 3
        ```
        ```bash
        pip install toma
        ```
        """
    )
    found = snippets(text)
    assert [(s.line, s.code, s.cuda, s.not_run) for s in found] == [
        (2, "a = 1\n", False, None),
        (6, "b = 2\n", True, None),
        (12, "c = 3\n", False, "needs two processes"),
    ]
    with pytest.raises(ValueError, match="needs a reason"):
        snippets("<!-- not run: -->\n```python\nx\n```\n")


def test_the_readme_and_every_topic_page_have_snippets():
    with_snippets = pages_with_snippets()
    assert "README.md" in with_snippets
    assert len(with_snippets) >= 10, with_snippets


@pytest.mark.slow
def test_the_site_builds_strict(tmp_path):
    pytest.importorskip("mkdocs", reason="mkdocs is not installed (the test and docs extras install it)")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "-f",
            os.path.join(REPO, "mkdocs.yml"),
            "-d",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        env=dict(os.environ, NO_MKDOCS_2_WARNING="1", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", "")),
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "index.html").exists()
    assert (tmp_path / "reference" / "forms" / "index.html").exists()
