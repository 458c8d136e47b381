"""One command for a machine with a GPU: every `cuda` test, the examples under a memory cap that forces real CUDA
out-of-memory errors, and the GPU benchmarks, in one report.

Run from the repository root:

    python benchmarks/gpu_check.py --out gpu-report

It writes
- gpu-report/report.json: the device, the versions (torch, CUDA, cuDNN, NCCL, Python), every part's status
  (passed, failed, timed out, skipped, not run), seconds, checks and figures (the benchmarks' JSON lines, the
  sizes, retries and rates the examples print) and the outcome of every `cuda` test;
- gpu-report/report.md: the same as tables, with the end of the log of each part that did not pass;
- gpu-report/logs/<part>.log: each part's whole output.
It exits 0 when every part passed, 1 otherwise. Each part runs in a subprocess with its own timeout, and all
share one budget (--budget, 1140 s by default), so the whole run fits in 20 minutes on one H100; a part the
budget no longer allows is reported as not run. `--parts tests,examples,benchmarks` runs only some kinds.

Without CUDA it only imports every toma module, the examples and the benchmark modules (without running them),
says that CUDA is not available, writes the report saying so, and exits 0 (1 if something failed to import).

A GPU benchmark is a script benchmarks/*_gpu.py. It appends one JSON line per figure,
{"figure": name, "value": number, "unit": text}, to the file named by the environment variable TOMA_FIGURES.
"""

import argparse
import datetime
import glob
import importlib
import importlib.util
import json
import os
import pkgutil
import platform
import re
import signal
import subprocess
import sys
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
BUDGET_S = 1140  # 19 minutes: the report and the interpreter's start fit in the 20th
LAST_PART_S = 20  # a part is not started with less of the budget left than this
KINDS = ("tests", "examples", "benchmarks")
MiB = 2**20

Figure = Dict[str, Any]


@dataclass
class Check:
    """One thing a part must show, and whether it did."""

    what: str
    ok: bool


Judged = Tuple[List[Check], List[Figure]]


@dataclass
class Part:
    """A subprocess to run and what its output must show. `judge(output)` returns the checks and figures."""

    name: str
    kind: str
    command: List[str]
    timeout: float
    judge: Callable[[str], Judged]
    env: Dict[str, str] = field(default_factory=dict)
    skip: Optional[str] = None  # why it cannot run here (a missing optional package)
    alone: bool = False  # runs after the parts run side by side, with nothing else on the GPU


@dataclass
class Outcome:
    name: str
    kind: str
    status: str  # passed, failed, timed out, skipped, not run
    seconds: float = 0.0
    timeout: float = 0.0
    command: str = ""
    returncode: Optional[int] = None
    checks: List[Check] = field(default_factory=list)
    figures: List[Figure] = field(default_factory=list)
    tests: Dict[str, str] = field(default_factory=dict)  # the cuda tests: name -> PASSED, FAILED, ...
    log: str = ""
    tail: str = ""
    reason: str = ""


def figure(name: str, value: Any, unit: str = "") -> Figure:
    return dict(figure=name, value=value, unit=unit)


def number(pattern: str, text: str) -> Optional[float]:
    """The number the last line matching `pattern` (one group) shows, or None."""
    found = re.findall(pattern, text, flags=re.M)
    return float(found[-1]) if found else None


# ---- what each part must show ---------------------------------------------------------------------------


def judge_tests(output: str) -> Judged:
    results = test_results(output)
    counts = {state: sum(1 for s in results.values() if s == state) for state in set(results.values())}
    checks = [
        Check("at least one cuda test ran", counts.get("PASSED", 0) + counts.get("FAILED", 0) > 0),
        Check("no cuda test failed or errored", counts.get("FAILED", 0) + counts.get("ERROR", 0) == 0),
    ]
    return checks, [figure(f"cuda tests {state.lower()}", count) for state, count in sorted(counts.items())]


OUTCOMES = "PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS"


def test_results(output: str) -> Dict[str, str]:
    """pytest -v's outcome per test, from its progress lines (there even when the run was killed); with
    pytest-xdist the lines read `[gw0] [ 10%] PASSED path::name`."""
    plain = re.findall(rf"^(\S+::.+?) ({OUTCOMES})\b", output, flags=re.M)
    spread = re.findall(rf"^\[gw\d+\] \[\s*\d+%\] ({OUTCOMES}) (\S+::.*?)\s*$", output, flags=re.M)
    return {**{name: state for name, state in plain}, **{name: state for state, name in spread}}


