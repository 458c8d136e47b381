"""TomaTrainer's step against the plain Hugging Face Trainer's, nothing running out of memory (see
hf_trainer_overhead.py, which interleaves the two for the ratio).

Run: python -m pytest benchmarks/test_hf_trainer_overhead.py --benchmark-only --benchmark-group-by=group
"""

import os
import sys

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import hf_trainer_overhead as overhead  # noqa: E402
from transformers import Trainer  # noqa: E402

from toma.integrations.transformers import TomaTrainer  # noqa: E402

NAMES = list(overhead.WORKLOADS)


@pytest.fixture(scope="module", params=NAMES, ids=["gpt2", "tiny"])
def workload(request, tmp_path_factory):
    torch.set_num_threads(1)
    shape = overhead.WORKLOADS[request.param]
    output_dir = str(tmp_path_factory.mktemp("hf"))
    trainers = {cls: overhead.make_trainer(cls, output_dir=output_dir, **shape) for cls in (Trainer, TomaTrainer)}
    return request.param, {
        cls: (t, *overhead.prepared(t, overhead.batch(shape["length"]))) for cls, t in trainers.items()
    }


def test_native_trainer_step(benchmark, workload):
    name, setups = workload
    benchmark.group = f"Hugging Face Trainer step: {name}"
    benchmark(overhead.step, *setups[Trainer])


def test_toma_trainer_step(benchmark, workload):
    name, setups = workload
    benchmark.group = f"Hugging Face Trainer step: {name}"
    trainer = setups[TomaTrainer][0]
    benchmark(overhead.step, *setups[TomaTrainer])
    assert trainer.toma_stats.micro_batch == 16, "the batch passes whole: no out-of-memory error in this benchmark"
