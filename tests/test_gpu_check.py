"""benchmarks/gpu_check.py, the one command for a GPU: without CUDA it checks the imports and says so; its
parts run under their own timeouts and a shared budget, and the report says what each showed."""

import importlib.util
import json
import os
import time

import pytest

from helpers import REPO, run_script


def load_gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", os.path.join(REPO, "benchmarks", "gpu_check.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_without_cuda_it_checks_the_imports_says_so_and_exits_0(tmp_path):
    result = run_script(
        os.path.join(REPO, "benchmarks", "gpu_check.py"),
        "--out",
        str(tmp_path / "report"),
        env=dict(CUDA_VISIBLE_DEVICES=""),  # no GPU, also on a machine with one (the fork server never used CUDA)
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "CUDA is not available" in result.stdout
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    assert report["cuda_available"] is False and report["parts"] == [] and report["passed"] is True
    imports = report["imports"]
    expected = ["toma", "toma.core.engine", "toma.core.oom", "examples/train_digits.py", "benchmarks/transfer_gpu.py"]
    assert all(imports.get(name) == "ok" for name in expected), imports
    assert report["imports_ok"] and "benchmarks/gpu_check.py" not in imports
    assert "CUDA is not available" in (tmp_path / "report" / "report.md").read_text()


def test_each_part_has_its_timeout_its_checks_and_a_share_of_the_budget(tmp_path):
    gpu_check = load_gpu_check()
    logs = tmp_path / "logs"
    logs.mkdir()
    figures = str(logs / "bench.jsonl")
    write_figure = f"import json; open({figures!r}, 'a').write(json.dumps(dict(figure='rate', value=2.5, unit='GB/s')))"
    deadline = time.monotonic() + 60
    Part, python, judge = gpu_check.Part, gpu_check.python, gpu_check.judge_adaptive
    parts = [
        Part("sleeps", "examples", python("-c", "import time; time.sleep(60)"), 1, judge),
        Part("no OOM", "examples", python("-c", "print('predict batch size: 8')"), 30, judge),
        Part("bench", "benchmarks", python("-c", write_figure), 30, gpu_check.judge_benchmark(figures)),
    ]
    started = time.monotonic()
    sleeps, no_oom, bench = [gpu_check.run(part, str(logs), deadline) for part in parts]
    assert sleeps.status == "timed out" and time.monotonic() - started < 20, "killed at its own timeout"
    assert no_oom.status == "failed" and "predict batch size: 8" in no_oom.tail
    assert {"figure": "predict batch size", "value": 8.0, "unit": ""} in no_oom.figures
    assert not next(c for c in no_oom.checks if "out-of-memory" in c.what).ok
    assert bench.status == "passed" and bench.figures == [{"figure": "rate", "value": 2.5, "unit": "GB/s"}]
    late = gpu_check.run(parts[1], str(logs), time.monotonic() + 5)
    assert late.status == "not run" and late.reason == "the budget was spent"


def test_the_cuda_tests_outcomes_are_read_from_pytests_progress_lines():
    gpu_check = load_gpu_check()
    output = (
        "tests/test_memory.py::test_a_cuda_snapshot_sees_an_allocation PASSED        [ 20%]\n"
        "tests/test_oom.py::test_x[cuDNN error: CUDNN_STATUS_BAD_PARAM] FAILED      [ 40%]\n"
        "tests/test_transfer.py::test_y SKIPPED (needs a CUDA GPU)                  [ 60%]\n"
    )
    assert gpu_check.test_results(output) == {
        "tests/test_memory.py::test_a_cuda_snapshot_sees_an_allocation": "PASSED",
        "tests/test_oom.py::test_x[cuDNN error: CUDNN_STATUS_BAD_PARAM]": "FAILED",
        "tests/test_transfer.py::test_y": "SKIPPED",
    }
    checks, figures = gpu_check.judge_tests(output)
    assert [c.ok for c in checks] == [True, False]
    assert {"figure": "cuda tests failed", "value": 1, "unit": ""} in figures


def test_the_outcomes_are_also_read_from_pytest_xdists_progress_lines():
    gpu_check = load_gpu_check()
    output = (
        "[gw1] [ 50%] PASSED tests/memory/test_cuda.py::test_real_cuda_oom \n"
        "[gw0] [100%] FAILED tests/test_oom.py::test_x[cuDNN error: CUDNN_STATUS_BAD_PARAM] \n"
    )
    assert gpu_check.test_results(output) == {
        "tests/memory/test_cuda.py::test_real_cuda_oom": "PASSED",
        "tests/test_oom.py::test_x[cuDNN error: CUDNN_STATUS_BAD_PARAM]": "FAILED",
    }
