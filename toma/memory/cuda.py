"""CUDA memory: freeing the caching allocator, memory queries, and whether an error means CUDA ran out."""

import gc
import logging
import re
from typing import Optional

import torch

__all__ = [
    "gc_cuda",
    "get_cuda_total_memory",
    "get_cuda_assumed_available_memory",
    "get_cuda_available_memory",
    "get_cuda_blocked_memory",
    "get_cuda_free_memory_if_initialized",
    "is_cuda_out_of_memory",
    "cuda_device_full",
    "is_cudnn_snafu",
    "cuda_meminfo",
]

log = logging.getLogger("toma")

# Texts of PyTorch's errors that mean CUDA memory ran out: the caching allocator's, the runtime's, and those
# of the CUDA libraries, which allocate their workspaces and handles outside the caching allocator and so fail
# exactly when a sizing policy has filled the device. PyTorch words them "CUDA error: <status> when calling
# `<call>`" (cuBLAS, cuSPARSE), "cuDNN error: <status>", "cusolver error: <status>, when calling ...",
# "cuFFT error: <status>". cuSPARSE's ALLOC_FAILED reaches PyTorch as "CUDA error: out of memory when calling
# `cusparse...`"; its status name is what other wrappers print.
CUDA_OOM_MARKERS = (
    "CUDA out of memory",
    "CUDA error: out of memory",
    "HIP out of memory",
    "CUBLAS_STATUS_ALLOC_FAILED",
    "CUDNN_STATUS_ALLOC_FAILED",  # cuDNN 8; an alias of HOST_ALLOCATION_FAILED in cuDNN 9
    "CUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED",  # cuDNN 9
    "CUDNN_STATUS_INTERNAL_ERROR_HOST_ALLOCATION_FAILED",  # cuDNN 9
    "CUSOLVER_STATUS_ALLOC_FAILED",
    "CUFFT_ALLOC_FAILED",
    "CUSPARSE_STATUS_ALLOC_FAILED",
)
# A status that means memory ran out only where one call reports it: cublasCreate answers NOT_INITIALIZED when
# it cannot get the memory for a handle (the first matmul on a full device). Elsewhere NOT_INITIALIZED means a
# handle that is broken or used without initialisation, which no smaller size mends.
CUDA_OOM_STATUS_OF_CALL = (("CUBLAS_STATUS_NOT_INITIALIZED", "`cublasCreate("),)
# Statuses that mean memory ran out only while the device is full: on an H200 filled to its last MiB (CUDA 13,
# cuDNN 9.19) a first cuDNN convolution answered a plain CUDNN_STATUS_INTERNAL_ERROR, cusolverDnCreate
# CUSOLVER_STATUS_INTERNAL_ERROR and a first FFT CUFFT_INTERNAL_ERROR. On a device with room they are real faults.
CUDA_OOM_WHEN_FULL = re.compile(
    r"CUDNN_STATUS_INTERNAL_ERROR(?![A-Z_])|CUSOLVER_STATUS_INTERNAL_ERROR|CUFFT_INTERNAL_ERROR"
)
# A device is full when the driver has less free than this, or than 1/64 of it (1.4 GiB of an H200's 140).
FULL_DEVICE_FREE = 2**29
# cuDNN's plain NOT_SUPPORTED (legacy API, "...NOT_SUPPORTED. This error may appear if you passed in a
# non-contiguous input."), often an input too large; not cuDNN 9's NOT_SUPPORTED_<reason> (architecture,
# driver, layout), which no smaller size mends.
CUDNN_SNAFU = re.compile(r"CUDNN_STATUS_NOT_SUPPORTED(?![A-Z_])")

_GiB = 2**30
_PROBE_MARGIN = 2**28


def gc_cuda() -> None:
    """Collect Python garbage, then hand PyTorch's cached but unused CUDA blocks back to the driver."""
    gc.collect()
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def get_cuda_total_memory() -> int:
    """Total memory of the current CUDA device in bytes (0 without CUDA)."""
    if not torch.cuda.is_available():
        return 0
    return int(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)


def get_cuda_assumed_available_memory() -> int:
    """Total device memory minus what PyTorch has reserved; ignores other processes (0 without CUDA)."""
    if not torch.cuda.is_available():
        return 0
    return get_cuda_total_memory() - int(torch.cuda.memory_reserved())


