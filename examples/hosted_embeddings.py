"""Skip-gram (word2vec) with embedding tables larger than the device's memory: `toma.HostedEmbedding` keeps
both tables and their Adam state in host memory and moves only the rows a batch touches.

The text is generated here: sentences drawn from topics, each topic with its own words, so words of one topic
end up closer to each other than to other topics' words (printed at the end). The device gets a memory cap
smaller than one table: on a GPU through `torch.cuda.set_per_process_memory_fraction`; on the CPU
(`--device cpu`, the default without CUDA) the tables are made first and the process then gets only
`--cap-mib` more address space.

    python examples/hosted_embeddings.py [--device cpu|cuda] [--steps 200]
"""

import argparse
import logging
import sys
import time

import torch
import torch.nn.functional as F

from toma import HostedEmbedding
from toma.memory.cpu import predictable_heap, set_cpu_memory_headroom

VOCABULARY, WIDTH = 1_000_000, 64  # 256 MB per table, 768 MB with Adam's two moments
TOPICS, WORDS_PER_TOPIC = 20, 100  # the words in use: 2000 of the table's rows
PAIRS, NEGATIVES, WINDOW = 4096, 5, 2


def sentences(generator: torch.Generator, count: int, length: int = 8) -> torch.Tensor:
    """Rows of word ids; each sentence's words come from one topic's block of the vocabulary."""
    topics = torch.randint(0, TOPICS, (count, 1), generator=generator)
    return topics * WORDS_PER_TOPIC + torch.randint(0, WORDS_PER_TOPIC, (count, length), generator=generator)


def pairs(text: torch.Tensor) -> tuple:
    """(center, context) pairs within `WINDOW` words."""
    centers, contexts = [], []
    for shift in range(1, WINDOW + 1):
        centers += [text[:, :-shift], text[:, shift:]]
        contexts += [text[:, shift:], text[:, :-shift]]
    return torch.cat([c.reshape(-1) for c in centers]), torch.cat([c.reshape(-1) for c in contexts])


def topic_separation(table: torch.Tensor, generator: torch.Generator) -> tuple:
    """Mean cosine similarity of word pairs within one topic and across topics, over trained words."""
    topic = torch.randint(0, TOPICS, (2000,), generator=generator)
    first = topic * WORDS_PER_TOPIC + torch.randint(0, WORDS_PER_TOPIC, (2000,), generator=generator)
    second = topic * WORDS_PER_TOPIC + torch.randint(0, WORDS_PER_TOPIC, (2000,), generator=generator)
    other = ((topic + 1) % TOPICS) * WORDS_PER_TOPIC + torch.randint(0, WORDS_PER_TOPIC, (2000,), generator=generator)
    within = F.cosine_similarity(table[first], table[second]).mean().item()
    across = F.cosine_similarity(table[first], table[other]).mean().item()
    return within, across


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--cap-mib", type=int, default=160)
    options = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    device = torch.device(options.device)
    if device.type == "cuda" and device.index is None:  # the memory fraction wants an index (torch 2.11)
        device = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    if device.type == "cpu":
        torch.set_num_threads(1)  # thread stacks count against the cap too
        predictable_heap()

    def factory(params):
        return torch.optim.Adam(params, lr=0.01)

    centers = HostedEmbedding(VOCABULARY, WIDTH, optimizer=factory, device=device)
    contexts = HostedEmbedding(VOCABULARY, WIDTH, optimizer=factory, device=device)
    with torch.no_grad():
        centers.weight.mul_(0.1)
        contexts.weight.zero_()
    table_mib = centers.weight.numel() * centers.weight.element_size() / 2**20

    generator = torch.Generator().manual_seed(1)
    text = sentences(generator, options.steps * PAIRS // 28 + 1)
    center_ids, context_ids = pairs(text)
    # Make the optimizer state tables (host memory, like the tables) before the cap.
    warm = torch.arange(2)
    (centers(warm) * contexts(warm)).sum().mul(0).backward()
    centers.step()
    contexts.step()
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(options.cap_mib * 2**20 / total, device)
    else:
        set_cpu_memory_headroom(options.cap_mib / 1024)
    print(
        f"two tables of {VOCABULARY} x {WIDTH} ({table_mib:.0f} MiB each, with Adam state 3x that) on the host; "
        f"{device} capped at {options.cap_mib} MiB"
    )

    resident = []
    start = time.perf_counter()
    for step in range(options.steps):
        window = slice(step * PAIRS % len(center_ids), step * PAIRS % len(center_ids) + PAIRS)
        center, context = center_ids[window], context_ids[window]
        negatives = torch.randint(0, TOPICS * WORDS_PER_TOPIC, (len(center), NEGATIVES), generator=generator)
        u = centers(center)
        v = contexts(torch.cat([context.unsqueeze(1), negatives], 1))
        scores = (u.unsqueeze(1) * v).sum(-1)
        labels = torch.zeros_like(scores)
        labels[:, 0] = 1
        loss = F.binary_cross_entropy_with_logits(scores, labels)
        loss.backward()
        centers.step()
        contexts.step()
        resident.append(centers.resident_rows + contexts.resident_rows)
        if step % 50 == 0 or step == options.steps - 1:
            print(f"step {step}: loss {loss.item():.4f}, rows on the device {resident[-1]}")
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elapsed = time.perf_counter() - start
    print(
        f"{options.steps / elapsed:.1f} steps/s; rows on the device per step: mean {sum(resident) / len(resident):.0f}, "
        f"max {max(resident)} of {2 * VOCABULARY}"
    )
    within, across = topic_separation(centers.weight, generator)
    print(f"cosine similarity of words in one topic {within:.3f}, across topics {across:.3f}")
    if not within > across + 0.1:
        raise SystemExit("the embeddings did not learn the topics")


if __name__ == "__main__":
    main()
