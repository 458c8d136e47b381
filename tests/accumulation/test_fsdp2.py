"""`toma.accumulate` on FSDP2 models (`fully_shard`), two real gloo ranks: the unsplit FSDP2 step's parameters,
every rank at the same micro-batch, an out-of-memory error on one rank in a forward or a backward pass retried
by all without a hang, another error stopping every rank."""

import ast
import json
import re

import pytest

from helpers import requires_cuda, run_ranks, torchrun

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

SETUP = """
import datetime, json, os
import torch, torch.distributed as dist, torch.nn as nn, torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from toma import NoBatchsizeCache, toma
torch.set_num_threads(1)
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank, world = dist.get_rank(), dist.get_world_size()
VOCAB, STEPS = 50, 3


def make(shard=True):
    torch.manual_seed(0)
    blocks = [nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True) for _ in range(3)]
    model = nn.Sequential(nn.Embedding(VOCAB, 16), *blocks, nn.Linear(16, VOCAB))
    if shard:
        for block in blocks:
            fully_shard(block)
        fully_shard(model)
    return model


def data(seed):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (12, 10), generator=generator) for _ in range(STEPS)]


def loss_of(model, x):
    return F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())


def finish(result):
    print(json.dumps(result), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)
"""

AGAINST_UNSPLIT = (
    SETUP
    + """
MODE, SYNC = os.environ["TOMA_MODE"], os.environ["TOMA_SYNC"]
mine = data(100 + rank)
reference = make()
optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
for x in mine:  # the unsplit FSDP2 step
    optimizer.zero_grad()
    loss_of(reference, x).backward()
    optimizer.step()
expected = [p.full_tensor() for p in reference.parameters()]

model = make()
optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
forwards, backwards, scatters = [], [], []
NAME = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"
reduce_scatter = getattr(dist, NAME)


def counted(*args, **kwargs):
    scatters.append(1)
    return reduce_scatter(*args, **kwargs)


setattr(dist, NAME, counted)


def middle_forward(module, args):
    if not torch.is_grad_enabled():  # toma's one check, without gradients, that the loss adds up
        return
    forwards.append(args[0].shape[0])
    if MODE == "held" and rank == 1 and any(p.grad is not None for p in module.parameters()):
        # the gradients of the micro-batches before, held unsharded, leave no room for this one's forward pass
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")
    if rank == 1 and len(forwards) == 2:  # the second micro-batch of the first logical batch
        if MODE == "forward":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")
        if MODE == "error":
            raise ValueError("a bug on rank 1, not memory")


def middle_backward(module, grad_input, grad_output):
    backwards.append(1)
    if MODE == "backward" and rank == 1 and len(backwards) == 2:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")


class FailingAllGather:  # the middle unit's all-gather, its buffer's allocation failing once on rank 1
    calls = 0

    def allocate(self, size, *, dtype, device):
        FailingAllGather.calls += 1
        if MODE == "allocate" and rank == 1 and FailingAllGather.calls == 4:  # the second micro-batch's backward
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate the all-gather's output")
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        return dist.all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)


if MODE == "allocate":
    model[2].set_custom_all_gather(FailingAllGather())
model[2].register_forward_pre_hook(middle_forward)
model[2].register_full_backward_hook(middle_backward)


@toma.accumulate(model=model, initial_micro_batch=4, gradient_sync=SYNC)
def compute_loss(x):
    return loss_of(model, x)


sizes, retries = [], []
try:
    for x in mine:
        optimizer.zero_grad()
        compute_loss(x)
        optimizer.step()
        sizes.append(compute_loss.stats.micro_batch)
        retries.append(compute_loss.stats.oom_retries)
except Exception as error:
    notes = " ".join(getattr(error, "__notes__", []))
    finish(dict(rank=rank, error=type(error).__name__, message=f"{error} {notes}"))
largest = max(float((p.full_tensor() - e).abs().max() / e.abs().max()) for p, e in zip(model.parameters(), expected))
finish(
    dict(
        rank=rank,
        difference=largest,
        sizes=sizes,
        forwards=forwards,
        retries=compute_loss.stats.oom_retries,
        retries_after=retries,
        scatters=len(scatters),
    )
)
"""
)


