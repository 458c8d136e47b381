"""benchmarks/figures_gpu.py, issue 33's GPU figures, dry-run on the CPU (`--device cpu --quick`) so that the script
cannot rot where there is no GPU: every part runs and writes its figures to TOMA_FIGURES, and a part that raises
is recorded as failed while the others still run. The figures themselves mean nothing on the CPU (part 3 runs out
of a fake budget there); only what the script must always show is checked: the accumulation's parameters equal
the hand-written loop's after one step, and its micro-batches are the loop's."""

import json
import os

import pytest

from helpers import REPO, run_pythons, run_script

SCRIPT = os.path.join(REPO, "benchmarks", "figures_gpu.py")
WORKLOADS = ("MLP activations", "pairwise distances", "transformer block forward+backward")
RULES = ("Halving (the default)", "FitToMemory()")


def figures(path):
    with open(path, encoding="utf-8") as file:
        return {line["figure"]: line["value"] for line in map(json.loads, file) if line}


@pytest.mark.slow
def test_the_dry_run_on_the_cpu_runs_every_part_and_writes_its_figures(tmp_path):
    path = str(tmp_path / "figures.jsonl")
    result = run_script(SCRIPT, "--device", "cpu", "--quick", env=dict(TOMA_FIGURES=path, OMP_NUM_THREADS="1"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "FAILED" not in result.stdout and "Traceback" not in result.stderr, result.stdout + result.stderr
    found = figures(path)
    assert not [name for name in found if name.endswith(" failed")]
    for name in (
        "plain call",
        "toma.batch",
        "toma.batch, NoBatchsizeCache",
        "toma.batch(policy=FitToMemory()), settled",
    ):
        assert found[f"no-op call: {name}"] > 0
    for name in ("toma.batch", "toma.batch(policy=FitToMemory()), settled"):
        assert found[f"no-op call: {name} / plain call"] > 1, "toma's call does more than a plain one"
    assert found["accumulation: hand-written loop per logical batch"] > 0
    assert found["accumulation: toma.accumulate / hand-written loop"] > 0
    assert found["accumulation: same parameters after one step (allclose)"] == 1
    assert found["accumulation: toma ran the hand loop's micro-batches in every step"] == 1
    for workload in WORKLOADS:
        assert found[f"fit: {workload}: M"] >= 1
        assert found[f"fit: {workload}: M fits again after the runs"] == 1
        for rule in RULES:
            assert 0 < found[f"fit: {workload}: {rule}: final / M"] <= 1.1  # M to 5% with --quick
            assert found[f"fit: {workload}: {rule}: OOMs per call"] >= 1 / 8, "it starts far above M"
    for rule in RULES:
        assert f"fit: {rule}: mean OOMs per call" in found
    for part in ("no-op call overhead", "accumulation on a transformer", "FitToMemory under a cap"):
        assert found[f"{part}: seconds"] > 0
    assert "| toma.accumulate |" in result.stdout and "| FitToMemory() |" in result.stdout


@pytest.mark.slow
def test_a_part_that_raises_is_recorded_as_failed_the_others_still_run_and_it_exits_1(tmp_path):
    path = str(tmp_path / "figures.jsonl")
    code = f"""
        import importlib.util, sys
        spec = importlib.util.spec_from_file_location("figures_gpu", {SCRIPT!r})
        script = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(script)
        def broken(device, quick):
            raise ZeroDivisionError("a part that breaks")
        script.noop_overhead = broken
        script.fit_to_memory = lambda device, quick: None  # (the test needs not wait for it)
        sys.exit(script.main(["--device", "cpu", "--quick"]))
    """
    (result,) = run_pythons([code], [dict(TOMA_FIGURES=path, OMP_NUM_THREADS="1")], timeout=120)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "ZeroDivisionError: a part that breaks" in result.stderr
    assert "FAILED: no-op call overhead" in result.stdout
    found = figures(path)
    assert found["no-op call overhead failed"] == 1
    assert "no-op call: plain call" not in found
    assert found["accumulation: same parameters after one step (allclose)"] == 1, "the next part still ran"
    assert "accumulation on a transformer failed" not in found and "FitToMemory under a cap failed" not in found
