"""One rank out of memory for real, two gloo ranks (issue 55): where the failing allocation lands, what toma does, and
how long until every rank is done.

    python benchmarks/one_rank_oom.py [--cases NAME,...] [--together] [--peaks] [--limit 240]

Each case starts two ranks (gloo on this host); rank 1 alone is capped for real, by its address space (RLIMIT_AS),
rank 0 never. A case is a gradient sync and where rank 1's cap lands:

- a *phase* of a logical batch: the cap is set on rank 1 during toma's first attempt, at the address space it holds
  the moment the phase begins (FSDP2's all-gather or reduce-scatter allocating its buffer, a block's forward pass, a
  block's backward pass, the buffers of the gradients' reduction, the inside of a collective after every rank
  agreed to run it, or the optimizer's step after toma's call, outside it), the free pieces of malloc's heap taken,
  so that the phase's next allocation fails for real; it stays for the rest of the run;
- a *cap* from the start: a few MiB below what one unsplit pass of the logical batch needs (`below`: 4 MiB or a
  twentieth, whichever is more), or half-way from there to what half the micro-batch needs (`halfway`), both
  measured in the run (the peak resident size above where the pass began), the cap's headroom all fresh address
  space (the heap's free pieces taken). Under "auto" and DDP the framework's own loop at half the micro-batch must
  train under the cap (checked: the case's premise).

Every rank trains two logical batches of 128 rows of 32 tokens (4 residual 512x512 blocks, SGD) with
`toma.accumulate(model=..., initial_micro_batch=128)` and ends either trained (to the parameters of the unsplit
steps, run before any cap) or with an error. The case `issue` is issue 55's own: 96 blocks, 196 rows of 2 tokens a
rank, rank 1 capped below what FSDP2's own loop needs for the unsplit pass, a quarter of the way up from what it
needs at half the micro-batch, where that loop trains (checked).

Printed: a line per case (its outcome on every rank, the seconds from the cap landing to the last rank's end, the
micro-batch sizes, the out-of-memory retries; with `--peaks`, after a case that trained, what one more of toma's
calls needs at the size it settled at against the framework's own loop at that micro-batch size, the cap lifted: the
memory a failed attempt leaves behind would show there), and a JSON line per rank. Each case runs on its own pair
of fresh ranks (`--together`: one after the other on one pair). A launch that does not end within `--limit` seconds
is a hang: each rank's stack is dumped (faulthandler) before it is killed. `--rank CASES` runs one rank (RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT set): what the driver starts, and what the tests start.
"""

import argparse
import ctypes
import datetime
import faulthandler
import json
import logging
import os
import resource
import socket
import subprocess
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from toma import toma
from toma.accumulation.fsdp2 import ShardedUnits
from toma.accumulation.gradient_collectives import GradientBuckets
from toma.core.caches import GlobalBatchsizeCache, NoBatchsizeCache
from toma.memory.cpu import predictable_heap, settled_address_space

MiB = 2**20
SMALL = dict(blocks=4, width=512, rows=128, tokens=32)
ISSUE = dict(blocks=96, width=512, rows=196, tokens=2)

