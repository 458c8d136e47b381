"""Out-of-memory classification for every backend, and user predicates."""

import pytest
import torch
from torch._dynamo.exc import InternalTorchDynamoError

from toma import explicit, register_oom_predicate, should_reduce_batch_size, unregister_oom_predicate
from toma.cpu_memory import is_out_of_cpu_memory
from toma.distributed import AgreedRetry, RankFailed
from toma.oom import ControlException
from toma.torch_cuda_memory import is_cuda_out_of_memory, is_cudnn_snafu

OOM_ERRORS = [
    torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 7.79 GiB total capacity)"),
    torch.OutOfMemoryError("HIP out of memory. Tried to allocate 2.00 GiB (GPU 0; 63.98 GiB total capacity)"),
    torch.OutOfMemoryError("XPU out of memory. Tried to allocate 1024.00 MiB"),
    torch.OutOfMemoryError("Allocation on device 0 would exceed allowed memory. (out of memory)"),
    torch.AcceleratorError("CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported"),
    RuntimeError("CUDA error: out of memory"),
    RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
    RuntimeError("cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if you passed in a non-contiguous"),
    RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED"),
    RuntimeError("MPS backend out of memory (MPS allocated: 9.00 GB, other allocations: 1.00 GB)"),
    RuntimeError(
        "[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: you tried "
        "to allocate 80000000000 bytes. Error code 12 (Cannot allocate memory)"
    ),
    RuntimeError("DefaultCPUAllocator: not enough memory: you tried to allocate 80000000000 bytes."),
    RuntimeError("Out Of Memory while running the kernel"),
    MemoryError(),
]

NOT_OOM = [
    RuntimeError("CUDA error: an illegal memory access was encountered"),
    RuntimeError("mat1 and mat2 shapes cannot be multiplied (2x3 and 4x5)"),
    torch.AcceleratorError("CUDA error: device-side assert triggered"),
    ValueError("out of memory"),  # only RuntimeError-family texts are read
    KeyError("CUDA out of memory"),
    TypeError("bad"),
]


@pytest.mark.parametrize("error", OOM_ERRORS, ids=lambda e: f"{type(e).__name__}:{str(e)[:40]}")
def test_every_backends_oom_is_recognised(error):
    assert should_reduce_batch_size(error)


@pytest.mark.parametrize("error", NOT_OOM, ids=lambda e: f"{type(e).__name__}:{str(e)[:40]}")
def test_other_errors_are_not_oom(error):
    assert not should_reduce_batch_size(error)


@pytest.mark.parametrize("error", OOM_ERRORS, ids=lambda e: f"{type(e).__name__}:{str(e)[:40]}")
def test_every_recognised_oom_is_retried(error):
    sizes = []

    def f(batchsize):
        sizes.append(batchsize)
        if batchsize > 2:
            raise error
        return batchsize

    assert explicit.batch(f, 8) == 2
    assert sizes == [8, 4, 2]


def test_backend_specific_predicates_keep_their_meaning():
    assert is_cuda_out_of_memory(RuntimeError("CUDA out of memory. Tried to allocate 2 MiB"))
    assert is_cuda_out_of_memory(torch.AcceleratorError("CUDA error: out of memory"))
    assert not is_cuda_out_of_memory(RuntimeError("DefaultCPUAllocator: can't allocate memory"))
    assert is_cudnn_snafu(RuntimeError("cuDNN error: CUDNN_STATUS_NOT_SUPPORTED."))
    assert not is_cudnn_snafu(RuntimeError("CUDA out of memory."))
    assert is_out_of_cpu_memory(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried"))
    assert is_out_of_cpu_memory(MemoryError())
    assert not is_out_of_cpu_memory(RuntimeError("CUDA out of memory."))


class DeviceQueueFull(Exception):
    pass


def test_users_can_extend_the_predicate():
    error = DeviceQueueFull("queue full")
    assert not should_reduce_batch_size(error)
    predicate = register_oom_predicate(lambda e: isinstance(e, DeviceQueueFull))
    try:
        assert should_reduce_batch_size(error)
        sizes = []

        def f(batchsize):
            sizes.append(batchsize)
            if batchsize > 1:
                raise DeviceQueueFull()

        explicit.batch(f, 4)
        assert sizes == [4, 2, 1]
    finally:
        unregister_oom_predicate(predicate)
    assert not should_reduce_batch_size(error)


def test_register_rejects_non_callables():
    with pytest.raises(TypeError, match="predicate"):
        register_oom_predicate("out of memory")


def real_cpu_oom(rows: int) -> None:
    """A real allocator failure: `rows` x 2**45 bytes is far beyond any machine."""
    torch.empty(rows, 2**45, dtype=torch.uint8)


def wrapped_like_torch_compile(rows: int) -> None:
    try:
        real_cpu_oom(rows)
    except RuntimeError as error:
        raise InternalTorchDynamoError("MemoryError: std::bad_alloc") from error


def test_an_error_raised_from_an_oom_is_an_oom():
    try:
        wrapped_like_torch_compile(1)
    except InternalTorchDynamoError as error:
        wrapped = error
    assert should_reduce_batch_size(wrapped)
    twice = ValueError("outer")
    twice.__cause__ = KeyError("middle")
    twice.__cause__.__cause__ = MemoryError()
    assert should_reduce_batch_size(twice), "the whole __cause__ chain is followed"
    context_only = ValueError("raised while handling an OOM, not from it")
    context_only.__context__ = MemoryError()
    assert not should_reduce_batch_size(context_only)
    cycle = ValueError("a")
    cycle.__cause__ = KeyError("b")
    cycle.__cause__.__cause__ = cycle
    assert not should_reduce_batch_size(cycle)


def test_a_wrapped_real_oom_is_retried():
    sizes = []

    def f(batchsize):
        sizes.append(batchsize)
        if batchsize > 2:
            wrapped_like_torch_compile(batchsize)
        return batchsize

    assert explicit.batch(f, 8) == 2 and sizes == [8, 4, 2]


def test_tomas_control_exceptions_are_never_oom_whatever_their_cause():
    try:
        try:
            real_cpu_oom(1)
        except RuntimeError as oom:
            raise RankFailed("toma: rank 1 ran out of memory at its smallest size (1)") from oom
    except RankFailed as error:
        failed = error
    assert isinstance(failed.__cause__, RuntimeError) and should_reduce_batch_size(failed.__cause__)
    assert not should_reduce_batch_size(failed)
    retry = AgreedRetry(4, "rank 0 ran out of memory")
    retry.__cause__ = MemoryError()
    assert not should_reduce_batch_size(retry)
    assert not should_reduce_batch_size(KeyError("x")) and issubclass(RankFailed, ControlException)
