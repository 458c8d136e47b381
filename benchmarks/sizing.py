"""Which size each sizing rule ends at, with how many OOMs, under a real CPU memory cap.

Run: python benchmarks/sizing.py [--quick]

Each workload runs in fresh subprocesses, each capped at the same headroom above its settled address space.
M, the largest size that fits, is found by bisection, one fresh subprocess per probe. Then each rule makes 8
calls from a start far above M, in a fresh subprocess of its own: `Halving`, `ShrinkByFactor(0.9)` (accelerate's rule), a
bisection with a 5% margin (Lightning's binsearch rule, written here) and `FitToMemory`. Reported per rule
and workload: the final size / M, the OOMs of the 8 calls, and their time over 8 calls at M. Then, for
`FitToMemory`: a second run reading the size file (TOMA_SIZES) the first run wrote, and a run in which memory
held for 4 calls is freed (against `Halving`, which never grows back).
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
START = 1 << 17  # far above every workload's M

SETUP = """
import gc, json, sys, time, torch, torch.nn as nn, torch.nn.functional as F
torch.set_num_threads(1)
from toma import FitToMemory, GlobalBatchsizeCache, Halving, ShrinkByFactor, explicit
from toma.cpu_memory import predictable_heap, set_cpu_memory_headroom
predictable_heap()
torch.manual_seed(0)
"""

WORKLOADS = {
    # a large fixed part (a 96 MiB buffer made per call) plus a little per row
    "fixed + rows": """
W = torch.randn(256, 256)
data = torch.randn(1 << 17, 256)
def work(size):
    buffer = torch.ones(24 * 2**20)
    return (torch.relu(data[:size] @ W).sum(1) + buffer[:1]).sum()
""",
    # the activations of an MLP's forward pass
    "MLP activations": """
W1, W2, W3 = torch.randn(256, 1024) / 16, torch.randn(1024, 1024) / 32, torch.randn(1024, 10) / 32
data = torch.randn(1 << 17, 256)
def work(size):
    return (torch.relu(torch.relu(data[:size] @ W1) @ W2) @ W3).sum()
""",
    # attention scores: size sequences of 128 tokens, (size, 128, 128) scores
    "attention scores": """
q = torch.randn(1 << 14, 128, 32)
def work(size):
    x = q[:size]
    scores = torch.softmax(x @ x.transpose(1, 2) / 32**0.5, dim=-1)
    return (scores @ x).sum()
""",
    # a training step: forward and backward of an MLP, gradients dropped after
    "training step": """
model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
data, targets = torch.randn(1 << 17, 256), torch.randint(0, 10, (1 << 17,))
def work(size):
    loss = F.cross_entropy(model(data[:size]), targets[:size])
    loss.backward()
    model.zero_grad(set_to_none=True)
    return loss.detach()
""",
}

HEADROOM_GIB = 0.25

PROBE = """
set_cpu_memory_headroom(HEADROOM)
try:
    work(SIZE)
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

set_cpu_memory_headroom(HEADROOM)
RULE = "RULE_NAME"
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
    # `count` calls of one call site: the size each ran at, and the OOMs
    sizes, ooms = [], 0
    for call in range(count):
        attempts = []
        def attempt(size):
            attempts.append(size)
            return work(size)
        explicit.batch(attempt, START, toma_policy=policy, toma_cache_type=GlobalBatchsizeCache)
        ooms += len(attempts) - 1
        sizes.append(attempts[-1])
    return sizes, ooms