def judge_digits(output: str) -> Judged:
    retries = number(r"^out-of-memory retries: (\d+)$", output)
    accuracy = number(r"^test accuracy: ([\d.]+)$", output)
    micro = number(r"^micro-batch size found: (\d+)$", output)
    checks = [
        Check("ran into real CUDA out-of-memory errors", "CUDA out of memory" in output and (retries or 0) >= 1),
        Check("test accuracy at least 0.9", (accuracy or 0) >= 0.9),
    ]
    return checks, [
        figure("micro-batch size found", micro),
        figure("out-of-memory retries", retries),
        figure("test accuracy", accuracy),
    ]


def judge_adaptive(output: str) -> Judged:
    checks = [
        Check("ran into real CUDA out-of-memory errors", "CUDA out of memory" in output),
        Check("predict matches the reference", "predict matches the reference: True" in output),
        Check("density matches the reference", "density matches the reference: True" in output),
    ]
    return checks, [
        figure("predict batch size", number(r"^predict batch size: (\d+)$", output)),
        figure("density step", number(r"^density step: (\d+)$", output)),
    ]


def judge_hosted(output: str) -> Judged:
    rate = number(r"^([\d.]+) steps/s", output)
    similarity = re.findall(r"in one topic ([-\d.]+), across topics ([-\d.]+)", output)
    checks = [Check("trained to the end and learned the topics", rate is not None and bool(similarity))]
    figures = [figure("training steps per second", rate, "steps/s")]
    if similarity:
        within, across = map(float, similarity[-1])
        figures += [figure("cosine similarity within a topic", within), figure("across topics", across)]
    return checks, figures


def judge_ddp(output: str) -> Judged:
    retries = number(r"^out-of-memory retries on rank 0: (\d+)$", output)
    sizes = re.findall(r"^micro-batch size on every rank: \[(\d+)", output, flags=re.M)
    checks = [
        Check("rank 0 ran into real CUDA out-of-memory errors", "CUDA out of memory" in output and (retries or 0) >= 1),
        Check("parameters identical on every rank", "parameters identical on every rank: True" in output),
    ]
    return checks, [
        figure("micro-batch size", float(sizes[-1]) if sizes else None),
        figure("out-of-memory retries on rank 0", retries),
    ]


def judge_embed(output: str) -> Judged:
    speedup = number(r"^speed-up: ([\d.]+)x$", output)
    difference = number(r"^largest difference between the embeddings: ([\d.e+-]+)$", output)
    checks = [
        Check("toma.map(lengths=) ran and compared its embeddings", speedup is not None and difference is not None),
        Check("the embeddings equal the fixed batches' (<= 1e-4)", difference is not None and difference <= 1e-4),
    ]
    return checks, [
        figure("toma.map(lengths=) speed-up over fixed batches", speedup, "ratio"),
        figure("largest difference between the embeddings", difference),
    ]


def judge_benchmark(figures_path: str) -> Callable[[str], Judged]:
    def judge(output: str) -> Judged:
        figures = []
        if os.path.exists(figures_path):
            with open(figures_path, encoding="utf-8") as file:
                figures = [json.loads(line) for line in file if line.strip()]
        return [Check("wrote its figures", bool(figures))], figures

    return judge


def judge_probe(output: str) -> Judged:
    return [Check("read the device", probe_result(output) is not None)], []


def probe_result(output: str) -> Optional[Dict[str, Any]]:
    lines = [line for line in output.splitlines() if line.startswith("{")]
    return json.loads(lines[-1]) if lines else None


PROBE = """
import json, platform, torch
properties = torch.cuda.get_device_properties(0)
try:
    version = torch.cuda.nccl.version()
    nccl = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
except Exception as error:
    nccl = f"unavailable ({type(error).__name__})"
print(json.dumps(dict(
    device=properties.name, devices=torch.cuda.device_count(), total_memory=properties.total_memory,
    capability=f"{properties.major}.{properties.minor}", multiprocessors=properties.multi_processor_count,
    torch=torch.__version__, cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version(), nccl=nccl,
    python=platform.python_version(),
)))
"""


# ---- the parts ------------------------------------------------------------------------------------------


def python(*args: str) -> List[str]:
    return [sys.executable, *args]


