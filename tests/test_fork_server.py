"""The fork server behind run_python and run_ranks behaves as `python -c` does where the tests rely on it."""

import json

import pytest

import helpers
from helpers import run_python, run_ranks


def test_a_child_runs_its_code_in_a_fresh_main_with_its_environment_and_imports_toma_afresh():
    out = run_python(
        """
        import json, os, sys
        before = "toma" in sys.modules
        import toma
        print(json.dumps(dict(name=__name__, argv=sys.argv, before=before, extra=os.environ["EXTRA"],
                              path0=sys.path[0], cwd=os.getcwd())))
        """,
        env=dict(EXTRA="set"),
    )
    result = json.loads(out.stdout)
    assert result == dict(name="__main__", argv=["-c"], before=False, extra="set", path0="", cwd=helpers.REPO)


def test_an_exception_fails_with_its_traceback_and_an_exit_status_passes_through():
    with pytest.raises(AssertionError, match=r"subprocess failed \(1\)(.|\n)*File \"<string>\", line 3(.|\n)*boom"):
        run_python("x = 1\n\nraise ValueError('boom')\n")
    (returncode, _, _), (returncode_1, stdout, _) = run_ranks(
        "import os, sys\nprint('rank', os.environ['RANK'])\nsys.exit(int(os.environ['RANK']) * 3)\n", 2, check=False
    )
    assert returncode == 0 and returncode_1 == 3 and stdout == "rank 1\n"


def test_atexit_handlers_run_and_output_is_flushed_at_exit():
    out = run_python("import atexit, sys\nsys.stdout.write('unflushed ')\natexit.register(print, 'at exit')\n")
    assert out.stdout == "unflushed at exit\n"


def test_a_hang_is_killed_at_the_timeout_and_fails_the_test():
    with pytest.raises(pytest.fail.Exception, match="did not finish within 1 s"):
        run_python("print('started', flush=True)\nimport time\ntime.sleep(60)\n", timeout=1)


def test_omp_num_threads_of_the_ranks_sets_torchs_threads():
    (out,) = run_ranks("import torch\nprint(torch.get_num_threads())\n", 1)
    assert out == "1\n"
