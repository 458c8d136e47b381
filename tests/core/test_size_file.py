"""Sizes that survive a restart: real subprocesses sharing an SQLite file, concurrent writers, bad files, the CLI."""

import json
import logging
import multiprocessing
import sqlite3
import time

import pytest
import torch

from toma import GlobalBatchsizeCache, explicit, remember_sizes
from toma.core.size_file import SizeStore

from helpers import raise_fake_oom, run_pythons, run_ranks

RUN = """
import json, logging, os, sys
logging.basicConfig(level=logging.WARNING)
from toma import toma
attempts = []
@toma.batch(initial_batchsize=64)
def work(batchsize):
    attempts.append(batchsize)
    if batchsize > 12:
        raise MemoryError("Tried to allocate 8.00 MiB (injected)")
    return batchsize
sizes = [work() for _ in range(3)]
print(json.dumps(dict(attempts=attempts, sizes=sizes)))
"""


def run(code, path, extra_env=None, log_level=None):
    env = dict(TOMA_SIZES=str(path), **(extra_env or {}))
    if log_level is not None:
        # on the code's first line, which is empty: the call sites' lines, part of their keys, stay
        code = f"import logging; logging.basicConfig(level=logging.{log_level})" + code
    (done,) = run_pythons([code], [env], timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def python_m_toma(*args):
    """`python -m toma ARGS` in a subprocess: runpy runs the package's __main__ as `-m` does."""
    code = f"import runpy, sys\nsys.argv = ['toma', *{list(args)!r}]\nrunpy.run_module('toma', run_name='__main__', alter_sys=True)\n"
    (done,) = run_pythons([code], [{}], timeout=60)
    return done


@pytest.fixture(autouse=True)
def no_store():
    yield
    remember_sizes(None)


@pytest.mark.slow
def test_a_second_run_starts_at_the_size_the_first_found(tmp_path):
    path = tmp_path / "sizes.db"
    first, _ = run(RUN, path)
    second, _ = run(RUN, path)
    assert first["attempts"][:4] == [64, 32, 16, 8], "the first run searches"
    assert second["attempts"] == [8, 8, 8], "the second starts where the first ended: no OOM"
    assert first["sizes"] == second["sizes"] == [8, 8, 8]


@pytest.mark.slow
def test_four_processes_writing_at_once_leave_a_valid_file(tmp_path):
    path = tmp_path / "sizes.db"
    codes = [RUN.replace("> 12", f"> {4 + i}") for i in range(4)]
    done = run_pythons(codes, [dict(TOMA_SIZES=str(path))] * 4, timeout=120)
    assert all(process.returncode == 0 for process in done), [process.stderr for process in done]
    assert not any("cannot use the size file" in process.stderr for process in done)
    rows = SizeStore(str(path)).rows()
    assert len(rows) == 1 and rows[0][2] in (4, 8), rows  # one call site: the last writer's size


def test_a_corrupt_file_or_a_directory_costs_one_warning_and_the_job_runs(tmp_path, caplog):
    corrupt = tmp_path / "corrupt.db"
    corrupt.write_bytes(b"this is not an SQLite database" * 100)
    for path in (corrupt, tmp_path):
        caplog.clear()
        remember_sizes(path)
        attempts = []

        def work(batchsize):
            attempts.append(batchsize)
            if batchsize > 8:
                raise_fake_oom()
            return batchsize

        with caplog.at_level(logging.WARNING, logger="toma"):
            calls = [
                explicit.batch(work, 32, toma_cache_type=GlobalBatchsizeCache, toma_context=str(path)) for _ in range(3)
            ]
            assert calls == [8] * 3
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and str(path) in warnings[0].getMessage(), warnings


def test_remember_sizes_in_process_and_the_cli_lists_and_clears(tmp_path):
    path = tmp_path / "sizes.db"
    remember_sizes(path)

    def work(batchsize):
        if batchsize > 5:
            raise_fake_oom()
        return batchsize

    assert explicit.batch(work, 40, toma_cache_type=GlobalBatchsizeCache) == 5
    listed = python_m_toma("sizes", "--file", str(path))
    assert listed.returncode == 0 and "<locals>.work called from" in listed.stdout and listed.stdout.split()[0] == "5"
    cleared = python_m_toma("sizes", "--file", str(path), "--clear")
    assert cleared.returncode == 0 and "forgot 1" in cleared.stdout
    assert SizeStore(str(path)).rows() == []
    with pytest.raises(TypeError, match="path"):
        remember_sizes(3)
    sqlite3.connect(str(path)).close()


FIT_RUN = """
import json, os, torch
from toma import FitToMemory, toma
from toma.memory.meters import Mark, MemoryMeter
MiB = 2**20
class Device(MemoryMeter):   # a simulated device of CAPACITY bytes: 64 MiB fixed + 1 MiB per row
    def __init__(self, capacity):
        self.capacity, self.peak = capacity, 0
    def begin(self):
        self.peak = 0
        return Mark(0, self.capacity)
    def used(self, mark):
        return self.peak
device = Device(int(os.environ["CAPACITY"]) * MiB)
attempts = []
@toma.batch(initial_batchsize=100000, policy=FitToMemory(meter=device))
def work(batchsize):
    attempts.append(batchsize)
    need = (64 + batchsize) * MiB
    if need > device.capacity:
        device.peak = 64 * MiB
        raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {batchsize} MiB (simulated)")
    device.peak = need
    return batchsize
sizes = [work() for _ in range(4)]
print(json.dumps(dict(attempts=attempts, sizes=sizes)))
"""


@pytest.mark.slow
def test_fit_to_memory_keeps_its_model_across_runs_and_predicts_a_size_for_another_budget(tmp_path):
    """Second run, same budget: the remembered size, no OOM. A run with less memory: a size predicted from
    the remembered model (no new search: at most one OOM), near the largest that fits; with more memory it
    starts larger than the remembered size at once."""
    path = tmp_path / "sizes.db"
    first, _ = run(FIT_RUN, path, dict(CAPACITY="4160"))  # 4096 rows fit
    again, _ = run(FIT_RUN, path, dict(CAPACITY="4160"))
    assert len(first["attempts"]) > 4, "the first run searches"
    assert again["attempts"] == again["sizes"] == [first["sizes"][-1]] * 4, (first, again)
    smaller, log = run(FIT_RUN, path, dict(CAPACITY="2112"), log_level="INFO")  # 2048 rows fit
    assert "instead of" in log and "predicted for 2.1 GiB free" in log, log
    assert len(smaller["attempts"]) <= 5, smaller
    assert 0.9 * 2048 <= smaller["sizes"][-1] <= 2048 and smaller["sizes"][0] >= 0.9 * 2048, smaller
    larger, _ = run(FIT_RUN, path, dict(CAPACITY="8256"))  # 8192 rows fit
    assert larger["attempts"][0] >= 0.9 * 8192 and len(larger["attempts"]) <= 5, larger


def test_the_device_key_is_the_device_of_the_work_not_the_current_one(monkeypatch):
    import torch

    from toma.core.size_file import device_key

    from fake_cuda_memory import FakeCuda, GiB

    fake = FakeCuda(monkeypatch, capacities=(8 * GiB, 4 * GiB), current=0)
    assert device_key(torch.device("cuda", 1)) == f"cuda:Fake GPU 1:{4 * GiB}:world=1"
    assert fake.indices_asked() == {1}
    assert device_key(torch.device("cpu")).startswith("cpu:limit="), "CPU work in a process that uses CUDA"
    assert device_key() == f"cuda:Fake GPU 0:{8 * GiB}:world=1", "not known: the current device, as before"


def test_a_token_budget_is_remembered_under_its_own_key_not_a_row_counts(tmp_path):
    path = tmp_path / "sizes.db"
    remember_sizes(path)
    model = torch.nn.Linear(4, 1)
    mask = (torch.arange(6)[None] < torch.tensor([6, 2, 4, 1])[:, None]).long()
    inputs = torch.randn(4, 6, 4) * mask[..., None]

    def loss(x, attention_mask):
        if x.shape[0] * x.shape[1] > 8:
            raise_fake_oom()
        return model(x).sum()

    explicit.accumulate(loss, model, 4, inputs, toma_lengths="attention_mask", attention_mask=mask)
    (site, _, size, _, _), *others = SizeStore(str(path)).rows()
    assert not others and site.endswith("[token budget]") and "<locals>.loss called from" in site and size <= 8


def _open_and_write_at(path, start, rank, results):
    while time.time() < start:  # every process opens the new file at the same moment, as a job's ranks do
        pass
    store = SizeStore(path)
    store.put(f"key {rank}", "site", "device", rank + 1, None, ())
    results.put(store.broken)


@pytest.mark.slow
def test_processes_that_open_a_new_file_at_the_same_moment_all_use_it(tmp_path):
    """SQLite answers "database is locked" at once to a change of journal mode while another process holds a lock,
    without waiting: the ranks of a job opening the file at their first call lost it, all but one."""
    context = multiprocessing.get_context("fork")
    for trial in range(4):
        path, results = str(tmp_path / f"sizes-{trial}.db"), context.Queue()
        start = time.time() + 0.3
        processes = [context.Process(target=_open_and_write_at, args=(path, start, r, results)) for r in range(3)]
        for process in processes:
            process.start()
        for process in processes:
            process.join(timeout=60)
        assert [results.get(timeout=5) for _ in processes] == [False] * 3
        assert sorted(row[2] for row in SizeStore(path).rows()) == [1, 2, 3]


DDP_RESTART = """
import datetime, json, os, torch, torch.distributed as dist, torch.nn as nn
from toma import toma
torch.set_num_threads(1)
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank = dist.get_rank()
torch.manual_seed(1)
model = nn.parallel.DistributedDataParallel(nn.Linear(4, 3))
sizes = []
@toma.accumulate(model=model, initial_micro_batch=16)
def loss(x):
    if torch.is_grad_enabled():
        sizes.append(len(x))
        if rank == 1 and len(x) > 4:  # rank 1 alone runs out of memory above 4 rows
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")
    return model(x).pow(2).mean()
loss(torch.randn(16, 4))
print(json.dumps(dict(sizes=sizes, retries=loss.stats.oom_retries)))
dist.destroy_process_group()
"""


@pytest.mark.slow
@pytest.mark.multiprocess
def test_ranks_sharing_a_file_restart_at_the_size_they_agreed_on(tmp_path):
    """Rank 0 fit at 16 rows where rank 1 did not: each keeps its own, and a restart's ranks agree on rank 1's 4
    at once (one key for both let rank 0's 16 win: every restart paid rank 1's two out-of-memory errors again)."""
    code = f"import os; os.environ['TOMA_SIZES'] = {str(tmp_path / 'sizes.db')!r}\n" + DDP_RESTART
    first = [json.loads(out.strip().splitlines()[-1]) for out in run_ranks(code, 2, timeout=120)]
    assert [run["retries"] for run in first] == [2, 2]
    second = [json.loads(out.strip().splitlines()[-1]) for out in run_ranks(code, 2, timeout=120)]
    assert second == [dict(sizes=[4, 4, 4, 4], retries=0)] * 2
    devices = sorted(row[1] for row in SizeStore(str(tmp_path / "sizes.db")).rows())
    assert [device.rsplit(":", 2)[1:] for device in devices] == [["world=2", "rank=0"], ["world=2", "rank=1"]]


def test_an_empty_path_is_refused_not_kept_in_a_temporary_database():
    with pytest.raises(ValueError, match="path must name a file"):
        remember_sizes("")