if RULE.startswith("frees:"):   # a tensor holds 40% of the room for 4 calls, then is freed: 4 more calls
    policy = FitToMemory() if RULE == "frees:FitToMemory" else Halving()
    ballast = torch.ones(int(HEADROOM * 0.4 * 2**30) // 4)
    held, ooms = batch_calls(policy, 4)
    del ballast
    gc.collect()
    freed, more = batch_calls(policy, 4)
    print(json.dumps(dict(final=freed[-1], ooms=ooms + more, held=held, freed=freed, seconds=0)))
    sys.exit(0)
policy = dict(Halving=Halving(), ShrinkByFactor=ShrinkByFactor(0.9), FitToMemory=FitToMemory()).get(RULE)
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
print(json.dumps(dict(final=sizes[-1], ooms=ooms, seconds=time.perf_counter() - started)))
"""


RULE_NAMES = {
    "Halving": "Halving",
    "ShrinkByFactor": "ShrinkByFactor(0.9)",
    "Bisection": "Bisection, 5% margin",
    "FitToMemory": "FitToMemory",
}


def python(code: str, timeout: float = 600, sizes_file: str = "") -> str:
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    env.pop("TOMA_SIZES", None)
    if sizes_file:
        env["TOMA_SIZES"] = sizes_file
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env, timeout=timeout
    )
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-3000:])
    return done.stdout.strip().splitlines()[-1]


def largest_fitting(workload: str) -> int:
    """M: bisection over fresh subprocesses, each under the same cap."""
    low, high = 1, START
    while low < high:
        mid = (low + high + 1) // 2
        code = SETUP + WORKLOADS[workload] + PROBE.replace("HEADROOM", str(HEADROOM_GIB)).replace("SIZE", str(mid))
        if json.loads(python(code)):
            low = mid
        else:
            high = mid - 1
    return low


def main(quick: bool = False) -> None:
    rows, second, frees = [], [], []
    names = list(WORKLOADS)[:2] if quick else list(WORKLOADS)
    for workload in names:
        best = largest_fitting(workload)
        code = (
            SETUP
            + WORKLOADS[workload]
            + RULES.replace("HEADROOM", str(HEADROOM_GIB)).replace("START", str(START)).replace("LARGEST", str(best))
        )
        base = json.loads(python(code.replace("RULE_NAME", "at M")))
        for rule, label in RULE_NAMES.items():
            result = json.loads(python(code.replace("RULE_NAME", rule)))
            rows.append((workload, best, label, result["final"] / best, result["ooms"], result["seconds"] / base["seconds"]))
        with tempfile.TemporaryDirectory() as folder:  # a first run fills a size file, a second reads it
            sizes_file = os.path.join(folder, "sizes.db")
            python(code.replace("RULE_NAME", "FitToMemory"), sizes_file=sizes_file)
            result = json.loads(python(code.replace("RULE_NAME", "FitToMemory"), sizes_file=sizes_file))
            second.append((workload, best, result["final"] / best, result["ooms"], result["seconds"] / base["seconds"]))
        for rule in ("Halving", "FitToMemory"):
            result = json.loads(python(code.replace("RULE_NAME", "frees:" + rule)))
            # calls after the release until the size reaches 0.90 of M (None: not in the 4 calls)
            reached = next((i + 1 for i, size in enumerate(result["freed"]) if size >= 0.9 * best), None)
            frees.append((workload, best, rule, result["held"][-1] / best, result["final"] / best, reached, result["ooms"]))
    print(f"Headroom {HEADROOM_GIB} GiB above the settled address space, start {START}, 8 calls per rule.")
    print("M by bisection over fresh subprocesses; each rule, and the 8 calls at M, in a fresh one of its own.\n")
    print("| workload | M | rule | final / M | OOMs in 8 calls | time / 8 calls at M |")
    print("|---|---|---|---|---|---|")
    for workload, best, rule, ratio, ooms, time_ratio in rows:
        print(f"| {workload} | {best} | {rule} | {ratio:.3f} | {ooms} | {time_ratio:.2f} |")
    print("\n| rule | mean final / M | min final / M | mean OOMs |")
    print("|---|---|---|---|")
    for rule in dict.fromkeys(row[2] for row in rows):
        mine = [row for row in rows if row[2] == rule]
        print(
            f"| {rule} | {statistics.mean(r[3] for r in mine):.3f} | {min(r[3] for r in mine):.3f} "
            f"| {statistics.mean(r[4] for r in mine):.2f} |"
        )
    print("\nA second run of `FitToMemory` with TOMA_SIZES set (the first run filled the file):\n")
    print("| workload | final / M | OOMs in 8 calls | time / 8 calls at M |")
    print("|---|---|---|---|")
    for workload, best, ratio, ooms, time_ratio in second:
        print(f"| {workload} | {ratio:.3f} | {ooms} | {time_ratio:.2f} |")
    print("\nMemory frees mid-run: a tensor holds 40% of the headroom for 4 calls, then is freed; 4 more calls:\n")
    print("| workload | rule | size while held / M | final / M | calls after the release to >= 0.90 M | OOMs |")
    print("|---|---|---|---|---|---|")
    for workload, best, rule, held, final, reached, ooms in frees:
        print(f"| {workload} | {rule} | {held:.3f} | {final:.3f} | {reached if reached else 'never'} | {ooms} |")


if __name__ == "__main__":
    main("--quick" in sys.argv)