SYNCS = ["logical_batch", "micro_batch", "sharded"]
UNITS = 4  # 3 blocks and the root


def ranks(mode: str, sync: str = "auto") -> list:
    script = AGAINST_UNSPLIT.replace('os.environ["TOMA_MODE"]', repr(mode)).replace(
        'os.environ["TOMA_SYNC"]', repr(sync)
    )
    outputs = run_ranks(script, 2, timeout=180)
    return [json.loads(out.strip().splitlines()[-1]) for out in outputs]


@pytest.mark.parametrize("sync", SYNCS)
def test_micro_batches_give_the_unsplit_fsdp2_steps_parameters(sync):
    for result in ranks("none", sync):
        assert result["difference"] < 1e-5, result
        assert result["sizes"] == [4, 4, 4] and result["retries"] == 0
        assert result["forwards"] == [4] * 9, "3 micro-batches of 4 rows per logical batch of 12"
        # one reduce-scatter per unit after each micro-batch, or after each logical batch
        assert result["scatters"] == (3 if sync == "logical_batch" else 9) * UNITS, result


@pytest.mark.parametrize("sync", SYNCS)
@pytest.mark.parametrize("where", ["forward", "backward"])
def test_an_oom_on_one_rank_in_the_middle_block_of_the_second_micro_batch_is_retried_by_every_rank(where, sync):
    results = ranks(where, sync)
    for result in results:
        assert result["difference"] < 1e-5, result
        assert result["retries"] == 1, "every rank redid the logical batch, the one that ran out and the other"
        assert result["sizes"][0] == 2, "at the same smaller size"
    # rank 1 stopped in its second micro-batch; rank 0 ran the attempt to its end before the agreement, or, with
    # an agreement after every micro-batch, to the end of the second
    assert results[1]["forwards"][:3] == [4, 4, 2]
    assert results[0]["forwards"][:4] == ([4, 4, 4, 2] if sync == "logical_batch" else [4, 4, 2, 2])


def test_sharded_an_oom_on_one_rank_allocating_an_all_gathers_buffer_is_retried_by_every_rank():
    results = ranks("allocate", "sharded")
    for result in results:
        assert result["difference"] < 1e-5, result
        assert result["retries"] == 1 and result["sizes"][0] == 2, result
    # rank 1 failed in the second micro-batch's backward pass, before the all-gather; rank 0 met it there
    assert results[1]["forwards"][:3] == results[0]["forwards"][:3] == [4, 4, 2]


@pytest.mark.parametrize("sync", SYNCS)
def test_an_error_that_is_not_out_of_memory_on_one_rank_stops_every_rank_with_a_named_error(sync):
    by_rank = {result["rank"]: result for result in ranks("error", sync)}
    assert by_rank[1]["error"] == "ValueError" and "a bug on rank 1" in by_rank[1]["message"]
    assert by_rank[0]["error"] == "RankFailed" and "rank 1" in by_rank[0]["message"], by_rank[0]


def test_auto_reduces_after_every_micro_batch_once_the_held_gradients_leave_no_room_for_one_row():
    results = ranks("held", "auto")
    for result in results:
        assert result["difference"] < 1e-5, result
        first, *later = result["retries_after"]
        assert first >= 1 and later == [first, first], "retried in the first logical batch only: the switch stays"
        # it shrank to one row before it switched, then sized anew from where the call started (the held
        # gradients' failures say nothing about the micro-batches once they are reduced after each)
        assert result["sizes"][0] == 4, result
        assert result["scatters"] > 0, "reduce-scattered after micro-batches"


