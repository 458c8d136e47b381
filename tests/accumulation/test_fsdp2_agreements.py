"""Groundwork for issue 43 (a sharded FSDP2 mode): FSDP2's own schedule (per-unit all-gathers inside the passes,
`reshard_after_forward=True`, a reduce-scatter after every micro-batch) made safe by toma's agreement protocol. With
`Agreement.all_finished` before every all-gather (`FSDPParamGroup.unshard`) and every reduce-scatter
(`FSDPParamGroup.post_backward`), a rank that runs out of memory in the forward or the backward pass of a middle unit
meets the others at their next agreement through its `after_attempt`; every rank leaves the attempt without a hang,
FSDP2's state is reset, and the retry at the smaller size trains to the unsplit FSDP2 steps' parameters. The
patch is the test's own (class-level, in the ranks' processes): the protocol alone, below the mode toma ships
(`gradient_sync="sharded"`, which meets the ranks inside FSDP2's communication objects instead, after the buffers'
allocation: tests/accumulation/test_fsdp2.py and test_fsdp2_sharded.py)."""

import json

import pytest

from helpers import run_ranks

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

RANKS = """
import datetime, json, os, time
import torch, torch.distributed as dist, torch.nn as nn, torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
from toma import Halving
from toma.core.agreement import Agreement, AgreedRetry
from toma.accumulation.fsdp2 import ShardedUnits
torch.set_num_threads(1)
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank = dist.get_rank()
WHERE = os.environ["TOMA_WHERE"]

def make():
    torch.manual_seed(0)
    blocks = [nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True) for _ in range(3)]
    model = nn.Sequential(nn.Embedding(50, 16), *blocks, nn.Linear(16, 50))
    for b in blocks:
        fully_shard(b)
    fully_shard(model)
    return model

def loss_of(model, x):
    return F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())

g = torch.Generator().manual_seed(100 + rank)
steps = [torch.randint(0, 50, (8, 10), generator=g) for _ in range(2)]
reference = make()
opt = torch.optim.SGD(reference.parameters(), lr=0.5)
for x in steps:
    opt.zero_grad(); loss_of(reference, x).backward(); opt.step()
expected = [p.full_tensor() for p in reference.parameters()]

agreement = Agreement()
current = {"size": None, "points": 0}
orig_unshard, orig_post_backward = FSDPParamGroup.unshard, FSDPParamGroup.post_backward
def unshard(self, async_op=False):
    if current["size"] is not None and self._all_gather_result is None and not self.is_unsharded:
        current["points"] += 1
        agreement.all_finished(current["size"])
    return orig_unshard(self, async_op)
def post_backward(self, *args):
    if current["size"] is not None:
        current["points"] += 1
        agreement.all_finished(current["size"])
    return orig_post_backward(self, *args)
FSDPParamGroup.unshard, FSDPParamGroup.post_backward = unshard, post_backward

model = make()
units = ShardedUnits(model)
middle = model[2]
def fail_forward(module, args, output):
    if rank == 1 and current["size"] == 8 and WHERE == "forward":
        raise torch.OutOfMemoryError("CUDA out of memory. fake in forward of the middle unit")
middle.register_forward_hook(fail_forward)
def fail_backward(module, gin, gout):
    if rank == 1 and current["size"] == 8 and WHERE == "backward":
        raise torch.OutOfMemoryError("CUDA out of memory. fake in backward of the middle unit")
middle.register_full_backward_hook(fail_backward)

opt = torch.optim.SGD(model.parameters(), lr=0.5)
log = []
for x in steps:
    size = 8
    while True:
        current["size"], current["points"] = size, 0
        opt.zero_grad(set_to_none=True)
        def attempt():
            for chunk in x.split(size):
                (loss_of(model, chunk) * len(chunk) / len(x)).backward()
        try:
            agreement.reported(attempt, size, Halving(), lambda: size, met_within=True)
            log.append([size, current["points"], "ok"])
            break
        except AgreedRetry as retry:
            log.append([size, current["points"], retry.reason])
            units.reset()
            size = retry.size
    current["size"] = None
    opt.step()
worst = max(float((p.full_tensor() - e).norm() / e.norm()) for p, e in zip(model.parameters(), expected))
print(json.dumps(dict(rank=rank, log=log, worst=worst)), flush=True)
dist.barrier(); dist.destroy_process_group(); os._exit(0)
"""


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_agreements_before_fsdp2s_own_collectives_let_every_rank_leave_a_failed_pass_and_retry(where, monkeypatch):
    monkeypatch.setenv("TOMA_WHERE", where)
    outputs = run_ranks(RANKS, 2, timeout=120)
    results = [json.loads(out.strip().splitlines()[-1]) for out in outputs]
    for result in results:
        sizes = [[size, reason == "ok"] for size, _, reason in result["log"]]
        assert sizes == [[8, False], [4, True]] * 2, result
        assert result["worst"] < 1e-5, result
    assert [line[2] for line in results[1]["log"][::2]] == ["rank 1 ran out of memory"] * 2
    assert [line[2] for line in results[0]["log"][::2]] == ["another rank ran out of memory"] * 2
