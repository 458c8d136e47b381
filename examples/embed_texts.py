"""Embed texts of very different lengths with a BERT built from a config, mean-pooled over the real tokens as
sentence-transformers does: fixed batches of 32 rows against `toma.map(lengths="attention_mask")`, which sorts
the rows by length, chunks them by a token budget (32 rows of the longest to start) and trims each chunk to its
longest row. It prints both times, the speed-up and the largest difference between the two sets of embeddings
(they agree to float rounding, in the texts' order).

    python examples/embed_texts.py            # 2048 texts
    python examples/embed_texts.py --quick    # 256 texts, for CI
    python examples/embed_texts.py --device cuda
"""

import argparse
import time

import torch
from transformers import BertConfig, BertModel

import toma

BATCH = 32
WIDTH = 256


def long_tailed_texts(rows: int, generator: torch.Generator) -> dict:
    """Token ids and masks of `rows` texts padded to WIDTH: most are short (median ~40 tokens), a few are long."""
    lengths = torch.distributions.LogNormal(3.7, 0.6).sample((rows,)).clamp(4, WIDTH).long()
    lengths[torch.randperm(rows, generator=generator)[: max(1, rows // 64)]] = WIDTH  # the long tail
    mask = (torch.arange(WIDTH)[None] < lengths[:, None]).long()
    ids = torch.randint(1, 1000, (rows, WIDTH), generator=generator) * mask
    return {"input_ids": ids, "attention_mask": mask}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="256 texts instead of 2048")
    parser.add_argument("--device", default="cpu", help="where BERT runs (the texts stay on the host)")
    options = parser.parse_args()
    torch.manual_seed(0)
    device = torch.device(options.device)
    config = BertConfig(vocab_size=1000, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=512, max_position_embeddings=WIDTH)  # fmt: skip
    bert = BertModel(config).to(device).eval()
    texts = long_tailed_texts(256 if options.quick else 2048, torch.Generator().manual_seed(1))
    padding = 1 - texts["attention_mask"].float().mean().item()

    def embed(batch: dict) -> torch.Tensor:
        batch = {key: value.to(device) for key, value in batch.items()}
        hidden = bert(**batch).last_hidden_state
        weights = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        return (hidden * weights).sum(1) / weights.sum(1)

    with torch.no_grad():
        embed({key: value[:2] for key, value in texts.items()})  # warm up
        started = time.perf_counter()
        rows = texts["input_ids"].shape[0]
        fixed = torch.cat([embed({k: v[s : s + BATCH] for k, v in texts.items()}).cpu() for s in range(0, rows, BATCH)])
        fixed_seconds = time.perf_counter() - started
        started = time.perf_counter()
        packed = toma.map(embed, texts, lengths="attention_mask", initial_step=BATCH, device=device)
        packed_seconds = time.perf_counter() - started
    print(f"{rows} texts padded to {WIDTH} tokens ({padding:.0%} padding), BERT of 2 layers, width 128, on {device}")
    print(f"fixed batches of {BATCH}: {fixed_seconds:.2f} s")
    print(f"toma.map(lengths='attention_mask'): {packed_seconds:.2f} s")
    print(f"speed-up: {fixed_seconds / packed_seconds:.2f}x")
    print(f"largest difference between the embeddings: {(fixed - packed).abs().max().item():.2e}")


if __name__ == "__main__":
    main()
