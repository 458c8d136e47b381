"""toma.accumulate under DDP on 2 gloo ranks against the hand-written DDP accumulation loop, per logical batch.

Run: python -m pytest benchmarks/test_distributed_step.py --benchmark-only
Rank 0 is this process, rank 1 a worker it starts; every round is announced by a broadcast that both loops
pay alike. Three loops, same work (8 micro-batches of 128 rows, one optimizer step):
- native: no_sync on all micro-batches but the last, whose backward pass all-reduces as it goes (overlap);
- native without overlap: no_sync on all, one bucketed all-reduce at the end;
- toma: the ranks agree (two one-number all-reduces), then one bucketed all-reduce at the end.
native -> without overlap is the lost overlap; without overlap -> toma is the agreement and bookkeeping.
"""

import datetime
import os
import socket
import subprocess
import sys

import pytest
import torch.distributed as dist

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

import ddp_steps  # noqa: E402

GROUP = f"DDP, 2 gloo ranks: logical batch {ddp_steps.LOGICAL} in micro-batches of {ddp_steps.MICRO}"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def steps():
    env = dict(
        os.environ,
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        RANK="1",
        WORLD_SIZE="2",
        PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
    )
    worker = subprocess.Popen([sys.executable, os.path.join(REPO, "benchmarks", "ddp_steps.py")], env=env)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{env['MASTER_PORT']}",
            rank=0,
            world_size=2,
            timeout=datetime.timedelta(seconds=60),
        )
        yield ddp_steps.Steps()
        dist.broadcast(ddp_steps.torch.tensor([ddp_steps.STOP]), 0)
        dist.barrier()
        dist.destroy_process_group()
        assert worker.wait(timeout=60) == 0
    finally:
        if worker.poll() is None:
            worker.kill()


@pytest.mark.multiprocess
@pytest.mark.benchmark(group=GROUP)
def test_native_ddp_accumulation_loop(benchmark, steps):
    benchmark(steps.run, ddp_steps.NATIVE)


@pytest.mark.multiprocess
@pytest.mark.benchmark(group=GROUP)
def test_ddp_loop_without_overlap(benchmark, steps):
    benchmark(steps.run, ddp_steps.NO_OVERLAP)


@pytest.mark.multiprocess
@pytest.mark.benchmark(group=GROUP)
def test_toma_accumulate_ddp(benchmark, steps):
    benchmark(steps.run, ddp_steps.TOMA)
