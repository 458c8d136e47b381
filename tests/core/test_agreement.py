"""Several ranks (real processes, gloo, CPU, hard timeouts): every rank agrees on every size, nothing hangs,
and accumulated gradients equal the single-process full-batch reference."""

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from toma.core import agreement as distributed

from helpers import COLLECT_TOMA_LOG, run_ranks, torchrun

pytestmark = pytest.mark.multiprocess

PER_RANK, MICRO = 24, 8  # 3 micro-batches per rank: first, middle, last

SETUP = """
import datetime, json, os
import torch, torch.distributed as dist, torch.nn as nn, torch.nn.functional as F
from toma import toma
torch.set_num_threads(1)
from toma import StacktraceMemoryBatchsizeCache
# Cache by call site only: free system RAM, shared by all ranks, may cross a 256 MiB step between two calls
# and hand every rank a fresh entry, which a test of "the next call starts at the cached size" cannot tell
# from a bug.
StacktraceMemoryBatchsizeCache.TRACK_RAM = False
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=TIMEOUT))
rank, world = dist.get_rank(), dist.get_world_size()
def data():
    torch.manual_seed(0)
    inputs, targets = torch.randn(24 * world, 6), torch.randint(0, 4, (24 * world,))
    return inputs[rank * 24:(rank + 1) * 24], targets[rank * 24:(rank + 1) * 24]
def make_model():
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 4))
def run_once(sabotage):
    # One logical batch through a fresh DDP model whose loss calls sabotage(calls) first: the outcome
    # ("finished" or "Type: message"), the seconds it took, and whether every gradient is None afterwards.
    import time
    model = make_model()
    ddp = nn.parallel.DistributedDataParallel(model)
    calls = []
    @toma.accumulate(model=ddp, initial_micro_batch=8)
    def compute_loss(xb, yb):
        if not torch.is_grad_enabled():  # toma's one check, without gradients, that the loss adds up
            return F.cross_entropy(ddp(xb), yb)
        calls.append(len(xb))
        sabotage(calls)
        return F.cross_entropy(ddp(xb), yb)
    started = time.monotonic()
    try:
        compute_loss(*data())
        outcome = "finished"
    except Exception as error:
        outcome = f"{type(error).__name__}: {error}"
    return dict(outcome=outcome, seconds=time.monotonic() - started, grads=[p.grad is None for p in model.parameters()])
def finish(result):
    print(json.dumps(result), flush=True)
    dist.barrier()   # a rank that exits while a peer still reads from it makes gloo abort the peer
    dist.destroy_process_group()
    os._exit(0)   # and skip the destructors of gloo's threads at interpreter exit, which abort now and then
"""


def reference_grads(world_size):
    torch.manual_seed(0)
    inputs, targets = torch.randn(PER_RANK * world_size, 6), torch.randint(0, 4, (PER_RANK * world_size,))
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 4))
    F.cross_entropy(model(inputs), targets).backward()
    return [p.grad for p in model.parameters()]


SCENARIOS = [(phase, where) for phase in ("forward", "backward") for where in (0, 1, 2)]