def has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def gpu_parts(total_memory: int, logs: str, kinds: List[str], jobs: int = 1) -> List[Part]:
    """Every part after the probe. Memory caps are in MiB, turned into this GPU's fraction. With `jobs` > 1 and
    pytest-xdist installed, the cuda tests run in that many processes (each has its own memory fraction)."""

    def fraction(mib: float) -> str:
        return f"{mib * MiB / total_memory:.8f}"

    parts: List[Part] = []
    if "tests" in kinds:
        paths = ["tests"] + (["benchmarks", "--benchmark-disable"] if has("pytest_benchmark") else [])
        pytest = python("-m", "pytest", *paths, "-v", "-rs", "-p", "no:cacheprovider")
        skip = None if has("pytest") else "pytest is not installed"
        if jobs > 1 and has("xdist"):
            # A test that fills the whole device would make the others run out of memory: it runs alone, after.
            parts += [
                Part(
                    "cuda tests",
                    "tests",
                    pytest + ["-n", str(jobs), "-m", "cuda and not whole_device"],
                    480,
                    judge_tests,
                    skip=skip,
                ),
                Part(
                    "cuda tests that fill the device",
                    "tests",
                    pytest + ["-m", "cuda and whole_device"],
                    300,
                    judge_tests,
                    skip=skip,
                    alone=True,
                ),
            ]
        else:
            parts.append(Part("cuda tests", "tests", pytest + ["-m", "cuda"], 480, judge_tests, skip=skip))
    if "examples" in kinds:
        parts += [
            Part(
                "example train_digits (GPU capped at 96 MiB)",
                "examples",
                python(
                    "examples/train_digits.py",
                    "--quick",
                    "--plot",
                    os.path.join(logs, "train_digits.png"),
                    "--memory-fraction",
                    fraction(96),
                ),
                180,
                judge_digits,
                skip=None if has("sklearn") else "scikit-learn is not installed",
            ),
            Part(
                "example adaptive_memory (GPU capped at 256 MiB)",
                "examples",
                python("examples/adaptive_memory.py", "--memory-fraction", fraction(256)),
                120,
                judge_adaptive,
            ),
            Part(
                "example hosted_embeddings (GPU capped at 160 MiB, tables of 256 MB)",
                "examples",
                python("examples/hosted_embeddings.py", "--device", "cuda", "--cap-mib", "160"),
                180,
                judge_hosted,
            ),
            Part(
                "example ddp_accumulate (1 rank, NCCL, GPU capped at 96 MiB)",
                "examples",
                python(
                    "-m",
                    "torch.distributed.run",
                    "--standalone",
                    "--nproc_per_node=1",
                    "examples/ddp_accumulate.py",
                    "--memory-fraction",
                    fraction(96),
                ),
                180,
                judge_ddp,
            ),
            Part(
                "example embed_texts (toma.map by tokens, BERT on the GPU)",
                "examples",
                python("examples/embed_texts.py", "--device", "cuda"),
                180,
                judge_embed,
                skip=None if has("transformers") else "transformers is not installed",
            ),
        ]
    if "benchmarks" in kinds:
        for path in sorted(glob.glob(os.path.join(HERE, "*_gpu.py"))):
            stem = os.path.splitext(os.path.basename(path))[0]
            figures_path = os.path.join(logs, f"{stem}.figures.jsonl")
            parts.append(
                Part(
                    f"benchmark {stem}",
                    "benchmarks",
                    python(os.path.relpath(path, REPO)),
                    300,
                    judge_benchmark(figures_path),
                    env=dict(TOMA_FIGURES=figures_path),
                    alone=True,
                )
            )
    return parts


