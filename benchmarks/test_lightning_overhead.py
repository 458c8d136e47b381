"""MicroBatching against plain Lightning: a fit of the same MLP, each batch whole (no out-of-memory error).

Run: python -m pytest benchmarks/test_lightning_overhead.py --benchmark-only
Each round is one fit of STEPS steps, Lightning's start-up included; `python benchmarks/lightning_overhead.py`
times the steps themselves, alternating the two, for the ratio per step. Under `--benchmark-disable` (CI) each
fit runs once, and the parameters of the two fits must agree.
"""

import os
import sys

import pytest
import torch

pytest.importorskip("lightning.pytorch")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import lightning_overhead  # noqa: E402

STEPS = 20
GROUP = f"Lightning fit of {STEPS} steps, MLP, logical batch {lightning_overhead.LOGICAL}"
trained = {}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.benchmark(group=GROUP)
def test_native_lightning_fit(benchmark):
    trained["plain"] = benchmark(lightning_overhead.fit, False, STEPS)[1]


@pytest.mark.benchmark(group=GROUP)
def test_micro_batching_fit(benchmark):
    trained["micro"] = benchmark(lightning_overhead.fit, True, STEPS)[1]
    if "plain" in trained:  # the same training: no out-of-memory error, every batch whole
        for got, expected in zip(trained["micro"].parameters(), trained["plain"].parameters(), strict=True):
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-7)
