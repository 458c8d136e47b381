"""Which size each sizing rule ends at, with how many OOMs, under a real CPU memory cap.

Run: python benchmarks/sizing.py [--quick] [--jobs N] [--workloads "MLP activations,pairwise distances"]

Each workload runs in fresh subprocesses, each capped at the same headroom above its settled address space.
M, the largest size that fits, is found by bisection, one fresh subprocess per probe. Then each rule makes 8
calls from a start far above M, in a fresh subprocess of its own: `Halving`, `ShrinkByFactor(0.9)`
(accelerate's rule), a bisection with a 5% margin (Lightning's binsearch rule, written here) and
`FitToMemory` at margins 0.05 and 0.02. Reported per rule and workload: the final size / M, the OOMs of the 8
calls, and their time over 8 calls at M. Then, for `FitToMemory`: a second run reading the size file
(TOMA_SIZES) the first run wrote, and a run in which memory held for 4 calls is freed (against `Halving`,
which never grows back). A last table checks the targets of issue 20.

`--jobs N` runs up to N subprocesses at once (each is capped on its own address space, so they do not share
a budget; times are noisier when they share cores). `--quick`: two workloads.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, List, NamedTuple, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
START = 1 << 17  # far above the M of every workload that does not set its own start
HEADROOM_GIB = 0.25
MARGINS = (0.05, 0.02)  # FitToMemory's margins, side by side


class Workload(NamedTuple):
    code: str  # defines `work(size)`
    start: int = START  # the size every rule starts from
    headroom: float = HEADROOM_GIB  # GiB above the settled address space


SETUP = """
import gc, json, sys, time, torch, torch.nn as nn, torch.nn.functional as F
torch.set_num_threads(1)
from toma import FitToMemory, GlobalBatchsizeCache, Halving, ShrinkByFactor, explicit
from toma.memory.cpu import predictable_heap, set_cpu_memory_headroom
predictable_heap()
torch.manual_seed(0)
"""

WORKLOADS = {
    # a large fixed part (a 96 MiB buffer made per call) plus a little per row
    # (its M is about 81600: from 131072, under twice M, halving's one error already decides the size, so it
    # starts at 262144, far above M as the other workloads do)
    "fixed + rows": Workload(
        """
W = torch.randn(256, 256)
data = torch.randn(1 << 18, 256)
def work(size):
    buffer = torch.ones(24 * 2**20)
    return (torch.relu(data[:size] @ W).sum(1) + buffer[:1]).sum()
""",
        start=1 << 18,
    ),
    # the activations of an MLP's forward pass
    "MLP activations": Workload("""
W1, W2, W3 = torch.randn(256, 1024) / 16, torch.randn(1024, 1024) / 32, torch.randn(1024, 10) / 32
data = torch.randn(1 << 17, 256)
def work(size):
    return (torch.relu(torch.relu(data[:size] @ W1) @ W2) @ W3).sum()
"""),
    # attention scores: size sequences of 128 tokens, (size, 128, 128) scores
    "attention scores": Workload("""
q = torch.randn(1 << 14, 128, 32)
def work(size):
    x = q[:size]
    scores = torch.softmax(x @ x.transpose(1, 2) / 32**0.5, dim=-1)
    return (scores @ x).sum()
"""),
    # a training step: forward and backward of an MLP, gradients dropped after
    "training step": Workload("""
model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
data, targets = torch.randn(1 << 17, 256), torch.randint(0, 10, (1 << 17,))
def work(size):
    loss = F.cross_entropy(model(data[:size]), targets[:size])
    loss.backward()
    model.zero_grad(set_to_none=True)
    return loss.detach()
"""),
    # memory that grows with the square of the size: the distances between every two rows of the batch (4 bytes
    # a pair). Issue 20's case: start 32768, and a headroom that puts M near 8800, so that halving ends at 8192.
    "pairwise distances": Workload(
        """
points = torch.randn(1 << 15, 64)
def work(size):
    x = points[:size]
    return torch.cdist(x, x).sum()
""",
        start=1 << 15,
        headroom=0.29,
    ),
    # a need with a step: above 16384 rows the work switches to a way that needs a 96 MiB workspace (as a
    # library switching algorithms), so a line through smaller sizes predicts far too much room above it
    "step-shaped": Workload("""
W = torch.randn(256, 1024) / 16
data = torch.randn(1 << 17, 256)
def work(size):
    workspace = torch.ones(24 * 2**20) if size > 16384 else torch.ones(1)
    return (torch.relu(data[:size] @ W).sum(1) + workspace[:1]).sum()