# name: (gradient sync, where rank 1's cap lands, what every rank must end with)
CASES: Dict[str, Tuple[str, str, str]] = {
    "sharded/all-gather": ("sharded", "all-gather", "trained"),
    "sharded/forward": ("sharded", "forward", "trained"),
    "sharded/backward": ("sharded", "backward", "trained"),
    "sharded/reduce-scatter": ("sharded", "reduce-scatter", "trained"),
    "sharded/inside the all-gather": ("sharded", "inside", "stopped"),
    "sharded/optimizer step": ("sharded", "optimizer", "stopped"),
    "auto/cap below": ("auto", "below", "trained"),
    "auto/cap halfway": ("auto", "halfway", "trained"),
    "auto/reduction": ("auto", "reduction", "trained"),
    "logical_batch/forward": ("logical_batch", "forward", "trained"),
    "logical_batch/backward": ("logical_batch", "backward", "trained"),
    "logical_batch/cap below": ("logical_batch", "below", "trained"),
    "logical_batch/all-gather": ("logical_batch", "all-gather", "stopped"),
    "micro_batch/forward": ("micro_batch", "forward", "trained"),
    "micro_batch/cap halfway": ("micro_batch", "halfway", "trained"),
    "ddp/forward": ("ddp", "forward", "trained"),
    "ddp/backward": ("ddp", "backward", "trained"),
    "ddp/reduction": ("ddp", "reduction", "trained"),
    "ddp/cap below": ("ddp", "below", "trained"),
    "ddp/cap halfway": ("ddp", "halfway", "trained"),
    "ddp/inside the all-reduce": ("ddp", "inside", "stopped"),
    "ddp/optimizer step": ("ddp", "optimizer", "stopped"),
    "issue": ("auto", "halfway", "trained"),
}
HELD = ("logical_batch", "micro_batch")


def address_space() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def cap(headroom: Optional[int], held: Optional[int] = None) -> None:
    """The address space capped at `headroom` bytes above what it holds (`held`, else now, once settled; None:
    lifted); the soft limit only, so that a later case in the same process can lift it."""
    if headroom is None:
        limit = resource.RLIM_INFINITY
    else:
        limit = (settled_address_space() if held is None else held) + headroom
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.RLIM_INFINITY))


def resident_peak_since_reset() -> Tuple[int, int]:
    """(the peak resident size since the last reset, the resident size now), bytes."""
    with open("/proc/self/status") as status:
        fields = dict(line.split(":", 1) for line in status.read().splitlines() if ":" in line)
    return tuple(int(fields[name].split()[0]) * 1024 for name in ("VmHWM", "VmRSS"))  # type: ignore[return-value]


def need_of(work: Callable[[], None]) -> int:
    """What `work` needed: its peak resident size above where it began, once settled (the kernel's high-water mark,
    reset first: exact, where sampling the address space also saw what a malloc arena of another thread reserves
    and never uses, 64 MiB at a time)."""
    cap(None)
    settled_address_space()
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")
    _, start = resident_peak_since_reset()
    work()
    peak, _ = resident_peak_since_reset()
    return peak - start


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.linear(x))


def fill_heap_holes(kept: List[int]) -> int:
    """Take the free pieces of malloc's heap of 64 KiB and more (largest first; their addresses into `kept`, held
    until the process ends): a large allocation could take them without new address space, so that a cap set
    after this is all fresh address space. Under a cap at the address space held now, malloc can only give those;
    that address space (settled) is returned, and the cap left at it."""
    held = settled_address_space()
    cap(0, held)
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    size = 64 * MiB
    while size >= 64 * 1024:
        pointer = libc.malloc(size)
        if pointer:
            kept.append(pointer)
        else:
            size //= 2
    return held


class Trap:
    """Rank 1's cap, set the first time its phase begins inside toma's first call (`armed`), at the address space it
    holds then (once settled, the heap's free pieces taken): the phase's next allocation of 64 KiB or more fails for
    real."""

    def __init__(self, rank: int, kept: List[int]) -> None:
        self.armed = False
        self.on_this_rank = rank == 1
        self.landed: Optional[float] = None
        self.kept = kept

    def spring(self) -> None:
        if self.armed and self.on_this_rank and self.landed is None:
            fill_heap_holes(self.kept)
            self.landed = time.monotonic()


