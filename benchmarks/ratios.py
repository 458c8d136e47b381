"""Median ratio of each benchmark to its group's `test_native*` baseline, over one or more runs.

for i in 1 2 3; do python -m pytest benchmarks --benchmark-only --benchmark-json=run$i.json; done
python benchmarks/ratios.py run1.json run2.json run3.json
"""

import json
import statistics
import sys
from collections import defaultdict


def ratios(paths):
    """{(group, name): (per-run medians in seconds, per-run ratios to the group's native baseline)}."""
    table = defaultdict(lambda: ([], []))
    for path in paths:
        with open(path, encoding="utf-8") as file:
            benchmarks = json.load(file)["benchmarks"]
        baselines = {b["group"]: b["stats"]["median"] for b in benchmarks if b["name"].startswith("test_native")}
        for b in benchmarks:
            medians, run_ratios = table[(b["group"], b["name"])]
            medians.append(b["stats"]["median"])
            run_ratios.append(b["stats"]["median"] / baselines[b["group"]])
    return table


def main(paths):
    print("| group | benchmark | median | ratio (median of runs) | ratio per run |")
    print("|---|---|---|---|---|")
    for (group, name), (medians, run_ratios) in sorted(ratios(paths).items()):
        per_run = ", ".join(f"{r:.2f}" for r in run_ratios)
        print(
            f"| {group} | {name} | {statistics.median(medians) * 1e6:.2f} µs "
            f"| {statistics.median(run_ratios):.3f} | {per_run} |"
        )


if __name__ == "__main__":
    main(sys.argv[1:])
