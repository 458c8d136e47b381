"""Errors of collectives across real ranks (gloo, CPU): never retried as a local out-of-memory error; every
rank stops at once."""

import json

import pytest

from helpers import run_ranks

pytestmark = pytest.mark.multiprocess

# What ProcessGroupNCCL raises when NCCL itself cannot allocate device memory.
NCCL_OOM = (
    "NCCL error in: ../torch/csrc/distributed/c10d/NCCLUtils.hpp:275, unhandled cuda error (run with "
    "NCCL_DEBUG=INFO for details), NCCL version 2.21.5\nncclUnhandledCudaError: Call to CUDA function failed.\n"
    "Last error:\nCuda failure 2 'out of memory'"
)

RANKS = """
import datetime, json, os, time
import torch, torch.distributed as dist, torch.nn as nn, torch.nn.functional as F
from toma import toma
torch.set_num_threads(1)
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
rank = dist.get_rank()
torch.manual_seed(1)
model = nn.Linear(6, 4)
ddp = nn.parallel.DistributedDataParallel(model)
torch.manual_seed(rank)
inputs, targets = torch.randn(24, 6), torch.randint(0, 4, (24,))
sizes = []

@toma.accumulate(model=ddp, initial_micro_batch=8)
def compute_loss(xb, yb):
    if not torch.is_grad_enabled():  # toma's one check, without gradients, that the loss adds up
        return F.cross_entropy(ddp(xb), yb)
    sizes.append(len(xb))
    if rank == 1 and len(sizes) == 2:   # a collective of the user's own failed in NCCL, out of device memory
        raise dist.DistBackendError(NCCL_OOM)
    return F.cross_entropy(ddp(xb), yb)

started = time.monotonic()
try:
    compute_loss(inputs, targets)
    outcome = "finished"
except Exception as error:
    outcome = f"{type(error).__name__}: {error}"
print(json.dumps(dict(outcome=outcome, sizes=sizes, seconds=time.monotonic() - started,
                      retries=compute_loss.stats.oom_retries, grads=[p.grad is None for p in model.parameters()])),
      flush=True)
dist.barrier()   # a rank that exits while a peer still reads from it makes gloo abort the peer
dist.destroy_process_group()
os._exit(0)   # skip the destructors of gloo's threads at interpreter exit, which abort now and then
"""


def test_a_collectives_out_of_memory_error_on_one_rank_stops_every_rank_without_a_retry():
    code = f"NCCL_OOM = {NCCL_OOM!r}\n" + RANKS
    results = [json.loads(out.strip().splitlines()[-1]) for out in run_ranks(code, 2, timeout=90)]
    failing, other = results[1], results[0]
    assert failing["outcome"] == f"DistBackendError: {NCCL_OOM}", "the failing rank raises its own error, untouched"
    assert failing["sizes"] == [8, 8], "raised in the second micro-batch, never retried"
    assert other["outcome"].startswith("RankFailed: toma: rank 1 failed with an error that is not out of memory")
    assert other["sizes"] == [8, 8, 8], "the other rank finished its attempt and redid nothing"
    for result in results:
        assert result["retries"] == 0
        assert result["seconds"] < 10, "the ranks stop at once, not at the process group's timeout"
        assert all(result["grads"]), "every rank's gradients are restored"


BOTH_FAIL = """
import datetime, json, os
import torch, torch.distributed as dist
from toma import toma
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
rank = dist.get_rank()
OWN = {0: ValueError("rank 0's own bug"), 1: KeyError("rank 1's own bug"), 2: None}

@toma.batch(initial_batchsize=8, distributed=True)
def work(batchsize):
    if OWN[rank] is not None:
        raise OWN[rank]
    if rank == 2 and batchsize > 1:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")
    return batchsize

try:
    work()
    outcome = "finished"
except Exception as error:
    outcome = f"{type(error).__name__}: {error}" + (" (its own)" if error is OWN[rank] else "")
print(json.dumps(dict(outcome=outcome)), flush=True)
dist.barrier()
dist.destroy_process_group()
os._exit(0)
"""


@pytest.mark.slow
def test_ranks_that_fail_at_the_same_attempt_each_raise_their_own_error():
    """Two ranks fail with errors of their own at once, a third runs out of memory: each failing rank raises its
    own error object (rank 0 raised RankFailed blaming rank 1, its own only as the cause); the third stops with
    RankFailed naming a failed rank."""
    results = [json.loads(out.strip().splitlines()[-1])["outcome"] for out in run_ranks(BOTH_FAIL, 3, timeout=90)]
    assert results[0] == "ValueError: rank 0's own bug (its own)"
    assert results[1] == 'KeyError: "rank 1\'s own bug" (its own)'
    assert results[2].startswith("RankFailed: toma: rank 1 failed with an error that is not out of memory")
