"""The package's layout: subpackages whose imports flow downward, and every earlier module path still the
module it moved to (so that patching a name through the old path patches the code that uses it)."""

import ast
import importlib
import os
import subprocess
import sys

import pytest

import toma
from toma import old_paths
from toma.core.caches import Batchsize
from toma.core.policy import LearningPolicy
from toma.core.steps import Step

from helpers import REPO

PACKAGE = os.path.join(REPO, "toma")
# lower layers first: a module may import from its own layer and the ones before it, never from a later one
LAYERS = [
    {"memory", "batching"},
    {"core"},
    {"sizing"},
    {"accumulation", "offload"},
    {"training"},
    {
        "forms",
        "__init__",
        "__main__",
        "old_paths",
        "version",
        "batchsize_cache",
        "cpu_memory",
        "stacktrace",
        "torch_cuda_memory",
    },
    {"integrations"},  # each imports its framework, which nothing below may
]


def _layer(part: str) -> int:
    return next(index for index, names in enumerate(LAYERS) if part in names)


def _imports(path):
    tree = ast.parse(open(path, encoding="utf-8").read())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("toma"):
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            yield node.lineno, names
        elif isinstance(node, ast.Import):
            yield node.lineno, [alias.name for alias in node.names if alias.name.startswith("toma")]


def test_imports_between_subpackages_flow_downward():
    upward = []
    for directory, _, files in os.walk(PACKAGE):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(directory, name)
            relative = os.path.relpath(path, PACKAGE).split(os.sep)
            here = _layer(relative[0] if len(relative) > 1 else relative[0][:-3])
            for line, modules in _imports(path):
                for module in modules:
                    parts = module.split(".")
                    if len(parts) < 2 or parts[1] not in {p for layer in LAYERS for p in layer}:
                        continue
                    if _layer(parts[1]) > here:
                        upward.append(f"{os.path.relpath(path, REPO)}:{line} imports {module}")
    assert not upward, "\n".join(upward)


def test_the_package_folder_holds_subpackages_and_only_the_public_surface():
    modules = {name for name in os.listdir(PACKAGE) if name.endswith(".py")}
    assert modules == {
        "__init__.py",
        "__main__.py",
        "old_paths.py",
        "version.py",
        "batchsize_cache.py",
        "cpu_memory.py",
        "stacktrace.py",
        "torch_cuda_memory.py",  # toma 1.1.0's, for type checkers
    }, modules


@pytest.mark.parametrize("old, new", sorted(old_paths.MOVED.items()))
def test_every_earlier_module_path_is_the_module_it_moved_to(old, new):
    assert importlib.import_module(old) is importlib.import_module(new)
    assert getattr(toma, old.split(".", 1)[1]) is importlib.import_module(new)


def test_patching_through_toma_1_1_0s_path_reaches_the_code_that_uses_it(monkeypatch):
    """`toma.torch_cuda_memory` is `toma.memory.cuda` itself: a name patched there is what the OOM test reads."""
    import toma.torch_cuda_memory

    monkeypatch.setattr(toma.torch_cuda_memory, "is_cuda_out_of_memory", lambda exception: True)
    assert toma.memory.cuda.is_cuda_out_of_memory(ValueError("anything")) is True


def test_old_paths_import_in_a_fresh_interpreter_before_anything_else():
    code = (
        "from toma.batchsize_cache import GlobalBatchsizeCache\n"
        "from toma.cpu_memory import set_cpu_memory_limit\n"
        "from toma.stacktrace import watermark\n"
        "from toma.torch_cuda_memory import gc_cuda\n"
        "import toma.engine, toma.fit_to_memory, toma.policy\n"
        "from toma.memory import snapshot, History\n"
        "assert toma.engine is toma.core.engine and toma.policy.Halving is toma.Halving\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert done.returncode == 0, done.stderr


class _Steady(LearningPolicy):
    """A learning policy that overrides one hook: the others are the base class's defaults."""

    def __init__(self):
        self.failures = []

    def shrink(self, size):
        return size // 2 or None

    def after_oom(self, entry, token, size, failed, error):
        self.failures.append(failed)
        return super().after_oom(entry, token, size, failed, error)


def test_a_learning_policy_needs_only_the_hooks_it_changes():
    from toma.core import engine

    from helpers import raise_fake_oom

    class Rows(Step):
        func = staticmethod(lambda size: None)

        def __call__(self, size):
            if size > 5:
                raise_fake_oom()
            return True

    policy, entry = _Steady(), Batchsize(None)
    engine.run(Rows(), entry, 40, policy)
    assert policy.failures == [40, 20, 10] and entry.value == 5
