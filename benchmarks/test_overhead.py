"""toma's overhead, side by side with the plain code it wraps (toma 1.1.0's benchmark set).

Run: python -m pytest benchmarks --benchmark-only --benchmark-group-by=group
Compare each row with the baseline of its group (`native_*`): the ratio is what toma costs. The real chunked
work is memory-bound and varies by several percent from run to run on a shared machine; the empty-body
group isolates toma's own cost per call, free of that noise.
"""

import pytest
import torch

from toma import FitToMemory, NoBatchsizeCache, explicit, simple, toma

SHAPE = (128, 256, 256)
STEP = 32


def body(chunk, start, end):
    chunk.add_(1.0)


@pytest.fixture(scope="module")
def data():
    torch.set_num_threads(1)
    return torch.zeros(SHAPE)


def native_loop(fn, tensor):
    """The hand-written loop toma.chunked replaces."""
    for start in range(0, tensor.shape[0], STEP):
        end = min(start + STEP, tensor.shape[0])
        fn(tensor.narrow(0, start, end - start), start, end)


toma_chunked = toma.chunked(initial_step=STEP)(body)
toma_chunked_no_cache = toma.chunked(initial_step=STEP, cache_type=NoBatchsizeCache)(body)


@pytest.mark.benchmark(group="chunked (128, 256, 256) in steps of 32")
def test_native_loop(benchmark, data):
    benchmark(native_loop, body, data)


@pytest.mark.benchmark(group="chunked (128, 256, 256) in steps of 32")
def test_simple_chunked(benchmark, data):
    benchmark(simple.chunked, body, data, STEP)


@pytest.mark.benchmark(group="chunked (128, 256, 256) in steps of 32")
def test_explicit_chunked(benchmark, data):
    benchmark(explicit.chunked, body, data, STEP)


@pytest.mark.benchmark(group="chunked (128, 256, 256) in steps of 32")
def test_toma_chunked(benchmark, data):
    benchmark(toma_chunked, data)


@pytest.mark.benchmark(group="chunked (128, 256, 256) in steps of 32")
def test_toma_chunked_no_cache(benchmark, data):
    benchmark(toma_chunked_no_cache, data)


def empty_body(chunk, start, end):
    pass


toma_chunked_empty = toma.chunked(initial_step=STEP)(empty_body)


@pytest.mark.benchmark(group="chunked with an empty body: toma's own cost")
def test_native_loop_empty_body(benchmark, data):
    benchmark(native_loop, empty_body, data)


@pytest.mark.benchmark(group="chunked with an empty body: toma's own cost")
def test_toma_chunked_empty_body(benchmark, data):
    benchmark(toma_chunked_empty, data)


def noop(batchsize):
    return batchsize


toma_noop = toma.batch(initial_batchsize=64)(noop)
toma_noop_no_cache = toma.batch(initial_batchsize=64, cache_type=NoBatchsizeCache)(noop)
toma_noop_fit = toma.batch(initial_batchsize=64, policy=FitToMemory())(noop)


@pytest.mark.benchmark(group="no-op call")
def test_native_noop_call(benchmark):
    benchmark(noop, 64)


@pytest.mark.benchmark(group="no-op call")
def test_toma_batch_noop_call(benchmark):
    assert benchmark(toma_noop) == 64


@pytest.mark.benchmark(group="no-op call")
def test_toma_batch_noop_call_no_cache(benchmark):
    assert benchmark(toma_noop_no_cache) == 64


@pytest.mark.benchmark(group="no-op call")
def test_toma_batch_noop_call_fit_to_memory(benchmark):
    """Settled (the size stopped changing): measured every 64th call, or when free memory moves."""
    assert benchmark(toma_noop_fit) == 64