"""),
}
QUICK = ("MLP activations", "pairwise distances")

PROBE = """
set_cpu_memory_headroom(PARAMS["headroom"])
try:
    work(PARAMS["size"])
    print(json.dumps(True))
except RuntimeError:
    print(json.dumps(False))
"""

RULES = """
class Bisection:
    # Lightning's binsearch, as a search before training: halve until a size fits, then bisect between the
    # largest size that fit and the smallest that failed, and keep (1 - margin) of the result.
    def __init__(self, start, margin=0.05):
        self.start, self.margin, self.size = start, margin, None
        self.ooms = 0
    def search(self, work):
        low, high, size = 0, None, self.start
        while True:
            try:
                work(size)
                low = size
            except RuntimeError:
                self.ooms += 1
                high = size
                gc.collect()  # as Lightning does after each OOM
            if high is None:
                break
            if low == 0:
                size //= 2
                continue
            if high - low <= max(1, low // 100):
                break
            size = (low + high) // 2
        self.size = max(1, int(low * (1 - self.margin)))

START, HEADROOM, LARGEST, RULE = PARAMS["start"], PARAMS["headroom"], PARAMS["largest"], PARAMS["rule"]
def make_policy(rule):
    if rule == "FitToMemory":
        return FitToMemory(margin=PARAMS["margin"])
    return dict(Halving=Halving(), ShrinkByFactor=ShrinkByFactor(0.9)).get(rule)

set_cpu_memory_headroom(HEADROOM)
if RULE == "at M":   # the baseline: 8 calls at M (a process may have a little less room: step down if so)
    at_m, m_here = [], LARGEST
    started = time.perf_counter()
    while not at_m:
        try:
            for _ in range(8):
                work(m_here); at_m.append(1)
        except RuntimeError:
            at_m, m_here = [], int(m_here * 0.99)
            gc.collect()
            started = time.perf_counter()
    print(json.dumps(dict(final=m_here, ooms=0, seconds=time.perf_counter() - started)))
    sys.exit(0)
def batch_calls(policy, count):
    # `count` calls of one call site: the size each ran at (0: the call failed at the smallest size), the OOMs
    sizes, ooms = [], 0
    for call in range(count):
        attempts = []
        def attempt(size):
            attempts.append(size)
            return work(size)
        try:
            explicit.batch(attempt, START, toma_policy=policy, toma_cache_type=GlobalBatchsizeCache)
            sizes.append(attempts[-1])
            ooms += len(attempts) - 1
        except RuntimeError:
            sizes.append(0)
            ooms += len(attempts)
            gc.collect()
    return sizes, ooms
if PARAMS["frees"]:   # a tensor holds 40% of the room for 4 calls, then is freed: 4 more calls
    policy = make_policy(RULE)
    ballast = torch.ones(int(HEADROOM * 0.4 * 2**30) // 4)
    held, ooms = batch_calls(policy, 4)
    del ballast
    gc.collect()
    freed, more = batch_calls(policy, 4)
    print(json.dumps(dict(final=freed[-1], ooms=ooms + more, held=held, freed=freed, seconds=0)))
    sys.exit(0)
policy = make_policy(RULE)
sizes, ooms = [], 0
started = time.perf_counter()
if policy is None:
    rule = Bisection(START)
    rule.search(work)
    ooms = rule.ooms
    for _ in range(8 - 1):
        while True:  # the searched size can fail later (memory moved): count it, and halve as a rerun would
            try:
                work(rule.size)
                break
            except RuntimeError:
                ooms += 1
                rule.size = max(1, rule.size // 2)
                gc.collect()
    sizes = [rule.size]
else:
    sizes, ooms = batch_calls(policy, 8)
print(json.dumps(dict(final=sizes[-1], ooms=ooms, sizes=sizes, seconds=time.perf_counter() - started)))
"""


class Rule(NamedTuple):
    label: str
    name: str  # what the subprocess makes of it
    margin: Optional[float] = None


FIT = [Rule(f"FitToMemory(margin={margin})", "FitToMemory", margin) for margin in MARGINS]
HALVING = Rule("Halving", "Halving")
RULES_COMPARED = [
    HALVING,
    Rule("ShrinkByFactor(0.9)", "ShrinkByFactor"),
    Rule("bisection, 5% margin (Lightning's rule)", "Bisection"),
    *FIT,
]

_slots = threading.Semaphore(1)  # subprocesses at once (--jobs)


def python(code: str, params: Dict[str, Any], timeout: float = 900, sizes_file: str = "") -> Any:
    """Run `code` with `PARAMS` set in a fresh interpreter; the JSON of its last line."""
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    env.pop("TOMA_SIZES", None)
    if sizes_file:
        env["TOMA_SIZES"] = sizes_file
    source = f"PARAMS = json.loads({json.dumps(params)!r})\n" + textwrap.dedent(code)
    with _slots:
        done = subprocess.run(
            [sys.executable, "-c", "import json\n" + source], capture_output=True, text=True, env=env, timeout=timeout
        )
    if done.returncode != 0:
        raise RuntimeError(f"subprocess failed ({params}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def largest_fitting(workload: Workload) -> int:
    """M: bisection over fresh subprocesses, each under the same cap."""
    low, high = 1, workload.start
    code = SETUP + workload.code + PROBE
    while low < high:
        mid = (low + high + 1) // 2
        if python(code, dict(headroom=workload.headroom, size=mid)):
            low = mid
        else:
            high = mid - 1
    return low


def run_rule(workload: Workload, best: int, rule: Rule, frees: bool = False, sizes_file: str = "") -> Any:
    params = dict(
        start=workload.start, headroom=workload.headroom, largest=best, rule=rule.name, margin=rule.margin, frees=frees
    )
    return python(SETUP + workload.code + RULES, params, sizes_file=sizes_file)


def restarted(workload: Workload, best: int, rule: Rule) -> Any:
    """A first run fills a size file, a second one (the result) reads it."""
    with tempfile.TemporaryDirectory() as folder:
        sizes_file = os.path.join(folder, "sizes.db")
        run_rule(workload, best, rule, sizes_file=sizes_file)
        return run_rule(workload, best, rule, sizes_file=sizes_file)


def measure(name: str, jobs: int) -> Dict[str, Any]:
    """Everything measured on one workload: M, then every run (independent runs in parallel)."""
    workload = WORKLOADS[name]
    best = largest_fitting(workload)
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        base = pool.submit(run_rule, workload, best, Rule("at M", "at M"))
        rules = {rule: pool.submit(run_rule, workload, best, rule) for rule in RULES_COMPARED}
        second = {rule: pool.submit(restarted, workload, best, rule) for rule in FIT}
        frees = {rule: pool.submit(run_rule, workload, best, rule, True) for rule in (HALVING, *FIT)}
        return dict(
            name=name,
            best=best,
            base=base.result(),
            rules={rule: future.result() for rule, future in rules.items()},
            second={rule: future.result() for rule, future in second.items()},
            frees={rule: future.result() for rule, future in frees.items()},
        )


def reached(result: Any, best: int) -> Optional[int]:
    """Calls after the release until the size reaches 0.90 of M (None: not within the 4 calls)."""
    return next((i + 1 for i, size in enumerate(result["freed"]) if size >= 0.9 * best), None)


def report(results: List[Dict[str, Any]], quick: bool) -> None:
    print("Each workload under a cap of its headroom (GiB) above the settled address space, 8 calls per rule.")
    print("M by bisection over fresh subprocesses; each rule, and the 8 calls at M, in a fresh one of its own.\n")
    print("| workload | headroom | start | M | rule | final / M | OOMs in 8 calls | time / 8 calls at M |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        workload = WORKLOADS[r["name"]]
        for i, (rule, result) in enumerate(r["rules"].items()):
            first = (r["name"], str(workload.headroom), str(workload.start), str(r["best"])) if i == 0 else ("",) * 4
            print(
                f"| {' | '.join(first)} | {rule.label} | {result['final'] / r['best']:.3f} | {result['ooms']} "
                f"| {result['seconds'] / r['base']['seconds']:.2f} |"
            )
    print("\n| rule | mean final / M | min final / M | mean OOMs |")
    print("|---|---|---|---|")
    for rule in RULES_COMPARED:
        ratios = [r["rules"][rule]["final"] / r["best"] for r in results]
        ooms = [r["rules"][rule]["ooms"] for r in results]
        print(f"| {rule.label} | {statistics.mean(ratios):.3f} | {min(ratios):.3f} | {statistics.mean(ooms):.2f} |")
    print("\nA second run of `FitToMemory` with TOMA_SIZES set (the first run filled the file):\n")
    print("| workload | rule | final / M | OOMs in 8 calls | time / 8 calls at M |")
    print("|---|---|---|---|---|")
    for r in results:
        for rule, result in r["second"].items():
            print(
                f"| {r['name']} | {rule.label} | {result['final'] / r['best']:.3f} | {result['ooms']} "
                f"| {result['seconds'] / r['base']['seconds']:.2f} |"
            )
    print("\nMemory frees mid-run: a tensor holds 40% of the headroom for 4 calls, then is freed; 4 more calls:\n")
    print("| workload | rule | size while held / M | final / M | calls after the release to >= 0.90 M | OOMs |")
    print("|---|---|---|---|---|---|")
    for r in results:
        for rule, result in r["frees"].items():
            calls = reached(result, r["best"])
            print(
                f"| {r['name']} | {rule.label} | {result['held'][-1] / r['best']:.3f} "
                f"| {result['final'] / r['best']:.3f} | {calls if calls else 'never'} | {result['ooms']} |"
            )
    targets(results, quick)


def targets(results: List[Dict[str, Any]], quick: bool) -> None:
    """Issue 20's targets for FitToMemory, one line per target and margin, naming the workloads that miss."""
    print(f"\nTargets (issue 20){', on the quick subset only' if quick else ''}:\n")
    print("| target | rule | measured | verdict |")
    print("|---|---|---|---|")
    missed = 0

    def line(target: str, rule: Rule, measured: str, misses: List[str]) -> None:
        nonlocal missed
        missed += bool(misses)
        verdict = "ok" if not misses else "MISSED: " + ", ".join(misses)
        print(f"| {target} | {rule.label} | {measured} | {verdict} |")

    for rule in FIT:
        needed = round(1 - (rule.margin or 0.0) - 0.02, 6)
        ratios = {r["name"]: r["rules"][rule]["final"] / r["best"] for r in results}
        low = min(ratios, key=ratios.__getitem__)
        line(
            f"final >= {needed:.2f} M on every workload",
            rule,
            f"lowest {ratios[low]:.4f} ({low})",
            [
                f"{r['name']} {r['rules'][rule]['final']} of {r['best']} ({ratios[r['name']]:.4f})"
                for r in results
                if ratios[r["name"]] < needed
            ],
        )
        ooms = statistics.mean(r["rules"][rule]["ooms"] for r in results)
        line("<= 2 OOMs on average", rule, f"{ooms:.2f}", [] if ooms <= 2 else [f"{ooms:.2f}"])
        line(
            "no more OOMs than Halving on any workload",
            rule,
            ", ".join(f"{r['rules'][rule]['ooms']} vs {r['rules'][HALVING]['ooms']}" for r in results),
            [
                f"{r['name']} {r['rules'][rule]['ooms']} > {r['rules'][HALVING]['ooms']}"
                for r in results
                if r["rules"][rule]["ooms"] > r["rules"][HALVING]["ooms"]
            ],
        )
        calls = {r["name"]: reached(r["frees"][rule], r["best"]) for r in results}
        line(
            "after memory frees: >= 0.90 M within 3 calls",
            rule,
            ", ".join(str(c) if c else "never" for c in calls.values()),
            [f"{name} {c if c else 'never'}" for name, c in calls.items() if not c or c > 3],
        )
        line(
            "restart with TOMA_SIZES: 0 OOMs",
            rule,
            ", ".join(str(r["second"][rule]["ooms"]) for r in results),
            [f"{r['name']} {r['second'][rule]['ooms']}" for r in results if r["second"][rule]["ooms"]],
        )
    print(f"\n{missed} target line(s) missed. (The settled no-op call's cost is benchmarks/test_overhead.py's.)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"only {' and '.join(QUICK)}")
    parser.add_argument("--jobs", type=int, default=1, help="subprocesses at once (default 1)")
    parser.add_argument("--workloads", default="", help="comma-separated workload names: " + ", ".join(WORKLOADS))
    args = parser.parse_args()
    if args.jobs < 1:
        parser.error("--jobs must be at least 1")
    names = [name.strip() for name in args.workloads.split(",") if name.strip()] or list(
        QUICK if args.quick else WORKLOADS
    )
    unknown = [name for name in names if name not in WORKLOADS]
    if unknown:
        parser.error(f"--workloads: unknown {unknown}; known: {list(WORKLOADS)}")
    global _slots
    _slots = threading.Semaphore(args.jobs)
    with ThreadPoolExecutor(max_workers=len(names)) as pool:  # the slots bound the subprocesses
        results = list(pool.map(lambda name: measure(name, args.jobs), names))
    report(results, quick=args.quick or bool(args.workloads))


if __name__ == "__main__":
    main()
