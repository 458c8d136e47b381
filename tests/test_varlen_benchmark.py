"""benchmarks/varlen.py (issue 31's benchmark) run with `--quick`, so that it cannot rot: every workload prints
every method's line, the figures of each method that this toma has, and the gradients' difference from the full
batch. The timings mean nothing at this size and are not checked; the gradients are (they are exactness)."""

import os
import re

import pytest

from helpers import REPO, run_script

pytest.importorskip("transformers")

SCRIPT = os.path.join(REPO, "benchmarks", "varlen.py")
WORKLOADS = ("A: long-tailed", "B: bimodal", "C: equal lengths")
METHODS = (
    "(1) fixed micro-batches",
    "(2) `toma.accumulate(weight=",
    "(3) sorted, packed",
    "(4) `toma.accumulate(lengths=",
)


def rows(section):
    """The method rows of a workload's markdown table: {method prefix: its cells}."""
    found = {}
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        for method in METHODS:
            if cells[0].startswith(method):
                found[method] = cells[1:]
    return found


@pytest.mark.slow
def test_the_quick_run_prints_every_method_and_its_gradients():
    result = run_script(SCRIPT, "--quick", env=dict(OMP_NUM_THREADS="1"))
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    lengths = "toma `lengths=`: yes" in out
    sections = re.split(r"^\*\*", out, flags=re.MULTILINE)[1:]
    assert [section.split("**")[0] for section in sections] == list(WORKLOADS), out
    for section in sections:
        found = rows(section)
        assert list(found) == list(METHODS), section
        for method, cells in found.items():
            if method.startswith("(4)") and not lengths:
                assert cells[0] == "not available yet", section
                continue
            time, tokens, ratio, _, difference = cells
            assert re.fullmatch(r"[0-9.]+ s", time) and re.fullmatch(r"[0-9,]+", tokens), section
            assert re.fullmatch(r"[0-9.]+x", ratio), section
            assert float(difference) <= 1e-5, f"{method}: gradients off the full batch's\n{section}"
    assert "- gradients: largest relative difference from the full batch" in out
    if lengths:
        assert "x the tokens/s of (1)" in out and "x the time of (2)" in out, out
    else:
        assert "not available yet in this toma" in out, out


@pytest.mark.slow
def test_the_trainer_packing_benchmark_runs_and_ends_at_the_plain_trainers_parameters():
    result = run_script(os.path.join(REPO, "benchmarks", "hf_varlen.py"), "--quick", "--rounds", "1", timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "| plain |" in result.stdout and "| TomaTrainer(toma_pack_tokens=True) |" in result.stdout
    difference = float(re.search(r"relative to the largest parameter: (\S+)", result.stdout).group(1))
    assert difference < 1e-5
