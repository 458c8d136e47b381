"""benchmarks/padding_free.py (issue 40's benchmark) run with `--quick`, so that it cannot rot: every method's line,
its figures, and the gradients' difference from the full batch. The timings and memory mean nothing at this size
and are not checked; the gradients are (they are exactness)."""

import os
import re

import pytest

from helpers import REPO, run_script

pytest.importorskip("transformers")

SCRIPT = os.path.join(REPO, "benchmarks", "padding_free.py")
METHODS = (
    "(1) fixed micro-batches",
    "(2) `toma.accumulate(lengths=",
    "(3) padding-free, sequences",
    "(4) `toma.accumulate(",
)


@pytest.mark.slow
def test_the_quick_run_prints_every_method_its_memory_and_its_gradients():
    result = run_script(SCRIPT, "--quick", env=dict(OMP_NUM_THREADS="1"))
    assert result.returncode == 0, result.stdout + result.stderr
    rows = {}
    for line in result.stdout.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        for method in METHODS:
            if cells[0].startswith(method) and method not in rows:
                rows[method] = cells[1:]
    assert list(rows) == list(METHODS), result.stdout
    for method, (time, tokens, ratio, _, memory, difference) in rows.items():
        assert re.fullmatch(r"[0-9.]+ s", time) and re.fullmatch(r"[0-9,]+", tokens), result.stdout
        assert re.fullmatch(r"[0-9.]+x", ratio) and re.fullmatch(r"[0-9.]+ MiB|not measured", memory), result.stdout
        assert float(difference) <= 1e-5, f"{method}: gradients off the full batch's\n{result.stdout}"
    assert "x the tokens/s of fixed rows (1)" in result.stdout and "x padded packing (2)" in result.stdout
