"""Type checkers see through the decorators: mypy --strict on code that uses toma, in a subprocess."""

import os
import re
import subprocess
import sys

import pytest

from helpers import REPO

pytest.importorskip("mypy")

# Each `# reveals: T` line must make mypy reveal T; each `# error` line must be an error; nothing else may be.
SNIPPET = """
import numpy as np
import torch
import toma
from toma import Halving, explicit, simple
from toma import toma as t


@t.batch(initial_batchsize=8)
def infer(batchsize: int, data: list[float], scale: float = 1.0) -> list[float]:
    return data[:batchsize]


reveal_type(infer([1.0]))  # reveals: list[float]
infer("not a list")  # error
infer([1.0], scale="not a float")  # error
reveal_type(infer([1.0], toma_initial_batchsize=4))  # reveals: list[float]
reveal_type(infer([1.0], toma_context="eval"))  # reveals: list[float]


@t.batch
def bare(batchsize: int) -> int:
    return batchsize


reveal_type(bare(toma_initial_batchsize=2))  # reveals: int


@t.range(initial_step=4)
def fill(start: int, end: int, out: list[int]) -> None:
    pass


fill(0, 10, [1])
fill(0, 10, "not a list")  # error
fill(0, 10, [1], toma_initial_step=2)
fill(start=0, end=10, out=[1])
reveal_type(fill.__name__)  # reveals: str
reveal_type(fill.__wrapped__)  # reveals: def (*Any, **Any) -> Any


@t.chunked(initial_step=4)
def normalise(chunk: torch.Tensor, start: int, end: int, scale: float) -> None:
    pass


normalise(torch.zeros(3), 2.0)
normalise(torch.zeros(3), "not a float")  # error
normalise(torch.zeros(3), 2.0, toma_dimension=0)
normalise(tensor=torch.zeros(3), scale=2.0)

model = torch.nn.Linear(1, 1)


@t.accumulate(model=model, initial_micro_batch=4)
def compute_loss(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(x, y)


reveal_type(compute_loss)  # reveals: toma.core.signatures.AccumulateFunction[[x: Any, y: Any]]
compute_loss(torch.zeros(2, 1))  # error
compute_loss(torch.zeros(2, 1), torch.zeros(2, 1), toma_initial_micro_batch=2)


def double(batchsize: int, text: str) -> str:
    return text * batchsize


reveal_type(simple.batch(double, 8, "a"))  # reveals: str
simple.batch(double, 8, 3)  # error
reveal_type(explicit.batch(double, 8, "a", toma_context="k"))  # reveals: str

toma.DEFAULT_CACHE_TYPE = toma.GlobalBatchsizeCache
t.DEFAULT_CACHE_TYPE = toma.NoBatchsizeCache
Halving(minimum=np.int64(4))
"""

# torch is not followed (its tensors are Any here): checking torch itself would cost some 20 s per run.
CONFIG = """
[mypy]
strict = True
[mypy-toma.*]
ignore_errors = True
[mypy-torch.*]
follow_imports = skip
follow_imports_for_stubs = True
"""


@pytest.mark.slow
def test_mypy_strict_sees_the_decorated_functions_signatures(tmp_path):
    (tmp_path / "snippet.py").write_text(SNIPPET)
    (tmp_path / "mypy.ini").write_text(CONFIG)
    env = dict(os.environ, MYPYPATH=REPO)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--config-file",
            "mypy.ini",
            "--cache-dir",
            str(tmp_path / "cache"),
            "snippet.py",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=240,
    )
    output = result.stdout + result.stderr
    reports = {}
    for line in output.splitlines():
        match = re.match(r"snippet\.py:(\d+): (error|note): (.*)", line)
        if match and (match[2] == "error" or "Revealed type" in match[3]):
            reports.setdefault(int(match[1]), []).append((match[2], match[3]))
    for number, line in enumerate(SNIPPET.splitlines(), start=1):
        got = reports.pop(number, [])
        if "# reveals:" in line:
            expected = line.split("# reveals:")[1].strip()
            assert ("note", f'Revealed type is "{expected}"') in got, f"line {number}: {line}\n{output}"
        elif line.rstrip().endswith("# error"):
            assert any(kind == "error" for kind, _ in got), f"line {number} should not type-check: {line}\n{output}"
        else:
            assert not got, f"line {number}: {line}: {got}\n{output}"
    assert not reports, output