@pytest.mark.parametrize("world_size", [2, 3])
def test_an_oom_on_one_rank_anywhere_moves_every_rank_to_the_same_size_with_exact_gradients(world_size):
    """For each scenario (forward or backward of the first, middle or last micro-batch) the last rank alone
    runs out of memory once; all ranks must redo the logical batch at one smaller size, end with the
    reference gradients, and run the next logical batch at that size with no retry."""
    code = (
        SETUP.replace("TIMEOUT", "60")
        + f"""
results = []
for phase, where in {SCENARIOS!r}:
    model = make_model()
    ddp = nn.parallel.DistributedDataParallel(model)
    x, y = data()
    state = dict(calls=0, armed=False, done=False)
    def hook(grad):
        if state["armed"]:
            state["armed"] = False
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB (injected)")
        return grad
    model[0].weight.register_hook(hook)
    sizes = []

    @toma.accumulate(model=ddp, initial_micro_batch={MICRO})
    def compute_loss(xb, yb):
        if not torch.is_grad_enabled():  # toma's one check, without gradients, that the loss adds up
            return F.cross_entropy(ddp(xb), yb)
        sizes.append(len(xb))
        fail_here = rank == world - 1 and not state["done"] and state["calls"] == where
        state["calls"] += 1
        if fail_here:
            state["done"] = True
            if phase == "forward":
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB (injected)")
            state["armed"] = True
        return F.cross_entropy(ddp(xb), yb)

    rounds = []
    for _ in range(2):   # one call site: the second logical batch starts at the agreed size
        ddp.zero_grad()
        sizes.clear()
        compute_loss(x, y)
        rounds.append(list(sizes))
        if not rounds[1:]:
            grads = [p.grad.tolist() for p in model.parameters()]
    results.append(dict(phase=phase, where=where, rounds=rounds, grads=grads,
                        micro_batch=compute_loss.stats.micro_batch, retries=compute_loss.stats.oom_retries))
finish(results)
"""
    )
    outputs = [json.loads(out.strip().splitlines()[-1]) for out in run_ranks(code, world_size, timeout=150)]
    expected = reference_grads(world_size)
    for rank, results in enumerate(outputs):
        for result in results:
            label = f"rank {rank}, OOM in the {result['phase']} of micro-batch {result['where']}"
            first, second = result["rounds"]
            fail_rank = rank == world_size - 1
            tried = first[: result["where"] + 1] if fail_rank else first[: first.index(4)]
            assert all(size == MICRO for size in tried), label
            assert first[len(first) - 6 :] == [4] * 6, label  # the redone logical batch, at the agreed size
            assert second == [4] * 6, label + ": the next logical batch starts at the agreed size"
            assert (result["micro_batch"], result["retries"]) == (4, 1), label
            for got, e in zip(result["grads"], expected, strict=True):
                torch.testing.assert_close(torch.tensor(got), e, rtol=1e-5, atol=1e-6, msg=label)
    assert len({json.dumps([r["rounds"][1] for r in results]) for results in outputs}) == 1


def test_an_error_that_is_not_oom_on_one_rank_stops_every_rank_with_a_clear_error():
    code = (
        SETUP.replace("TIMEOUT", "30")
        + """
def sabotage(calls):
    if rank == 1 and len(calls) == 2:
        raise ValueError("a bug on rank 1")
finish(run_once(sabotage))
"""
    )
    results = [json.loads(out.strip().splitlines()[-1]) for out in run_ranks(code, 3, timeout=120)]
    assert results[1]["outcome"] == "ValueError: a bug on rank 1", "the failing rank raises its own error"
    for rank in (0, 2):
        assert results[rank]["outcome"].startswith("RankFailed: toma: rank 1 failed with an error that is not")
    for result in results:
        assert result["seconds"] < 10, "the others stop at once, not at the process group's timeout"
        assert all(result["grads"]), "every rank's gradients are restored"


def test_a_rank_that_dies_lets_the_others_fail_within_the_process_group_timeout():
    code = (
        SETUP.replace("TIMEOUT", "10")
        + """
def sabotage(calls):
    if rank == 1:
        os._exit(3)   # killed: it never reaches the agreement
result = run_once(sabotage)
print(json.dumps(dict(outcome=result["outcome"].split(":")[0], seconds=result["seconds"])), flush=True)
os._exit(0)
"""
    )
    (code0, out0, err0), (code1, _, _) = run_ranks(code, 2, timeout=90, check=False)
    assert code1 == 3 and code0 == 0, err0
    result = json.loads(out0.strip().splitlines()[-1])
    assert result["outcome"] != "finished" and result["seconds"] < 60


def test_decorators_with_collectives_use_the_same_size_on_every_rank():
    """The functions all-reduce inside; without the agreement the rank that retries would hang in it."""
    code = (
        SETUP.replace("TIMEOUT", "60")
        + """
from toma import explicit
sizes = []
@toma.batch(initial_batchsize=16, distributed=True)
def total(batchsize):
    sizes.append(batchsize)
    part = torch.full((batchsize,), float(rank + 1))
    dist.all_reduce(part)   # a collective in the user's function
    if rank == 0 and batchsize > 4:
        raise torch.OutOfMemoryError("CUDA out of memory (injected)")
    return batchsize, part.sum().item()

out = torch.zeros(20)
chunks = []
def fill(start, end):
    chunks.append((start, end))
    part = torch.arange(start, end, dtype=torch.float32)
    dist.all_reduce(part)
    if rank == 1 and end - start > 2 and start >= 8:
        raise torch.OutOfMemoryError("CUDA out of memory (injected)")
    out[start:end] = part / world

result, second = [total() for _ in range(2)]   # one call site: the second call starts at the agreed size
explicit.range(fill, 0, 20, 4, toma_distributed=True)
finish(dict(sizes=sizes, result=result, second=second, chunks=chunks, out=out.tolist()))
"""
    )
    results = [json.loads(out.strip().splitlines()[-1]) for out in run_ranks(code, 2, timeout=120)]
    assert results[0]["sizes"] == results[1]["sizes"] == [16, 8, 4, 4]
    assert results[0]["result"] == [4, 12.0] and results[0]["second"] == [4, 12.0]
    assert results[0]["chunks"] == results[1]["chunks"]
    assert results[0]["chunks"][:2] == [[0, 4], [4, 8]] and results[0]["chunks"][-1][1] == 20
    for result in results:
        assert result["out"] == list(map(float, range(20)))


