"""The repository's promises: CI runs README's test command, and the main example runs."""

import os
import re

import pytest
from helpers import REPO, run_python


def read(*parts):
    with open(os.path.join(REPO, *parts), encoding="utf-8") as file:
        return file.read()


def test_ci_runs_the_readme_test_command_verbatim():
    ci_commands = [
        line for line in read(".ci", "run").splitlines() if line and not line.startswith(("#", "set ", "cd "))
    ]
    assert len(ci_commands) == 1
    readme_commands = re.findall(r"```bash\n(.*?)\n```", read("README.md"), flags=re.S)
    test_commands = [command for command in readme_commands if "pytest tests" in command]
    assert test_commands == [ci_commands[0]]


@pytest.mark.slow
def test_main_example_adapts_under_its_memory_cap():
    example = read("examples", "adaptive_memory.py")
    output = run_python(example + "\n", timeout=300).stdout
    assert "predict matches the reference: True" in output
    assert "density matches the reference: True" in output
    assert output.count("retrying with") >= 2, output
    sizes = dict(re.findall(r"^(predict batch size|density step): (\d+)$", output, flags=re.M))
    assert 0 < int(sizes["predict batch size"]) < 32768 and 0 < int(sizes["density step"]) < 16384
