"""toma.batching.transfer: moves of nested batches, device checks, and on CUDA pinned staging and overlapping streams."""

import collections
import json
import logging
import weakref

import pytest
import torch

from toma.batching import staging
from toma.batching.staging import aligned
from toma.batching.transfer import Transfers, check_device

import fake_cuda
from helpers import requires_cuda, run_python


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


# --- CUDA paths on the CPU (tests/fake_cuda.py: streams, events, record_stream and pinning recorded) --------


@pytest.fixture
def fake(monkeypatch):
    return fake_cuda.install(monkeypatch)


def test_with_fake_cuda_host_tensors_are_staged_on_the_side_stream_and_arrive_exact(fake):
    transfers = Transfers("cpu")
    assert transfers.cuda and transfers.stream is fake.sides[0]
    batch = {"a": torch.randn(10, 3), "b": (torch.arange(5, dtype=torch.int16), 7)}
    moved = transfers.move(batch)
    assert torch.equal(moved["a"], batch["a"]) and torch.equal(moved["b"][0], batch["b"][0]) and moved["b"][1] == 7
    assert moved["a"].data_ptr() != batch["a"].data_ptr()  # a copy, through the staging buffer
    assert transfers.staged_bytes > 0 and fake.pinned
    assert fake.recorded and all(stream is fake.default for _, stream in fake.recorded)
    assert fake.default.waited  # the stream that uses the result waited for the copy


def test_only_the_tensors_asked_for_move_the_rest_pass_as_given(fake):
    transfers = Transfers("cpu")
    rows, shared = torch.randn(8, 4), torch.randn(3)
    pending = transfers.prefetch((rows, shared), stage=[rows])
    moved_rows, passed = pending.take()
    assert passed is shared and torch.equal(moved_rows, rows) and moved_rows is not rows
    assert transfers.staged_bytes == aligned(rows.numel() * 4)


def test_sparse_zero_dim_and_grad_requiring_tensors_move_intact(fake):
    transfers = Transfers("cpu")
    sparse = torch.randn(4, 3).relu().to_sparse()
    leaf = torch.randn(5, 3, requires_grad=True)
    scalar, dense = torch.tensor(2.5), torch.randn(5, 3)
    moved = transfers.move((sparse, leaf, scalar, dense))  # on main: "copy_() between dense and sparse"
    assert moved[0].is_sparse and torch.equal(moved[0].to_dense(), sparse.to_dense())
    assert torch.equal(moved[2], scalar) and torch.equal(moved[3], dense)
    (moved[1] * moved[3]).sum().backward()  # the moved input keeps its link: the gradient reaches the leaf
    assert leaf.grad is not None and torch.equal(leaf.grad, dense)


def test_to_host_records_no_stream_and_keeps_the_outputs_until_taken(fake):
    transfers = Transfers("cpu")
    rows = transfers.move(torch.randn(6, 4))  # allocated "on the side stream", like prefetched rows
    fake.recorded.clear()
    out = rows * 2
    pending = transfers.to_host((rows, out))  # an identity function's output: a view of the side block
    assert fake.recorded == []  # never record_stream: cudaMallocAsync warns onto the allocating stream
    back = pending.take()
    assert torch.equal(back[0], rows) and torch.equal(back[1], out) and back[1].data_ptr() != out.data_ptr()
    assert fake.sides[0].waited[-1] is fake.default  # the copy waited for the stream that computed them


def test_an_output_dropped_untaken_stays_alive_until_its_copy_is_waited_for(fake):
    transfers = Transfers("cpu", slots=1)
    out = torch.randn(6, 4)
    alive = weakref.ref(out)
    transfers.to_host(out)  # dropped untaken: the side stream may still read it
    del out
    assert alive() is not None
    transfers.to_host(torch.randn(2)).take()  # the slot's next use waits for the copy first
    assert alive() is None


class OnAnotherGPU(torch.Tensor):
    """A CPU tensor that says it lives on cuda:1 and notes the fake stream current at each operation on it."""

    seen = []
    fake = None

    @property
    def device(self):
        return torch.device("cuda", 1)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        cls.seen.append((getattr(func, "__name__", str(func)), cls.fake.current))
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


