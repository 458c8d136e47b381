"""toma.batching.transfer's CUDA paths on the CPU: streams, events, `record_stream` and pinning stand-ins that record
what is done with them. The "device" is the CPU; host tensors still travel through the staging buffers and
side-stream copies as on a GPU (as plain copies), so results can be compared and every move counted."""

import contextlib
import threading

import torch

from toma.batching import staging, transfer


class FakeStream:
    def __init__(self, name):
        self.name = name
        self.waited = []  # events and streams waited on, in order

    def wait_event(self, event):
        self.waited.append(event)

    def wait_stream(self, stream):
        self.waited.append(stream)

    def __repr__(self):
        return f"FakeStream({self.name})"


class FakeEvent:
    def __init__(self, cuda):
        self.cuda = cuda
        self.stream = None
        self.synchronized = False

    def record(self, stream=None):
        self.stream = stream or self.cuda.current

    def synchronize(self):
        self.synchronized = True


class FakeCuda:
    """What toma.batching.transfer asks of torch.cuda, recorded: `recorded` holds (tensor, stream) for every
    `record_stream`, `pinned` the sizes pinned, `current` the stream work is queued on now."""

    def __init__(self):
        self.default = FakeStream("default")
        self.current = self.default
        self.sides = []
        self.recorded = []
        self.pinned = []

    def Stream(self, device=None):
        stream = FakeStream(f"side{len(self.sides)}")
        self.sides.append(stream)
        return stream

    @contextlib.contextmanager
    def stream(self, stream):
        previous, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = previous

    def current_stream(self, device=None):
        return self.current

    def Event(self, *args, **kwargs):
        return FakeEvent(self)

    def record_stream(self, tensor, stream):
        self.recorded.append((tensor, stream))

    def pin(self, nbytes):
        self.pinned.append(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8)


def install(monkeypatch) -> FakeCuda:
    """Make every `Transfers` (and the accumulation pipeline) treat the CPU as a CUDA device, with fakes."""
    fake = FakeCuda()
    monkeypatch.setattr(transfer, "uses_cuda", lambda device: device.type in ("cpu", "cuda"))
    monkeypatch.setattr(staging, "pinned_block", fake.pin)
    monkeypatch.setattr(transfer, "_per_thread", threading.local())  # no fake Transfers kept for later tests
    monkeypatch.setattr(torch.cuda, "Stream", fake.Stream)
    monkeypatch.setattr(torch.cuda, "stream", fake.stream)
    monkeypatch.setattr(torch.cuda, "Event", fake.Event)
    monkeypatch.setattr(torch.cuda, "current_stream", fake.current_stream)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda tensor, stream: fake.record_stream(tensor, stream))
    return fake