def run(part: Part, logs: str, deadline: float) -> Outcome:
    """Run one part in its own process group (killed whole at its timeout), its output into its log."""
    outcome = Outcome(part.name, part.kind, "not run", timeout=part.timeout, command=" ".join(part.command))
    if part.skip:
        outcome.status, outcome.reason = "skipped", part.skip
        return outcome
    left = deadline - time.monotonic()
    if left < LAST_PART_S:
        outcome.reason = "the budget was spent"
        return outcome
    timeout = min(part.timeout, left)
    outcome.timeout = round(timeout)
    slug = re.sub(r"[^a-z0-9]+", "-", part.name.lower()).strip("-")[:60]
    log_path = os.path.join(logs, f"{slug}.log")
    outcome.log = os.path.relpath(log_path, os.path.dirname(logs))
    for path in part.env.values():
        if path.startswith(logs) and os.path.exists(path):
            os.remove(path)
    env = dict(os.environ, PYTHONUNBUFFERED="1", **part.env)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    print(f"[gpu_check] {part.name} (at most {timeout:.0f} s) ...", flush=True)
    started = time.monotonic()
    with open(log_path, "w", encoding="utf-8") as log:
        log.write(f"$ {outcome.command}\n")
        log.flush()
        process = subprocess.Popen(
            part.command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            outcome.returncode = process.wait(timeout=timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            timed_out = True
    outcome.seconds = round(time.monotonic() - started, 1)
    with open(log_path, encoding="utf-8", errors="replace") as log:
        output = log.read()
    checks, figures = part.judge(output)
    outcome.checks = [
        Check(f"finished within {timeout:.0f} s", not timed_out),
        Check("exited with status 0", outcome.returncode == 0),
    ] + checks
    outcome.figures = figures
    if part.kind == "tests":
        outcome.tests = test_results(output)
    if timed_out:
        outcome.status = "timed out"
    else:
        outcome.status = "passed" if all(check.ok for check in outcome.checks) else "failed"
    if outcome.status != "passed":
        outcome.tail = output[-4000:]
    print(f"[gpu_check] {part.name}: {outcome.status} in {outcome.seconds:.0f} s", flush=True)
    return outcome


# ---- imports, for every machine --------------------------------------------------------------------------


def check_imports() -> Dict[str, str]:
    """Import every toma module, the examples and the benchmark modules without running them: name -> "ok" or
    the error."""
    results: Dict[str, str] = {}
    sys.path[:0] = [REPO, HERE]

    def attempt(name: str, load: Callable[[str], Any], what: str) -> Any:
        try:
            loaded = load(what)
        except Exception:  # an import that fails is what this check reports
            results[name] = traceback.format_exc(limit=2).strip().splitlines()[-1]
            return None
        results[name] = "ok"
        return loaded

    toma = attempt("toma", importlib.import_module, "toma")
    if toma is not None:
        for module in pkgutil.walk_packages(toma.__path__, "toma."):
            attempt(module.name, importlib.import_module, module.name)
    files = sorted(glob.glob(os.path.join(REPO, "examples", "*.py"))) + sorted(glob.glob(os.path.join(HERE, "*.py")))
    for path in files:
        if os.path.abspath(path) != os.path.abspath(__file__):
            attempt(os.path.relpath(path, REPO), load_file, path)
    return results


def load_file(path: str) -> Any:
    """Import a script by its path as a module that is not __main__, so its main() does not run."""
    name = "gpu_check_import_" + re.sub(r"\W", "_", os.path.relpath(path, REPO))
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---- the report -------------------------------------------------------------------------------------------


def environment() -> Dict[str, Any]:
    import torch

    try:
        git = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=30)
        commit = git.stdout.strip() if git.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired):  # no git, or no repository: the report says unknown
        commit = None
    return dict(
        torch=torch.__version__,
        cuda=torch.version.cuda,
        python=platform.python_version(),
        platform=platform.platform(),
        commit=commit,
    )


def markdown(report: Dict[str, Any]) -> str:
    env, device = report["environment"], report.get("device") or {}
    lines = [
        "# toma GPU check",
        "",
        f"- when: {report['created']}; command: `{report['command']}`; commit: {env.get('commit') or 'unknown'}",
    ]
    if not report["cuda_available"]:
        lines += [
            f"- torch {env['torch']}, Python {env['python']}, {env['platform']}",
            "- **CUDA is not available on this machine**: only the imports were checked; nothing ran on a GPU.",
            f"- imports: {'all ok' if report['imports_ok'] else 'FAILED'} ({len(report['imports'])} modules)",
        ]
        lines += [f"  - `{name}`: {result}" for name, result in report["imports"].items() if result != "ok"]
        return "\n".join(lines) + "\n"
    if device:
        lines.append(
            f"- device: {device['device']} ({device['total_memory'] / 2**30:.1f} GiB, compute capability "
            f"{device['capability']}, {device['devices']} visible); torch {device['torch']}, CUDA {device['cuda']}, "
            f"cuDNN {device['cudnn']}, NCCL {device['nccl']}, Python {device['python']}"
        )
    passed = sum(1 for part in report["parts"] if part["status"] == "passed")
    lines += [
        f"- result: **{'PASSED' if report['passed'] else 'FAILED'}**, {passed} of {len(report['parts'])} parts "
        f"passed in {report['seconds']:.0f} s (budget {report['budget']} s); imports "
        f"{'all ok' if report['imports_ok'] else 'FAILED'}",
        "",
        "## Parts",
        "",
        "| part | status | seconds (limit) | checks |",
        "|---|---|---|---|",
    ]
    for part in report["parts"]:
        checks = "; ".join(f"{'ok' if c['ok'] else 'FAILED'}: {c['what']}" for c in part["checks"]) or part["reason"]
        limits = f"{part['seconds']:.0f} ({part['timeout']:.0f})"
        lines.append(f"| {part['name']} | {part['status']} | {limits} | {checks} |")
    lines += ["", "## Figures", "", "| part | figure | value | unit |", "|---|---|---|---|"]
    for part in report["parts"]:
        for f in part["figures"]:
            value = f["value"]
            shown = f"{value:.4g}" if isinstance(value, float) else str(value)
            lines.append(f"| {part['name']} | {f['figure']} | {shown} | {f.get('unit', '')} |")
    tests = [(name, state) for part in report["parts"] for name, state in part["tests"].items()]
    if tests:
        lines += ["", "## cuda tests", "", "| test | outcome |", "|---|---|"]
        lines += [f"| `{name}` | {state} |" for name, state in tests]
    failed_imports = {name: result for name, result in report["imports"].items() if result != "ok"}
    if failed_imports:
        lines += ["", "## Imports that failed", ""] + [f"- `{n}`: {r}" for n, r in failed_imports.items()]
    for part in report["parts"]:
        if part["tail"]:
            lines += ["", f"## {part['name']}: {part['status']} (end of {part['log']})", "", "```", part["tail"], "```"]
    return "\n".join(lines) + "\n"


