"""CUDA memory helpers; real CUDA out-of-memory under a per-process memory fraction (marked `cuda`)."""

import json

import pytest
import torch

from toma import torch_cuda_memory as tcm

from helpers import COLLECT_TOMA_LOG, requires_cuda, run_python


def test_queries_without_cuda_do_not_initialise_it():
    if torch.cuda.is_available():
        pytest.skip("checks the no-GPU answers")
    assert tcm.get_cuda_total_memory() == 0
    assert tcm.get_cuda_assumed_available_memory() == 0
    assert tcm.get_cuda_available_memory() == 0
    assert tcm.get_cuda_blocked_memory() == 0
    assert tcm.get_cuda_free_memory_if_initialized() is None
    assert tcm.cuda_meminfo() == "CUDA not available"
    tcm.gc_cuda()
    assert not torch.cuda.is_initialized()


def cuda_preamble(limit_gib: int) -> str:
    """Subprocess code: cap this process's CUDA memory at `limit_gib` GiB and collect toma's log lines."""
    return COLLECT_TOMA_LOG + CUDA_CAP.replace("LIMIT_GIB", str(limit_gib))


CUDA_CAP = """
import gc, json
import torch
from toma import toma, explicit, simple, NoBatchsizeCache
from toma.memory.cuda import get_cuda_free_memory_if_initialized, cuda_meminfo

LIMIT = LIMIT_GIB * 2**30
torch.cuda.init()
torch.cuda.set_per_process_memory_fraction(LIMIT / torch.cuda.get_device_properties(0).total_memory)
"""


@pytest.mark.cuda
@requires_cuda
def test_real_cuda_oom_under_a_memory_fraction_is_survived():
    code = (
        cuda_preamble(1)
        + """
x = torch.randn(16384, 64, device="cuda")
reference = torch.cat([torch.cdist(x[s:s + 512], x).sum(1) for s in range(0, 16384, 512)])
torch.cuda.synchronize()

@toma.batch(initial_batchsize=16384)
def kernel(batchsize):
    # 16384 x 16384 floats is 1 GiB per buffer, all of the cap: the full batch cannot fit.
    parts = [torch.cdist(x[s:s + batchsize], x).sum(1) for s in range(0, 16384, batchsize)]
    return torch.cat(parts)

out = torch.empty(16384, device="cuda")
@toma.chunked(initial_step=16384)
def chunks(chunk, start, end):
    chunk.copy_(torch.cdist(x[start:end], x).sum(1))

result = kernel()
chunks(out)
print(json.dumps(dict(
    batch_ok=bool(torch.allclose(result, reference, rtol=1e-4, atol=1e-2)),
    chunk_ok=bool(torch.allclose(out, reference, rtol=1e-4, atol=1e-2)),
    messages=messages, free=get_cuda_free_memory_if_initialized(), info=cuda_meminfo())))
"""
    )
    result = json.loads(run_python(code).stdout.splitlines()[-1])
    assert result["batch_ok"] and result["chunk_ok"]
    retries = [message for message in result["messages"] if "ran out of memory" in message]
    assert {m.split()[0] for m in retries} == {"kernel", "chunks"}, "both forms must have hit a real CUDA OOM"
    assert all("CUDA out of memory" in message for message in retries), result["messages"]
    assert result["free"] > 0


@pytest.mark.cuda
@requires_cuda
def test_memory_returns_to_baseline_after_100_oom_retries():
    code = (
        cuda_preamble(2)
        + """
keep = torch.ones(64 * 2**20, device="cuda")  # something that stays, to see it is not freed by mistake
torch.cuda.synchronize(); torch.cuda.empty_cache()
baseline_allocated = torch.cuda.memory_allocated()
baseline_reserved = torch.cuda.memory_reserved()
at_attempt_start = []

@toma.batch(initial_batchsize=4 * 2**30, cache_type=NoBatchsizeCache)
def grab(batchsize):
    at_attempt_start.append(torch.cuda.memory_allocated() - baseline_allocated)
    first = torch.empty(batchsize // 8, dtype=torch.uint8, device="cuda")  # held by the failing frame
    second = torch.empty(batchsize, dtype=torch.uint8, device="cuda")
    return int(second.numel())

sizes = [grab() for _ in range(100)]
gc.collect(); torch.cuda.empty_cache()
print(json.dumps(dict(
    sizes=sorted(set(sizes)), retries=len(messages), starts=sorted(set(at_attempt_start)),
    allocated=torch.cuda.memory_allocated() - baseline_allocated,
    reserved=torch.cuda.memory_reserved() - baseline_reserved, keep=float(keep.sum()))))
"""
    )
    result = json.loads(run_python(code, timeout=500).stdout.splitlines()[-1])
    assert result["retries"] >= 100, "every call must have run out of memory at least once"
    assert result["starts"] == [0], "a failed attempt's tensors were still allocated when the next one began"
    assert result["allocated"] == 0 and result["reserved"] == 0
    assert result["keep"] == 64 * 2**20


@pytest.mark.cuda
@pytest.mark.whole_device
@requires_cuda
def test_the_cuda_libraries_failing_on_a_full_device_fail_as_oom():
    """A fresh process fills the device to its last MiB, then uses cuBLAS, cuDNN, cuSOLVER and cuFFT for the
    first time: their handles and workspaces cannot be had, and every error they raise is one toma retries."""
    code = """
        import json, torch
        from toma import should_reduce_batch_size
        torch.cuda.init()
        a = torch.randn(64, 64, device="cuda")
        symmetric = a + a.T  # no matmul yet: cuBLAS stays unused
        image, kernel = torch.randn(1, 3, 32, 32, device="cuda"), torch.randn(8, 3, 3, 3, device="cuda")
        torch.cuda.synchronize()
        held, block = [], 2**30
        while block >= 2**20:
            try:
                held.append(torch.empty(block, dtype=torch.uint8, device="cuda"))
            except torch.OutOfMemoryError:
                block //= 2
        uses = dict(
            cublas=lambda: a @ a,
            cudnn=lambda: torch.nn.functional.conv2d(image, kernel),
            cusolver=lambda: torch.linalg.eigh(symmetric),
            cufft=lambda: torch.fft.fft(a),
        )
        outcomes = {}
        for name, use in uses.items():
            try:
                use()
                torch.cuda.synchronize()
                outcomes[name] = None
            except Exception as error:
                outcomes[name] = dict(type=type(error).__name__, message=str(error).splitlines()[0][:300],
                                      oom=should_reduce_batch_size(error))
        print(json.dumps(dict(free=torch.cuda.mem_get_info()[0], outcomes=outcomes)))
        """
    result = json.loads(run_python(code, timeout=300).stdout.splitlines()[-1])
    failures = {name: outcome for name, outcome in result["outcomes"].items() if outcome is not None}
    assert failures, f"a full device gave every library what it needed: {result}"
    assert all(outcome["oom"] for outcome in failures.values()), f"not recognised as out of memory: {failures}"
