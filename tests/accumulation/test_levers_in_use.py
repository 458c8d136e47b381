"""Below one row: where one unit does not fit, `toma.accumulate` turns activation checkpointing on for the rest of
the call, trains the full batch's gradients, leaves the model as it was, starts the function's next call with it,
and with `levers=False` re-raises the error; under a real address-space cap a batch whose one row fails plain
trains to the uncapped reference."""

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from toma import Halving, NoBatchsizeCache, toma
from toma.core.size_file import SizeStore

from helpers import CHECKPOINT_TOWER, raise_fake_oom, run_python, run_ranks


class Tower(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in range(3))
        self.head = nn.Linear(6, 2)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def checkpointed(model):
    return all("forward" in vars(block) for block in model.blocks)


def loss_fn(model, seen):
    """Out of memory for any micro-batch the blocks run plain (as a row that only fits checkpointed)."""

    def compute_loss(x, y):
        if torch.is_grad_enabled():
            seen.append((len(x), checkpointed(model)))
            if not checkpointed(model):
                raise_fake_oom()
        return F.cross_entropy(model(x), y)

    return compute_loss


def reference(x, y):
    model = Tower()
    F.cross_entropy(model(x), y).backward()
    return [p.grad for p in model.parameters()]


def test_one_row_that_does_not_fit_trains_checkpointed_and_the_next_call_starts_so():
    model, seen = Tower(), []
    x, y = torch.randn(4, 6), torch.tensor([0, 1, 1, 0])
    compute_loss = toma.accumulate(model=model, initial_micro_batch=2, policy=Halving())(loss_fn(model, seen))
    calls = []
    for _ in range(2):  # one call site: its cache entry remembers the lever with the size
        seen.clear()
        model.zero_grad(set_to_none=True)
        compute_loss(x, y)
        calls.append((list(seen), compute_loss.stats.oom_retries, checkpointed(model)))
        for got, expected in zip([p.grad for p in model.parameters()], reference(x, y), strict=True):
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-7)
    assert calls[0] == ([(2, False), (1, False), (1, True), (1, True), (1, True), (1, True)], 2, False)
    assert calls[1] == ([(1, True)] * 4, 2, False), "on from the start: no failure; off after the call"
    assert compute_loss.stats.levers == ["activation checkpointing"]


def test_levers_false_re_raises_the_error_at_one_row():
    model, seen = Tower(), []
    compute_loss = toma.accumulate(model=model, initial_micro_batch=1, levers=False, cache_type=NoBatchsizeCache)(
        loss_fn(model, seen)
    )
    with pytest.raises(torch.OutOfMemoryError) as raised:
        compute_loss(torch.randn(2, 6), torch.tensor([0, 1]))
    assert "nothing left to reduce" in "".join(getattr(raised.value, "__notes__", []))
    assert seen == [(1, False)] and not checkpointed(model)
    with pytest.raises(TypeError, match="levers must be True or False"):
        toma.accumulate(model=model, levers="yes")


def test_an_error_that_is_not_out_of_memory_passes_through_and_the_lever_is_off_again():
    model, calls = Tower(), []

    def compute_loss(x):
        if torch.is_grad_enabled():
            calls.append(checkpointed(model))
            if not checkpointed(model):
                raise_fake_oom()
            raise ValueError("a bug of the user's")
        return model(x).sum()

    with pytest.raises(ValueError, match="a bug of the user's"):
        toma.accumulate(model=model, initial_micro_batch=1, groups="rows")(compute_loss)(torch.randn(1, 6))
    assert calls == [False, True] and not checkpointed(model)