def write(report: Dict[str, Any], out: str) -> None:
    with open(os.path.join(out, "report.json"), "w", encoding="utf-8") as file:
        json.dump(report, file, indent=1)
    with open(os.path.join(out, "report.md"), "w", encoding="utf-8") as file:
        file.write(markdown(report))


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="gpu-report", help="the folder for report.json, report.md and logs/")
    parser.add_argument("--budget", type=float, default=BUDGET_S, help="seconds for all parts together")
    parser.add_argument("--parts", default=",".join(KINDS), help="which kinds of parts run: " + ", ".join(KINDS))
    parser.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="run the tests and examples this many at a time (tests through pytest-xdist, when installed); the "
        "benchmarks and a test that fills the device run alone, after them, sharing the GPU with nothing",
    )
    options = parser.parse_args(argv)
    kinds = [kind.strip() for kind in options.parts.split(",") if kind.strip()]
    if not set(kinds) <= set(KINDS):
        parser.error(f"--parts takes a comma-separated subset of {', '.join(KINDS)}, got {options.parts!r}")
    started = time.monotonic()
    deadline = started + options.budget
    out = os.path.abspath(options.out)
    logs = os.path.join(out, "logs")
    os.makedirs(logs, exist_ok=True)

    import torch

    cuda = torch.cuda.is_available()  # asks the driver; creates no CUDA context in this process
    imports = check_imports()
    report: Dict[str, Any] = dict(
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        command=" ".join([os.path.relpath(sys.argv[0], REPO) if sys.argv[0] else "gpu_check.py", *sys.argv[1:]]),
        cuda_available=cuda,
        environment=environment(),
        imports=imports,
        imports_ok=all(result == "ok" for result in imports.values()),
        budget=options.budget,
        device=None,
        parts=[],
        passed=False,
        seconds=0.0,
    )
    if not cuda:
        report.update(passed=report["imports_ok"], seconds=round(time.monotonic() - started, 1))
        write(report, out)
        print("CUDA is not available on this machine: checked that every module imports; nothing ran on a GPU.")
        print(f"imports: {'all ok' if report['imports_ok'] else 'some FAILED'}; report: {out}/report.md")
        return 0 if report["imports_ok"] else 1

    probe = run(Part("device probe", "probe", python("-c", PROBE), 120, judge_probe), logs, deadline)
    outcomes = [probe]
    device = None
    if probe.status == "passed":
        with open(os.path.join(out, probe.log), encoding="utf-8") as log:
            device = probe_result(log.read())
    report["device"] = device
    if device is not None:
        parts = gpu_parts(int(device["total_memory"]), logs, kinds, max(1, options.jobs))
        lock = threading.Lock()

        def run_and_report(part: Part) -> None:
            outcome = run(part, logs, deadline)
            with lock:
                outcomes.append(outcome)
                report.update(parts=[asdict(o) for o in outcomes], seconds=round(time.monotonic() - started, 1))
                write(report, out)  # the report so far, should the machine be taken away

        with ThreadPoolExecutor(max_workers=max(1, options.jobs)) as pool:
            list(pool.map(run_and_report, [part for part in parts if not part.alone]))
        for part in parts:
            if part.alone:
                run_and_report(part)
    report["parts"] = [asdict(outcome) for outcome in outcomes]
    report["passed"] = report["imports_ok"] and all(outcome.status in ("passed", "skipped") for outcome in outcomes)
    report["seconds"] = round(time.monotonic() - started, 1)
    write(report, out)
    verdict = "PASSED" if report["passed"] else "FAILED"
    print(f"[gpu_check] {verdict} in {report['seconds']:.0f} s; report: {out}/report.md")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
