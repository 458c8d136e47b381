"""GPU figures for host memory as the overflow (needs CUDA; prints a table, exits 0 with a note without it).

Run: python benchmarks/transfer_gpu.py
With TOMA_FIGURES=<path> set, each figure is also appended to that file as a JSON line,
{"figure": ..., "value": ..., "unit": ...}, for benchmarks/gpu_check.py.
1. Host-to-device GB/s: a large pinned `copy_` (the peak), a pageable `.to()`, and `toma.map`'s transfers
   (a pageable host tensor mapped with a function that does next to nothing), beside the host's own copy of
   a pageable tensor into pinned memory (the bound for a pageable source: it is staged through pinned
   buffers) and `toma.map` of a pinned source (copied straight from it).
2. Overlap: `toma.map` wall time for a function whose compute per chunk is about its transfer, against
   max(transfer alone, compute alone); 1.0 is perfect overlap, 2.0 none.
3. `HostedEmbedding` steps/s (Adam) against `nn.Embedding(sparse=True)` + `SparseAdam` on the GPU (the table
   fits there) and on the CPU.
"""

import os
import sys
import time

import torch

from toma import HostedEmbedding, NoBatchsizeCache
from toma import toma as tm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the benchmarks folder, however run
from figure_lines import record  # noqa: E402

GiB = 1 << 30


def timed(func, repeat=3):
    best = float("inf")
    for _ in range(repeat):
        torch.cuda.synchronize()
        start = time.perf_counter()
        func()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def map_all(source, chunk_rows):
    """`toma.map` of a function that does next to nothing over `source`, to the GPU: its transfers alone."""
    return tm.map(lambda c: c[:, :1], source, device="cuda", initial_step=chunk_rows, cache_type=NoBatchsizeCache)


def transfer_rates(size=2 * GiB, chunk_rows=16384):
    rows = size // (4 * 4096)
    pageable = torch.randn(rows, 4096)
    pinned = pageable.pin_memory()
    target = torch.empty_like(pinned, device="cuda")
    peak = size / timed(lambda: target.copy_(pinned, non_blocking=True)) / 1e9  # noqa: F821 (bound above)
    plain = size / timed(lambda: pageable.to("cuda")) / 1e9
    del target
    mapped = size / timed(lambda: map_all(pageable, chunk_rows)) / 1e9
    staging = torch.empty_like(pinned)
    host_copy = size / timed(lambda: staging.copy_(pageable)) / 1e9  # what staging a pageable source can reach
    mapped_pinned = size / timed(lambda: map_all(pinned, chunk_rows)) / 1e9
    return peak, plain, mapped, host_copy, mapped_pinned, pageable, chunk_rows


def overlap(pageable, chunk_rows):
    weight = torch.randn(4096, 4096, device="cuda") / 64
    chunk = pageable[:chunk_rows].cuda()

    def compute(c):
        for _ in range(repeats):
            c = torch.tanh(c @ weight)
        return c[:, :1]

    repeats = 1
    per_chunk_copy = timed(lambda: chunk.copy_(pageable[:chunk_rows].pin_memory(), non_blocking=True))
    while timed(lambda: compute(chunk)) < per_chunk_copy and repeats < 64:
        repeats += 1
    chunks = len(pageable) // chunk_rows
    compute_alone = timed(lambda: [compute(chunk) for _ in range(chunks)])
    transfer_alone = timed(lambda: map_all(pageable, chunk_rows))
    both = timed(lambda: tm.map(compute, pageable, device="cuda", initial_step=chunk_rows, cache_type=NoBatchsizeCache))
    return compute_alone, transfer_alone, both


def embedding_rates(rows=4_000_000, width=64, lookups=65536, steps=50):
    generator = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, rows, (lookups,), generator=generator) for _ in range(steps)]
    results = {}

    def sparse(device):
        table = torch.nn.Embedding(rows, width, sparse=True, device=device)
        optimizer = torch.optim.SparseAdam(table.parameters(), lr=1e-3)

        def run():
            for indices in batches:
                optimizer.zero_grad()
                table(indices.to(device)).pow(2).sum().backward()
                optimizer.step()

        return run

    hosted = HostedEmbedding(rows, width, optimizer=lambda p: torch.optim.Adam(p, lr=1e-3), device="cuda")

    def run_hosted():
        for i, indices in enumerate(batches):
            out = hosted(indices)
            if i + 1 < len(batches):
                hosted.prefetch(batches[i + 1])
            out.pow(2).sum().backward()
            hosted.step()

    results["HostedEmbedding (Adam), table on the host"] = steps / timed(run_hosted, repeat=2)
    results["nn.Embedding(sparse=True) + SparseAdam on the GPU"] = steps / timed(sparse("cuda"), repeat=2)
    results["nn.Embedding(sparse=True) + SparseAdam on the CPU"] = steps / timed(sparse("cpu"), repeat=1)
    return results


def main() -> int:
    if not torch.cuda.is_available():
        print("transfer_gpu.py needs a CUDA GPU; nothing measured")
        return 0
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    peak, plain, mapped, host_copy, mapped_pinned, pageable, chunk_rows = transfer_rates()
    bound = min(peak, host_copy)  # a pageable source is first copied into pinned memory on the host
    print(
        f"host-to-device: pinned copy_ {peak:.1f} GB/s, pageable .to() {plain:.1f} GB/s, "
        f"toma.map {mapped:.1f} GB/s = {mapped / peak:.2f} of the pinned peak; host copy into pinned memory "
        f"{host_copy:.1f} GB/s, so a pageable source's bound is {bound:.1f} GB/s ({mapped / bound:.2f} of it); "
        f"toma.map of a pinned source {mapped_pinned:.1f} GB/s = {mapped_pinned / peak:.2f} of the peak"
    )
    record("host-to-device, pinned copy_", peak, "GB/s")
    record("host-to-device, pageable .to()", plain, "GB/s")
    record("host-to-device, toma.map", mapped, "GB/s")
    record("toma.map / pinned peak", mapped / peak, "ratio")
    record("host copy, pageable into pinned", host_copy, "GB/s")
    record("toma.map / min(pinned peak, host copy)", mapped / bound, "ratio")
    record("host-to-device, toma.map of a pinned source", mapped_pinned, "GB/s")
    record("toma.map of a pinned source / pinned peak", mapped_pinned / peak, "ratio")
    compute_alone, transfer_alone, both = overlap(pageable, chunk_rows)
    print(
        f"overlap: compute alone {compute_alone * 1e3:.0f} ms, transfer alone {transfer_alone * 1e3:.0f} ms, "
        f"toma.map {both * 1e3:.0f} ms = {both / max(compute_alone, transfer_alone):.2f}x the larger"
    )
    record("overlap: compute alone", compute_alone * 1e3, "ms")
    record("overlap: transfer alone", transfer_alone * 1e3, "ms")
    record("overlap: toma.map", both * 1e3, "ms")
    record("overlap: toma.map / the larger (1.0 perfect, 2.0 none)", both / max(compute_alone, transfer_alone), "ratio")
    for name, rate in embedding_rates().items():
        print(f"{name}: {rate:.1f} steps/s")
        record(name, rate, "steps/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