UNDER_A_CAP = (
    CHECKPOINT_TOWER
    + """
import json
from toma import Halving, toma
x = torch.randn(2, 4096, 256)  # two rows of 4096 tokens: one row's activations need about 0.6 GiB plain
loss = lambda x: model(x).pow(2).mean()
loss(x[:1]).backward(); loss(x[1:]).backward()  # the reference, uncapped: the mean of the rows' means
expected = [p.grad.clone() / 2 for p in model.parameters()]
for p in model.parameters():
    p.grad.zero_()
set_cpu_memory_headroom(0.35)
plain = "fit"
try:
    loss(x[:1]).backward()
except RuntimeError as error:
    plain = "out of memory"
for p in model.parameters():
    p.grad.zero_()
stats = toma.accumulate(model=model, initial_micro_batch=2, policy=Halving())(loss)
stats(x)
worst = max(float((p.grad - e).norm() / e.norm()) for p, e in zip(model.parameters(), expected))
print(json.dumps([plain, stats.stats.levers, worst, "forward" in vars(model[0])]))
"""
)


@pytest.mark.slow
def test_under_a_real_cap_a_row_that_fails_plain_trains_checkpointed_to_the_uncapped_reference():
    out = run_python(UNDER_A_CAP, fresh=True, timeout=300)
    plain, levers, worst, still_on = json.loads(out.stdout.strip().splitlines()[-1])
    assert plain == "out of memory" and levers == ["activation checkpointing"]
    assert worst < 1e-5 and not still_on


RESTARTED = """
import json, sys
import torch
sys.path[:0] = ["tests", "tests/accumulation"]
from test_levers_in_use import Tower, checkpointed, loss_fn
from toma import Halving, remember_sizes, toma
remember_sizes(PATH)
model, seen = Tower(), []
compute_loss = toma.accumulate(model=model, initial_micro_batch=2, policy=Halving())(loss_fn(model, seen))
compute_loss(torch.randn(4, 6), torch.tensor([0, 1, 1, 0]))
print(json.dumps([compute_loss.stats.oom_retries, seen, checkpointed(model)]))
"""


def test_the_size_file_keeps_the_lever_with_the_size_and_a_restart_starts_with_both(tmp_path):
    code = RESTARTED.replace("PATH", repr(str(tmp_path / "sizes.db")))
    first, second = (json.loads(run_python(code).stdout.strip().splitlines()[-1]) for _ in range(2))
    assert first[0] == 2 and first[1][-4:] == [[1, True]] * 4
    assert second == [0, [[1, True]] * 4, False], "the size and the lever from the file; off after the call"
    assert SizeStore(str(tmp_path / "sizes.db")).rows()[0][2] == 1


def test_a_size_file_written_before_levers_were_kept_gets_their_column(tmp_path):
    import sqlite3

    path = tmp_path / "old.db"
    with sqlite3.connect(path) as old:
        old.execute(
            "CREATE TABLE toma_sizes (key TEXT PRIMARY KEY, site TEXT NOT NULL, device TEXT NOT NULL, "
            "size INTEGER NOT NULL, model TEXT, updated REAL NOT NULL)"
        )
        old.execute("INSERT INTO toma_sizes VALUES ('k', 's', 'd', 3, NULL, 0)")
    store = SizeStore(str(path))
    assert store.recall("k") == (3, None, ())
    store.put("k", "s", "d", 2, None, ("activation checkpointing",))
    assert store.recall("k") == (2, None, ("activation checkpointing",)) and not store.broken


def test_under_the_lever_the_micro_batch_grows_above_one_row_again():
    """Turning a lever on resets what the entry learned without it; FitToMemory then sizes under the lever and,
    with room measured, grows past the one row at which the lever turned on (up to what the call asks)."""
    model, seen = Tower(), []
    x, y = torch.randn(16, 6), torch.randint(0, 2, (16,))
    compute_loss = toma.accumulate(model=model, initial_micro_batch=8)(loss_fn(model, seen))
    sizes = []
    for _ in range(4):
        seen.clear()
        compute_loss(x, y)
        sizes.append(compute_loss.stats.micro_batch)
    assert sizes[0] == 1 and compute_loss.stats.levers == ["activation checkpointing"]
    assert sizes[-1] == 8 and all(on for _, on in seen), "grown back to the asked size, the lever on"


