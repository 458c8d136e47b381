"""Shared test helpers: fake OOMs, a fixed free-memory gauge, subprocesses, the CUDA marker."""

import atexit
import os
import socket
import subprocess
import sys
import textwrap
import time
from typing import Dict, List, Optional

import pytest
import torch

from fork_server import ForkServer

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


def run_python(
    code: str, timeout: float = 180, env: Optional[Dict[str, str]] = None, fresh: bool = False
) -> subprocess.CompletedProcess:
    """Run `code` as `python -c` would, with the repository importable and `env` added to the environment;
    fail the test on a non-zero exit. The process is a fork of a server that imported torch once
    (tests/fork_server.py); `fresh=True` starts a new interpreter instead, for code whose point is what an
    environment variable does when torch starts."""
    code = textwrap.dedent(code)
    if fresh:
        result = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=dict(_env(), **(env or {})),
            cwd=REPO,
        )
    else:
        (result,) = run_pythons([code], [env or {}], timeout)
    assert result.returncode == 0, f"subprocess failed ({result.returncode}):\n{result.stdout}\n{result.stderr}"
    return result


def _env() -> Dict[str, str]:
    return dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))


_server: Optional[ForkServer] = None
_ENV = dict(os.environ)  # as the session started: a test's monkeypatched variables do not reach the server


def run_pythons(
    codes: List[str], envs: List[Dict[str, str]], timeout: float = 180
) -> List[subprocess.CompletedProcess]:
    """Run the codes at once, each as `python -c` would in a fork of the session's server, with the repository
    first on PYTHONPATH and its `envs` entry added to the environment. A hang past `timeout` seconds kills them
    and fails the test; a failure is the caller's to judge."""
    global _server
    if _server is None:
        # one malloc arena from the server's start, for every child: `predictable_heap` asks for it, but a child
        # that inherits arenas made before it asked keeps them, and a thread's new one reserves 64 MiB of a cap
        env = dict(_ENV, PYTHONPATH=REPO + os.pathsep + _ENV.get("PYTHONPATH", ""), MALLOC_ARENA_MAX="1")
        _server = ForkServer(env, REPO)
        atexit.register(_server.close)
    children = [_server.start(textwrap.dedent(code), dict(_env(), **env), REPO) for code, env in zip(codes, envs)]
    finished = _server.wait([child.pid for child in children], time.monotonic() + timeout)
    if not finished:
        for child in children:
            if child.returncode is None:
                _server.kill(child.pid)
    results = [subprocess.CompletedProcess(["fork"], child.returncode, *child.output()) for child in children]
    if not finished:
        outputs = "".join(f"\n{result.stdout}\n{result.stderr}" for result in results)
        pytest.fail(f"{len(children)} subprocess(es) did not finish within {timeout} s: a hang{outputs}")
    return results


def run_script(
    path: str, *args: str, env: Optional[Dict[str, str]] = None, timeout: float = 180
) -> subprocess.CompletedProcess:
    """`python PATH ARGS` in the fork server (runpy runs the script as the interpreter does: as `__main__`, its
    folder first on sys.path); a failure is the caller's to judge."""
    code = (
        f"import runpy, sys\nsys.argv = {[path, *args]!r}\nsys.path[0] = {os.path.dirname(path)!r}\n"
        f"runpy.run_path({path!r}, run_name='__main__')\n"
    )
    (result,) = run_pythons([code], [env or {}], timeout)
    return result


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def torchrun(*script: str, timeout: float = 300) -> str:
    """The stdout of a script of this repository run by torchrun on 2 CPU ranks (fails the test if it fails)."""
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *script],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        env=dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1"),
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def run_ranks(code: str, world_size: int, timeout: float = 120, check: bool = True) -> list:
    """Run `code` as `world_size` processes of one torch.distributed job (env:// rendezvous on localhost,
    RANK and WORLD_SIZE set); returns their stdouts (with check=False: (returncode, stdout, stderr) per
    rank). A hang fails the test after `timeout` seconds."""
    env = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1")
    envs = [dict(env, RANK=str(rank), LOCAL_RANK=str(rank)) for rank in range(world_size)]
    results = run_pythons([code] * world_size, envs, timeout)
    if not check:
        return [(result.returncode, result.stdout, result.stderr) for result in results]
    for rank, result in enumerate(results):
        assert result.returncode == 0, f"rank {rank} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}"
    return [result.stdout for result in results]


requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


# A 12-block residual MLP whose activations for 4096 tokens (16 MiB per 4096 x 1024 tensor) need about 0.6 GiB
# in a plain step and about 0.12 GiB with activation checkpointing: the memory levers' real-cap tests.
CHECKPOINT_TOWER = """
import torch, torch.nn as nn
torch.set_num_threads(1)
from toma.memory.cpu import predictable_heap, set_cpu_memory_headroom
predictable_heap()

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(256, 1024), nn.Linear(1024, 256)
    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(x)))

torch.manual_seed(0)
model = nn.Sequential(*[Block() for _ in range(12)])
"""
