"""CPU memory: the cap, what is available under it, and real out-of-memory errors under it."""

import json

import pytest

from toma.memory.cpu import (
    get_available_cpu_memory,
    is_out_of_cpu_memory,
    set_cpu_memory_headroom,
    set_cpu_memory_limit,
)

from helpers import COLLECT_TOMA_LOG, run_python


@pytest.mark.parametrize(
    "value, error",
    [
        (0, ValueError),
        (-1, ValueError),
        (float("inf"), ValueError),
        (float("nan"), ValueError),
        ("8", TypeError),
        (True, TypeError),
    ],
)
def test_limit_rejects_bad_values(value, error):
    with pytest.raises(error, match="num_gigabytes"):
        set_cpu_memory_limit(value)


@pytest.mark.parametrize(
    "value, error", [(0, ValueError), (-0.5, ValueError), (float("inf"), ValueError), ("1", TypeError)]
)
def test_headroom_rejects_bad_values(value, error):
    with pytest.raises(error, match="num_gigabytes"):
        set_cpu_memory_headroom(value)


@pytest.mark.slow
def test_headroom_caps_at_the_settled_address_space_plus_the_headroom():
    out = run_python(
        """
        import json, resource, psutil
        from toma.memory.cpu import predictable_heap, set_cpu_memory_headroom
        predictable_heap()
        garbage = [bytearray(64 * 2**20) for _ in range(4)]
        del garbage  # freed memory leaves the address space before the cap is measured
        cap = set_cpu_memory_headroom(0.5)
        vms = psutil.Process().memory_info().vms
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        try:
            bytearray(600 * 2**20)
            failed = False
        except MemoryError:
            failed = True
        small = bytearray(300 * 2**20)
        print(json.dumps(dict(cap=cap, vms=vms, soft=soft, hard=hard, failed=failed)))
        """
    )
    result = json.loads(out.stdout)
    assert result["soft"] == result["hard"] == result["cap"]
    assert 0 <= result["cap"] - 2**29 - result["vms"] < 2**24, "the cap is the address space in use plus 512 MiB"
    assert result["failed"], "600 MiB must not fit in 512 MiB of headroom (300 MiB did)"


@pytest.mark.parametrize("threshold", [0, -1, 1.5, True])
def test_predictable_heap_rejects_a_bad_mmap_threshold(threshold):
    from toma.memory.cpu import predictable_heap

    with pytest.raises(ValueError, match="mmap_threshold"):
        predictable_heap(threshold)


@pytest.mark.slow
@pytest.mark.parametrize("threshold, mapped", [(None, False), (64 * 1024, True)])
def test_predictable_heaps_mmap_threshold_reaches_malloc(threshold, mapped):
    """Ten 100 KiB tensors: from the heap at the 1 MiB threshold, each in its own mapping (freed with it) below
    it (glibc's count of mapped chunks, `mallinfo2().hblks`)."""
    out = run_python(
        f"""
        import ctypes, json, torch
        from toma.memory.cpu import predictable_heap
        predictable_heap({"" if threshold is None else threshold})
        libc = ctypes.CDLL("libc.so.6")
        if not hasattr(libc, "mallinfo2"):
            print(json.dumps(dict(mapped=None)))  # glibc before 2.33
            raise SystemExit
        libc.mallinfo2.restype = type("Info", (ctypes.Structure,), dict(_fields_=[(n, ctypes.c_size_t) for n in
            ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keep")]))
        import gc
        gc.collect()
        gc.disable()  # no garbage of the imports (freed mapped chunks) collected while the pieces are counted
        before = libc.mallinfo2().hblks
        # many pieces: a free chunk that the imports left in the heap serves a request above the threshold too
        pieces = [torch.empty(100 * 1024, dtype=torch.uint8) for _ in range(60)]
        print(json.dumps(dict(mapped=libc.mallinfo2().hblks - before)))
        """
    )
    count = json.loads(out.stdout)["mapped"]
    if count is None:
        pytest.skip("glibc's mallinfo2 (2.33 and later) is not here")
    assert (count >= 30) == mapped and (count > 0) == mapped, count  # glibc's count moves with other frees too