def test_a_rank_whose_attempt_fit_during_an_agreed_retry_learns_from_its_own_measurement():
    """Rank 0 runs out of memory above 16 rows; rank 1's attempt at 64 finished before the ranks agreed to
    redo it smaller. Rank 1 keeps that attempt as evidence: a fit at 64 and the bytes it needed."""
    code = (
        SETUP.replace("TIMEOUT", "60")
        + """
from toma import FitToMemory, GlobalBatchsizeCache, explicit
from toma.core.caches import get_cache_for_context
from toma.memory.meters import Mark, MemoryMeter
class Meter(MemoryMeter):
    now = 0
    def begin(self):
        Meter.now = 0
        return Mark(0, 2**30)
    def used(self, mark):
        return Meter.now
policy = FitToMemory(meter=Meter())
sizes = []
def work(batchsize):
    sizes.append(batchsize)
    Meter.now = 2**20 * batchsize
    part = torch.ones(1)
    dist.all_reduce(part)
    if rank == 0 and batchsize > 16:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
    return batchsize
explicit.batch(work, 64, toma_policy=policy, toma_cache_type=GlobalBatchsizeCache, toma_context="agreed",
               toma_distributed=True)
entry = get_cache_for_context(GlobalBatchsizeCache, "agreed").batchsize
state = entry.learned
finish(dict(sizes=sizes, low=policy.bracket(entry, 2**30).low, measured=state.measured))
"""
    )
    results = [json.loads(out.strip().splitlines()[-1]) for out in run_ranks(code, 2, timeout=120)]
    assert results[0]["sizes"] == results[1]["sizes"] and results[1]["sizes"][0] == 64
    assert results[1]["low"] == 64 and [64, 64 * 2**20] in results[1]["measured"], results[1]
    assert results[0]["low"] < 64, "rank 0's own attempt at 64 failed"


def test_without_a_process_group_there_is_nothing_to_agree_on():
    assert distributed.agreement_for(True) is None and distributed.agreement_for(False) is None
    assert not distributed.is_distributed()


@pytest.mark.slow
def test_the_ddp_example_runs_under_torchrun():
    out = torchrun("examples/ddp_accumulate.py", timeout=240)
    own = [line for line in out.splitlines() if line.startswith("[rank 0] ") and "ran out of memory" in line]
    assert own and "can't allocate memory" in own[0], "rank 0 must run out of memory for real"
    assert "another rank ran out of memory" in out, "rank 1 must follow rank 0"
    sizes = json.loads(out.split("micro-batch size on every rank: ")[1].splitlines()[0])
    assert len(sizes) == 2 and len(set(sizes)) == 1 and sizes[0] < 4096
    assert "parameters identical on every rank: True" in out


def test_ddp_buffers_are_broadcast_outside_the_retried_region():
    """With broadcast_buffers (DDP's default) and BatchNorm, a rank that runs out of memory before its first
    forward pass, or whose micro-batches all weigh nothing, must not leave rank 0 alone in DDP's buffer
    broadcast: after every logical batch the ranks hold rank 0's buffers."""
    code = (
        SETUP.replace("TIMEOUT", "20")
        + """
torch.manual_seed(1)
model = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
ddp = nn.parallel.DistributedDataParallel(model)   # broadcast_buffers=True
x, y = data()
state = dict(call=0)
@toma.accumulate(model=ddp, initial_micro_batch=8, weight=lambda xb, yb: (yb != -100).sum())
def compute_loss(xb, yb):
    if rank == 1 and state["call"] < 2 and len(xb) > 4:
        raise torch.OutOfMemoryError("CUDA out of memory (injected before the forward pass)")
    return F.cross_entropy(ddp(xb), yb, ignore_index=-100)
outcomes = []
for call in range(4):
    state["call"] = call
    labels = torch.full_like(y, -100) if (rank == 1 and call == 2) else y   # rank 1 has nothing to learn from
    ddp.zero_grad()
    try:
        compute_loss(x, labels)
        outcomes.append("finished")
    except Exception as error:
        outcomes.append(f"{type(error).__name__}: {error}")
finish(dict(outcomes=outcomes, mean=model[1].running_mean.tolist(), tracked=int(model[1].num_batches_tracked)))
"""
    )
    results = [json.loads(out.strip().splitlines()[-1]) for out in run_ranks(code, 2, timeout=90)]
    for result in results:
        assert result["outcomes"] == ["finished"] * 4
    assert results[0]["mean"] == results[1]["mean"] and results[0]["tracked"] == results[1]["tracked"]


