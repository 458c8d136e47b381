"""The package namespace: toma 1.1.0's public names at their old import paths, the new ones, and nothing else."""

import importlib
import os
import re
import subprocess
import sys

import pytest
import torch

import toma as toma_package
from toma import NoBatchsizeCache, StacktraceMemoryBatchsizeCache, old_paths

from helpers import REPO

TOMA_1_1_NAMES = {
    "toma": [
        "toma",
        "simple",
        "explicit",
        "DEFAULT_CACHE_TYPE",
        "should_reduce_batch_size",
        "NoBatchsizeCache",
        "GlobalBatchsizeCache",
        "StacktraceMemoryBatchsizeCache",
        "is_out_of_cpu_memory",
        "is_cuda_out_of_memory",
        "is_cudnn_snafu",
        "gc_cuda",
        "tst",
        "get_cache_for_context",
        "CONTEXT_CACHE_SIZE",
    ],
    "toma.core.caches": [
        "Batchsize",
        "BatchsizeCache",
        "NoBatchsizeCache",
        "GlobalBatchsizeCache",
        "StacktraceMemoryBatchsizeCache",
    ],
    "toma.core.call_sites": ["get_simple_traceback", "watermark", "set_watermark"],
    "toma.memory.cpu": ["get_available_cpu_memory", "set_cpu_memory_limit", "is_out_of_cpu_memory"],
    "toma.memory.cuda": [
        "gc_cuda",
        "get_cuda_total_memory",
        "get_cuda_assumed_available_memory",
        "get_cuda_available_memory",
        "get_cuda_blocked_memory",
        "is_cuda_out_of_memory",
        "is_cudnn_snafu",
        "cuda_meminfo",
    ],
}


def test_every_toma_1_1_name_is_importable_from_its_old_path():
    missing = [
        f"{module}.{name}"
        for module, names in TOMA_1_1_NAMES.items()
        for name in names
        if not hasattr(importlib.import_module(module), name)
    ]
    assert missing == []
    from toma import toma

    for form in ("batch", "range", "chunked"):
        for namespace in (toma, toma.execute, toma_package.explicit, toma_package.simple):
            assert callable(getattr(namespace, form))


def test_the_new_names():
    from toma import toma

    for name in toma_package.__all__:
        assert hasattr(toma_package, name), name
    assert callable(toma.accumulate) and callable(toma_package.explicit.accumulate)
    assert toma.whole is toma_package.whole
    assert issubclass(toma_package.AccumulationMisuse, RuntimeError)


def test_version_and_type_marker():
    assert toma_package.__version__.count(".") == 2
    assert os.path.exists(os.path.join(os.path.dirname(toma_package.__file__), "py.typed"))


def test_default_cache_type_reads_and_writes_one_setting():
    assert toma_package.DEFAULT_CACHE_TYPE is StacktraceMemoryBatchsizeCache
    toma_package.DEFAULT_CACHE_TYPE = NoBatchsizeCache
    from toma import DEFAULT_CACHE_TYPE

    assert DEFAULT_CACHE_TYPE is NoBatchsizeCache
    assert toma_package.toma.DEFAULT_CACHE_TYPE is NoBatchsizeCache
    assert "DEFAULT_CACHE_TYPE" not in vars(toma_package), "an instance attribute would shadow the setting"


def test_default_policy_is_halving_and_a_setting_the_forms_read_at_call_time():
    from toma import FitToMemory, Halving, explicit, toma
    from toma.sizing.defaults import DEFAULTS

    assert isinstance(toma_package.DEFAULT_POLICY, Halving), "toma 1.1.0's sequences stay the default"
    assert isinstance(DEFAULTS.accumulation.resolve(), FitToMemory), "accumulation sizes by measuring"
    sizes = []

    def plain(batchsize):
        sizes.append(batchsize)
        if batchsize > 40:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return batchsize

    run = toma.batch(initial_batchsize=64, cache_type=NoBatchsizeCache)(plain)  # before the setting changes
    toma_package.DEFAULT_POLICY = toma_package.ShrinkByFactor(0.9)
    assert toma.DEFAULT_POLICY is toma_package.DEFAULT_POLICY
    assert run() == 40 and sizes == [64, 57, 51, 45, 40]
    sizes.clear()
    assert explicit.batch(plain, 64, toma_cache_type=NoBatchsizeCache) == 40 and sizes == [64, 57, 51, 45, 40]
    assert "DEFAULT_POLICY" not in vars(toma_package)
    with pytest.raises(TypeError, match="DEFAULT_POLICY"):
        toma_package.DEFAULT_POLICY = "halving"
    toma_package.DEFAULT_POLICY = None  # each capability's own default again
    assert isinstance(toma_package.DEFAULT_POLICY, Halving) and DEFAULTS.assigned is None
    assert isinstance(DEFAULTS.accumulation.resolve(), FitToMemory), "not the forms' Halving"
    sizes.clear()
    assert run() == 32 and sizes == [64, 32]


def test_decorated_functions_keep_their_identity():
    from toma import toma

    def run_inference(batchsize, model):
        """Runs the model."""
        return batchsize

    wrapped = toma.batch(initial_batchsize=8)(run_inference)
    assert wrapped.__name__ == "run_inference" and wrapped.__wrapped__ is run_inference
    assert "Runs the model." in wrapped.__doc__ and "toma_initial_batchsize" in wrapped.__doc__


def test_the_package_namespace_is_the_public_api_and_toma_1_1_0s_module_paths():
    """`dir(toma)` after `import toma` (in a fresh interpreter: other tests import more): `__all__`, `toma.map`
    (left out of `__all__`, which a star import would shadow the builtin with) and 1.1.0's module paths."""
    code = "import toma; print(' '.join(dir(toma))); print(' '.join(toma.__all__))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert done.returncode == 0, done.stderr
    listed, public = (set(line.split()) for line in done.stdout.splitlines())
    paths = {path.split(".", 1)[1] for path in old_paths.MOVED}
    dunder = re.compile(r"^__\w+__$")
    assert {name for name in listed if not dunder.match(name)} == {
        name for name in public | {"map"} | paths if not dunder.match(name)
    }


def test_an_imported_subpackage_is_reached_as_an_attribute_but_names_the_imports_left_are_not():
    import toma.offload.pinned

    assert toma.offload.pinned.HOST is importlib.import_module("toma.offload.pinned").HOST
    for leaked in ("sys", "Type", "accumulate", "engine", "trainer", "PackageModule", "BatchsizeCache"):
        assert not hasattr(toma, leaked), leaked
