"""Gradient caching (issue 56): in-batch negatives (MultipleNegativesRankingLoss's loss, written as a user writes it)
on a small BERT built from a config, under a real CPU memory cap.

    python benchmarks/gradient_cache.py [--quick] [--headroom-mib 160]

Each part runs in a fresh process capped by its address space (`toma.memory.cpu.set_cpu_memory_headroom`):

1. **Largest logical batch**: doubling from 16 rows, the largest batch of anchor/positive pairs whose step trains
   plain (one forward and backward of the whole batch), and the largest that trains with `toma.accumulate(model=...)`
   (the split check finds the loss couples rows, gradient caching trains it), up to 64x the plain one. Target >= 8x.
2. **Time per step against hand-set gradient caching** at the batch that plain cannot train: toma (its size found by
   out-of-memory errors, settled) against the same algorithm written by hand as sentence-transformers'
   `CachedMultipleNegativesRankingLoss` runs it (embed every mini-batch without a graph with its random state kept,
   the loss on all embeddings, its gradient, each mini-batch again with its graph), at each hand-set `mini_batch_size`
   that fits, the best of them reported. Both in the same process, alternating, the median of the steps; peak memory
   (resident, above where the step began) of each. Targets: time <= 1.05x the best hand setting, peak no higher.
3. **Against sentence-transformers itself** (where it is installed): the same BERT as a `SentenceTransformer`
   (Transformer + mean Pooling), `MultipleNegativesRankingLoss` through `toma.accumulate(model=...)` against
   `CachedMultipleNegativesRankingLoss` at each `mini_batch_size` that fits, at the same batch, the same way.

Printed: a markdown table per part and a JSON line per part.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any, Callable, Dict, List

MiB = 1 << 20


def encoder_and_data(rows: int, seed: int = 0) -> Any:
    """A 2-layer BERT (hidden 128, 32 tokens a row) with mean pooling, and `rows` anchor/positive pairs of ids."""
    import torch
    from transformers import BertConfig, BertModel

    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=1000,
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=256,
        max_position_embeddings=64,
    )
    bert = BertModel(config, add_pooling_layer=False)

    class Encoder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bert = bert

        def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
            return self.bert(input_ids=input_ids).last_hidden_state.mean(1)

    generator = torch.Generator().manual_seed(seed + 1)
    anchors = torch.randint(1, 1000, (rows, 32), generator=generator)
    positives = torch.randint(1, 1000, (rows, 32), generator=generator)
    return Encoder(), anchors, positives


def mnrl(encoder: Any, anchors: Any, positives: Any) -> Any:
    """MultipleNegativesRankingLoss as written by hand: each anchor against every positive of the batch, scale 20."""
    import torch
    import torch.nn.functional as F

    a, p = F.normalize(encoder(anchors), dim=-1), F.normalize(encoder(positives), dim=-1)
    return F.cross_entropy(a @ p.T * 20.0, torch.arange(len(a)))


def hand_cached_step(encoder: Any, anchors: Any, positives: Any, mini: int) -> None:
    """Gradient caching by hand, as sentence-transformers' Cached losses run it, at `mini_batch_size=mini`."""
    import torch
    import torch.nn.functional as F

    reps, states = [], []
    for inputs in (anchors, positives):
        column, column_states = [], []
        for start in range(0, len(inputs), mini):
            column_states.append(torch.get_rng_state())
            with torch.no_grad():
                column.append(encoder(inputs[start : start + mini]))
        reps.append(torch.cat(column).requires_grad_())
        states.append(column_states)
    a, p = F.normalize(reps[0], dim=-1), F.normalize(reps[1], dim=-1)
    F.cross_entropy(a @ p.T * 20.0, torch.arange(len(a))).backward()
    after = torch.get_rng_state()
    for inputs, rep, column_states in zip((anchors, positives), reps, states):
        for index, start in enumerate(range(0, len(inputs), mini)):
            torch.set_rng_state(column_states[index])
            out = encoder(inputs[start : start + mini])
            out.backward(rep.grad[start : start + mini])
    torch.set_rng_state(after)


def resident_peak_since(start: Callable[[], None], work: Callable[[], None]) -> int:
    """What `work` needed: the kernel's resident high-water mark above where it began, malloc's free pages given back
    to the kernel first (`malloc_trim`), so that reusing them shows as new resident memory."""
    import ctypes

    start()
    ctypes.CDLL(None).malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")
    before = _vm("VmHWM")
    work()
    return _vm("VmHWM") - before