def test_a_token_mean_over_ranks_is_the_mean_over_all_their_tokens():
    """With weight= the ranks' gradients are the logical batch's token mean over every rank's tokens, not
    the mean of per-rank token means (which weighs a rank with few label tokens as much as one with many)."""
    code = (
        SETUP.replace("TIMEOUT", "30")
        + """
x, y = data()
y = y.clone()
y[: 20 if rank == 0 else 2] = -100   # rank 0 keeps 4 labels, rank 1 keeps 22
model = make_model()
ddp = nn.parallel.DistributedDataParallel(model)
@toma.accumulate(model=ddp, initial_micro_batch=8, weight=lambda xb, yb: (yb != -100).sum())
def compute_loss(xb, yb):
    return F.cross_entropy(ddp(xb), yb, ignore_index=-100)
compute_loss(x, y)
finish([p.grad.tolist() for p in model.parameters()])
"""
    )
    outputs = [json.loads(out.strip().splitlines()[-1]) for out in run_ranks(code, 2, timeout=90)]
    torch.manual_seed(0)
    inputs, targets = torch.randn(PER_RANK * 2, 6), torch.randint(0, 4, (PER_RANK * 2,))
    targets[:20] = -100
    targets[PER_RANK : PER_RANK + 2] = -100
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 4))
    F.cross_entropy(model(inputs), targets, ignore_index=-100).backward()
    for grads in outputs:
        for got, p in zip(grads, model.parameters(), strict=True):
            torch.testing.assert_close(torch.tensor(got), p.grad, rtol=1e-5, atol=1e-6)


CAPPED_ROWS, CAPPED_WIDTH = 8192, 4096


@pytest.mark.slow
def test_fit_to_memory_over_ranks_with_different_real_caps_agrees_on_every_size_with_exact_gradients():
    """Rank 0 gets 0.2 GiB above its settled address space, rank 1 0.5 GiB: both run out of memory for real
    at different sizes. With FitToMemory (accumulate's default) every rank must run each logical batch at the
    same agreed micro-batch, that size must come from rank 0's measured model (its log line names the need),
    and the gradients must equal the single-process full-batch reference (computed on each rank before the
    cap)."""
    code = (
        SETUP.replace("TIMEOUT", "120")
        + COLLECT_TOMA_LOG
        + f"""
from toma.memory.cpu import predictable_heap, set_cpu_memory_headroom
predictable_heap()
ROWS = {CAPPED_ROWS}
torch.manual_seed(0)
inputs, targets = torch.randn(ROWS * world, 64), torch.randint(0, 10, (ROWS * world,))
torch.manual_seed(1)
model = nn.Sequential(nn.Linear(64, {CAPPED_WIDTH}), nn.ReLU(), nn.Linear({CAPPED_WIDTH}, 10))
for start in range(0, ROWS * world, 2048):   # the full-batch mean's gradient, before the cap
    part = slice(start, start + 2048)
    (F.cross_entropy(model(inputs[part]), targets[part], reduction="sum") / (ROWS * world)).backward()
reference = [p.grad.clone() for p in model.parameters()]
model.zero_grad(set_to_none=True)
x, y = inputs[rank * ROWS:(rank + 1) * ROWS].clone(), targets[rank * ROWS:(rank + 1) * ROWS].clone()
del inputs, targets, part
ddp = nn.parallel.DistributedDataParallel(model)
@toma.accumulate(model=ddp, initial_micro_batch=ROWS)
def compute_loss(xb, yb):
    return F.cross_entropy(ddp(xb), yb)
dist.barrier()
set_cpu_memory_headroom(0.2 if rank == 0 else 0.5)
calls, errors = [], []
for call in range(3):
    ddp.zero_grad()
    before = compute_loss.stats.oom_retries
    compute_loss(x, y)
    calls.append(dict(micro=compute_loss.stats.micro_batch, retries=compute_loss.stats.oom_retries - before))
    errors.append(max(float(((p.grad - r).abs() / (r.abs() + 1e-6)).max()) for p, r in zip(model.parameters(), reference)))
finish(dict(calls=calls, errors=errors, lines=messages))
"""
    )
    runs = run_ranks(code, 2, timeout=240, check=False)
    for rank, (returncode, out, err) in enumerate(runs):
        assert returncode == 0, f"rank {rank} failed ({returncode}):\n{out[-3000:]}\n{err[-3000:]}"
    outputs = [json.loads(out.strip().splitlines()[-1]) for _, out, _ in runs]
    assert outputs[0]["calls"] == outputs[1]["calls"], "every rank runs every logical batch at the same size"
    first, *later = outputs[0]["calls"]
    assert first["retries"] >= 1 and first["micro"] < CAPPED_ROWS, first
    assert all(call["retries"] == 0 for call in later), "settled after the first logical batch"
    own = [line for line in outputs[0]["lines"] if "ran out of memory at" in line and "can't allocate" in line]
    assert own and "needed >=" in own[0], outputs[0]["lines"]
    follow = [line for line in outputs[1]["lines"] if "another rank ran out of memory" in line]
    assert follow, outputs[1]["lines"]
    for output in outputs:
        assert max(output["errors"]) < 1e-3, output["errors"]  # relative, element-wise, fp32 sums in other orders


