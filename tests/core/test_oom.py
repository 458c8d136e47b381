"""Out-of-memory classification for every backend, and user predicates."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch._dynamo.exc import InternalTorchDynamoError

import toma.memory.cuda as cuda_memory
from toma import explicit, register_oom_predicate, should_reduce_batch_size, toma, unregister_oom_predicate
from toma.core.agreement import AgreedRetry, RankFailed
from toma.core.oom import ControlException
from toma.memory.cpu import is_out_of_cpu_memory
from toma.memory.cuda import is_cuda_out_of_memory, is_cudnn_snafu

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
    """A real allocator failure: `rows` x 2**58 bytes is beyond any address space (57 bits hold 2**57), so it
    fails also where memory is overcommitted (2**45 bytes were granted on a 128 GiB machine)."""
    torch.empty(rows, 2**58, dtype=torch.uint8)


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


# The CUDA libraries' allocation failures, worded as PyTorch's checks word them (ATen/cuda/Exceptions.h,
# CuFFTUtils.h; cuDNN's and cuSPARSE's strings from their own cudnnGetErrorString / cusparseGetErrorString).
CUDA_LIBRARY_OOMS = [
    RuntimeError("cuDNN error: CUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED"),
    RuntimeError("cuDNN error: CUDNN_STATUS_INTERNAL_ERROR_HOST_ALLOCATION_FAILED"),
    RuntimeError(
        "cuDNN Frontend error: [cudnn_frontend] Error: No execution plans support the graph. "
        "CUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED"
    ),
    RuntimeError("CUDA error: CUBLAS_STATUS_NOT_INITIALIZED when calling `cublasCreate(handle)`"),
    RuntimeError(
        "cusolver error: CUSOLVER_STATUS_ALLOC_FAILED, when calling `cusolverDnCreate(handle)`. If you keep seeing "
        "this error, you may use `torch.backends.cuda.preferred_linalg_library()` to try linear algebra operators "
        "with other supported backends."
    ),
    RuntimeError("cuFFT error: CUFFT_ALLOC_FAILED"),
    # cusparseGetErrorString(CUSPARSE_STATUS_ALLOC_FAILED) is "out of memory"
    RuntimeError(
        "CUDA error: out of memory when calling `cusparseSpMM_bufferSize( handle, opa, opb, &alpha, descA, descB, "
        "&beta, descC, compute_type, CUSPARSE_SPMM_CSR_ALG1, &bufferSize)`"
    ),
    RuntimeError("CuSparseError: CUSPARSE_STATUS_ALLOC_FAILED"),  # as other wrappers name it
]

# Statuses that are not memory running out, however close their names.
CUDA_LIBRARY_NEAR_MISSES = [
    RuntimeError("cuDNN error: CUDNN_STATUS_BAD_PARAM"),
    RuntimeError("cuDNN error: CUDNN_STATUS_INTERNAL_ERROR"),
    RuntimeError("cuDNN error: CUDNN_STATUS_EXECUTION_FAILED"),
    RuntimeError("cuDNN error: CUDNN_STATUS_NOT_SUPPORTED_ARCH_MISMATCH"),
    RuntimeError("cuDNN error: CUDNN_STATUS_NOT_SUPPORTED_INCOMPATIBLE_CUDA_DRIVER"),
    # NOT_INITIALIZED from any call but cublasCreate is a broken or uninitialised handle, not a full device
    RuntimeError("CUDA error: CUBLAS_STATUS_NOT_INITIALIZED when calling `cublasSetStream(handle, stream)`"),
    RuntimeError("CUDA error: CUBLAS_STATUS_NOT_INITIALIZED"),
    RuntimeError(
        "CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasSgemm( handle, opa, opb, m, n, k, &alpha, "
        "a, lda, b, ldb, &beta, c, ldc)`"
    ),
    RuntimeError("CUDA error: CUBLAS_STATUS_INVALID_VALUE when calling `cublasCreate(handle)`"),
    RuntimeError(
        "cusolver error: CUSOLVER_STATUS_INVALID_VALUE, when calling `cusolverDnSgetrf( handle, m, n, dA, ldda, "
        "static_cast<float*>(dataPtr.get()), ipiv, info)`. This error may appear if the input matrix contains NaN."
    ),
    RuntimeError("cusolver error: CUSOLVER_STATUS_EXECUTION_FAILED, when calling `cusolverDnCreate(handle)`. "),
    RuntimeError("cuFFT error: CUFFT_INVALID_SIZE"),
    RuntimeError("cuFFT error: CUFFT_INTERNAL_ERROR"),
    RuntimeError("CUDA error: insufficient resources when calling `cusparseSpGEMM_workEstimation( handle, ...)`"),
    RuntimeError("CUDA error: internal error when calling `cusparseSpGEMM_workEstimation( handle, ...)`"),
]


@pytest.mark.parametrize("error", CUDA_LIBRARY_OOMS, ids=lambda e: str(e)[:60])
def test_the_cuda_libraries_allocation_failures_are_oom(error):
    assert is_cuda_out_of_memory(error)
    assert should_reduce_batch_size(error)


@pytest.mark.parametrize("error", CUDA_LIBRARY_NEAR_MISSES, ids=lambda e: str(e)[:60])
def test_the_cuda_libraries_other_failures_are_not(error):
    assert not is_cuda_out_of_memory(error)
    assert not should_reduce_batch_size(error)


# What cuDNN 9.19, cuSOLVER and cuFFT (CUDA 13) answered on an H200 filled to its last MiB
# (tests/memory/test_cuda.py::test_the_cuda_libraries_failing_on_a_full_device_fail_as_oom).
CUDA_LIBRARY_FAILURES_OF_A_FULL_DEVICE = [
    RuntimeError("cuDNN error: CUDNN_STATUS_INTERNAL_ERROR"),
    RuntimeError(
        "cusolver error: CUSOLVER_STATUS_INTERNAL_ERROR, when calling `cusolverDnCreate(handle)`. If you keep seeing "
        "this error, you may use `torch.backends.cuda.preferred_linalg_library()` to try linear algebra operators "
        "with other supported backends."
    ),
    RuntimeError("cuFFT error: CUFFT_INTERNAL_ERROR"),
]


@pytest.mark.parametrize("error", CUDA_LIBRARY_FAILURES_OF_A_FULL_DEVICE, ids=lambda e: str(e)[:40])
def test_the_libraries_internal_errors_are_oom_only_while_the_device_is_full(error, monkeypatch):
    monkeypatch.setattr(cuda_memory, "cuda_device_full", lambda: True)
    assert is_cuda_out_of_memory(error) and should_reduce_batch_size(error)
    monkeypatch.setattr(cuda_memory, "cuda_device_full", lambda: False)
    assert not is_cuda_out_of_memory(error) and not should_reduce_batch_size(error)


def test_on_a_full_device_the_other_statuses_stay_what_they_are(monkeypatch):
    monkeypatch.setattr(cuda_memory, "cuda_device_full", lambda: True)
    full = {str(error) for error in CUDA_LIBRARY_FAILURES_OF_A_FULL_DEVICE}
    others = [error for error in CUDA_LIBRARY_NEAR_MISSES if str(error) not in full]
    assert others and not any(is_cuda_out_of_memory(error) for error in others)


def test_a_device_is_full_below_a_64th_of_its_memory_or_half_a_gib_free(monkeypatch):
    free = {0: 0}
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(cuda_memory, "_has_context", lambda index: index == 1)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda index: (free[0], 140 * 2**30) if index == 1 else 1 / 0)
    for bytes_free, full in [(2**20, True), (2 * 2**30, True), (3 * 2**30, False)]:
        free[0] = bytes_free
        assert cuda_memory.cuda_device_full() is full, bytes_free
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda index: (2**20, 4 * 2**30))
    assert cuda_memory.cuda_device_full(), "half a GiB free at least, also on a small device"


def test_whether_the_device_is_full_is_not_asked_before_cuda_is_in_use():
    if torch.cuda.is_initialized():
        pytest.skip("CUDA is in use in this process")
    assert not cuda_memory.cuda_device_full() and not torch.cuda.is_initialized()


def test_cudnns_plain_not_supported_stays_a_snafu_and_its_reasons_do_not():
    legacy = RuntimeError(
        "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if you passed in a non-contiguous input."
    )
    assert is_cudnn_snafu(legacy) and should_reduce_batch_size(legacy)
    assert is_cudnn_snafu(RuntimeError("cuDNN error: CUDNN_STATUS_NOT_SUPPORTED"))
    assert not is_cudnn_snafu(RuntimeError("cuDNN error: CUDNN_STATUS_NOT_SUPPORTED_LAYOUT"))


# What a collective raises when NCCL itself cannot allocate (ProcessGroupNCCL's check of an NCCL call).
NCCL_OOM = (
    "NCCL error in: ../torch/csrc/distributed/c10d/NCCLUtils.hpp:275, unhandled cuda error (run with "
    "NCCL_DEBUG=INFO for details), NCCL version 2.21.5\nncclUnhandledCudaError: Call to CUDA function failed.\n"
    "Last error:\nCuda failure 2 'out of memory'"
)


def raised_from(error, cause):
    try:
        try:
            raise cause
        except BaseException as inner:
            raise error from inner
    except BaseException as outer:
        return outer


def collective_errors():
    return [
        dist.DistBackendError(NCCL_OOM),
        dist.DistError(NCCL_OOM),
        dist.DistNetworkError("Connection reset by peer: out of memory"),
        dist.DistStoreError("out of memory"),
        RuntimeError(NCCL_OOM),  # an older torch's plain RuntimeError with NCCL's text
    ]


@pytest.mark.parametrize("error", collective_errors(), ids=lambda e: type(e).__name__)
def test_an_error_of_a_collective_is_never_a_local_oom(error):
    assert should_reduce_batch_size(RuntimeError("Cuda failure 2 'out of memory'")), "the text alone is an OOM"
    assert not should_reduce_batch_size(error)


def test_a_collective_error_anywhere_in_the_cause_chain_stops_the_retry():
    """Outer from collective: the collective failed first, whatever the wrapper says. Collective from an OOM:
    the collective still failed, the peers are in it. Either way a local retry cannot mend it."""
    nccl = dist.DistBackendError(NCCL_OOM)
    wrapped = raised_from(ValueError("the gradient all-reduce failed"), nccl)
    assert not should_reduce_batch_size(wrapped)
    named_oom = raised_from(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB"), nccl)
    assert not should_reduce_batch_size(named_oom), "an OOM raised from a collective's error is the collective's"
    from_oom = raised_from(dist.DistBackendError("NCCL communicator was aborted"), torch.OutOfMemoryError("CUDA"))
    assert not should_reduce_batch_size(from_oom)
    deep = raised_from(KeyError("outer"), raised_from(ValueError("middle"), nccl))
    assert not should_reduce_batch_size(deep)
    assert should_reduce_batch_size(raised_from(ValueError("outer"), torch.OutOfMemoryError("CUDA"))), "control"


def test_a_registered_predicate_cannot_make_a_collective_error_retried():
    predicate = register_oom_predicate(lambda e: True)
    try:
        assert not should_reduce_batch_size(dist.DistBackendError(NCCL_OOM))
    finally:
        unregister_oom_predicate(predicate)


def test_a_collective_error_passes_through_a_decorator_untouched_and_is_never_retried():
    error = dist.DistBackendError(NCCL_OOM)
    sizes = []

    def f(batchsize):
        sizes.append(batchsize)
        raise error

    with pytest.raises(dist.DistBackendError) as info:
        explicit.batch(f, 8)
    assert info.value is error and sizes == [8]
    assert not getattr(error, "__notes__", None)


def test_a_collective_error_in_accumulation_passes_through_untouched_with_no_retry():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    inputs, targets = torch.randn(32, 6), torch.randint(0, 3, (32,))
    error = dist.DistBackendError(NCCL_OOM)
    sizes = []

    @toma.accumulate(model=model, initial_micro_batch=8)
    def compute_loss(inputs, targets):
        if not torch.is_grad_enabled():  # toma's one check, without gradients, that the loss adds up
            return F.cross_entropy(model(inputs), targets)
        sizes.append(len(inputs))
        if len(sizes) == 2:  # the second micro-batch, after the first one's backward pass
            raise error
        return F.cross_entropy(model(inputs), targets)

    with pytest.raises(dist.DistBackendError) as info:
        compute_loss(inputs, targets)
    assert info.value is error and sizes == [8, 8], "raised once, never retried"
    assert compute_loss.stats.oom_retries == 0
    assert all(p.grad is None for p in model.parameters()), "the failed attempt's gradients are dropped"


def test_an_error_raised_inside_a_collective_is_marked_never_retried_and_otherwise_untouched():
    from toma.core.oom import collective, inside_collective

    error = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    with pytest.raises(torch.OutOfMemoryError) as raised:
        with collective("gradients' all-reduce"):
            raise error
    assert raised.value is error, "the same error, its type and message"
    assert inside_collective(error) and not should_reduce_batch_size(error)
    assert "inside the gradients' all-reduce" in error.__notes__[-1]
    wrapped = RuntimeError("while reducing")
    wrapped.__cause__ = error
    assert inside_collective(wrapped) and not should_reduce_batch_size(wrapped), "also as a cause"
    assert not inside_collective(torch.OutOfMemoryError("CUDA out of memory")), "only what was raised inside"