def test_held_gradients_that_leave_no_room_for_one_row_stop_every_rank_when_asked_to_hold_them():
    by_rank = {result["rank"]: result for result in ranks("held", "logical_batch")}
    assert by_rank[1]["error"] == "OutOfMemoryError" and "smallest" in by_rank[1]["message"], by_rank[1]
    assert by_rank[0]["error"] == "RankFailed" and "rank 1 ran out of memory" in by_rank[0]["message"], by_rank[0]


WEIGHTED = (
    SETUP
    + """
# Rows right-padded with -100 labels, more real tokens on rank 0 than on rank 1: with weight= the gradients are
# those of the token mean over both ranks' rows, computed here by one unsharded model on all of them.
def rows(seed, count, longest):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randint(0, VOCAB, (count, 10), generator=generator)
    lengths = torch.randint(2, longest + 1, (count,), generator=generator)
    labels = x[:, 1:].masked_fill(torch.arange(9)[None] >= lengths[:, None], -100)
    return x[:, :-1], labels


batches = [rows(7, 12, 9), rows(8, 7, 4)]  # 3 micro-batches of rank 0's against 2 of rank 1's
everything = [torch.cat(parts) for parts in zip(*batches)]
single = make(shard=False)
F.cross_entropy(single(everything[0]).flatten(0, 1), everything[1].flatten(), ignore_index=-100).backward()
expected = [p.grad for p in single.parameters()]

model = make()


@toma.accumulate(
    model=model, initial_micro_batch=5, weight=lambda x, labels: (labels != -100).sum(), gradient_sync=SYNC
)
def compute_loss(x, labels):
    return F.cross_entropy(model(x).flatten(0, 1), labels.flatten(), ignore_index=-100)


compute_loss(*batches[rank])
got = [p.grad.full_tensor() for p in model.parameters()]
largest = max(float((g - e).abs().max() / e.abs().max()) for g, e in zip(got, expected))
finish(dict(rank=rank, difference=largest, tokens=int((batches[rank][1] != -100).sum())))
"""
)


@pytest.mark.parametrize("sync", SYNCS)
def test_weight_gives_the_token_mean_over_every_ranks_rows(sync):
    script = WEIGHTED.replace("gradient_sync=SYNC", f"gradient_sync={sync!r}")
    results = [json.loads(out.strip().splitlines()[-1]) for out in run_ranks(script, 2, timeout=180)]
    assert results[0]["tokens"] != results[1]["tokens"]
    for result in results:
        assert result["difference"] < 1e-5, result


def test_sharded_a_rank_whose_rows_count_nothing_joins_the_others_rounds_without_a_nan():
    # rank 1's 4 rows have no label at all: its one micro-batch's mean is 0/0 (NaN) and does not run; it still joins
    # rank 0's 3 rounds of FSDP2's collectives, counting nothing, and both get rank 0's token mean
    script = (
        WEIGHTED.replace("gradient_sync=SYNC", "gradient_sync='sharded'")
        .replace(
            "batches = [rows(7, 12, 9), rows(8, 7, 4)]",
            "batches = [rows(7, 12, 9), (rows(8, 4, 4)[0], torch.full((4, 9), -100))]",
        )
        .replace(  # a masked mean: 0/0, NaN, and NaN gradients even multiplied by 0, where nothing counts
            "return F.cross_entropy(model(x).flatten(0, 1), labels.flatten(), ignore_index=-100)",
            "mask = (labels.flatten() != -100).float()\n"
            "    each = F.cross_entropy(model(x).flatten(0, 1), labels.flatten().clamp(min=0), reduction='none')\n"
            "    return (each * mask).sum() / mask.sum()",
        )
    )
    results = [json.loads(out.strip().splitlines()[-1]) for out in run_ranks(script, 2, timeout=180)]
    assert [result["tokens"] for result in results][1] == 0
    for result in results:
        assert result["difference"] < 1e-5, result