# --- NCCL's agreement on the rank's GPU, not the current device (CUDA and the process group faked) --------


@pytest.fixture
def nccl_rank_1(monkeypatch):
    """Rank 1 of 2 under NCCL whose current CUDA device is 0: PyTorch's DDP tutorial does `model.to(rank)`
    without `set_device`, and a new thread's current device is 0."""
    from fake_cuda_memory import FakeCuda

    fake = FakeCuda(monkeypatch, current=0)
    dist = torch.distributed
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    return fake


def test_the_ddp_agreement_lives_on_ddps_device_not_the_current_one(nccl_rank_1, monkeypatch):
    from types import SimpleNamespace

    from toma.accumulation.sync import AgreeingDDP

    cuda0, cuda1 = torch.device("cuda", 0), torch.device("cuda", 1)
    ddp = SimpleNamespace(process_group=None, device_ids=[1], device_type="cuda", module=nn.Linear(2, 1))
    assert AgreeingDDP(ddp).agreement.device == cuda1  # DistributedDataParallel(model, device_ids=[rank])
    assert distributed._device_for(None, cuda1) == cuda1
    assert distributed._device_for(None) == cuda0, "nothing known: the current device, as before"
    monkeypatch.setattr(torch.distributed, "get_backend", lambda group=None: "gloo")
    assert distributed._device_for(None, cuda1) == torch.device("cpu"), "gloo reduces on the CPU"


def test_a_form_with_distributed_agrees_on_the_device_of_its_tensors(nccl_rank_1, monkeypatch):
    from toma import toma

    from fake_cuda_memory import on_cuda_1

    devices = []

    def all_reduce_min(agreement, value):  # every rank alone here: the MIN is its own value
        devices.append(agreement.device)
        return value

    monkeypatch.setattr(distributed.Agreement, "_min", all_reduce_min)

    @toma.batch(initial_batchsize=8, distributed=True)
    def work(batchsize, x):
        return batchsize

    assert work(on_cuda_1(torch.zeros(3))) == 8
    assert devices and set(devices) == {torch.device("cuda", 1)}


NCCL_WITHOUT_SET_DEVICE = """
import datetime, os, torch, torch.distributed as dist, torch.nn as nn
import toma

rank = int(os.environ["RANK"])
dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=60))
torch.manual_seed(0)
model = nn.Linear(16, 1).to(rank)  # PyTorch's DDP tutorial: no torch.cuda.set_device, the current device is 0
ddp = nn.parallel.DistributedDataParallel(model, device_ids=[rank])
torch.manual_seed(1)
x, y = torch.randn(64, 16, device=rank), torch.randn(64, 1, device=rank)

@toma.accumulate(model=ddp, initial_micro_batch=64)
def loss(x, y):
    if rank == 1 and len(x) > 16:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
    return ((ddp(x) - y) ** 2).mean()

loss(x, y)
grads = [round(float(g), 6) for g in model.weight.grad.flatten()[:4]]
print("done", rank, torch.cuda.current_device(), grads, flush=True)
dist.destroy_process_group()
os._exit(0)
"""


