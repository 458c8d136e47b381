"""The linter and formatter (ruff, configured in ruff.toml) pass on the whole tree."""

import shutil
import subprocess
import sys

import pytest

from helpers import REPO


def _ruff():
    found = shutil.which("ruff", path=f"{sys.prefix}/bin") or shutil.which("ruff")
    if found is None:
        pytest.skip("ruff is not installed (pip install -e '.[test]' installs it)")
    return found


@pytest.mark.parametrize("command", [["check", "."], ["format", "--check", "."]], ids=["lint", "format"])
def test_ruff_passes_on_the_whole_tree(command):
    done = subprocess.run([_ruff(), *command], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