def test_the_levers_cost_is_measured_against_plain_calls_and_said_once(caplog):
    model, seen, tight = Tower(), [], []

    def compute_loss(x, y):
        if torch.is_grad_enabled() and tight and not checkpointed(model):
            raise_fake_oom()
        seen.append(checkpointed(model))
        return F.cross_entropy(model(x), y)

    step = toma.accumulate(model=model, initial_micro_batch=1, policy=Halving())(compute_loss)
    x, y = torch.randn(4, 6), torch.tensor([0, 1, 1, 0])
    with caplog.at_level("INFO", logger="toma"):
        for call in range(4):
            tight.extend([True] if call == 1 else [])
            step(x, y)
    cost = step.stats.lever_cost
    assert cost.plain_items == 4 and cost.lever_items == 8, "the call that failed first is not timed"
    assert cost.ratio is not None and cost.ratio > 0
    said = [r.getMessage() for r in caplog.records if "the time per item" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("toma: with activation checkpointing a step takes")


DDP_LEVERS = """
import json, os
import torch, torch.distributed as dist, torch.nn as nn, torch.nn.functional as F
from toma import toma, Halving, StacktraceMemoryBatchsizeCache
torch.set_num_threads(1)
StacktraceMemoryBatchsizeCache.TRACK_RAM = False
dist.init_process_group("gloo", timeout=__import__("datetime").timedelta(seconds=60))
rank = dist.get_rank()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(6, 6), nn.Sequential(*[nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in range(3)]))
ddp = nn.parallel.DistributedDataParallel(model)
x, y = torch.randn(8, 6), torch.randint(0, 6, (8,))
mine = slice(4 * rank, 4 * rank + 4)
def checkpointed():
    return all("forward" in vars(block) for block in model[1])
seen = []
@toma.accumulate(model=ddp, initial_micro_batch=2, policy=Halving())
def compute_loss(x, y):
    if torch.is_grad_enabled():
        seen.append([len(x), checkpointed()])
        if rank == 1 and not checkpointed():  # this rank's one row fits only checkpointed
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")
    return F.cross_entropy(ddp(x), y)
calls = []
for _ in range(2):
    ddp.zero_grad(set_to_none=True); seen.clear()
    compute_loss(x[mine], y[mine])
    calls.append(dict(seen=list(seen), levers=compute_loss.stats.levers, after=checkpointed()))
print(json.dumps(dict(calls=calls, grads=[p.grad.tolist() for p in model.parameters()])), flush=True)
dist.barrier(); dist.destroy_process_group(); os._exit(0)
"""


@pytest.mark.multiprocess
def test_ddp_ranks_agree_on_the_lever_and_train_the_full_batch():
    """2 gloo ranks: rank 1's one row does not fit plain; every rank turns checkpointing on together (one agreed
    retry, `AgreedRetry.lighter`), trains to the full batch's gradients, and the next call starts with it."""
    outputs = run_ranks(DDP_LEVERS, 2, timeout=120)
    results = [json.loads(out.strip().splitlines()[-1]) for out in outputs]
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(6, 6), nn.Sequential(*[nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in range(3)])
    )
    x, y = torch.randn(8, 6), torch.randint(0, 6, (8,))
    F.cross_entropy(model(x), y).backward()
    for rank, result in enumerate(results):
        first, second = result["calls"]
        assert first["levers"] == ["activation checkpointing"] and not first["after"] and not second["after"]
        assert first["seen"][-4:] == [[1, True]] * 4 and second["seen"] == [[1, True]] * 4, rank
        for got, expected in zip(result["grads"], [p.grad for p in model.parameters()], strict=True):
            torch.testing.assert_close(torch.tensor(got), expected, rtol=1e-5, atol=1e-7)