def _vm(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def capped(headroom_mib: float) -> None:
    from toma.memory.cpu import predictable_heap, set_cpu_memory_headroom

    predictable_heap()
    set_cpu_memory_headroom(headroom_mib / 1024)


def largest(headroom_mib: float, limit_factor: int) -> Dict[str, Any]:
    """Part 1, in this (fresh) process: the largest batch that trains plain, then with toma (doubling)."""
    import gc

    import torch

    from toma import toma
    from toma.core.oom import should_reduce_batch_size

    torch.set_num_threads(1)
    encoder, anchors, positives = encoder_and_data(16 * 64 * limit_factor)
    capped(headroom_mib)

    def trains(rows: int, with_toma: bool) -> bool:
        encoder.zero_grad(set_to_none=True)
        try:
            if with_toma:
                toma.accumulate(model=encoder)(lambda a, p: mnrl(encoder, a, p))(anchors[:rows], positives[:rows])
            else:
                mnrl(encoder, anchors[:rows], positives[:rows]).backward()
            return True
        except Exception as error:
            if not should_reduce_batch_size(error):
                raise
            return False
        finally:
            encoder.zero_grad(set_to_none=True)
            gc.collect()

    found: Dict[str, Any] = {}
    rows = 16
    while trains(rows, False):
        rows *= 2
    found["plain"] = plain = rows // 2
    rows, ceiling = max(plain, 16), max(plain, 16) * limit_factor
    while rows <= ceiling and trains(rows, True):
        rows *= 2
    found["toma"] = rows // 2
    found["toma_reached_the_ceiling"] = rows > ceiling
    found["ratio"] = round(found["toma"] / max(plain, 1), 1)
    return found


def timing(headroom_mib: float, rows: int, steps: int) -> Dict[str, Any]:
    """Part 2, in this (fresh) process: toma against hand-set gradient caching at `rows` pairs."""
    import gc

    import torch

    from toma import GlobalBatchsizeCache, toma
    from toma.core.oom import should_reduce_batch_size

    torch.set_num_threads(1)
    encoder, anchors, positives = encoder_and_data(rows)
    capped(headroom_mib)
    # one size for the call site, as the trainers keep it (the default cache keys sizes by the free memory too, which
    # moves under a cap from call to call: each new key would pay its out-of-memory errors again)
    step = toma.accumulate(model=encoder, cache_type=GlobalBatchsizeCache)(lambda a, p: mnrl(encoder, a, p))

    def ours() -> None:
        step(anchors, positives)

    def settle() -> None:
        encoder.zero_grad(set_to_none=True)
        gc.collect()

    for _ in range(10):  # toma finds its size (out-of-memory errors, growth), times its rows (8 calls), then settles
        ours()
        settle()
    hands: Dict[int, Callable[[], None]] = {}
    for mini in (16, 32) if steps == 1 else (8, 16, 32, 64, 128, 256):  # --quick: two settings
        if mini >= rows:
            break
        try:
            hand_cached_step(encoder, anchors, positives, mini)
            hands[mini] = lambda mini=mini: hand_cached_step(encoder, anchors, positives, mini)
        except Exception as error:
            if not should_reduce_batch_size(error):
                raise
        settle()
    times: Dict[str, List[float]] = {"toma": [], **{str(m): [] for m in hands}}
    for _ in range(steps):
        for name, work in [("toma", ours), *[(str(m), w) for m, w in hands.items()]]:
            started = time.perf_counter()
            work()
            times[name].append(time.perf_counter() - started)
            settle()
    medians = {name: statistics.median(values) for name, values in times.items()}
    best = min((name for name in medians if name != "toma"), key=lambda name: medians[name])
    rows_used = str(step.stats.split_check.speed.chosen or step.stats.micro_batch)  # toma's micro-batch rows
    same = rows_used if rows_used in medians else None
    measured = [("toma", ours), (best, hands[int(best)])] + (
        [(same, hands[int(same)])] if same and same != best else []
    )
    peaks = {name: resident_peak_since(settle, work) for name, work in measured}
    return dict(
        same_size_time_ratio=round(medians["toma"] / medians[same], 3) if same else None,
        same_size_peak_ratio=round(peaks["toma"] / peaks[same], 3) if same else None,
        rows=rows,
        toma_micro_batch=step.stats.micro_batch,
        toma_rows=step.stats.split_check.speed.chosen,
        toma_retries=step.stats.oom_retries,
        coupled=step.stats.split_check.coupled,
        seconds={name: round(value, 4) for name, value in medians.items()},
        best_hand=int(best),
        time_ratio=round(medians["toma"] / medians[best], 3),
        peak_mib={name: round(value / MiB, 1) for name, value in peaks.items()},
        peak_ratio=round(peaks["toma"] / peaks[best], 3),
    )


def sentence_model_and_features(rows: int, seed: int = 0) -> Any:
    """The same BERT as a SentenceTransformer (a word-level tokenizer and the model saved to a temporary folder, no
    download), and `rows` anchor/positive features dicts of 32 tokens."""
    import tempfile

    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    encoder, anchors, positives = encoder_and_data(rows, seed)
    folder = tempfile.mkdtemp(prefix="toma-bench-")
    vocab = {"[PAD]": 0, "[UNK]": 1, **{f"w{i}": i for i in range(2, 1000)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="[PAD]", unk_token="[UNK]").save_pretrained(folder)
    encoder.bert.save_pretrained(folder)
    transformer = Transformer(folder)
    model = SentenceTransformer(modules=[transformer, Pooling(transformer.get_embedding_dimension())], device="cpu")
    model.train()
    mask = torch.ones_like(anchors)
    return model, {"input_ids": anchors, "attention_mask": mask}, {"input_ids": positives, "attention_mask": mask}


def cached_loss(headroom_mib: float, rows: int, steps: int) -> Dict[str, Any]:
    """Part 3, in this (fresh) process: MultipleNegativesRankingLoss through toma against sentence-transformers'
    CachedMultipleNegativesRankingLoss at each mini_batch_size that fits, at `rows` pairs."""
    import gc

    import torch
    from sentence_transformers.sentence_transformer import losses

    from toma import GlobalBatchsizeCache, toma
    from toma.core.oom import should_reduce_batch_size

    torch.set_num_threads(1)
    model, anchors, positives = sentence_model_and_features(rows)
    plain_loss = losses.MultipleNegativesRankingLoss(model)
    capped(headroom_mib)
    step = toma.accumulate(model=model, cache_type=GlobalBatchsizeCache)(lambda a, p: plain_loss([a, p], None))

    def ours() -> None:
        step(anchors, positives)

    def settle() -> None:
        model.zero_grad(set_to_none=True)
        gc.collect()

    for _ in range(10):  # its size, then its rows timed (8 calls)
        ours()
        settle()
    cached: Dict[int, Callable[[], None]] = {}
    for mini in (16, 32) if steps == 1 else (8, 16, 32, 64, 128, 256):
        if mini >= rows:
            break
        loss = losses.CachedMultipleNegativesRankingLoss(model, mini_batch_size=mini)
        work = lambda loss=loss: loss([anchors, positives], None).backward()  # noqa: E731
        try:
            work()
            cached[mini] = work
        except Exception as error:
            if not should_reduce_batch_size(error):
                raise
        settle()
    times: Dict[str, List[float]] = {"toma": [], **{str(m): [] for m in cached}}
    for _ in range(steps):
        for name, work in [("toma", ours), *[(str(m), w) for m, w in cached.items()]]:
            started = time.perf_counter()
            work()
            times[name].append(time.perf_counter() - started)
            settle()
    medians = {name: statistics.median(values) for name, values in times.items()}
    best = min((name for name in medians if name != "toma"), key=lambda name: medians[name])
    rows_used = str(step.stats.split_check.speed.chosen or step.stats.micro_batch)
    same = rows_used if rows_used in medians else None
    measured = [("toma", ours), (best, cached[int(best)])] + (
        [(same, cached[int(same)])] if same and same != best else []
    )
    peaks = {name: resident_peak_since(settle, work) for name, work in measured}
    return dict(
        rows=rows,
        toma_micro_batch=step.stats.micro_batch,
        toma_rows=step.stats.split_check.speed.chosen,
        toma_retries=step.stats.oom_retries,
        coupled=step.stats.split_check.coupled,
        seconds={name: round(value, 4) for name, value in medians.items()},
        best_cached=int(best),
        time_ratio=round(medians["toma"] / medians[best], 3),
        peak_mib={name: round(value / MiB, 1) for name, value in peaks.items()},
        peak_ratio=round(peaks["toma"] / peaks[best], 3),
        same_size_time_ratio=round(medians["toma"] / medians[same], 3) if same else None,
        same_size_peak_ratio=round(peaks["toma"] / peaks[same], 3) if same else None,
    )


def child(part: str, arguments: List[str]) -> Dict[str, Any]:
    """Run `part` in a fresh interpreter (its own cap) and return its JSON line."""
    command = [sys.executable, os.path.abspath(__file__), "--part", part, *arguments]
    env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_ARENA_MAX="1")
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1200)
    if result.returncode != 0:
        raise SystemExit(f"{part} failed:\n{result.stdout}\n{result.stderr[-4000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small limits, few steps: that it runs, not its figures")
    parser.add_argument("--headroom-mib", type=float, default=160.0)
    parser.add_argument("--part", help=argparse.SUPPRESS)
    parser.add_argument("--rows", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    limit_factor, steps = (2, 1) if args.quick else (16, 5)
    if args.part == "largest":
        print(json.dumps(largest(args.headroom_mib, limit_factor)))
        return
    if args.part == "timing":
        print(json.dumps(timing(args.headroom_mib, args.rows, steps)))
        return
    if args.part == "cached_loss":
        print(json.dumps(cached_loss(args.headroom_mib, args.rows, steps)))
        return
    import torch

    common = ["--headroom-mib", str(args.headroom_mib)] + (["--quick"] if args.quick else [])
    sizes = child("largest", common)
    print(f"torch {torch.__version__}, 1 thread, a 2-layer BERT (hidden 128, 32 tokens), in-batch negatives,")
    print(f"{args.headroom_mib:.0f} MiB of address space over the settled process (a real cap)\n")
    print("| | largest logical batch that trains (anchor/positive pairs) |")
    print("|---|---:|")
    print(f"| plain (one forward and backward) | {sizes['plain']} |")
    reached = " (the ceiling tried)" if sizes["toma_reached_the_ceiling"] else ""
    print(f"| toma.accumulate (gradient caching) | {sizes['toma']}{reached} |")
    print(f"| ratio | {sizes['ratio']}x |\n")
    print(json.dumps(dict(part="largest", **sizes)))
    rows = max(64, sizes["plain"] * (2 if args.quick else 4))
    found = child("timing", common + ["--rows", str(rows)])
    print(
        f"\nAt {rows} pairs (plain cannot train it): toma's size {found['toma_micro_batch']} rows "
        f"(found by {found['toma_retries']} out-of-memory retries), its micro-batches {found['toma_rows']} rows (chosen "
        f"by time per row), the median of {steps} steps\n"
    )
    print("| | s per step | peak MiB |")
    print("|---|---:|---:|")
    for name, seconds in found["seconds"].items():
        label = "toma.accumulate" if name == "toma" else f"by hand, mini_batch_size={name}"
        peak = found["peak_mib"].get(name, "")
        print(f"| {label} | {seconds:.3f} | {peak} |")
    print(
        f"\ntoma / the best hand setting ({found['best_hand']}): time {found['time_ratio']}x, "
        f"peak {found['peak_ratio']}x"
    )
    if found["same_size_time_ratio"] is not None:
        print(
            f"toma / by hand at toma's rows ({found['toma_rows']}): time {found['same_size_time_ratio']}x, "
            f"peak {found['same_size_peak_ratio']}x"
        )
    print(json.dumps(dict(part="timing", **found)))
    try:
        import sentence_transformers  # noqa: F401
    except ImportError:
        print("\nsentence-transformers is not installed: part 3 left out")
        return
    real = child("cached_loss", common + ["--rows", str(rows)])
    print(
        f"\nsentence-transformers at {rows} pairs: MultipleNegativesRankingLoss through toma (size "
        f"{real['toma_micro_batch']}, {real['toma_retries']} retries, micro-batches of {real['toma_rows']} rows) "
        "against CachedMultipleNegativesRankingLoss\n"
    )
    print("| | s per step | peak MiB |")
    print("|---|---:|---:|")
    for name, seconds in real["seconds"].items():
        label = "MNRL through toma.accumulate" if name == "toma" else f"CachedMNRL, mini_batch_size={name}"
        print(f"| {label} | {seconds:.3f} | {real['peak_mib'].get(name, '')} |")
    print(
        f"\ntoma / CachedMNRL at its best mini_batch_size ({real['best_cached']}): time {real['time_ratio']}x, "
        f"peak {real['peak_ratio']}x"
    )
    if real["same_size_time_ratio"] is not None:
        print(
            f"toma / CachedMNRL at toma's rows ({real['toma_rows']}): time {real['same_size_time_ratio']}x, "
            f"peak {real['same_size_peak_ratio']}x"
        )
    print(json.dumps(dict(part="cached_loss", **real)))


if __name__ == "__main__":
    main()
