"""benchmarks/gradient_cache.py (issue 56: the largest logical batch of in-batch negatives plain and by gradient
caching under a real cap; toma's time and peak against hand-set gradient caching) run with `--quick`, so that it
cannot rot: its tables and their JSON lines. The figures mean nothing at this size and are not checked."""

import json
import os
import re

import pytest

from helpers import REPO, run_script

pytest.importorskip("transformers")


@pytest.mark.slow
def test_the_quick_run_prints_both_parts():
    result = run_script(
        os.path.join(REPO, "benchmarks", "gradient_cache.py"), "--quick", env=dict(OMP_NUM_THREADS="1"), timeout=600
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.search(r"\| plain \(one forward and backward\) \| \d+ \|", result.stdout), result.stdout
    parts = {line["part"]: line for line in map(json.loads, re.findall(r"^\{.*\}$", result.stdout, re.M))}
    assert parts["largest"]["toma"] > parts["largest"]["plain"], "gradient caching trains a batch plain cannot"
    assert parts["timing"]["coupled"] and parts["timing"]["toma_micro_batch"] < parts["timing"]["rows"]
    assert re.search(r"toma / the best hand setting \(\d+\): time [0-9.]+x, peak [0-9.]+x", result.stdout)
