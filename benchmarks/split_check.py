"""What toma's one check that a loss is what its parts add up to costs (issue 40): the first split logical batch of a
call site runs its first micro-batch once more together and once as two halves, without gradients.

Run: python benchmarks/split_check.py [--rounds 5] [--threads 1] [--quick]

A causal LM (a Llama from a config) trains logical batches of 64 rows of 128 tokens in micro-batches of 8 rows
(`toma.accumulate(initial_micro_batch=8, weight=label tokens)`). Each round makes two fresh call sites: one that
checks (`groups=None`, the default) and one told the rows are independent (`groups="rows"`), and times on each its
first logical batch (where the check runs) and a later one (where it never does), the two sites taking turns to go
first. The check's cost is the median of the rounds' first-batch ratios; the later batches' ratio shows that
nothing is left once it ran.
"""

import argparse
import statistics
import time
from typing import Any, Callable, Dict, List

import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers import logging as hf_logging

from toma import NoBatchsizeCache, toma

ROWS, MICRO = 64, 8
MODEL = dict(vocab_size=2048, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4)
QUICK_MODEL = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)


def make_model(shape: Dict[str, int], width: int) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        **shape, num_key_value_heads=shape["num_attention_heads"], max_position_embeddings=width, use_cache=False
    )
    return LlamaForCausalLM(config)


def batch_of(vocab: int, width: int, seed: int) -> Dict[str, torch.Tensor]:
    ids = torch.randint(1, vocab, (ROWS, width), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids}


def label_tokens(batch: Dict[str, torch.Tensor]) -> torch.Tensor:
    return (batch["labels"][:, 1:] != -100).sum()


def call_site(model: torch.nn.Module, groups: Any) -> Callable[..., Any]:
    @toma.accumulate(
        model=model, initial_micro_batch=MICRO, weight=label_tokens, groups=groups, cache_type=NoBatchsizeCache
    )
    def loss(batch: Dict[str, torch.Tensor]) -> torch.Tensor:
        return model(**batch).loss

    return loss


def timed(step: Callable[..., Any], batch: Dict[str, torch.Tensor], model: torch.nn.Module) -> float:
    model.zero_grad(set_to_none=True)
    start = time.process_time()
    step(batch)
    return time.process_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="a tiny model, one round: seconds")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    hf_logging.set_verbosity_error()
    shape, width = (QUICK_MODEL, 16) if args.quick else (MODEL, 128)
    rounds = 1 if args.quick else args.rounds
    model = make_model(shape, width)
    first, later = batch_of(shape["vocab_size"], width, 0), batch_of(shape["vocab_size"], width, 1)
    timed(call_site(model, "rows"), first, model)  # warm up
    ratios: Dict[str, List[float]] = {"first": [], "later": []}
    seconds: Dict[str, List[float]] = {"checked": [], "unchecked": []}
    for number in range(rounds):
        checked, unchecked = call_site(model, None), call_site(model, "rows")
        sites = [("checked", checked), ("unchecked", unchecked)]
        times: Dict[str, List[float]] = {"checked": [0.0, 0.0], "unchecked": [0.0, 0.0]}
        for index, batch in enumerate((first, later)):  # each batch on both sites, which goes first alternating
            for name, step in sites if (number + index) % 2 == 0 else sites[::-1]:
                times[name][index] = timed(step, batch, model)
        assert checked.stats.split_check.done, checked.stats
        ratios["first"].append(times["checked"][0] / times["unchecked"][0])
        ratios["later"].append(times["checked"][1] / times["unchecked"][1])
        seconds["checked"].append(times["checked"][0])
        seconds["unchecked"].append(times["unchecked"][0])
    print(
        f"Llama from a config: {shape['num_hidden_layers']} layers, width {shape['hidden_size']}; logical batches of "
        f"{ROWS} rows x {width} tokens in micro-batches of {MICRO}; torch {torch.__version__}, {args.threads} "
        f"thread(s), process CPU time, {rounds} round(s)"
    )
    print()
    print("| logical batch | checked (groups=None) | told independent (groups='rows') | ratio |")
    print("|---|---|---|---|")
    print(
        f"| the first split (the check runs) | {statistics.median(seconds['checked']):.3f} s | "
        f"{statistics.median(seconds['unchecked']):.3f} s | {statistics.median(ratios['first']):.3f}x |"
    )
    print(f"| every later one | | | {statistics.median(ratios['later']):.3f}x |")
    print()
    print(
        f"- the check: {statistics.median(ratios['first']) - 1:+.1%} on the first split logical batch of a call site "
        f"({ROWS // MICRO} micro-batches), {statistics.median(ratios['later']) - 1:+.1%} afterwards"
    )


if __name__ == "__main__":
    main()
