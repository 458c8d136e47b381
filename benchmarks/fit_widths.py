"""What `FitToMemory` costs a call whose padded batches change width at every call, beside `Halving` in one process.

Run: python benchmarks/fit_widths.py [--repeats 3]

`toma.accumulate` by rows (an embedding and a linear head, micro-batches of 8 rows asked for, which always fit)
over 40 logical batches of 32 rows: their widths drawn from 8-63 tokens, or all 32. Each policy and kind of epoch
gets its own context; after 10 calls to settle, the epochs are timed in turns, the fastest kept. Prints one JSON
line: microseconds per call, and how many of the calls read the memory meter (before issue 44's change, every
call whose width differed from the last one's did: on a GPU, `torch.cuda.memory_stats` on the host each time).
"""

import argparse
import json
import time
from typing import Dict, List

import torch

from toma import FitToMemory, Halving, toma
from toma.sizing import fit_to_memory

CALLS = 40


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="timed epochs of each kind, in turns")
    args = parser.parse_args()
    torch.manual_seed(0)
    embedding, head = torch.nn.Embedding(100, 16), torch.nn.Linear(16, 1)
    model = torch.nn.Sequential(embedding, head)
    reads = [0]
    begin = fit_to_memory.FitToMemory.begin

    def counting_begin(self, call):  # type: ignore[no-untyped-def]
        token = begin(self, call)
        reads[0] += token is not None
        return token

    fit_to_memory.FitToMemory.begin = counting_begin  # type: ignore[method-assign]
    epochs = {
        "widths 8-63": [torch.randint(0, 100, (32, int(w))) for w in torch.randint(8, 64, (CALLS,))],
        "one width": [torch.randint(0, 100, (32, 32)) for _ in range(CALLS)],
    }
    functions = {}
    for policy_name, policy in (("FitToMemory", FitToMemory()), ("Halving", Halving())):
        for epoch_name in epochs:

            @toma.accumulate(model=model, initial_micro_batch=8, policy=policy, context=(policy_name, epoch_name))
            def loss(ids: torch.Tensor) -> torch.Tensor:
                return head(embedding(ids)).mean()

            functions[(policy_name, epoch_name)] = loss
    for (_, epoch_name), function in functions.items():
        for ids in epochs[epoch_name][:10]:
            function(ids)
    best: Dict[str, float] = {}
    measured: Dict[str, List[int]] = {}
    for _ in range(args.repeats):
        for (policy_name, epoch_name), function in functions.items():
            key = f"{policy_name}, {epoch_name}"
            reads[0] = 0
            started = time.perf_counter()
            for ids in epochs[epoch_name]:
                function(ids)
            best[key] = min(best.get(key, float("inf")), (time.perf_counter() - started) / CALLS)
            measured.setdefault(key, []).append(reads[0])
    figures = {f"{key} (us per call)": round(seconds * 1e6, 1) for key, seconds in best.items()}
    figures.update({f"{key}: meter reads per call": round(sum(n) / (CALLS * len(n)), 3) for key, n in measured.items()})
    figures["FitToMemory / Halving, widths 8-63"] = round(
        best["FitToMemory, widths 8-63"] / best["Halving, widths 8-63"], 3
    )
    figures["FitToMemory / Halving, one width"] = round(best["FitToMemory, one width"] / best["Halving, one width"], 3)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