class Landing(torch.autograd.Function):
    """The identity, whose backward pass springs the trap and then allocates (a copy of the gradient): a
    backward-pass allocation that fails for real."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, trap: Trap) -> torch.Tensor:
        ctx.trap = trap
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[torch.Tensor, None]:
        ctx.trap.spring()
        return grad.clone(), None


class Case:
    """One rank of one case: the model, the data, the unsplit reference steps, toma's steps under the cap."""

    def __init__(self, name: str, sizes: Dict[str, int], peaks: bool = False) -> None:
        self.name, self.peaks = name, peaks
        self.sync, self.where, self.expected = CASES[name]
        self.rank = dist.get_rank()
        self.blocks, self.width, self.rows, self.tokens = (sizes[k] for k in ("blocks", "width", "rows", "tokens"))
        generator = torch.Generator().manual_seed(10 + self.rank)
        self.steps = [torch.randn(self.rows, self.tokens, self.width, generator=generator) for _ in range(2)]
        self.kept: List[int] = []  # the heap's free pieces, taken
        self.trap = Trap(self.rank, self.kept)

    # the model and its training
    def build(self) -> nn.Module:
        torch.manual_seed(0)
        blocks = []
        for _ in range(self.blocks):  # each block sharded as it is made: the unsharded model never exists whole
            block = Block(self.width)
            if self.sync != "ddp":
                from torch.distributed.fsdp import fully_shard

                fully_shard(block)
            blocks.append(block)
        model = nn.Sequential(*blocks)
        if self.sync == "ddp":
            return nn.parallel.DistributedDataParallel(model)
        from torch.distributed.fsdp import fully_shard

        fully_shard(model)
        return model

    @staticmethod
    def loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return model(x).square().mean()

    def optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        """SGD; with momentum (made at its first step: an allocation outside toma) where the cap lands in the
        optimizer's step."""
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9 if self.where == "optimizer" else 0.0)

    def hand_pass(self, model: nn.Module, x: torch.Tensor, micro: int) -> None:
        """The framework's own accumulation loop over `x` in micro-batches of `micro` rows (DDP: no_sync on all
        but the last; FSDP2: a reduce-scatter in every backward pass, as its default loop)."""
        chunks = x.split(micro)
        for index, chunk in enumerate(chunks):
            last = index == len(chunks) - 1
            scaled = self.loss(model, chunk) * (len(chunk) / len(x))
            if self.sync == "ddp" and not last:
                with model.no_sync():
                    scaled.backward()
            else:
                scaled.backward()

    def parameters_of(self, model: nn.Module) -> List[torch.Tensor]:
        if self.sync == "ddp":
            return [p.detach().clone() for p in model.parameters()]
        return [p.full_tensor().detach() for p in model.parameters()]

    def reference(self) -> Tuple[List[torch.Tensor], int]:
        """The unsplit steps' parameters, before any cap, and what the second one's pass needed (`need_of`; the first
        step also sets up what later ones reuse, FSDP2's lazy state among it)."""
        model = self.build()
        optimizer = self.optimizer(model)
        needs = []
        for x in self.steps:
            optimizer.zero_grad()
            needs.append(need_of(lambda: self.loss(model, x).backward()))
            optimizer.step()
        return self.parameters_of(model), needs[-1]

    # where the cap lands
    def set_trap(self, model: nn.Module) -> None:
        """Install the hooks that spring the trap where the case's phase begins (in the middle block, or the
        gradients' reduction after the last block's backward pass)."""
        where, trap = self.where, self.trap
        blocks = list(model.module if self.sync == "ddp" else model)
        # late in the forward pass (where the cap leaves room for most activations), the middle of the backward pass
        middle = blocks[(3 * len(blocks)) // 4] if where in ("forward", "all-gather") else blocks[len(blocks) // 2]
        if where == "forward":
            middle.linear.register_forward_pre_hook(lambda module, args: trap.spring())
        elif where == "backward":
            middle.register_forward_hook(lambda module, args, output: Landing.apply(output, trap))
        elif where == "reduction":  # where the buffers of the gradients' reduction are allocated, before it
            trap_before(GradientBuckets, "__init__", trap)
            trap_before(ShardedUnits, "scatter_buffers", trap)
        elif where in ("all-gather", "reduce-scatter", "inside"):
            comm = TrappedCollective(trap, where)
            if self.sync == "ddp":
                comm.patch_all_reduce()
            elif where == "reduce-scatter":
                middle.set_custom_reduce_scatter(comm)
            else:
                middle.set_custom_all_gather(comm)

    def run(self, expected: List[torch.Tensor], unsplit_need: int) -> Dict[str, Any]:
        """Toma's two steps with rank 1's cap where the case puts it; what this rank ended with."""
        result: Dict[str, Any] = dict(case=self.name, rank=self.rank)
        model = self.build()
        optimizer = self.optimizer(model)
        if self.where in ("below", "halfway"):
            result.update(self.static_cap(model, unsplit_need))
        else:
            self.set_trap(model)
        compute_loss = toma.accumulate(
            model=model,
            initial_micro_batch=self.rows,
            gradient_sync="auto" if self.sync == "ddp" else self.sync,
            cache_type=GlobalBatchsizeCache,
            context=self.name,
        )(lambda x: self.loss(model, x))
        sizes: List[int] = []
        started = time.monotonic()
        try:
            for step, x in enumerate(self.steps):
                optimizer.zero_grad()
                self.trap.armed = step == 0 and self.where != "optimizer"
                compute_loss(x)
                self.trap.armed = False
                sizes.append(int(compute_loss.stats.micro_batch))
                if self.where == "optimizer" and step == 0:
                    self.trap.armed = True
                    self.trap.spring()
                optimizer.step()
            result["outcome"] = "trained"
        except Exception as error:  # the error this rank ends with: its kind and its first lines, notes included
            notes = " ".join(getattr(error, "__notes__", []))
            result.update(outcome="error", error=f"{type(error).__name__}: {error} {notes}"[:800])
        ended = time.monotonic()
        landed = self.trap.landed if self.trap.landed is not None else started
        result.update(
            sizes=sizes,
            retries=compute_loss.stats.oom_retries,
            landed=self.trap.landed is not None,
            seconds=round(ended - landed, 2),
        )
        cap(None)
        if result["outcome"] == "trained":  # every rank trained: the parameters against the unsplit steps'
            try:
                got = self.parameters_of(model)
                result["difference"] = max(float((g - e).abs().max() / e.abs().max()) for g, e in zip(got, expected))
            except Exception as error:
                result["difference"] = f"{type(error).__name__}: {error}"[:300]
            if self.peaks:
                result.update(self.peaks_after(model, compute_loss, sizes[-1]))
        return result

    def peaks_after(self, model: nn.Module, compute_loss: Callable[[torch.Tensor], Any], size: int) -> Dict[str, Any]:
        """After the run (rank 1's real out-of-memory errors among it), the cap lifted: what one more of toma's calls
        needs at the size it settled at, against the framework's own loop at that micro-batch size (`need_of`, the
        same model and data; gradients dropped after each)."""
        x = self.steps[0]

        def dropped(work: Callable[[], Any]) -> Callable[[], None]:
            def run() -> None:
                work()
                for p in model.parameters():
                    p.grad = None

            return run

        hand = need_of(dropped(lambda: self.hand_pass(model, x, size)))
        ours = need_of(dropped(lambda: compute_loss(x)))
        return dict(toma_mib=round(ours / MiB, 2), loop_mib=round(hand / MiB, 2), peak_ratio=round(ours / hand, 3))

    def static_cap(self, model: nn.Module, unsplit_need: int) -> Dict[str, Any]:
        """Rank 1 capped from the start: a few MiB below what one unsplit pass needs, or half-way from there to what
        half the micro-batch needs (`need_of`, here).
        Under "auto" and DDP the framework's own pass (`unsplit_need`, the reference's), whose loop at half the
        micro-batch must train under the cap (the case's premise, checked); in the held modes toma's own pass in
        that mode (what an unsplit pass needs there)."""
        x = self.steps[0]
        held = self.sync in HELD
        hand = model if self.sync == "ddp" or held else self.build()

        def one_pass(micro: int) -> Callable[[], None]:
            def work() -> None:
                if held:
                    toma.accumulate(
                        model=model, initial_micro_batch=micro, gradient_sync=self.sync, cache_type=NoBatchsizeCache
                    )(lambda x: self.loss(model, x))(x)
                else:
                    self.hand_pass(hand, x, micro)
                for p in [*model.parameters(), *hand.parameters()]:
                    p.grad = None

            return work

        def need(micro: int) -> int:
            return need_of(one_pass(micro))

        full = need(self.rows) if held else unsplit_need
        figures: Dict[str, Any] = dict(full_mib=round(full / MiB, 2))
        if self.where == "below":  # a few MiB below, more than sampling the peak may be off by (a twentieth)
            headroom = full - max(4 * MiB, full // 20)
        else:
            half = need(self.rows // 2)
            # the issue's case a quarter of the way: half-way up, toma's sharded mode ran the unsplit pass whole (in
            # this flow it needed less than FSDP2's own loop, whose premise a quarter of the way still holds)
            headroom = (full + half) // 2 if self.name != "issue" else half + (full - half) // 4
            figures["half_mib"] = round(half / MiB, 2)
        figures["headroom_mib"] = round(headroom / MiB, 2)
        if self.rank == 1:
            cap(headroom, fill_heap_holes(self.kept))
        if not held:
            try:
                one_pass(self.rows // 2)()
                figures["premise"] = "the framework's own loop at half the micro-batch trains under the cap"
            except Exception as error:
                figures["premise"] = f"failed: {type(error).__name__}: {error}"[:200]
        return figures


def trap_before(owner: type, name: str, trap: Trap) -> None:
    """`owner.name` springs `trap` before it runs (toma's reduction buffers: where the phase begins)."""
    original = getattr(owner, name)

    def trapped(*args: Any, **kwargs: Any) -> Any:
        trap.spring()
        return original(*args, **kwargs)

    setattr(owner, name, trapped)


class TrappedCollective:
    """FSDP2's all-gather or reduce-scatter of the middle block (`set_custom_all_gather`/`_reduce_scatter`), or
    DDP's all-reduce, with the trap sprung where its buffer is allocated or, `inside`, inside the collective,
    after every rank agreed to run it."""

    def __init__(self, trap: Trap, where: str) -> None:
        self.trap, self.where = trap, where

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if self.where != "inside":
            self.trap.spring()
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, **kwargs: Any) -> Any:
        if self.where == "inside":
            self.trap.spring()
        if self.where == "reduce-scatter":
            return _reduce_scatter()(output_tensor, input_tensor, group=group, **kwargs)
        return _all_gather()(output_tensor, input_tensor, group=group, **kwargs)

    def patch_all_reduce(self) -> None:
        """DDP's gradients are all-reduced by `torch.distributed.all_reduce`: the trap inside it (after the agreement)."""
        original = dist.all_reduce

        def all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if tensor.numel() > 1:  # the gradients' buckets, not an agreement's one number
                self.trap.spring()
            return original(tensor, *args, **kwargs)

        dist.all_reduce = all_reduce


def _all_gather() -> Callable[..., Any]:
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _reduce_scatter() -> Callable[..., Any]:
    return getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def run_ranks_cases(names: List[str], limit: float, peaks: bool = False) -> None:
    """This rank's part of cases `names`, one after the other in this process (the process group from the
    environment): a JSON line each. After a case that ended with an error, the rest are not run. `peaks`: after a
    trained case, what one more call needs against the framework's own loop (`Case.peaks_after`)."""
    faulthandler.dump_traceback_later(max(limit - 5, 1), exit=True)  # where this rank stands, if it hangs
    if os.environ.get("TOMA_LOG"):  # toma's INFO lines on stderr
        logging.basicConfig(level=logging.INFO, format=f"[rank {os.environ.get('RANK')}] %(message)s")
    predictable_heap(64 * 1024)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    references: Dict[Tuple[str, int, bool], Tuple[List[torch.Tensor], int]] = {}
    for name in names:
        case = Case(name, ISSUE if name == "issue" else SMALL, peaks)
        key = ("ddp" if case.sync == "ddp" else "fsdp2", case.blocks, case.where == "optimizer")
        if key not in references:
            references[key] = case.reference()
        result = case.run(*references[key])
        print(json.dumps(result), flush=True)
        if result["outcome"] != "trained":
            break
    faulthandler.cancel_dump_traceback_later()


def launch(
    names: List[str], limit: float, peaks: bool = False
) -> Tuple[Dict[str, List[Optional[Dict[str, Any]]]], List[str]]:
    """Cases `names`, one after the other, on two fresh ranks (fresh interpreters, one malloc arena from their
    start, as `predictable_heap` asks but cannot ask once an arena was made): each case's result per rank (None
    where a rank printed none), and the ranks' stderr."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    processes = []
    for rank in range(2):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(rank))
        env.update(OMP_NUM_THREADS="1", MALLOC_ARENA_MAX="1")
        env["PYTHONPATH"] = here + os.pathsep + os.environ.get("PYTHONPATH", "")
        command = [sys.executable, os.path.abspath(__file__), "--rank", ",".join(names), "--limit", str(limit)]
        command += ["--peaks"] if peaks else []
        processes.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    started = time.monotonic()
    outputs = []
    for process in processes:
        try:
            out, err = process.communicate(timeout=max(1.0, limit + 10 - (time.monotonic() - started)))
        except subprocess.TimeoutExpired:
            process.kill()
            out, err = process.communicate()
        outputs.append((out, err))
    per_rank = [parsed(out) for out, _ in outputs]
    return {name: [results.get(name) for results in per_rank] for name in names}, [err for _, err in outputs]


def parsed(out: str) -> Dict[str, Dict[str, Any]]:
    """A rank's results, the JSON lines it printed, by case."""
    results = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return {result["case"]: result for result in results}


def judged(results: List[Optional[Dict[str, Any]]]) -> str:
    """What the case ended with, over the ranks."""
    if any(result is None for result in results):
        return "no answer from a rank (a hang)"
    outcomes = {result["outcome"] for result in results if result is not None}
    if outcomes == {"trained"}:
        exact = all(result.get("difference", 1.0) < 1e-5 for result in results if result is not None)
        return "trained, the unsplit steps' parameters" if exact else "trained, other parameters"
    if outcomes == {"error"}:
        return "stopped with an error on every rank"
    return "one rank trained, one stopped"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated case names")
    parser.add_argument("--together", action="store_true", help="the cases one after the other on one pair of ranks")
    parser.add_argument("--limit", type=float, default=240.0, help="seconds before a launch counts as a hang")
    parser.add_argument("--peaks", action="store_true", help="after each trained case, one more call's need")
    parser.add_argument("--rank", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank:
        run_ranks_cases(args.rank.split(","), args.limit, args.peaks)
        os._exit(0)  # no teardown collective: a rank that stopped may have left the other one's unmatched
    names = args.cases.split(",")
    print(f"torch {torch.__version__}, 2 gloo ranks on {os.cpu_count()} CPU cores; rank 1 alone capped for real")
    print(f"{'case':34} {'outcome':42} {'s to end':>8}  sizes / retries")
    for launched in [names] if args.together else [[name] for name in names]:
        results, errors = launch(launched, args.limit, args.peaks)
        for name in launched:
            ranks = results[name]
            seconds = max((r["seconds"] for r in ranks if r is not None), default=float("nan"))
            sizes = "/".join(str(r["sizes"]) for r in ranks if r is not None)
            retries = max((r["retries"] for r in ranks if r is not None), default=0)
            ratios = "/".join(str(r["peak_ratio"]) for r in ranks if r is not None and "peak_ratio" in r)
            after = f"  peak after it, toma / the loop: {ratios}" if ratios else ""
            print(f"{name:34} {judged(ranks):42} {seconds:8.1f}  {sizes} / {retries}{after}", flush=True)
            for rank, result in enumerate(ranks):
                print(f"  rank {rank}: {json.dumps(result) if result else errors[rank][-3000:]}", flush=True)


if __name__ == "__main__":
    main()