def test_to_host_copies_another_devices_output_at_once_not_on_this_devices_side_stream(fake, monkeypatch):
    monkeypatch.setattr(OnAnotherGPU, "fake", fake)
    monkeypatch.setattr(OnAnotherGPU, "seen", [])
    transfers = Transfers("cpu")  # "cuda:0"; the output below is on "cuda:1"
    values = torch.randn(5, 2)
    other = values.clone().as_subclass(OnAnotherGPU)
    here = torch.randn(3)
    back = transfers.to_host((other, here)).take()
    # The side stream's event covers this device only: a copy queued there for cuda:1 would be read too early.
    assert all(stream is fake.default for _, stream in OnAnotherGPU.seen), OnAnotherGPU.seen
    assert torch.equal(back[0].as_subclass(torch.Tensor), values) and torch.equal(back[1], here)


def test_pinning_refused_falls_back_to_pageable_copies_with_one_warning(fake, monkeypatch, caplog):
    def refuse(nbytes):
        raise RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported")

    monkeypatch.setattr(staging, "pinned_block", refuse)
    monkeypatch.setattr(staging, "_refusal_warned", False)
    transfers = Transfers("cpu")
    batch = (torch.randn(8, 3), torch.arange(8))
    with caplog.at_level(logging.WARNING, logger="toma"):
        moved = transfers.move(batch)
        back = transfers.to_host(moved).take()
        again = Transfers("cpu").move(batch)
    assert all(torch.equal(a, b) for a, b in zip(moved, batch)) and all(torch.equal(a, b) for a, b in zip(back, batch))
    assert torch.equal(again[0], batch[0]) and transfers.pinned_bytes == 0 and not transfers.pinning
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "pin" in warnings[0].getMessage()


def test_keyboard_interrupt_while_pinning_is_not_swallowed(fake, monkeypatch):
    def interrupted(nbytes):
        raise KeyboardInterrupt

    monkeypatch.setattr(staging, "pinned_block", interrupted)
    with pytest.raises(KeyboardInterrupt):
        Transfers("cpu").move(torch.randn(4, 2))


# --- the same on a GPU ------------------------------------------------------------------------------------


@pytest.mark.cuda
@requires_cuda
def test_on_cuda_sparse_zero_dim_and_grad_requiring_tensors_move_intact():
    sparse = torch.randn(4, 3).relu().to_sparse()
    leaf, scalar, dense = torch.randn(5, 3, requires_grad=True), torch.tensor(2.5), torch.randn(5, 3)
    moved = Transfers("cuda").move((sparse, leaf, scalar, dense))
    assert moved[0].is_sparse and moved[0].is_cuda and torch.equal(moved[0].to_dense().cpu(), sparse.to_dense())
    assert moved[1].is_cuda and moved[3].is_cuda and torch.equal(moved[2].cpu(), scalar)
    (moved[1] * moved[3]).sum().backward()
    assert torch.equal(leaf.grad, dense)


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_on_two_gpus_to_host_of_an_output_on_the_other_gpu_is_not_stale():
    transfers = Transfers("cuda:0")
    square = torch.randn(4096, 4096, device="cuda:1") / 64
    torch.cuda.synchronize(1)
    for _ in range(30):  # queued on cuda:1: busy long after this loop returns
        square = torch.tanh(square @ square) * 2
    out = square[:, :8] + 1.0
    back = transfers.to_host(out).take()
    assert torch.equal(back, out.cpu())


@pytest.mark.cuda
@requires_cuda
def test_under_cuda_malloc_async_no_record_stream_warning(monkeypatch):
    """record_stream onto a block's allocating stream warns at every step under backend:cudaMallocAsync; rows
    prefetched and written back (HostedEmbedding) and an identity function in toma.map are such blocks."""
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "backend:cudaMallocAsync")
    out = run_python(
        """
import json, warnings, torch
import toma
from toma.batching import staging
from toma import HostedEmbedding
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    table = HostedEmbedding(1000, 16, optimizer=lambda params: torch.optim.SGD(params, lr=0.1), device="cuda")
    for step in range(4):
        indices = torch.randint(0, 1000, (64,))
        table.prefetch(indices)
        table(indices).pow(2).sum().backward()
        table.step()
    x = torch.randn(512, 8)
    same = toma.map(lambda chunk: chunk, x, device="cuda", initial_step=64)
print(json.dumps(dict(backend=torch.cuda.get_allocator_backend(), same=bool(torch.equal(same, x)),
                      warnings=[str(w.message) for w in caught])))
""",
        fresh=True,  # the allocator reads the variable when torch starts
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["backend"] == "cudaMallocAsync" and result["same"]
    assert not [w for w in result["warnings"] if "record_stream" in w], result["warnings"]
    assert "record_stream" not in out.stderr
