"""toma.memory: snapshots of RAM and (where CUDA is in use) GPU memory, and a history of them."""

import json

import pytest
import torch

from toma import memory

from helpers import requires_cuda, run_python


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
        memory.snapshot(); memory.snapshot("cuda"); memory.MemoryHistory().record()
        print(torch.cuda.is_initialized())
        """
    )
    assert out.stdout.strip() == "False"


def test_history_records_around_a_block_keeps_the_last_and_finds_the_peak(tmp_path):
    history = memory.MemoryHistory(max_length=3)
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


def test_a_snapshot_never_initialises_cuda_where_it_is_available(monkeypatch):
    """Where a GPU exists but this process has not used it, no CUDA call is made (each would create a
    context); once CUDA is in use the very calls patched here are the ones read."""
    calls = []

    def record(name, value):
        return lambda *args, **kwargs: calls.append(name) or value

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    for name in ("init", "_lazy_init", "device_count", "get_device_properties"):
        monkeypatch.setattr(torch.cuda, name, record(name, None))
    readings = dict(
        current_device=0, mem_get_info=(5, 8), memory_allocated=1, memory_reserved=2, max_memory_allocated=3
    )
    for name, value in readings.items():
        monkeypatch.setattr(torch.cuda, name, record(name, value))
    taken = [memory.snapshot(), memory.snapshot("cuda"), memory.snapshot(0), memory.MemoryHistory("cuda:0").record()]
    assert calls == [] and all(s.cuda_allocated is None and s.cuda_total is None for s in taken)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    in_use = memory.snapshot("cuda:0").as_dict()
    fields = ("cuda_allocated", "cuda_reserved", "cuda_peak", "cuda_free", "cuda_total")
    assert [in_use[field] for field in fields] == [1, 2, 3, 5, 8]
    assert "init" not in calls and "_lazy_init" not in calls


@pytest.mark.cuda
@requires_cuda
def test_a_cuda_snapshot_sees_an_allocation():
    torch.cuda.init()  # a snapshot never initialises CUDA itself: before this it would hold no CUDA numbers
    before = memory.snapshot("cuda")
    assert before.cuda_allocated is not None
    block = torch.empty(2**28, dtype=torch.uint8, device="cuda")
    after = memory.snapshot("cuda")
    assert after.cuda_allocated - before.cuda_allocated >= 2**28
    assert after.cuda_peak >= after.cuda_allocated and 0 < after.cuda_free < after.cuda_total
    del block
