"""toma under a real memory cap: the process gets 192 MiB more address space than it has, then runs work
whose first attempts need several times that. toma shrinks the batch and the step until they fit, and
the example prints the sizes it chose and checks the results against a plain computation in small
pieces. Runs on the CPU; on a GPU, drop the cap and the same code adapts to CUDA memory.

    python examples/adaptive_memory.py
"""

import ctypes
import gc
import logging
import sys
import time

import psutil
import torch

from toma import toma
from toma.cpu_memory import set_cpu_memory_limit

HEADROOM_MIB = 192


def _glibc(function: str, *args: int) -> None:
    try:
        getattr(ctypes.CDLL(None), function)(*args)
    except (OSError, AttributeError):  # not glibc: nothing to tune
        pass


def predictable_heap() -> None:
    """Make freed memory leave the address space at once, so that the cap's baseline holds.

    glibc raises its mmap threshold after large frees, after which multi-MiB tensors come from the heap and
    their memory stays counted as address space until some later free trims the heap, hundreds of MiB at a
    time. A fixed threshold of 1 MiB (M_MMAP_THRESHOLD) keeps large tensors in mappings that go on free.
    """
    _glibc("mallopt", -3, 2**20)


def settled_address_space() -> int:
    """The address space in use once freed memory has left it (the kernel lets go with a delay)."""
    process, last = psutil.Process(), -1
    while True:
        gc.collect()
        _glibc("malloc_trim", 0)  # free memory at the top of the heap goes back now, not at some later free
        vms = process.memory_info().vms
        if vms == last:
            return vms
        last = vms
        time.sleep(0.3)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    torch.set_num_threads(1)  # thread stacks count against the cap too
    predictable_heap()
    generator = torch.Generator().manual_seed(0)

    # A model and a data set to run inference on, and points for a kernel density estimate. The first
    # attempts below need 1 GiB each (two 32768 x 4096 activations; a 16384 x 16384 matrix): far beyond the
    # cap even when the address space the process settles at moves by a few hundred MiB.
    model = torch.nn.Sequential(torch.nn.Linear(64, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 10))
    inputs = torch.randn(32768, 64, generator=generator)
    points = torch.randn(16384, 16, generator=generator)
    with torch.no_grad():
        reference_logits = torch.cat([model(inputs[s : s + 256]) for s in range(0, len(inputs), 256)])
    reference_density = torch.cat(
        [torch.cdist(points[s : s + 256], points).neg().exp().mean(1) for s in range(0, len(points), 256)]
    )

    set_cpu_memory_limit((settled_address_space() + HEADROOM_MIB * 2**20) / 2**30)
    print(f"capped this process at {HEADROOM_MIB} MiB more than it uses")

    chosen = {}

    @toma.batch(initial_batchsize=len(inputs))
    def predict(batchsize: int, data: torch.Tensor) -> torch.Tensor:
        chosen["predict batch size"] = batchsize
        with torch.no_grad():
            return torch.cat([model(data[s : s + batchsize]) for s in range(0, len(data), batchsize)])

    @toma.chunked(initial_step=len(points))
    def density(out: torch.Tensor, start: int, end: int) -> None:
        chosen["density step"] = end - start
        out.copy_(torch.cdist(points[start:end], points).neg_().exp_().mean(1))

    logits = predict(inputs)
    densities = torch.empty(len(points))
    density(densities)

    for name, size in chosen.items():
        print(f"{name}: {size}")
    print("predict matches the reference:", torch.allclose(logits, reference_logits, atol=1e-5))
    print("density matches the reference:", torch.allclose(densities, reference_density, atol=1e-6))


if __name__ == "__main__":
    main()
