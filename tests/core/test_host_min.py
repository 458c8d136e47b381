"""`toma.core.host_min`: the ranks' MIN through shared memory, real gloo ranks on this host: the all-reduce's
answers, ranks out of step, a rank that ends or never comes, the fall back where a rank cannot map the file."""

import json
import random

import pytest

from toma.core.agreement import _COUNTS, FINISHED, LIGHTER
from toma.core.host_min import decoded, encoded

from helpers import run_ranks

SETUP = """
import datetime, json, os, random, time
import torch, torch.distributed as dist
from toma.core import host_min
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=TIMEOUT))
rank, world = dist.get_rank(), dist.get_world_size()


def waited(value):  # prints how exchange.min(value) ended (a RuntimeError's message) and after how long
    start = time.monotonic()
    try:
        exchange.min(value)
        outcome = "returned"
    except RuntimeError as error:
        outcome = str(error)
    print(json.dumps(dict(outcome=outcome, seconds=time.monotonic() - start)), flush=True)
"""


def test_codes_keep_the_agreements_order_and_give_back_every_number():
    numbers = [-41, -3, -1, LIGHTER, 1, 7, 4096, 2**40, FINISHED - _COUNTS + 1, FINISHED - 5, FINISHED - 1, FINISHED]
    numbers += random.Random(0).sample(range(-(2**19), 2**41), 200)
    codes = [encoded(n) for n in numbers]
    assert all(0 <= code < 2**43 for code in codes)
    assert [decoded(code) for code in codes] == numbers
    assert sorted(numbers) == [decoded(code) for code in sorted(codes)]
    for outside in (-(2**21), 2**42, FINISHED + 1):
        with pytest.raises(ValueError, match="cannot carry"):
            encoded(outside)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_three_ranks_out_of_step_get_the_all_reduces_minimum_every_time_and_leave_no_file():
    code = (
        SETUP.replace("TIMEOUT", "60")
        + """
def ours():
    return {name for name in os.listdir("/dev/shm") if name.startswith("toma-agreement-")}
before = ours()
exchange = host_min.host_min_for(None)
assert exchange is not None
left = sorted(ours() - before) if rank == 0 else []
values = [random.Random(f"{rank}-{n}").randrange(-7, 2**41) for n in range(300)]
values[50:60] = [host_min.FINISHED - rank] * 10
got = []
for n, value in enumerate(values):
    if (n + rank) % 37 == 0:
        time.sleep(0.01)  # the ranks drift apart: one is an agreement ahead of another
    got.append(exchange.min(value))
expected = []
for value in values:
    tensor = torch.tensor([value])
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
    expected.append(int(tensor))
exchange._sequence = 2**20 - 7  # every rank: the sequence number wraps to 0 within the next agreements
wrapped = [exchange.min(rank * 1000 + n) for n in range(20)]
try:
    exchange.min(1.5)  # a number it cannot carry: raised before any rank could wait for this one
    bad = "returned"
except TypeError:
    bad = "TypeError"
after = exchange.min(7 - rank)
print(json.dumps(dict(same=got == expected, distinct=len(set(got)), left=left, wrapped=wrapped, bad=bad, after=after)))
"""
    )
    for out in run_ranks(code, 3, timeout=120):
        result = json.loads(out.strip().splitlines()[-1])
        assert result["same"] and result["distinct"] > 250
        assert result["left"] == [], "the handshake unlinks the file once every rank mapped it"
        assert result["wrapped"] == list(range(20)) and result["bad"] == "TypeError"
        assert result["after"] == 5, "the ranks still meet after the refused number"


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_rank_that_ends_stops_the_one_waiting_for_it_within_seconds():
    code = (
        SETUP.replace("TIMEOUT", "600")
        + """
exchange = host_min.host_min_for(None)
exchange.min(5)
if rank == 1:
    os._exit(3)
waited(5)
os._exit(0)
"""
    )
    (code0, out0, err0), (code1, _, _) = run_ranks(code, 2, timeout=90, check=False)
    assert (code0, code1) == (0, 3), err0
    result = json.loads(out0.strip().splitlines()[-1])
    assert "rank 1 of the group" in result["outcome"] and "ended" in result["outcome"]
    assert result["seconds"] < 10, "noticed within seconds, not at the group's 600 s timeout"


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_rank_that_never_comes_stops_the_other_at_the_groups_timeout():
    code = (
        SETUP.replace("TIMEOUT", "3")
        + """
exchange = host_min.host_min_for(None)
print(json.dumps(dict(timeout=exchange.timeout)), flush=True)
if rank == 1:
    time.sleep(8)
    os._exit(0)
waited(5)
os._exit(0)
"""
    )
    out0 = run_ranks(code, 2, timeout=90)[0].strip().splitlines()
    assert json.loads(out0[0])["timeout"] == 3.0, "the group's own timeout"
    result = json.loads(out0[-1])
    assert "did not reach the agreement within the group's timeout (3 s)" in result["outcome"]
    assert 3 <= result["seconds"] < 6


@pytest.mark.slow
@pytest.mark.multiprocess
def test_where_one_rank_cannot_map_the_file_every_rank_keeps_the_all_reduce():
    code = (
        SETUP.replace("TIMEOUT", "60")
        + """
if rank == 1:
    host_min._mapped = lambda path, size, token: None  # as on another host
print(json.dumps(dict(exchange=host_min.host_min_for(None) is not None, again=host_min.host_min_for(None) is None)))
"""
    )
    for out in run_ranks(code, 2, timeout=90):
        assert json.loads(out.strip().splitlines()[-1]) == dict(exchange=False, again=True)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_ranks_whose_process_ids_mean_nothing_here_still_agree_but_are_not_watched():
    code = (
        SETUP.replace("TIMEOUT", "60")
        + """
if rank == 1:
    host_min._pid_namespace = lambda: 1  # as in another container sharing /dev/shm
exchange = host_min.host_min_for(None)
print(json.dumps(dict(watched=[pid is not None for pid in exchange.pids], min=exchange.min(10 + rank))))
"""
    )
    outs = [json.loads(out.strip().splitlines()[-1]) for out in run_ranks(code, 2, timeout=90)]
    assert outs == [dict(watched=[True, False], min=10), dict(watched=[False, True], min=10)]