FSDP2_LEVERS = """
import datetime, json, os
import torch, torch.distributed as dist, torch.nn as nn, torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from toma import Halving, toma, StacktraceMemoryBatchsizeCache
torch.set_num_threads(1)
StacktraceMemoryBatchsizeCache.TRACK_RAM = False
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank = dist.get_rank()
def make():
    torch.manual_seed(0)
    blocks = nn.Sequential(*[nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True) for _ in range(3)])
    model = nn.Sequential(nn.Embedding(50, 16), blocks, nn.Linear(16, 50))
    for block in blocks:
        fully_shard(block)
    fully_shard(model)
    return model
def loss_of(model, x):
    return F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
generator = torch.Generator().manual_seed(100 + rank)
steps = [torch.randint(0, 50, (4, 10), generator=generator) for _ in range(2)]
reference = make()
optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
for x in steps:
    optimizer.zero_grad()
    loss_of(reference, x).backward()
    optimizer.step()
expected = [p.full_tensor() for p in reference.parameters()]
model = make()
def checkpointed():
    return all("forward" in vars(block) for block in model[1])
seen = []
@toma.accumulate(model=model, initial_micro_batch=2, policy=Halving())
def compute_loss(x):
    if torch.is_grad_enabled():
        seen.append([len(x), checkpointed()])
        if rank == 1 and not checkpointed():
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")
    return loss_of(model, x)
optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
calls = []
for x in steps:
    optimizer.zero_grad(); seen.clear()
    compute_loss(x)
    optimizer.step()
    calls.append(dict(seen=list(seen), levers=compute_loss.stats.levers, after=checkpointed()))
worst = max(float((p.full_tensor() - e).norm() / e.norm()) for p, e in zip(model.parameters(), expected))
print(json.dumps(dict(calls=calls, worst=worst)), flush=True)
dist.barrier(); dist.destroy_process_group(); os._exit(0)
"""


@pytest.mark.multiprocess
@pytest.mark.slow
def test_fsdp2_ranks_reduce_after_every_micro_batch_then_turn_the_lever_on_together():
    """2 gloo ranks, `fully_shard` blocks: rank 1's one row does not fit plain. The ranks first agree on the
    lighter gradient sync (reduce-scatter after every micro-batch), then on checkpointing (composed with
    `fully_shard`); 2 steps train to the unsplit FSDP2 steps' parameters."""
    outputs = run_ranks(FSDP2_LEVERS, 2, timeout=180)
    for rank, out in enumerate(outputs):
        result = json.loads(out.strip().splitlines()[-1])
        first, second = result["calls"]
        assert first["levers"] == ["activation checkpointing"] and not first["after"] and not second["after"]
        assert second["seen"] == [[1, True]] * 4, rank
        assert result["worst"] < 1e-5, rank


class DropoutTower(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(6, 6), nn.Dropout(0.3), nn.Tanh()) for _ in range(3))
        self.head = nn.Linear(6, 2)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_with_dropout_the_levered_batch_draws_what_the_plain_one_draws():
    """The reference runs the same micro-batches plain from the same seed: the failed plain attempt's draws are
    rolled back, and checkpointing recomputes with the random state it saved, so the gradients are equal."""
    x, y = torch.randn(4, 6), torch.tensor([0, 1, 1, 0])
    results = []
    for tight in (False, True):
        model = DropoutTower()

        def compute_loss(x, y, model=model, tight=tight):
            out = model(x)  # the failed attempt draws its dropout masks before it runs out of memory
            if tight and torch.is_grad_enabled() and not checkpointed(model):
                raise_fake_oom()
            return F.cross_entropy(out, y)

        decorated = toma.accumulate(model=model, initial_micro_batch=1, cache_type=NoBatchsizeCache, groups="rows")(
            compute_loss
        )
        torch.manual_seed(7)
        decorated(x, y)
        results.append(([p.grad.clone() for p in model.parameters()], decorated.stats.levers))
    (plain, none), (levered, levers) = results
    assert none == [] and levers == ["activation checkpointing"]
    for got, expected in zip(levered, plain, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-7)


def test_a_lever_that_fails_to_come_off_does_not_keep_the_others_on():
    from toma.accumulation.levers_in_use import LeversInUse

    levers, calls = LeversInUse(Tower(), True), []

    def broken():
        calls.append("broken")
        raise RuntimeError("the switch would not turn off")

    levers._removals.extend([lambda: calls.append("first"), broken])
    with pytest.raises(RuntimeError, match="would not turn off"):
        levers.turn_off()
    assert calls == ["broken", "first"]
