"""toma.transfer: moves of nested batches, device checks, and on CUDA pinned staging and overlapping streams."""

import collections

import pytest
import torch
from helpers import requires_cuda

from toma.transfer import Transfers, check_device


def test_a_nested_batch_moves_with_its_types_and_values():
    Pair = collections.namedtuple("Pair", "x y")
    batch = {"a": torch.arange(6).reshape(3, 2), "b": [Pair(torch.ones(3), torch.zeros(3, 1)), 7], "c": "text"}
    moved = Transfers("cpu").move(batch)
    assert isinstance(moved["b"][0], Pair) and moved["b"][1] == 7 and moved["c"] == "text"
    assert torch.equal(moved["a"], batch["a"]) and torch.equal(moved["b"][0].y, batch["b"][0].y)


def test_a_tensor_already_on_the_device_is_not_copied():
    tensor = torch.randn(4, 3)
    assert Transfers("cpu").move((tensor,))[0] is tensor
    assert Transfers("cpu").to_host((tensor,)).take()[0] is tensor
    assert Transfers("cpu").pinned_bytes == 0  # nothing is pinned without an accelerator in use


@pytest.mark.parametrize("device", ["nope", "cuda:x", 3.5])
def test_a_device_that_cannot_be_parsed_is_named(device):
    with pytest.raises(ValueError, match="device"):
        check_device(device, "device")


def test_a_cuda_device_that_does_not_exist_is_named():
    with pytest.raises(ValueError, match="my_device"):
        check_device(f"cuda:{torch.cuda.device_count() + 3}", "my_device")


def test_no_device_means_cuda_where_there_is_one():
    assert check_device(None, "device").type == ("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.cuda
@requires_cuda
def test_host_tensors_go_through_pinned_staging_and_arrive_exact():
    transfers = Transfers("cuda")
    pageable, pinned = torch.randn(1000, 33), torch.randn(500, 7).pin_memory()
    moved = transfers.move({"a": pageable, "b": (pinned, torch.arange(5, dtype=torch.int16))})
    assert transfers.pinned_bytes > 0 and transfers.staged_bytes >= pageable.numel() * 4
    assert moved["a"].is_cuda and torch.equal(moved["a"].cpu(), pageable)
    assert torch.equal(moved["b"][0].cpu(), pinned) and moved["b"][1].dtype == torch.int16
    back = transfers.to_host(moved).take()
    assert not back["a"].is_cuda and torch.equal(back["a"], pageable)


@pytest.mark.cuda
@requires_cuda
def test_the_copy_runs_while_the_compute_stream_is_busy():
    transfers = Transfers("cuda")
    host = torch.randn(64, 1 << 20)  # 256 MiB
    square = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    begin, computed = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    copy_begin, copied = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(80):  # queued on the compute stream: the GPU is busy long after this loop returns
        square = torch.tanh(square @ square)
    computed.record()
    copy_begin.record(transfers.stream)
    pending = transfers.prefetch(host)
    copied.record(transfers.stream)
    moved = pending.take()
    torch.cuda.synchronize()
    assert transfers.stream != torch.cuda.current_stream()
    # The copy began (and here also ended) before the computation queued ahead of it finished.
    assert begin.elapsed_time(copy_begin) < begin.elapsed_time(computed)
    assert torch.equal(moved.cpu(), host)


@pytest.mark.cuda
@requires_cuda
def test_no_use_after_free_across_streams_when_buffers_are_reused():
    transfers = Transfers("cuda")
    chunks = [torch.full((256, 1024), float(i)) for i in range(40)]
    pending = transfers.prefetch(chunks[0])
    sums = []
    for i in range(len(chunks)):
        current = pending.take()
        if i + 1 < len(chunks):
            pending = transfers.prefetch(chunks[i + 1])
        for _ in range(5):
            current = current * 1.0 + 0.0  # work on the compute stream while the next copy runs
        sums.append(transfers.to_host(current.sum(1)).take())
        del current  # freed on the compute stream while the side stream still copies the next chunk
    for i, value in enumerate(sums):
        assert torch.equal(value, torch.full((256,), 1024.0 * i))