GROUPED = (
    SETUP
    + """
SYNC = os.environ["TOMA_SYNC"]


def make_grouped():  # as accelerate shards a language model: the final norm and the head one FSDP2 group
    torch.manual_seed(0)
    blocks = [nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True) for _ in range(2)]
    model = nn.Sequential(nn.Embedding(VOCAB, 16), *blocks, nn.LayerNorm(16), nn.Linear(16, VOCAB))
    model[0].weight.requires_grad_(False)  # frozen, as LoRA freezes the base weights: no gradient, as in FSDP2
    for block in blocks:
        fully_shard(block)
    fully_shard([model[3], model[4]])
    fully_shard(model)
    return model


x = data(100 + rank)[0]
reference = make_grouped()
loss_of(reference, x).backward()
expected = [None if p.grad is None else p.grad.full_tensor() for p in reference.parameters()]
model = make_grouped()
toma.accumulate(model=model, initial_micro_batch=4, gradient_sync=SYNC)(lambda x: loss_of(model, x))(x)
got = [None if p.grad is None else p.grad.full_tensor() for p in model.parameters()]
frozen = [g is None for g in got] == [e is None for e in expected] and expected[0] is None
trained = [(g, e) for g, e in zip(got, expected) if e is not None]
largest = max(float((g - e).abs().max() / e.abs().max()) for g, e in trained)
# every rank's micro-batches count nothing: the same error on every rank, no hang
nothing = None
try:
    toma.accumulate(model=model, initial_micro_batch=4, gradient_sync=SYNC, weight=lambda x: 0)(
        lambda x: loss_of(model, x)
    )(x)
except Exception as error:
    nothing = type(error).__name__
finish(dict(rank=rank, difference=largest, frozen=frozen, nothing=nothing))
"""
)


@pytest.mark.parametrize("sync", SYNCS)
def test_modules_sharded_as_one_group_and_frozen_weights_get_the_unsplit_fsdp2_gradients(sync):
    script = GROUPED.replace('os.environ["TOMA_SYNC"]', repr(sync))
    for result in [json.loads(out.strip().splitlines()[-1]) for out in run_ranks(script, 2, timeout=180)]:
        assert result["difference"] < 1e-5, result
        assert result["frozen"], "a frozen parameter keeps no gradient, as under FSDP2 itself"
        assert result["nothing"] == "NothingCounted", result


MIXED = (
    SETUP
    + """
from torch.distributed.fsdp import MixedPrecisionPolicy

SYNC = os.environ["TOMA_SYNC"]
policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def make_mixed():
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16)) for _ in range(2)]
    model = nn.Sequential(*blocks, nn.Linear(16, 4))
    for block in blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


generator = torch.Generator().manual_seed(100 + rank)
batches = [(torch.randn(16, 16, generator=generator), torch.randint(0, 4, (16,), generator=generator)) for _ in range(2)]
reference = make_mixed()
optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
for x, y in batches:  # the unsplit FSDP2 steps, in bf16 with fp32 reductions
    optimizer.zero_grad()
    F.cross_entropy(reference(x).float(), y).backward()
    optimizer.step()
expected = [p.full_tensor() for p in reference.parameters()]
start = [p.full_tensor() for p in make_mixed().parameters()]
model = make_mixed()
optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
calls = []


def second_block(module, args):  # rank 1 runs out in the 2nd micro-batch, after the 1st one's gradients exist
    calls.append(1)
    if rank == 1 and len(calls) == 2:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")


model[1].register_forward_pre_hook(second_block)
compute_loss = toma.accumulate(model=model, initial_micro_batch=4, gradient_sync=SYNC)(
    lambda x, y: F.cross_entropy(model(x).float(), y)
)
for x, y in batches:
    optimizer.zero_grad()
    compute_loss(x, y)
    dtypes = sorted({str(p.grad.dtype) for p in model.parameters()})
    optimizer.step()
got = [p.full_tensor() for p in model.parameters()]
moved = sum(float((e - s).square().sum()) for e, s in zip(expected, start)) ** 0.5
apart = sum(float((g - e).square().sum()) for g, e in zip(got, expected)) ** 0.5
finish(dict(rank=rank, dtypes=dtypes, apart=apart / moved, retries=compute_loss.stats.oom_retries))
"""
)