@pytest.mark.cuda
@pytest.mark.multiprocess
@pytest.mark.skipif(
    torch.cuda.device_count() < 2 or not torch.distributed.is_nccl_available(), reason="needs two GPUs and NCCL"
)
def test_nccl_ranks_whose_current_device_is_0_agree_on_their_own_gpus():
    outputs = run_ranks(NCCL_WITHOUT_SET_DEVICE, 2, timeout=180)
    lines = [out.strip().splitlines()[-1].split(" ", 3) for out in outputs]
    assert [line[:3] for line in lines] == [["done", "0", "0"], ["done", "1", "0"]]
    assert lines[0][3] == lines[1][3], "the same averaged gradients on both ranks"


SUBGROUP = """
import datetime, json, os
import torch, torch.distributed as dist
from toma import toma
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
rank = dist.get_rank()
pair = dist.new_group([0, 1])  # on rank 2: torch's placeholder for a rank outside the group
sizes = []

@toma.batch(initial_batchsize=8, distributed=pair)
def work(batchsize):
    sizes.append(batchsize)
    if rank == 1 and batchsize > 2:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")
    return batchsize

print(json.dumps(dict(result=work(), sizes=sizes)), flush=True)
dist.barrier()
dist.destroy_process_group()
os._exit(0)
"""


@pytest.mark.slow
def test_a_rank_outside_the_process_group_runs_on_its_own():
    """The ranks of the group agree on every size; a rank outside it (given torch's placeholder by `new_group`)
    runs alone, as torch's collectives there do nothing (it was refused: "got -100")."""
    results = [json.loads(out.strip().splitlines()[-1]) for out in run_ranks(SUBGROUP, 3, timeout=90)]
    assert results[0] == results[1] == dict(result=2, sizes=[8, 4, 2])
    assert results[2] == dict(result=8, sizes=[8])


# --- what a rank tells the others, whatever fails on its way there (the exchange faked, no process group) ----


class Told:
    """A `MinExchange` that records what this rank tells and answers as the other ranks would (`answers`, else
    what this rank told)."""

    def __init__(self, *answers):
        self.told, self.answers = [], list(answers)

    def min(self, value):
        self.told.append(value)
        return self.answers.pop(0) if self.answers else value


@pytest.fixture
def rank_0_of_2(monkeypatch):
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    agreement = distributed.Agreement()
    agreement.exchange = Told()
    return agreement


def test_a_proposal_that_cannot_be_worked_out_still_tells_the_others_that_this_rank_stops(rank_0_of_2):
    from toma.sizing.policies import Halving

    def out_of_memory_while_proposing(size, failed, error):
        raise MemoryError("no room left to work out a smaller size")

    rank_0_of_2.propose = out_of_memory_while_proposing
    with pytest.raises(MemoryError, match="no room left"):
        rank_0_of_2.after_attempt(64, torch.OutOfMemoryError("CUDA out of memory"), Halving())
    assert rank_0_of_2.exchange.told == [-1], "told once, as a stop: the others raise RankFailed, no one waits"


def test_an_error_inside_a_collective_is_raised_at_once_without_an_agreement(rank_0_of_2):
    from toma.core.oom import collective, should_reduce_batch_size
    from toma.sizing.policies import Halving

    def attempt():
        with collective("an all-gather"):
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1050624 bytes")

    with pytest.raises(RuntimeError, match="can't allocate memory") as raised:
        rank_0_of_2.reported(attempt, 64, Halving(), lambda: 64)
    assert rank_0_of_2.exchange.told == [], "the others are inside that collective, not at an agreement"
    assert not should_reduce_batch_size(raised.value), "never retried"
    assert any("inside the an all-gather" in note for note in raised.value.__notes__)


def test_an_attempt_runs_with_room_kept_and_gives_it_back_before_telling_the_others(rank_0_of_2, monkeypatch):
    from toma.memory import reserve
    from toma.sizing.policies import Halving

    monkeypatch.setattr(reserve, "address_space_limit", lambda: 2**40)  # a limit: the reserve is held
    held_while = []

    def attempt():
        held_while.append(rank_0_of_2.reserve.held)
        raise torch.OutOfMemoryError("CUDA out of memory")

    def told(value):
        held_while.append(rank_0_of_2.reserve.held)
        return value

    rank_0_of_2.exchange.min = told
    with pytest.raises(distributed.AgreedRetry, match="retry at 32"):
        rank_0_of_2.reported(attempt, 64, Halving(), lambda: 64)
    assert held_while == [True, False], "held during the attempt, given back before the agreement"
    assert not rank_0_of_2.reserve.held
