"""benchmarks/generation.py (issue 57: toma.generate under a real CPU cap against the largest fixed batch, restarting
on OOM and batch 1) run with `--quick`, so that it cannot rot: its table, its JSON line, and every way's sequences
equal to `generate`'s. The figures mean nothing at this size and are not checked."""

import json
import os
import re

import pytest

from helpers import REPO, run_script

pytest.importorskip("transformers")


@pytest.mark.slow
def test_the_quick_run_prints_every_way_with_generates_sequences():
    result = run_script(
        os.path.join(REPO, "benchmarks", "generation.py"), "--quick", env=dict(OMP_NUM_THREADS="1"), timeout=600
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.search(r"\| toma.generate \| [0-9.]+ \|", result.stdout), result.stdout
    found = json.loads(re.findall(r"^\{.*\}$", result.stdout, re.M)[-1])
    assert set(found["results"]) == {"fixed", "toma", "restart", "one"}
    assert all(way["equal"] for way in found["results"].values()), found