@pytest.mark.parametrize("sync", SYNCS)
def test_bf16_parameters_with_fp32_reductions_retry_and_train_as_the_unsplit_fsdp2_steps_within_bf16_rounding(sync):
    script = MIXED.replace('os.environ["TOMA_SYNC"]', repr(sync))
    for result in [json.loads(out.strip().splitlines()[-1]) for out in run_ranks(script, 2, timeout=180)]:
        assert result["dtypes"] == ["torch.float32"], "the sharded fp32 parameters get fp32 gradients"
        assert result["apart"] < 0.02, result  # a small part of how far the steps moved the parameters
        assert result["retries"] == 1, "the failed attempt's fp32 accumulated gradients must not reach the retry"


TOO_LARGE = (
    SETUP
    + """
import time
from toma.memory.cpu import predictable_heap, set_cpu_memory_headroom
predictable_heap()
torch.manual_seed(0)
wide = nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(4)])  # 64 MiB unsharded, 32 MiB on each rank
for layer in wide:
    fully_shard(layer)
fully_shard(wide)
if rank == 1:
    set_cpu_memory_headroom(48 / 1024)  # room for micro-batches, not for every unit unsharded
started = time.monotonic()
try:
    toma.accumulate(model=wide, initial_micro_batch=4, gradient_sync=os.environ["TOMA_SYNC"])(
        lambda x: wide(x).square().mean()
    )(torch.randn(16, 2048))
except Exception as error:
    finish(dict(rank=rank, error=type(error).__name__, message=str(error), seconds=time.monotonic() - started))
finish(dict(rank=rank, error=None))
"""
)


def cannot_hold(sync: str, monkeypatch) -> dict:
    monkeypatch.setenv("TOMA_SYNC", sync)
    return {json.loads(out.strip().splitlines()[-1])["rank"]: json.loads(out.strip().splitlines()[-1])
            for out in run_ranks(TOO_LARGE, 2, timeout=120)}  # fmt: skip


@pytest.mark.parametrize("sync", ["logical_batch", "micro_batch"])
def test_a_rank_that_cannot_hold_the_units_unsharded_stops_every_rank_at_once_naming_why(sync, monkeypatch):
    by_rank = cannot_hold(sync, monkeypatch)
    assert by_rank[1]["error"] == "UnshardedDoesNotFit", by_rank[1]
    assert "rank 1 cannot hold the model's units unsharded" in by_rank[1]["message"]
    assert by_rank[0]["error"] == "RankFailed" and "rank 1" in by_rank[0]["message"], by_rank[0]
    assert max(result["seconds"] for result in by_rank.values()) < 30, "no collective left waiting for its timeout"
    assert "gradient_sync='sharded'" in by_rank[1]["message"], "the way out named"


def test_auto_goes_on_sharded_where_a_rank_cannot_hold_the_units_unsharded_and_stops_every_rank_where_no_row_fits(
    monkeypatch,
):
    # 16 MiB units on gloo: an all-gather's buffer and gloo's copies inside it do not fit in rank 1's 48 MiB either
    by_rank = cannot_hold("auto", monkeypatch)
    assert by_rank[1]["error"] == "MemoryError" and "kept for gloo inside FSDP2" in by_rank[1]["message"], by_rank
    assert by_rank[0]["error"] == "RankFailed" and "smallest size (1)" in by_rank[0]["message"], by_rank
    assert max(result["seconds"] for result in by_rank.values()) < 30, "no collective left waiting for its timeout"


REFUSALS = (
    SETUP
    + """
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
fully_shard(model[0])  # a sharded block, but not the root
try:
    toma.accumulate(model=model, initial_micro_batch=2)(lambda x: model(x).sum())(torch.randn(4, 4))
except ValueError as error:
    finish(dict(rank=rank, message=str(error)))
finish(dict(rank=rank, message=None))
"""
)


