"""benchmarks/levers.py (issue 42's benchmark) run with `--quick`, so that it cannot rot: every way's longest
sequence under the cap, every timed way's line, the lever on for the timed toma calls, and the gradients equal to the
plain step's. The timings mean nothing at this size and are not checked; the gradients are (they are exactness), and
toma trains at least as long a sequence as the plain step."""

import os
import re

import pytest

from helpers import REPO, run_script

pytest.importorskip("transformers")

SCRIPT = os.path.join(REPO, "benchmarks", "levers.py")
WAYS = ("(a) plain", "(b) `toma.accumulate(", "(c) checkpointing by hand", "(d) plain, on an out-of-memory")
TIMED = ("(1) plain", "(2) checkpointing by hand", "(3) `toma.accumulate`, lever on", "(4) `toma.accumulate`, no")


def rows(stdout, names):
    found = {}
    for line in stdout.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        for name in names:
            if cells[0].startswith(name) and name not in found:
                found[name] = cells[1:]
    return found


@pytest.mark.slow
def test_the_quick_run_finds_every_longest_sequence_and_times_every_way_with_the_same_gradients():
    result = run_script(SCRIPT, "--quick", env=dict(OMP_NUM_THREADS="1"), timeout=300)
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    longest = rows(out, WAYS)
    assert list(longest) == list(WAYS), out
    for longest_sequence, versus, _, probes in longest.values():
        assert re.fullmatch(r"[0-9]+", longest_sequence) and re.fullmatch(r"[0-9.]+x", versus), out
        assert re.fullmatch(r"[0-9]+", probes), out
    plain, toma = int(longest[WAYS[0]][0]), int(longest[WAYS[1]][0])
    assert 0 < plain <= toma, f"toma trains a shorter sequence than the plain step\n{out}"
    assert longest[WAYS[1]][2] == "activation checkpointing", out
    timed = rows(out, TIMED)
    assert list(timed) == list(TIMED), out
    for name, (step, token, versus_plain, versus_hand, difference) in timed.items():
        assert re.fullmatch(r"[0-9.]+ s", step) and re.fullmatch(r"[0-9]+ us", token), out
        assert re.fullmatch(r"[0-9.]+x", versus_plain) and re.fullmatch(r"[0-9.]+x", versus_hand), out
        assert name == TIMED[0] or float(difference) <= 1e-5, f"{name}: gradients off the plain step's\n{out}"
    assert "turned on: activation checkpointing" in out and "(3)'s lever: on" in out, out