def get_cuda_blocked_memory() -> int:
    """Memory that is neither reserved by PyTorch nor allocatable: other processes, CUDA contexts.

    Found by allocating ever smaller blocks until one fits, so it is slow and empties the cache.
    """
    if not torch.cuda.is_available():
        return 0
    available = get_cuda_assumed_available_memory()
    size = available - _PROBE_MARGIN
    while size > 0:
        try:
            block = torch.empty((size,), dtype=torch.uint8, device="cuda")
        except RuntimeError as exception:
            if not is_cuda_out_of_memory(exception):
                raise
            size -= _GiB
            continue
        del block
        gc_cuda()
        return available - size
    gc_cuda()
    return available


def get_cuda_available_memory() -> int:
    """Memory a new tensor could really get on the current device, by probing (0 without CUDA)."""
    if not torch.cuda.is_available():
        return 0
    return get_cuda_assumed_available_memory() - get_cuda_blocked_memory()


def _has_context(index: int) -> bool:
    """Whether CUDA device `index` has its context already (reading its free memory would create one)."""
    has_context = getattr(torch._C, "_cuda_hasPrimaryContext", None)
    if has_context is not None:
        return bool(has_context(index))
    return torch.cuda.memory_reserved(index) > 0  # an older build: memory PyTorch holds means a context


def get_cuda_free_memory_if_initialized(device: Optional[torch.device] = None) -> Optional[int]:
    """Free memory of the CUDA `device` plus PyTorch's cached but unused blocks there; None while CUDA is
    not initialised, or for a device that is not CUDA. `device` None: the current device, if it has a
    context (a thread's current device may be one the process never used).

    Never initialises CUDA, nor a device's context (that would cost memory there and break later forks).
    """
    if not torch.cuda.is_initialized():
        return None
    if device is None:
        index = torch.cuda.current_device()
        if not _has_context(index):
            return None
    elif device.type != "cuda":
        return None
    else:
        index = torch.cuda.current_device() if device.index is None else device.index
    free, _total = torch.cuda.mem_get_info(index)
    return int(free + torch.cuda.memory_reserved(index) - torch.cuda.memory_allocated(index))


def _message(exception: BaseException) -> str:
    return str(exception) if isinstance(exception, RuntimeError) else ""


def is_cuda_out_of_memory(exception: BaseException) -> bool:
    """True for out-of-memory errors of CUDA or ROCm, their allocator, and the CUDA libraries (cuBLAS, cuDNN,
    cuSOLVER, cuFFT, cuSPARSE), including the internal errors those libraries give on a full device."""
    if isinstance(exception, torch.OutOfMemoryError):
        return True
    message = _message(exception)
    return (
        any(marker in message for marker in CUDA_OOM_MARKERS)
        or any(status in message and call in message for status, call in CUDA_OOM_STATUS_OF_CALL)
        or (CUDA_OOM_WHEN_FULL.search(message) is not None and cuda_device_full())
    )


def cuda_device_full() -> bool:
    """Whether a CUDA device this process uses has next to no free memory as the driver counts it (PyTorch's
    cached blocks count as used: the libraries allocate outside the cache). Never creates a context."""
    if not torch.cuda.is_initialized():
        return False
    for index in range(torch.cuda.device_count()):
        if not _has_context(index):
            continue
        try:
            free, total = torch.cuda.mem_get_info(index)
        except RuntimeError:  # a device in an error state: its memory is not what failed
            continue
        if free < max(FULL_DEVICE_FREE, total // 64):
            return True
    return False


def is_cudnn_snafu(exception: BaseException) -> bool:
    """cuDNN's NOT_SUPPORTED, which in practice often means the input was too large."""
    return CUDNN_SNAFU.search(_message(exception)) is not None


def cuda_meminfo() -> str:
    """A one-line summary of PyTorch's CUDA memory use, logged at INFO on the "toma" logger and returned."""
    if not torch.cuda.is_available():
        return "CUDA not available"
    summary = (
        f"allocated {torch.cuda.memory_allocated() / _GiB:.3f} GiB, "
        f"reserved {torch.cuda.memory_reserved() / _GiB:.3f} GiB, "
        f"max allocated {torch.cuda.max_memory_allocated() / _GiB:.3f} GiB, "
        f"max reserved {torch.cuda.max_memory_reserved() / _GiB:.3f} GiB"
    )
    log.info("CUDA memory: %s", summary)
    return summary
