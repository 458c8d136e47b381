"""Generation under a real CPU memory cap (issue 57): `toma.generate` against the largest fixed batch that fits for
the whole run, against restarting the batch on out-of-memory errors (`toma.batch` around `generate`), and against
batch 1 (where an evaluation harness's automatic batch size ends for generation).

    python benchmarks/generation.py [--quick] [--headroom-mib 48]

A 4-layer GPT-2 (hidden 256, vocabulary 512) from a config, 96 prompts of 8-32 tokens (left-padded to 32), greedy,
up to 192 new tokens. Output lengths are long-tailed: each row stops at a length its last prompt token selects (a
logits processor forces the end-of-sequence token there; most rows stop within 48 tokens, a few run to 192), as
real completions do. Each way runs in a fresh process capped at `--headroom-mib` of address space over its settled
size (`toma.memory.cpu.set_cpu_memory_headroom`), on one thread; generated tokens per second (end-of-sequence
included, padding after it not), the median of the runs. Every way's sequences are checked equal to the uncapped
reference's. Printed: a markdown table and a JSON line.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any, Dict, List, Tuple

PROMPTS, WIDTH, NEW, EOS, PAD = 96, 32, 192, 1, 0


def model_and_prompts(rows: int) -> Tuple[Any, Any, Any]:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=512, n_positions=256, n_embd=256, n_layer=4, n_head=4, eos_token_id=EOS, pad_token_id=PAD
    )
    model = GPT2LMHeadModel(config).eval()
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(2, 512, (rows, WIDTH), generator=generator)
    lengths = torch.randint(8, WIDTH + 1, (rows,), generator=generator)
    mask = (torch.arange(WIDTH)[None, :] >= (WIDTH - lengths)[:, None]).long()
    return model, ids * mask, mask


def target_length(token: int) -> int:
    """A row's output length, chosen by its last prompt token: long-tailed (most short, a few to the limit)."""
    u = ((token * 7919) % 997) / 997.0
    return max(4, min(NEW, int(12 / (1.0 - 0.94 * u) ** 1.3)))


def stopping_processor() -> Any:
    """Forces the end-of-sequence token at each row's target length (counted from the prompt's width)."""
    import torch
    from transformers import LogitsProcessor, LogitsProcessorList

    class EndAt(LogitsProcessor):  # type: ignore[misc]
        def __call__(self, input_ids: Any, scores: Any) -> Any:
            made = input_ids.shape[1] - WIDTH
            targets = torch.tensor([target_length(int(t)) for t in input_ids[:, WIDTH - 1].tolist()])
            ending = (targets == made + 1).to(scores.device)
            scores[ending] = -float("inf")
            scores[ending, EOS] = 0.0
            scores[~ending, EOS] = -float("inf")  # no early end of its own
            return scores

    return LogitsProcessorList([EndAt()])


def settings() -> Dict[str, Any]:
    return dict(
        max_new_tokens=NEW, do_sample=False, pad_token_id=PAD, eos_token_id=EOS, logits_processor=stopping_processor()
    )


def generated_tokens(sequences: Any) -> int:
    """New tokens up to and including each row's end-of-sequence token."""
    new = sequences[:, WIDTH:]
    ended = (new == EOS).int().cumsum(1)
    return int(((ended == 0) | ((ended == 1) & (new == EOS))).sum())


def _stripped(row: Any) -> Any:
    """A sequence without the padding after its end-of-sequence token."""
    new = row[WIDTH:]
    ends = (new == EOS).nonzero()
    return row[: WIDTH + int(ends[0]) + 1] if len(ends) else row


