"""The repository's promises: CI runs README's test command, and the main example runs."""

import os
import re

import pytest

from helpers import REPO, run_python, run_script


def read(*parts):
    with open(os.path.join(REPO, *parts), encoding="utf-8") as file:
        return file.read()


def test_ci_runs_the_readme_test_command_verbatim():
    ci_commands = [
        line for line in read(".ci", "run").splitlines() if line and not line.startswith(("#", "set ", "cd "))
    ]
    assert len(ci_commands) == 1
    test_commands = [command for command in readme_commands() if "pytest tests" in command]
    assert test_commands == [ci_commands[0]]


def readme_commands():
    return re.findall(r"```bash\n(.*?)\n```", read("README.md"), flags=re.S)


def test_readme_runs_the_digits_example_as_the_main_job():
    assert any(
        command.endswith("examples/train_digits.py") and "pip install" in command for command in readme_commands()
    )


@pytest.mark.slow
def test_the_digits_example_finds_a_micro_batch_under_its_cap_and_learns(tmp_path):
    """README's main job, in its --quick form: 10 epochs, under a minute."""
    plot = tmp_path / "history.png"
    script = os.path.join(REPO, "examples", "train_digits.py")
    result = run_script(script, "--quick", "--plot", str(plot), timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    output = result.stdout
    found = dict(re.findall(r"^(micro-batch size found|out-of-memory retries|test accuracy): ([\d.]+)$", output, re.M))
    assert 0 < int(found["micro-batch size found"]) < 256, output
    assert int(found["out-of-memory retries"]) >= 1, output
    assert "can't allocate memory" in output, "the search must run into real out-of-memory errors"
    assert float(found["test accuracy"]) >= 0.95, output
    assert plot.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
def test_adaptive_memory_example_adapts_under_its_memory_cap():
    example = read("examples", "adaptive_memory.py")
    output = run_python(example + "\n", timeout=300).stdout
    assert "predict matches the reference: True" in output
    assert "density matches the reference: True" in output
    assert output.count("retrying with") >= 2, output
    sizes = dict(re.findall(r"^(predict batch size|density step): (\d+)$", output, flags=re.M))
    assert 0 < int(sizes["predict batch size"]) < 32768 and 0 < int(sizes["density step"]) < 16384