def test_available_memory_is_positive():
    assert get_available_cpu_memory() > 0


def test_is_out_of_cpu_memory_messages():
    assert is_out_of_cpu_memory(RuntimeError("DefaultCPUAllocator: not enough memory: you tried to allocate 8"))
    assert not is_out_of_cpu_memory(RuntimeError("DefaultCPUAllocator"))


@pytest.mark.slow
def test_limit_caps_the_address_space_and_available_memory():
    out = run_python(
        """
        import json, resource, psutil
        from toma.memory.cpu import set_cpu_memory_limit, get_available_cpu_memory
        vms = psutil.Process().memory_info().vms
        set_cpu_memory_limit((vms + 2**30) / 2**30)
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        available = get_available_cpu_memory()
        try:
            bytearray(2 * 2**30)
            failed = False
        except MemoryError:
            failed = True
        print(json.dumps(dict(vms=vms, soft=soft, hard=hard, available=available, failed=failed)))
        """
    )
    result = json.loads(out.stdout)
    assert result["soft"] == result["hard"] == result["vms"] + 2**30
    assert 0 < result["available"] <= 2**30
    assert result["failed"], "a 2 GiB allocation must fail under a 1 GiB headroom"


# One process, capped at its current address space plus HEADROOM, runs every form on a computation whose
# first attempt needs several times HEADROOM. Each form must end with the reference result after real
# allocator failures, and no tensor of a failed attempt may be alive when the next attempt starts.
REAL_OOM_SCENARIOS = (
    COLLECT_TOMA_LOG
    + """
import json, weakref
import torch
torch.set_num_threads(1)
from toma import toma, explicit, simple
from toma.memory.cpu import predictable_heap, set_cpu_memory_headroom

predictable_heap()

HEADROOM = 160 * 2**20
N, D = 4096, 8
x = torch.randn(N, D, generator=torch.Generator().manual_seed(0))

def kernel_rows(start, end):
    # (end - start) x N x D floats, twice: 1 GiB at the full step of N rows, 64 MiB at 256 rows.
    differences = x[start:end, None, :] - x[None, :, :]
    return differences.square_().sum(-1).neg_().exp_().sum(1)

reference = torch.cat([kernel_rows(s, min(s + 256, N)) for s in range(0, N, 256)])


refs, leaked = [], []
def attempt_starts():
    # Every tensor of earlier attempts (failed ones, or finished chunks) must be gone by now.
    leaked.append(sum(r() is not None for r in refs))
    refs.clear()

def watch(tensor):
    refs.append(weakref.ref(tensor))

set_cpu_memory_headroom(HEADROOM / 2**30)

def run_batch(batchsize):
    attempt_starts()
    rows = []
    for start in range(0, N, batchsize):
        rows.append(kernel_rows(start, min(start + batchsize, N)))
        watch(rows[-1])
    return torch.cat(rows)

def rows_into(out):
    def body(start, end):
        attempt_starts()
        part = kernel_rows(start, end)
        watch(part)
        out[start:end] = part
    return body

def chunk_into(chunk, start, end):
    attempt_starts()
    part = kernel_rows(start, end)
    watch(part)
    chunk.copy_(part)

results = {}
def record(name, result, sizes_from):
    results[name] = dict(
        ok=bool(torch.allclose(result, reference, rtol=1e-4, atol=1e-3)),
        messages=messages[sizes_from:],
        leaked=list(leaked),
    )
    refs.clear(); leaked.clear()

mark = len(messages); record("toma.batch", toma.batch(initial_batchsize=N)(run_batch)(), mark)
mark = len(messages); record("simple.batch", simple.batch(run_batch, N), mark)
mark = len(messages)
@toma.execute.batch(N)
def executed(batchsize):
    return run_batch(batchsize)
record("toma.execute.batch", executed, mark)

out = torch.empty(N); mark = len(messages)
toma.range(initial_step=N)(rows_into(out))(0, N); record("toma.range", out, mark)
out = torch.empty(N); mark = len(messages)
explicit.range(rows_into(out), 0, N, N); record("explicit.range", out, mark)
out = torch.empty(N); mark = len(messages)
toma.chunked(initial_step=N)(chunk_into)(out); record("toma.chunked", out, mark)
out = torch.empty(N); mark = len(messages)
explicit.chunked(chunk_into, out, N); record("explicit.chunked", out, mark)
out = torch.empty(N); mark = len(messages)
simple.chunked(chunk_into, out, N); record("simple.chunked", out, mark)

def python_lists(batchsize):
    return [bytearray(batchsize * 2**20) for _ in range(2)][0][:1]
mark = len(messages); simple.batch(python_lists, 4096)
results["MemoryError"] = dict(ok=True, messages=messages[mark:], leaked=[])
print(json.dumps(results))
"""
)


