"""The cost of one more micro-batch, in padded positions: fitted to timed micro-batches, then never timed again."""

import pytest
import torch
from torch import nn

from toma import toma
from toma.batching.micro_batch_cost import GIVE_UP, NEVER, SAMPLES, WARMUP, MicroBatchCost, _fitted
from toma.batching.splitting import ArgumentBatch
from toma.batching.tokens import TokenBatch
from toma.memory.backends import CUDA


def feed(cost, timings):
    cost.add(list(timings))


def line(overhead_s, per_position_s, areas):
    return [(area, overhead_s + per_position_s * area) for area in areas]


def test_the_overhead_is_the_fitted_lines_intercept_over_its_slope():
    samples = line(0.005, 2e-6, [4096, 1024, 4000, 900, 4096, 700, 3900, 1100])
    assert _fitted(samples) == 2500
    assert _fitted(line(0.0, 1e-6, [100, 400, 800])) == 0
    assert _fitted(line(0.01, 0.0, [100, 400, 800])) == NEVER, "time that does not grow with the area"
    assert _fitted(line(0.01, 1e-6, [1000, 1100, 1200])) is None, "areas too alike to fit a line"


def test_after_the_warm_up_and_the_samples_the_cost_is_fixed_and_nothing_more_is_timed():
    cost = MicroBatchCost()
    assert cost.timing and cost.overhead(4096) == 1024, "until measured: a quarter of the budget"
    warm_up = [(4096, 9.0)] * WARMUP  # slow first micro-batches (kernels chosen, allocator grown) are left out
    feed(cost, warm_up + line(0.004, 1e-6, [4096, 1024] * (SAMPLES // 2 - 1)))
    assert cost.timing
    feed(cost, line(0.004, 1e-6, [4096, 1024]))
    assert not cost.timing and cost.overhead(4096) == 4000 and cost.overhead(10**6) == 4000
    feed(cost, line(1.0, 0.0, [5, 10] * SAMPLES))
    assert cost.overhead(4096) == 4000, "measured once"


def test_areas_that_never_differ_leave_the_default_after_a_while():
    cost = MicroBatchCost()
    feed(cost, line(0.004, 1e-6, [4096] * (WARMUP + GIVE_UP - 1)))
    assert cost.timing
    feed(cost, line(0.004, 1e-6, [4096]))
    assert not cost.timing and cost.overhead(800) == 200


def test_a_given_overhead_is_never_timed_and_is_checked():
    assert not MicroBatchCost(0).timing and MicroBatchCost(0).overhead(100) == 0
    assert MicroBatchCost(0).timer(None) is None
    for bad in (-1, 2.5, True, "7"):
        with pytest.raises(ValueError, match="overhead"):
            MicroBatchCost(bad)


class Clock:
    """Marks that read a clock the test sets: what each micro-batch took, as the device's events would say."""

    def __init__(self):
        self.now, self.marked = 0.0, []

    def timestamp(self, device):
        self.marked.append(device)
        return self.now

    def seconds_between(self, start, end):
        return end - start


def test_a_run_on_cuda_is_timed_by_marks_on_the_device_and_once_measured_never_again(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(type(CUDA), "timestamp", clock.timestamp)
    monkeypatch.setattr(type(CUDA), "seconds_between", clock.seconds_between)
    cost, device = MicroBatchCost(), torch.device("cuda", 0)
    runs = 0
    while cost.timing:
        timer = cost.timer(device)
        for area in (4096, 1024, 4096):
            timer.begin(area)
            clock.now += 0.004 + 1e-6 * area
        timer.end()
        runs += 1
    assert cost.overhead(4096) == 4000 and runs == 4, "3 micro-batches a run: 2 to warm up, then 8 samples"
    assert clock.marked == [device] * 4 * runs and cost.timer(device) is None


def test_a_failed_micro_batch_is_no_sample_and_the_ones_before_it_are():
    cost = MicroBatchCost()
    timer = cost.timer(None)
    for _ in range(WARMUP + 2):
        timer.begin(100)
    timer.drop()
    assert cost._seen == WARMUP + 1 and len(cost._samples) == 1


def test_while_timing_micro_batches_from_odd_rows_get_a_quarter_of_the_budget():
    lengths = torch.tensor([8] * 16)
    mask = (torch.arange(8)[None] < lengths[:, None]).long()
    batch = ArgumentBatch((), dict(input_ids=mask * 3, attention_mask=mask))
    timing = TokenBatch(batch, "attention_mask", MicroBatchCost())
    assert [(s, e) for _, s, e, _ in timing.micro_batches(64)] == [(0, 8), (8, 16)], "even starts: the budget"
    assert [(s, e) for _, s, e, _ in timing.micro_batches(40)] == [(0, 5), (5, 6), (6, 11), (11, 12), (12, 16)]
    measured = TokenBatch(batch, "attention_mask", MicroBatchCost(0))
    assert [(s, e) for _, s, e, _ in measured.micro_batches(40)] == [(0, 5), (5, 10), (10, 15), (15, 16)]


def test_an_accumulating_function_measures_its_cost_on_its_first_micro_batches_and_keeps_it():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(20, 16), nn.Linear(16, 20))

    @toma.accumulate(model=model, lengths="attention_mask", initial_tokens=64)
    def loss(input_ids, attention_mask):
        return nn.functional.cross_entropy(model(input_ids).flatten(0, 1), input_ids.flatten(), reduction="mean")

    lengths = torch.tensor([16, 14, 9, 8, 5, 4, 3, 2] * 2)
    mask = (torch.arange(16)[None] < lengths[:, None]).long()
    calls = 0
    while loss.stats.packing.timing:
        loss(input_ids=mask * 5, attention_mask=mask)
        calls += 1
        assert calls < 40, "still timing"
    assert loss.stats.packing.fixed is not None and loss.stats.packing.fixed >= 0


def test_a_cost_pickles_and_copies_with_what_it_measured():
    import copy
    import pickle

    cost = MicroBatchCost()
    feed(cost, line(0.004, 1e-6, [4096, 1024] * ((WARMUP + SAMPLES) // 2)))
    for twin in (pickle.loads(pickle.dumps(cost)), copy.deepcopy(cost)):
        assert twin.fixed == 4000 and not twin.timing and twin._lock is not cost._lock
    timing = pickle.loads(pickle.dumps(MicroBatchCost()))
    feed(timing, line(0.004, 1e-6, [4096, 1024] * ((WARMUP + SAMPLES) // 2)))
    assert timing.fixed == 4000
