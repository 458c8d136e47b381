"""toma.memory: snapshots of RAM and (where CUDA is in use) GPU memory, and a history of them."""

import json

import pytest
import torch
from helpers import requires_cuda, run_python

from toma import memory


def test_a_snapshot_has_ram_always():
    taken = memory.snapshot(label="now")
    assert taken.rss > 2**20 and taken.available_ram > 0 and taken.label == "now"
    if not torch.cuda.is_initialized():
        assert taken.cuda_allocated is None and taken.cuda_total is None


def test_a_snapshot_never_initialises_cuda():
    out = run_python(
        """
        import torch
        from toma import memory
        memory.snapshot(); memory.snapshot("cuda"); memory.History().record()
        print(torch.cuda.is_initialized())
        """
    )
    assert out.stdout.strip() == "False"


def test_history_records_around_a_block_keeps_the_last_and_finds_the_peak(tmp_path):
    history = memory.History(max_length=3)
    with history.around("step"):
        block = torch.ones(2**22)  # 16 MiB, touched
    assert [s.label for s in history.snapshots] == ["step start", "step end"]
    history.record("a")
    history.record("b")
    assert [s.label for s in history.snapshots] == ["step end", "a", "b"] and len(history) == 3
    assert history.peak("rss") == max(s.rss for s in history.snapshots)
    assert history.peak("cuda_allocated") is None or torch.cuda.is_initialized()
    history.save(tmp_path / "memory.json")
    history.save(str(tmp_path / "memory.csv"))
    saved = json.loads((tmp_path / "memory.json").read_text())
    assert [row["label"] for row in saved] == ["step end", "a", "b"] and saved[0]["rss"] == history.snapshots[0].rss
    assert (tmp_path / "memory.csv").read_text().splitlines()[0].startswith("time,rss,available_ram,cuda_allocated")
    history.clear()
    assert len(history) == 0
    del block


@pytest.mark.cuda
@requires_cuda
def test_a_cuda_snapshot_sees_an_allocation():
    before = memory.snapshot("cuda")
    block = torch.empty(2**28, dtype=torch.uint8, device="cuda")
    after = memory.snapshot("cuda")
    assert after.cuda_allocated - before.cuda_allocated >= 2**28
    assert after.cuda_peak >= after.cuda_allocated and 0 < after.cuda_free < after.cuda_total
    del block
