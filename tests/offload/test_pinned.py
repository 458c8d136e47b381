"""toma.offload.pinned: host tensors page-locked at their own size and unlocked when freed, pageable when locking fails."""

import ctypes
import gc
import logging

import pytest
import torch

from toma.offload import pinned

from helpers import requires_cuda

CUDA = torch.device("cuda")  # only a name here: the recording registrar never touches CUDA


class Recording:
    """A registrar that records its calls, and fails while `failing`."""

    def __init__(self, failing=False):
        self.calls, self.failing = [], failing

    def register(self, address, nbytes, device):
        self.calls.append(("register", address, nbytes, device))
        if self.failing:
            raise RuntimeError("CUDA error: out of memory")

    def unregister(self, address):
        self.calls.append(("unregister", address))
        self.last_bytes = ctypes.string_at(address, 4)  # still mapped when unlocked (else this would crash)


def test_a_tensor_is_locked_at_its_exact_size_and_unlocked_once_when_its_last_view_is_freed():
    registrar = Recording()
    host = pinned.PinnedHost(registrar)
    rows = 2**18 + 3  # float32 rows of 4 bytes: 1 MiB + 12 bytes, which a power-of-two allocator would double
    table = host.empty((rows, 1), torch.float32, CUDA)
    address = table.data_ptr()
    assert table.shape == (rows, 1) and table.dtype == torch.float32
    assert registrar.calls == [("register", address, rows * 4, CUDA)] and host.registered_bytes == rows * 4
    table.fill_(2.0)
    view = table[10:20]
    del table
    gc.collect()
    assert len(registrar.calls) == 1  # the view still uses the memory
    assert float(view.sum()) == 20.0
    del view
    assert registrar.calls[1:] == [("unregister", address)] and host.registered_bytes == 0
    assert registrar.last_bytes == torch.tensor([2.0]).numpy().tobytes()
    gc.collect()
    assert len(registrar.calls) == 2  # once


def test_tensors_of_several_dtypes_and_shapes_hold_what_is_written():
    host = pinned.PinnedHost(Recording())
    for dtype in (torch.float16, torch.bfloat16, torch.float64, torch.int64):
        tensor = host.empty((3, 5, 7), dtype, CUDA)
        source = torch.arange(105).reshape(3, 5, 7).to(dtype)
        tensor.copy_(source)
        assert torch.equal(tensor, source) and tensor.is_contiguous()
    assert host.empty((0, 4), torch.float32, CUDA).shape == (0, 4)  # nothing to lock


def test_a_failed_lock_leaves_pageable_memory_with_one_warning_and_no_error(caplog):
    registrar = Recording(failing=True)
    host = pinned.PinnedHost(registrar)
    with caplog.at_level(logging.DEBUG, logger="toma"):
        first = host.empty((100, 8), torch.float32, CUDA)
        second = host.empty((50, 8), torch.float32, CUDA)
    first.fill_(1.0)
    second.copy_(torch.ones(50, 8))
    assert float(first.sum() + second.sum()) == 1200.0
    warnings = [record for record in caplog.records if record.levelno == logging.WARNING]
    assert len(warnings) == 1 and "page-lock 3200 bytes" in warnings[0].getMessage()
    assert host.failures == 2 and host.registered_bytes == 0
    del first, second
    gc.collect()
    assert [call[0] for call in registrar.calls] == ["register", "register"]  # nothing to unlock


def test_the_module_level_empty_uses_the_replaceable_host(monkeypatch):
    registrar = Recording()
    monkeypatch.setattr(pinned, "HOST", pinned.PinnedHost(registrar))
    tensor = pinned.empty((4, 4), torch.float32, CUDA)
    assert registrar.calls == [("register", tensor.data_ptr(), 64, CUDA)]


@pytest.mark.cuda
@requires_cuda
def test_on_cuda_a_locked_tensor_is_pinned_and_copies_to_the_device():
    host = pinned.PinnedHost(pinned.CudaRegistrar())
    tensor = host.empty((1000, 7), torch.float32, torch.device("cuda"))
    tensor.copy_(torch.arange(7000.0).reshape(1000, 7))
    assert tensor.is_pinned() and host.registered_bytes == 28000
    assert torch.equal(tensor.to("cuda", non_blocking=True).cpu(), tensor)
    del tensor
    gc.collect()
    assert host.registered_bytes == 0


class RegisteredTwice(pinned.CudaRegistrar):
    """Locks the memory and then locks it again, which CUDA refuses (already registered)."""

    def register(self, address, nbytes, device):
        super().register(address, nbytes, device)
        try:
            super().register(address, nbytes, device)
        finally:
            self.unregister(address)


@pytest.mark.cuda
@requires_cuda
def test_on_cuda_a_refused_lock_falls_back_and_leaves_no_cuda_error_for_the_next_kernel(caplog):
    host = pinned.PinnedHost(RegisteredTwice())
    with caplog.at_level(logging.WARNING, logger="toma"):
        tensor = host.empty((256, 4), torch.float32, torch.device("cuda"))
    assert host.failures == 1 and not tensor.is_pinned()
    assert float(torch.ones(4, device="cuda").sum()) == 4.0  # a launch that would report a stale error
    assert len(caplog.records) == 1
