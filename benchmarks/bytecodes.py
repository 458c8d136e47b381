"""Python bytecodes executed per call: a noise-free proxy of toma's own cost on the hot path, where wall-clock
timings of microsecond calls move by 2x on a shared machine.

Run: python benchmarks/bytecodes.py   (prints one JSON line; run it on two trees with PYTHONPATH to compare)
Counts `sys.settrace` opcode events over settled calls (after warm-up) with a fixed free-memory gauge: a no-op
`toma.batch` call with the default cache and without one, a settled `FitToMemory` call, `simple.batch`,
`toma.chunked` over 8 empty chunks, and `toma.accumulate` over 8 micro-batches of a 4 -> 1 linear model.
"""

import json
import sys

import torch

from toma import FitToMemory, Halving, NoBatchsizeCache, simple, toma


class G:
    def read(self, device=None):
        return (0, 0)


FitToMemory.gauge = G()
count = 0


def tracer(frame, event, arg):
    frame.f_trace_opcodes = True
    return local


def local(frame, event, arg):
    global count
    if event == "opcode":
        count += 1
    return local


def measure(fn, calls=200, warm=300):
    global count
    for _ in range(warm):
        fn()
    count = 0
    sys.settrace(tracer)
    for _ in range(calls):
        fn()
    sys.settrace(None)
    return round(count / calls, 1)


@toma.batch(initial_batchsize=64)
def noop(bs):
    return bs


@toma.batch(initial_batchsize=64, cache_type=NoBatchsizeCache)
def noop_nc(bs):
    return bs


@toma.batch(initial_batchsize=64, policy=FitToMemory(measure_every=10**9))
def noop_fit(bs):
    return bs


data = torch.zeros(64, 2)


@toma.chunked(initial_step=8)
def chunk(c, s, e):
    pass


model = torch.nn.Linear(4, 1)
x, y = torch.randn(64, 4), torch.randn(64, 1)


@toma.accumulate(model=model, initial_micro_batch=8, policy=Halving())
def acc(xb, yb):
    return torch.nn.functional.mse_loss(model(xb), yb)


r = dict(
    noop=measure(noop),
    noop_nocache=measure(noop_nc),
    noop_fit=measure(noop_fit, 2000),
    simple=measure(lambda: simple.batch(lambda b: b, 64)),
    chunked_8=measure(lambda: chunk(data)),
    accumulate_8=measure(lambda: acc(x, y), 50, 30),
)
print(json.dumps(r))
