"""benchmarks/split_check.py (what the one check that a loss adds up costs) run with `--quick`, so that it cannot
rot: both rows of its table and the summary. The timings mean nothing at this size and are not checked."""

import os
import re

import pytest

from helpers import REPO, run_script

pytest.importorskip("transformers")


@pytest.mark.slow
def test_the_quick_run_prints_the_first_split_and_the_later_ones():
    result = run_script(os.path.join(REPO, "benchmarks", "split_check.py"), "--quick", env=dict(OMP_NUM_THREADS="1"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.search(r"\| the first split \(the check runs\) \| [0-9.]+ s \| [0-9.]+ s \| [0-9.]+x \|", result.stdout)
    assert re.search(r"\| every later one \| \| \| [0-9.]+x \|", result.stdout)
    assert re.search(r"- the check: [+-][0-9.]+% on the first split", result.stdout), result.stdout
