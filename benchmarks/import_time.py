"""What `import toma` costs after `import torch`, beside `import torch` alone, in fresh interpreters.

Run: python benchmarks/import_time.py [--rounds 7]

Each round starts new interpreters (bytecode caches written and used, as an installed package has them):
`python -X importtime -c "import torch"` and `... -c "import torch, toma"`, and reads the cumulative time of the
top-level `torch` and `toma` lines; toma's share is its own line. A third interpreter times `import toma` after
`gc.collect()`: right after `import torch` the collector owes a full pass over torch's objects (80-100 ms on a
busy 2-core machine), paid by whatever allocates next; the second figure is toma's share without that debt.
Reported: the median and the fastest round of each, and how many modules toma adds.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

REPO = Path(__file__).resolve().parent.parent

AFTER_COLLECTION = """
import gc, json, sys, time
import torch
gc.collect()
before = len(sys.modules)
start = time.perf_counter()
import toma
seconds = time.perf_counter() - start
print(json.dumps({"seconds": seconds, "modules": len(sys.modules) - before,
                  "fsdp2": "torch.distributed.fsdp" in sys.modules}))
"""


def _env() -> Dict[str, str]:
    env = dict(os.environ)
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # an installed package imports from its bytecode caches
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    return env


def importtime(statement: str) -> Dict[str, float]:
    """The cumulative seconds of each top-level module `python -X importtime -c statement` imports."""
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", statement], capture_output=True, text=True, env=_env(), check=True
    )
    tops: Dict[str, float] = {}
    for line in result.stderr.splitlines():
        if not line.startswith("import time:") or "cumulative" in line:
            continue
        _, cumulative, name = line.split("|")
        if not name.startswith("  "):  # a top-level import: its name follows a single space
            tops[name.strip()] = int(cumulative) / 1e6
    return tops


def after_collection() -> Dict[str, float]:
    result = subprocess.run(
        [sys.executable, "-c", AFTER_COLLECTION], capture_output=True, text=True, env=_env(), check=True
    )
    measured: Dict[str, float] = json.loads(result.stdout.strip().splitlines()[-1])
    return measured


def measure(rounds: int) -> Dict[str, List[float]]:
    importtime("import torch, toma")  # writes the bytecode caches
    figures: Dict[str, List[float]] = {"torch alone": [], "torch in import torch, toma": [], "toma's share": []}
    figures.update({"toma after torch's pending collection": [], "modules toma adds": [], "fsdp2 imported": []})
    for _ in range(rounds):
        figures["torch alone"].append(importtime("import torch")["torch"])
        both = importtime("import torch, toma")
        figures["torch in import torch, toma"].append(both["torch"])
        figures["toma's share"].append(both["toma"])
        collected = after_collection()
        figures["toma after torch's pending collection"].append(collected["seconds"])
        figures["modules toma adds"].append(collected["modules"])
        figures["fsdp2 imported"].append(float(collected["fsdp2"]))
    return figures


def report(figures: Dict[str, List[float]]) -> None:
    print("| what | median | fastest |")
    print("|---|---|---|")
    for name in ("torch alone", "torch in import torch, toma", "toma's share", "toma after torch's pending collection"):
        values = figures[name]
        print(f"| {name} | {statistics.median(values):.3f} s | {min(values):.3f} s |")
    print(f"| modules toma adds | {int(statistics.median(figures['modules toma adds']))} | |")
    share = statistics.median(figures["toma's share"]) / statistics.median(figures["torch alone"])
    print(f"\ntoma's share / torch alone: {share:.3f}; FSDP2 imported by import toma: {any(figures['fsdp2 imported'])}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7, help="fresh interpreters per figure")
    args = parser.parse_args()
    report(measure(args.rounds))


if __name__ == "__main__":
    main()
