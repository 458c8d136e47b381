"""Shared test helpers: fake OOMs, a fixed free-memory gauge, subprocesses, the CUDA marker."""

import os
import socket
import subprocess
import sys
import textwrap
import time

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CUDA_OOM_MESSAGE = "CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 15.78 GiB total capacity)"


def raise_fake_oom(message: str = CUDA_OOM_MESSAGE) -> None:
    """What PyTorch's CUDA caching allocator raises, without needing a GPU."""
    raise torch.OutOfMemoryError(message)


class FixedGauge:
    """A free-memory gauge that reads whatever the test sets, so cache keys are deterministic."""

    def __init__(self, cpu: int = 8 * 2**30, gpu=None) -> None:
        self.cpu, self.gpu = cpu, gpu
        self.reads = 0

    def read(self):
        self.reads += 1
        return self.cpu, self.gpu

    def invalidate(self) -> None:
        pass


# Subprocess code: collects toma's log lines into `messages`.
COLLECT_TOMA_LOG = """
import logging
messages = []
class Collect(logging.Handler):
    def emit(self, record):
        messages.append(record.getMessage())
logging.getLogger("toma").addHandler(Collect())
logging.getLogger("toma").setLevel(logging.INFO)
"""


# Subprocess code for work under a real CPU memory cap: a wide MLP (`make_model()`) and a logical batch of N rows
# whose every activation (N x WIDTH floats, 512 MiB) is far beyond a cap of a few hundred MiB of headroom, even
# when the address space the process settles at moves a little. Log lines land in `messages`.
WIDE_MLP_UNDER_A_CAP = (
    COLLECT_TOMA_LOG
    + """
import json, torch, torch.nn as nn, torch.nn.functional as F
torch.set_num_threads(1)
from toma.memory.cpu import predictable_heap, set_cpu_memory_headroom
predictable_heap()
N, WIDTH = 16384, 8192
def make_model():
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(32, WIDTH), nn.ReLU(), nn.Linear(WIDTH, 10))
torch.manual_seed(0)
inputs, targets = torch.randn(N, 32), torch.randint(0, 10, (N,))
"""
)


def run_python(code: str, timeout: float = 180) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter with the repository importable; fail the test on a non-zero exit."""
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=REPO,
    )
    assert result.returncode == 0, f"subprocess failed ({result.returncode}):\n{result.stdout}\n{result.stderr}"
    return result


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_ranks(code: str, world_size: int, timeout: float = 120, check: bool = True) -> list:
    """Run `code` as `world_size` processes of one torch.distributed job (env:// rendezvous on localhost,
    RANK and WORLD_SIZE set); returns their stdouts (with check=False: (returncode, stdout, stderr) per
    rank). A hang fails the test after `timeout` seconds."""
    env = dict(
        os.environ,
        PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        WORLD_SIZE=str(world_size),
        OMP_NUM_THREADS="1",
    )
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(code)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank)),
            cwd=REPO,
        )
        for rank in range(world_size)
    ]
    outputs = []
    deadline = time.monotonic() + timeout
    try:
        for rank, process in enumerate(processes):
            stdout, stderr = process.communicate(timeout=max(0.1, deadline - time.monotonic()))
            if not check:
                outputs.append((process.returncode, stdout, stderr))
                continue
            assert process.returncode == 0, f"rank {rank} failed ({process.returncode}):\n{stdout}\n{stderr}"
            outputs.append(stdout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the {world_size} ranks did not finish within {timeout} s: a hang")
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.communicate()
    return outputs


requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