def test_a_model_whose_blocks_are_sharded_but_not_its_root_is_refused_naming_the_fix():
    (output,) = run_ranks(REFUSALS, 1, timeout=120)
    message = json.loads(output.strip().splitlines()[-1])["message"]
    assert message is not None and "fully_shard on the root module" in message


ROOTS = (
    SETUP
    + """
from toma.accumulation.fsdp2 import fsdp2_root


def outcome(module):
    try:
        root = fsdp2_root(module, "here")
    except ValueError as error:
        return str(error)
    return None if root is None else next(name for name, m in module.named_modules() if m is root)


class Holder(nn.Module):  # a LightningModule-like holder of the sharded model
    def __init__(self, extra=False, two=False):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
        self.other = nn.Linear(2, 2) if two else None
        self.scale = nn.Parameter(torch.ones(1)) if extra else None


plain, inner, itself, extra, two = Holder(), Holder(), Holder(), Holder(extra=True), Holder(two=True)
for holder in (inner, itself, extra, two):
    fully_shard(holder.net[0])
    fully_shard(holder.net)
fully_shard(two.other)
fully_shard(itself)
finish(dict(plain=outcome(plain), inner=outcome(inner), itself=outcome(itself), extra=outcome(extra), two=outcome(two)))
"""
)


def test_the_fsdp2_root_is_the_model_or_its_one_outermost_sharded_module_holding_every_trained_parameter():
    (output,) = run_ranks(ROOTS, 1, timeout=120)
    found = json.loads(output.strip().splitlines()[-1])
    assert found["plain"] is None and found["inner"] == "net" and found["itself"] == ""
    assert "outside the FSDP2 root 'net' (scale)" in found["extra"], found["extra"]
    assert "several FSDP2 roots (net, other)" in found["two"], found["two"]


def test_the_example_trains_under_a_real_cap_on_one_rank_as_the_unsplit_steps():
    out = torchrun("examples/fsdp2_accumulate.py")
    own = [line for line in out.splitlines() if line.startswith("[rank 1] ") and "ran out of memory" in line]
    assert own and "needed" in own[0], "rank 1 must run out of memory for real, under its cap"
    assert "[rank 0]" in out and "another rank ran out of memory" in out, "rank 0 must follow rank 1"
    sizes = json.loads(re.search(r"micro-batch sizes on every rank: (\[\[[^]]*\], \[[^]]*\]\])", out).group(1))
    assert sizes[0] == sizes[1] and sizes[0][0] < 4096
    difference = float(out.split("largest difference from the unsplit FSDP2 steps: ")[1].split()[0])
    assert difference < 1e-5