@pytest.mark.slow
def test_every_form_survives_a_real_cpu_out_of_memory():
    results = json.loads(run_python(REAL_OOM_SCENARIOS, timeout=300).stdout)
    assert len(results) == 9
    for name, result in results.items():
        assert result["ok"], f"{name}: wrong result"
        assert result["messages"], f"{name}: never ran out of memory, so nothing was tested"
        expected = "MemoryError" if name == "MemoryError" else "DefaultCPUAllocator: can't allocate memory"
        assert all(expected in message for message in result["messages"]), result["messages"]
        assert all("retrying with" in message for message in result["messages"])
        assert set(result["leaked"]) <= {0}, f"{name}: a failed attempt's tensor outlived it: {result['leaked']}"


@pytest.mark.slow
def test_an_out_of_memory_error_leaves_the_cap_whole():
    # After a failed allocation glibc retries in a new malloc arena, reserving 64 MiB of address space for
    # good: with it, 256 MiB no longer fits in 288 MiB of headroom and the search ends at 128.
    out = run_python(
        """
        import json, psutil, torch
        torch.set_num_threads(2)
        from toma import simple
        from toma.memory.cpu import predictable_heap, set_cpu_memory_headroom
        predictable_heap()
        process, seen = psutil.Process(), []

        def attempt(batchsize):
            seen.append(process.memory_info().vms)
            rows = torch.ones(batchsize, 2**18)  # batchsize MiB, filled and summed on both threads
            return batchsize, float(rows.sum())

        attempt(1)  # starts torch's worker thread, whose stack counts too, before the cap
        seen.clear()
        set_cpu_memory_headroom(288 / 1024)
        size, _ = simple.batch(attempt, 1024)
        print(json.dumps(dict(size=size, seen=seen)))
        """
    )
    result = json.loads(out.stdout)
    first, *later = result["seen"]
    growth = [(vms - first) / 2**20 for vms in later]
    assert len(later) == 2 and all(abs(mib) < 16 for mib in growth), f"address space after each OOM: {growth} MiB"
    assert result["size"] == 256, "256 MiB fits in 288 MiB of headroom"


def test_a_limit_given_as_a_numpy_number_reaches_setrlimit(monkeypatch):
    """Any real number of GiB, numpy's integers too (np.float64 passed and np.int64 was refused)."""
    import numpy as np

    from toma.memory import cpu

    limits = []
    monkeypatch.setattr(cpu.resource, "setrlimit", lambda kind, values: limits.append(values))
    monkeypatch.setattr(cpu.resource, "getrlimit", lambda kind: (cpu.resource.RLIM_INFINITY,) * 2)
    for value in (np.int64(2), np.float64(2.0), 2):
        set_cpu_memory_limit(value)
    assert limits == [(2 * 2**30, 2 * 2**30)] * 3
