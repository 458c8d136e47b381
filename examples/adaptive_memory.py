"""toma under a real memory cap: the process gets 192 MiB more address space than it has, then runs work
whose first attempts need several times that. toma shrinks the batch and the step until they fit, and
the example prints the sizes it chose and checks the results against a plain computation in small
pieces. Runs on the CPU; with `--memory-fraction` the same code runs on the GPU, capped by
`torch.cuda.set_per_process_memory_fraction` instead (a share of 256 MiB forces real CUDA out-of-memory errors).

    python examples/adaptive_memory.py
    python examples/adaptive_memory.py --memory-fraction 0.003   # on an 80 GiB GPU: 246 MiB
"""

import argparse
import logging
import sys

import torch

from toma import toma
from toma.memory.cpu import predictable_heap, set_cpu_memory_headroom

HEADROOM_MIB = 192


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--memory-fraction", type=float, help="run on the GPU with this share of its memory instead of the CPU cap"
    )
    options = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    cuda = options.memory_fraction is not None
    if cuda and not torch.cuda.is_available():
        parser.error("--memory-fraction caps GPU memory and needs CUDA")
    if not cuda:
        torch.set_num_threads(1)  # thread stacks count against the cap too
        predictable_heap()
    device = torch.device("cuda" if cuda else "cpu")
    generator = torch.Generator().manual_seed(0)

    # A model and a data set to run inference on, and points for a kernel density estimate. The first
    # attempts below need 1 GiB each (two 32768 x 4096 activations; a 16384 x 16384 matrix): far beyond the
    # cap even when the address space the process settles at moves by a few hundred MiB.
    model = torch.nn.Sequential(torch.nn.Linear(64, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 10)).to(device)
    inputs = torch.randn(32768, 64, generator=generator).to(device)
    points = torch.randn(16384, 16, generator=generator).to(device)
    with torch.no_grad():
        reference_logits = torch.cat([model(inputs[s : s + 256]) for s in range(0, len(inputs), 256)])
    reference_density = torch.cat(
        [torch.cdist(points[s : s + 256], points).neg().exp().mean(1) for s in range(0, len(points), 256)]
    )

    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # the pieces above stay cached otherwise, and count against the cap
        torch.cuda.set_per_process_memory_fraction(options.memory_fraction)
        mib = options.memory_fraction * torch.cuda.get_device_properties(0).total_memory / 2**20
        print(f"capped the GPU at {mib:.0f} MiB")
    else:
        set_cpu_memory_headroom(HEADROOM_MIB / 1024)
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
    densities = torch.empty(len(points), device=device)
    density(densities)

    for name, size in chosen.items():
        print(f"{name}: {size}")
    # cuBLAS may sum in another order for another number of rows: float32 rounding, not a different result
    tolerance = 1e-4 if cuda else 1e-5
    print("predict matches the reference:", torch.allclose(logits, reference_logits, atol=tolerance))
    print("density matches the reference:", torch.allclose(densities, reference_density, atol=tolerance / 10))


if __name__ == "__main__":
    main()