def test_the_benchmark_runs_quick_and_toma_issues_no_all_gather_per_micro_batch():
    out = torchrun("benchmarks/fsdp2_steps.py", "--quick")
    counted = dict(re.findall(r"^collectives per logical batch, (.+?): (\{.*\})$", out, re.M))
    hand, ours = (ast.literal_eval(counted[name]) for name in ("hand-written FSDP2 loop", "toma.accumulate"))
    units = 3  # 2 blocks and the root
    assert ours.get("all_gather_single", 0) + ours.get("all_gather_into_tensor", 0) == units, "once per unit"
    assert hand.get("all_gather_single", 0) + hand.get("all_gather_into_tensor", 0) > units
    assert float(out.split("largest parameter difference between the two at the end: ")[1].split()[0]) < 1e-5
    reducing = ast.literal_eval(counted['toma.accumulate, gradient_sync="micro_batch"'])
    scatters = reducing.get("reduce_scatter_single", 0) + reducing.get("reduce_scatter_tensor", 0)
    assert scatters == units * 4, "one per unit after each of 4 micro-batches"
    held = dict(
        re.findall(r"^unsharded gradients held when a micro-batch's forward pass starts, (.+?): (\S+) MiB$", out, re.M)
    )
    assert float(held["toma.accumulate"]) > 0 and float(held['toma.accumulate, gradient_sync="micro_batch"']) == 0
    assert float(out.split("micro_batch against the hand-written loop (norm-wise): ")[1].split()[0]) < 1e-5
    # the sharded mode: FSDP2's own collectives, as its default loop issues them, each after one agreement (in
    # shared memory: the two ranks share this host), and not one collective more
    sharded = ast.literal_eval(counted['toma.accumulate, gradient_sync="sharded"'])
    every = ast.literal_eval(counted["hand-written FSDP2 loop, reduce-scatter every micro-batch"])
    fsdp2s = {name: n for name, n in sharded.items() if name != "agreement_in_shared_memory"}
    assert fsdp2s == every, (sharded, every)
    assert sharded["agreement_in_shared_memory"] >= sum(fsdp2s.values()), "one before each of FSDP2's collectives"
    assert float(out.split("sharded against the hand-written loop (norm-wise): ")[1].split()[0]) < 1e-5
    peaks = dict(re.findall(r"^peak memory per rank during a logical batch, (.+?): (\S+) MiB$", out, re.M))
    assert len(peaks) == 5 and float(peaks['toma.accumulate, gradient_sync="sharded"']) > 0, peaks


SIZE_FILE = (
    SETUP
    + """
from toma import Halving, remember_sizes
from toma.core.size_file import SizeStore
path = os.path.join(os.environ["TOMA_TEST_DIR"], f"sizes-{rank}.db")
remember_sizes(path)
model = make()


@toma.accumulate(model=model, initial_micro_batch=4, policy=Halving())
def compute_loss(x):
    if rank == 1 and len(x) == 4:  # rank 1 runs out: both ranks move to 2 rows, and remember it
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")
    return loss_of(model, x)


compute_loss(data(100 + rank)[0])
finish(dict(rank=rank, rows=[list(row[:3]) for row in SizeStore(path).rows()]))
"""
)


def test_the_size_file_keys_a_sharded_models_size_by_its_sharding_and_the_world_size(tmp_path):
    code = f"import os; os.environ['TOMA_TEST_DIR'] = {str(tmp_path)!r}\n" + SIZE_FILE
    for output in run_ranks(code, 2, timeout=180):
        result = json.loads(output.strip().splitlines()[-1])
        (site, device, size), *others = result["rows"]
        assert not others and site.endswith("[FSDP2: 4 units sharded over 2 ranks]"), site
        assert device.endswith(f"world=2:rank={result['rank']}") and size == 2


TRAINER = (
    SETUP
    + """
import toma as toma_package


def mlp():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Sequential(nn.Linear(6, 32), nn.ReLU()), nn.Sequential(nn.Linear(32, 32), nn.ReLU()),
                          nn.Linear(32, 4))  # fmt: skip
    fully_shard(model[0])
    fully_shard(model[1])
    fully_shard(model)
    return model


generator = torch.Generator().manual_seed(rank)
x, y = torch.randn(64, 6, generator=generator), torch.randint(0, 4, (64,), generator=generator)
reference = mlp()
optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
for start in range(0, 64, 32):  # the unsplit FSDP2 steps on logical batches of 32
    optimizer.zero_grad()
    F.cross_entropy(reference(x[start : start + 32]), y[start : start + 32]).backward()
    optimizer.step()

model = mlp()


def refuse(module, args):
    if rank == 1 and args[0].shape[0] > 8:  # rank 1 has room for 8 rows only
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")


model[1].register_forward_pre_hook(refuse)
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)
trainer = toma_package.Trainer(
    model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(), loader, batch_size=32, verbose=0,
    gradient_sync=os.environ["TOMA_SYNC"],
)
gathers, all_gather = [], dist.all_gather_single
dist.all_gather_single = lambda *args, **kwargs: (gathers.append(1), all_gather(*args, **kwargs))[1]
trainer.fit(1)
largest = max(
    float((p.detach().full_tensor() - r.detach().full_tensor()).abs().max() / r.detach().full_tensor().abs().max())
    for p, r in zip(model.parameters(), reference.parameters())
)
finish(dict(rank=rank, difference=largest, micro_batch=trainer.stats.micro_batch, unshards=len(gathers)))
"""
)


