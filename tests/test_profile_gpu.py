"""benchmarks/profile_gpu.py (issue 44's profiler capture) dry-run on the CPU with `--quick`, so that the script a
GPU session runs in its few minutes cannot rot: a trace per method that a profiler viewer reads, each method's line
of counts, and the operators toma calls beyond the hand-written loops. The counts differ on a GPU; here they only
have to come from the captures."""

import gzip
import json
import os
import re

import pytest

from helpers import REPO, run_script

pytest.importorskip("transformers")

SCRIPT = os.path.join(REPO, "benchmarks", "profile_gpu.py")
METHODS = ("(1) fixed rows, by hand", "(2) accumulate by rows", "(3) packed by hand", "(4) lengths=", "(5) never split")


@pytest.mark.slow
def test_the_dry_run_saves_a_trace_per_method_and_counts_from_them(tmp_path):
    figures = tmp_path / "figures.jsonl"
    result = run_script(
        SCRIPT, "--cpu", "--quick", "--repeats", "1", env=dict(OMP_NUM_THREADS="1", TOMA_FIGURES=str(figures))
    )
    assert result.returncode == 0, result.stdout + result.stderr
    for number in range(1, len(METHODS) + 1):
        with gzip.open(tmp_path / f"profile_{number}.json.gz", "rt") as trace:
            names = {event.get("name") for event in json.load(trace)["traceEvents"]}
        assert "logical batch" in names and "aten::addmm" in names, number
    lines = {}
    for line in result.stdout.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if cells[0] in METHODS:
            lines[cells[0]] = cells[1:]
    assert set(lines) == set(METHODS)
    for cells in lines.values():
        step_ms, host_ms, launches, synchronisations, scalars = (float(cell) for cell in cells[:5])
        assert step_ms > 0 and host_ms > 0 and launches == synchronisations == 0, "no device on the CPU"
    assert re.search(
        r"operators \(2\) accumulate by rows calls more often than \(1\) [^:]+: \[\('aten::", result.stdout
    )
    recorded = [json.loads(line)["figure"] for line in figures.read_text().splitlines()]
    assert "profile: (2) accumulate by rows: host span ms" in recorded and "profile: device" in recorded