def run_way(way: str, headroom_mib: float, cap: bool = True) -> Dict[str, Any]:
    """One way, in this fresh process under the cap: its sequences checked against the uncapped reference."""
    import torch

    import toma
    from toma.core.oom import should_reduce_batch_size
    from toma.memory.cpu import predictable_heap, set_cpu_memory_headroom

    torch.set_num_threads(1)
    torch.backends.mkldnn.enabled = False  # oneDNN reports an allocation failing under the cap as another error
    if cap:
        predictable_heap()
    model, ids, mask = model_and_prompts(PROMPTS)
    with torch.no_grad():  # the uncapped reference, 16 rows at a time (each row's sequence, its padding stripped)
        expected = []
        for start in range(0, PROMPTS, 16):
            out = model.generate(
                input_ids=ids[start : start + 16], attention_mask=mask[start : start + 16], **settings()
            )
            expected.extend(_stripped(row) for row in out)
    if cap:  # a cap cannot be raised again: the quick run's later ways share the first one's
        set_cpu_memory_headroom(headroom_mib / 1024)
    outputs: List[Any] = []

    def fixed(batch: int) -> None:
        for start in range(0, PROMPTS, batch):
            outputs.append(
                model.generate(
                    input_ids=ids[start : start + batch], attention_mask=mask[start : start + batch], **settings()
                )
            )

    started = time.perf_counter()
    found: Dict[str, Any] = dict(way=way)
    with torch.no_grad():
        if way == "toma":
            outputs.append(toma.generate(model, ids, mask, **settings()))
        elif way == "restart":

            @toma.toma.batch(initial_batchsize=PROMPTS)
            def restarting(batch: int) -> None:
                outputs.clear()
                fixed(batch)

            restarting()
        elif way == "one":
            fixed(1)
        else:  # "fixed": the largest batch that fits for the whole run, found by trying (its failures not timed)
            for batch in (96, 48, 32, 24, 16, 12, 8, 6, 4, 2, 1):
                outputs.clear()
                try:
                    started = time.perf_counter()
                    fixed(batch)
                    found["batch"] = batch
                    break
                except Exception as error:
                    if not should_reduce_batch_size(error):
                        raise
    seconds = time.perf_counter() - started
    rows = [row for out in outputs for row in out]
    equal = len(rows) == PROMPTS and all(torch.equal(_stripped(row), ref) for row, ref in zip(rows, expected))
    tokens = sum(generated_tokens(out) for out in outputs)
    found.update(seconds=round(seconds, 3), tokens=tokens, tokens_per_s=round(tokens / seconds, 1), equal=equal)
    return found


def child(way: str, headroom_mib: float) -> Dict[str, Any]:
    command = [sys.executable, os.path.abspath(__file__), "--way", way, "--headroom-mib", str(headroom_mib)]
    env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_ARENA_MAX="1")
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1800)
    if result.returncode != 0:
        raise SystemExit(f"{way} failed:\n{result.stdout}\n{result.stderr[-4000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def main() -> None:
    global PROMPTS, NEW
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small run: that it runs, not its figures")
    parser.add_argument("--headroom-mib", type=float, default=48.0)
    parser.add_argument("--way", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        PROMPTS, NEW = 12, 24
    ways = ["fixed", "toma", "restart", "one"]
    if args.way == "all":  # --quick: every way in one process (one import of transformers), one after the other
        print(json.dumps({way: run_way(way, args.headroom_mib, cap=way == ways[0]) for way in ways}))
        return
    if args.way:
        print(json.dumps(run_way(args.way, args.headroom_mib)))
        return
    if args.quick:
        command = [sys.executable, os.path.abspath(__file__), "--way", "all", "--quick"]
        command += ["--headroom-mib", str(args.headroom_mib)]
        env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_ARENA_MAX="1")
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1800)
        if done.returncode != 0:
            raise SystemExit(f"the quick run failed:\n{done.stdout}\n{done.stderr[-4000:]}")
        results = json.loads(done.stdout.strip().splitlines()[-1])
    else:
        results = {way: child(way, args.headroom_mib) for way in ways}
    import torch

    base = results["fixed"]["tokens_per_s"]
    print(
        f"torch {torch.__version__}, 1 thread, {PROMPTS} prompts, up to {NEW} new tokens, {args.headroom_mib:.0f} MiB cap\n"
    )
    print("| | generated tokens/s | seconds | equal to generate | ratio to the fixed batch |")
    print("|---|---:|---:|---|---:|")
    labels = {
        "fixed": f"largest fixed batch that fits ({results['fixed'].get('batch')})",
        "toma": "toma.generate",
        "restart": "restart on OOM (toma.batch around generate)",
        "one": "batch 1",
    }
    for way in ways:
        found = results[way]
        ratio = found["tokens_per_s"] / base if base else float("nan")
        print(f"| {labels[way]} | {found['tokens_per_s']} | {found['seconds']} | {found['equal']} | {ratio:.2f}x |")
    print(json.dumps(dict(results=results, toma_over_fixed=round(results["toma"]["tokens_per_s"] / base, 2))))


if __name__ == "__main__":
    main()