@pytest.mark.parametrize("sync", ["auto", "sharded"])
def test_the_trainer_trains_an_fsdp2_model_as_the_unsplit_steps_with_one_rank_short_of_memory(sync, monkeypatch):
    monkeypatch.setenv("TOMA_SYNC", sync)
    results = [json.loads(out.strip().splitlines()[-1]) for out in run_ranks(TRAINER, 2, timeout=180)]
    for result in results:
        assert result["difference"] < 1e-5 and result["micro_batch"] == 8, result
        # sharded: the two blocks all-gathered in every micro-batch's passes (2 steps of 4 micro-batches of 8 at
        # least), not once per attempt
        assert (result["unshards"] >= 2 * 2 * 8) == (sync == "sharded"), result


ON_A_GPU = """
import datetime, json, os
import torch, torch.distributed as dist, torch.nn as nn, torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from toma import toma
dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=120))
device = torch.device("cuda", 0)
torch.cuda.set_device(device)
SYNC, ROWS, WIDTH = os.environ["TOMA_SYNC"], 16384, 8192


def make():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Sequential(nn.Linear(64, WIDTH), nn.ReLU()), nn.Sequential(nn.Linear(WIDTH, 64), nn.ReLU()), nn.Linear(64, 10)
    ).to(device)
    for block in model[:2]:
        fully_shard(block)
    fully_shard(model)
    return model


generator = torch.Generator().manual_seed(1)
batches = [(torch.randn(ROWS, 64, generator=generator).to(device), torch.randint(0, 10, (ROWS,), generator=generator).to(device))
           for _ in range(2)]  # fmt: skip
reference = make()
optimizer = torch.optim.SGD(reference.parameters(), lr=0.05)
for x, y in batches:  # the unsplit FSDP2 steps, before any cap
    optimizer.zero_grad()
    F.cross_entropy(reference(x), y).backward()
    optimizer.step()
expected = [p.full_tensor().cpu() for p in reference.parameters()]
del reference, optimizer
torch.cuda.empty_cache()
model = make()
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
compute_loss = toma.accumulate(model=model, initial_micro_batch=ROWS, gradient_sync=SYNC)(
    lambda x, y: F.cross_entropy(model(x), y)
)
# 512 MiB above what the process holds: one 16384 x 8192 activation alone is 512 MiB
total = torch.cuda.get_device_properties(device).total_memory
torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_reserved(device) + 512 * 2**20) / total, device)
sizes = []
for x, y in batches:
    optimizer.zero_grad()
    compute_loss(x, y)
    optimizer.step()
    sizes.append(compute_loss.stats.micro_batch)
got = [p.full_tensor().cpu() for p in model.parameters()]
largest = max(float((g - e).abs().max() / e.abs().max()) for g, e in zip(got, expected))
print(json.dumps(dict(difference=largest, sizes=sizes, retries=compute_loss.stats.oom_retries)), flush=True)
dist.destroy_process_group()
os._exit(0)
"""


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("sync", SYNCS)
def test_on_a_gpu_a_real_cuda_oom_under_fsdp2_over_nccl_is_retried_to_the_unsplit_parameters(sync):
    """One rank on a GPU, NCCL's all-gathers and reduce-scatters, a real out-of-memory error under
    `set_per_process_memory_fraction`."""
    (output,) = run_ranks(ON_A_GPU.replace('os.environ["TOMA_SYNC"]', repr(sync)), 1, timeout=300)
    result = json.loads(output.strip().splitlines()[-1])
    assert result["retries"] >= 1 and result["sizes"][0] < 16384, result
    assert result["difference"] < 1e-4, result
