"""`toma.accumulate(lengths=...)`: micro-batches packed by tokens and trimmed give the full batch's gradients and
loss, for GPT-2 and BERT built from configs, right and left padding, dict and keyword batches, `weight=` token means,
an out-of-memory error in the middle micro-batch, and a single row that still does not fit."""

import json

import pytest
import torch

from toma import FitToMemory, Halving, NoBatchsizeCache, explicit, toma

from helpers import COLLECT_TOMA_LOG, raise_fake_oom, run_python, run_pythons, run_ranks

transformers = pytest.importorskip("transformers")

WIDTH, VOCAB = 40, 97


def gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def bert():
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=3,
    )  # fmt: skip
    return transformers.BertForSequenceClassification(config)


def padded_batch(rows=14, seed=1, left=False):
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, WIDTH + 1, (rows,), generator=generator)
    lengths[3] = WIDTH
    mask = (torch.arange(WIDTH)[None] < lengths[:, None]).long()
    ids = torch.randint(1, VOCAB, (rows, WIDTH), generator=generator) * mask
    if left:
        mask, ids = mask.flip(1), ids.flip(1)
    return dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))


def label_tokens(batch):
    return (batch["labels"][:, 1:] != -100).sum()


def full_batch(model, batch):
    model.zero_grad()
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def assert_same(model, reference, rtol=1e-5):
    """Every gradient within `rtol` of the largest reference gradient (a parameter whose gradient is zero but
    for rounding is compared on that scale too)."""
    scale = max(float(expected.abs().max()) for expected in reference)
    for p, expected in zip(model.parameters(), reference):
        assert float((p.grad - expected).abs().max()) < rtol * scale


def test_gpt2_packed_and_trimmed_equals_the_full_batch_with_a_dict_batch():
    model, batch = gpt2(), padded_batch()
    loss, reference = full_batch(model, batch)
    model.zero_grad()
    shapes = []

    @toma.accumulate(model=model, lengths="attention_mask", initial_tokens=100, weight=label_tokens)
    def compute_loss(micro):
        if torch.is_grad_enabled():  # not toma's one check, without gradients, that the loss adds up
            shapes.append(tuple(micro["input_ids"].shape))
        return model(**micro).loss

    assert torch.allclose(compute_loss(batch), loss, rtol=1e-6)
    assert_same(model, reference)
    assert all(rows * width <= 100 for rows, width in shapes) and sum(rows for rows, _ in shapes) == 14
    assert shapes[0][1] == WIDTH and shapes[-1][1] < WIDTH, "longest first, then trimmed"
    assert [width for _, width in shapes] == sorted((width for _, width in shapes), reverse=True)


def test_without_a_starting_size_the_budget_starts_at_the_whole_batchs_padded_area():
    """No `initial_micro_batch` nor `initial_tokens`: the first attempt holds every row at the batch's width; an
    out-of-memory error from there packs by tokens below that area."""
    model, batch = gpt2(), padded_batch()
    loss, reference = full_batch(model, batch)
    model.zero_grad()
    shapes = []

    @toma.accumulate(
        model=model, lengths="attention_mask", weight=label_tokens, policy=Halving(), split_for_padding=False
    )
    def compute_loss(micro):
        if torch.is_grad_enabled():
            shapes.append(tuple(micro["input_ids"].shape))
            if micro["input_ids"].numel() > 14 * WIDTH // 2:
                raise_fake_oom()
        return model(**micro).loss

    assert torch.allclose(compute_loss(batch), loss, rtol=1e-6)
    assert_same(model, reference)
    assert shapes[0] == (14, WIDTH), "the whole batch first"
    assert shapes[1][0] * shapes[1][1] <= 14 * WIDTH // 2 and len(shapes) > 2


def test_gpt2_with_keyword_arguments_and_the_row_mean_of_bert():
    model, batch = gpt2(), padded_batch(seed=2)
    loss, reference = full_batch(model, batch)
    model.zero_grad()
    weight = lambda input_ids, attention_mask, labels: (labels[:, 1:] != -100).sum()  # noqa: E731
    got = explicit.accumulate(
        lambda **micro: model(**micro).loss, model, 3, toma_lengths="attention_mask", toma_weight=weight, **batch
    )
    assert torch.allclose(got, loss, rtol=1e-6)
    assert_same(model, reference)

    classifier, batch = bert(), padded_batch(seed=3)
    labels = torch.arange(14) % 3
    inputs = dict(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=labels)
    loss, reference = full_batch(classifier, inputs)
    classifier.zero_grad()

    @toma.accumulate(model=classifier, lengths="attention_mask", initial_micro_batch=4)
    def classify(input_ids, attention_mask, labels):
        return classifier(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss

    assert torch.allclose(classify(**inputs), loss, rtol=1e-6)
    assert_same(classifier, reference)


@pytest.mark.parametrize("positions", [True, False], ids=["position_ids given", "no position_ids"])
def test_left_padding_is_sorted_but_never_trimmed_and_exact(positions):
    """Dropping leading padding would change the loss even with position_ids: GPT-2 counts the first real token
    as predicted from the padding before it, whose output depends on how much padding there is."""
    model, batch = gpt2(), padded_batch(seed=4, left=True)
    if positions:
        batch["position_ids"] = (batch["attention_mask"].cumsum(1) - 1).clamp(min=0)
    loss, reference = full_batch(model, batch)
    model.zero_grad()
    widths = []

    @toma.accumulate(model=model, lengths="attention_mask", initial_tokens=120, weight=label_tokens)
    def compute_loss(micro):
        if torch.is_grad_enabled():  # not toma's one check, without gradients, that the loss adds up
            widths.append(micro["input_ids"].shape[1])
        return model(**micro).loss

    assert torch.allclose(compute_loss(batch), loss, rtol=1e-6)
    assert_same(model, reference)
    assert set(widths) == {WIDTH} and len(widths) > 1


def test_an_oom_in_the_middle_micro_batch_retries_a_smaller_budget_with_the_same_gradients():
    model, batch = gpt2(), padded_batch(seed=5)
    loss, reference = full_batch(model, batch)
    model.zero_grad()
    seen = []

    @toma.accumulate(model=model, lengths="attention_mask", initial_tokens=160, weight=label_tokens)
    def compute_loss(micro):
        rows, width = micro["input_ids"].shape
        if not torch.is_grad_enabled():  # toma's one check, without gradients, that the loss adds up
            return model(**micro).loss
        seen.append((rows, width))
        if len(seen) == 3:  # the third micro-batch of the first attempt: after two backward passes
            raise_fake_oom()
        return model(**micro).loss

    assert torch.allclose(compute_loss(batch), loss, rtol=1e-6)
    assert_same(model, reference)
    retry = seen[3:]
    assert max(r * w for r, w in retry) <= 80 and max(r * w for r, w in seen[:3]) > 80


def test_a_row_that_does_not_fit_alone_re_raises_the_original_error_without_smaller_budgets():
    model, batch = gpt2(), padded_batch(seed=6)
    attempts = []

    @toma.accumulate(
        model=model, lengths="attention_mask", initial_tokens=400, policy=Halving(), cache_type=NoBatchsizeCache
    )
    def compute_loss(micro):
        attempts.append(tuple(micro["input_ids"].shape))
        if micro["input_ids"].shape[1] == WIDTH:  # the longest row never fits, alone or not
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return model(**micro).loss

    with pytest.raises(torch.OutOfMemoryError, match="Tried to allocate 2.00 GiB") as raised:
        compute_loss(batch)
    notes = "\n".join(getattr(raised.value, "__notes__", []))
    assert "smallest token budget" in notes and "activation checkpointing tried too" in notes
    rows = [r for r, _ in attempts]
    # once every micro-batch holds one row, one more attempt with activation checkpointing (issue 42), then it stops
    # (the split check's two rows, failing, are tried once more with the model's calls cut into single rows)
    assert rows[-2:] == [1, 1] and len(attempts) <= 7, "stops once one row fails with every lever"


def test_fit_to_memory_learns_the_budget_and_the_second_call_starts_from_it():
    model = gpt2()
    budgets = []

    @toma.accumulate(model=model, lengths="attention_mask", initial_tokens=10**6, policy=FitToMemory())
    def compute_loss(micro):
        if torch.is_grad_enabled():  # not toma's one check, without gradients, that the loss adds up
            budgets.append(micro["input_ids"].numel())
        return model(**micro).loss

    compute_loss(padded_batch(seed=7))
    compute_loss(padded_batch(seed=8))
    assert compute_loss.stats.micro_batch is not None


def test_initial_tokens_needs_lengths_and_excludes_rows():
    model = gpt2()
    with pytest.raises(ValueError, match="initial_tokens is a token budget: it needs lengths="):
        toma.accumulate(model=model, initial_tokens=64)
    with pytest.raises(ValueError, match="initial_micro_batch .* or initial_tokens .*not both"):
        toma.accumulate(model=model, lengths="attention_mask", initial_micro_batch=2, initial_tokens=64)
    with pytest.raises(TypeError, match="lengths must be the name of a 0/1 mask"):
        toma.accumulate(model=model, initial_micro_batch=2, lengths=5)


LATE_LONG_BATCH_EPOCH = (
    COLLECT_TOMA_LOG
    + """
import json, os, torch, torch.nn as nn, torch.nn.functional as F
torch.set_num_threads(1)
from toma import Halving, toma
from toma.memory.cpu import predictable_heap, set_cpu_memory_headroom
predictable_heap()
VOCAB, WIDTH, HIDDEN = 64, 32, 4096


class PerToken(nn.Module):
    # its memory follows the padded tokens: about 4 x HIDDEN floats (64 KiB) for each
    def __init__(self):
        super().__init__()
        self.embed, self.up, self.down = nn.Embedding(VOCAB, WIDTH), nn.Linear(WIDTH, HIDDEN), nn.Linear(HIDDEN, VOCAB)

    def forward(self, input_ids, attention_mask, labels):
        logits = self.down(torch.relu(self.up(self.embed(input_ids))))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)


def epoch():
    generator = torch.Generator().manual_seed(0)
    batches = []
    for index in range(8):
        lengths = torch.randint(21, 41, (48,), generator=generator)
        if index == 6:  # the long tail comes late, as it does in a shuffled epoch
            lengths[5], lengths[9] = 512, 400
        width = int(lengths.max())
        mask = (torch.arange(width)[None] < lengths[:, None]).long()
        ids = torch.randint(1, VOCAB, (48, width), generator=generator) * mask
        batches.append(dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)))
    return batches


batches = epoch()
torch.manual_seed(1)
model = PerToken()
rows = dict(initial_micro_batch=48, policy=Halving())  # a fixed row count, found on the first batches
options = rows if os.environ["TOMA_MODE"] == "rows" else dict(lengths="attention_mask", initial_tokens=10**5)
weight = lambda input_ids, attention_mask, labels: (labels != -100).sum()
compute_loss = toma.accumulate(model=model, weight=weight, **options)(lambda **batch: model(**batch))
set_cpu_memory_headroom(96 / 1024)
retries_at = []
for index, batch in enumerate(batches):
    before = len([m for m in messages if "ran out of memory" in m])
    compute_loss(**batch)
    model.zero_grad()
    retries_at += [index] * (len([m for m in messages if "ran out of memory" in m]) - before)
print(json.dumps(dict(retries_at=retries_at, size=compute_loss.stats.micro_batch)))
"""
)


@pytest.mark.slow
def test_under_a_real_cpu_cap_a_learned_token_budget_runs_out_only_while_learning_and_fixed_rows_late():
    rows, tokens = run_pythons([LATE_LONG_BATCH_EPOCH] * 2, [dict(TOMA_MODE="rows"), dict(TOMA_MODE="tokens")], 400)
    found = {}
    for name, result in (("rows", rows), ("tokens", tokens)):
        assert result.returncode == 0, result.stdout + result.stderr
        found[name] = json.loads(result.stdout.strip().splitlines()[-1])
    assert found["tokens"]["retries_at"] and max(found["tokens"]["retries_at"]) <= 1, found
    assert any(index >= 2 for index in found["rows"]["retries_at"]), f"the rows found early never failed: {found}"


DDP_TOKENS = """
import json, os
import torch, torch.distributed as dist, torch.nn as nn, torch.nn.functional as F
from toma import NoBatchsizeCache, toma
torch.set_num_threads(1)
dist.init_process_group("gloo", timeout=__import__("datetime").timedelta(seconds=60))
rank, world = dist.get_rank(), dist.get_world_size()


class Tagger(nn.Module):  # a per-token model: a mean over the real tokens of every rank
    def __init__(self):
        super().__init__()
        self.embed, self.head = nn.Embedding(30, 8), nn.Linear(8, 30)

    def forward(self, input_ids, attention_mask, labels):
        return F.cross_entropy(self.head(self.embed(input_ids)).flatten(0, 1), labels.flatten(), ignore_index=-100)


def rows(seed, count):
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 25, (count,), generator=generator)
    mask = (torch.arange(24)[None] < lengths[:, None]).long()
    ids = torch.randint(1, 30, (count, 24), generator=generator) * mask
    return dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))


torch.manual_seed(0)
model = Tagger()
ddp = nn.parallel.DistributedDataParallel(model)
mine = rows(10 + rank, 12 if rank == 0 else 9)  # other rows, other token counts on each rank
budgets = []


@toma.accumulate(model=ddp, lengths="attention_mask", initial_tokens=200, cache_type=NoBatchsizeCache,
                 weight=lambda input_ids, attention_mask, labels: (labels != -100).sum())
def compute_loss(input_ids, attention_mask, labels):
    if rank == 1 and input_ids.numel() > 48:  # only rank 1 runs out, above 48 padded tokens
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")
    budgets.append(input_ids.numel())
    return ddp(input_ids, attention_mask, labels)


loss = compute_loss(**mine)
print(json.dumps(dict(grads=[p.grad.tolist() for p in model.parameters()], loss=float(loss),
                      budget=compute_loss.stats.micro_batch, largest=max(budgets))), flush=True)
dist.barrier()
dist.destroy_process_group()
os._exit(0)
"""


@pytest.mark.multiprocess
def test_ranks_agree_on_the_token_budget_and_train_the_token_mean_of_every_rank():
    outputs = run_ranks(DDP_TOKENS, 2, timeout=180)
    results = [json.loads(out.strip().splitlines()[-1]) for out in outputs]
    assert results[0]["budget"] == results[1]["budget"] < 200 and results[1]["largest"] <= 48, results
    namespace: dict = {}
    exec(DDP_TOKENS.split("torch.manual_seed(0)")[0].split("dist.init_process_group")[0], namespace)
    exec("class Tagger" + DDP_TOKENS.split("class Tagger")[1].split("torch.manual_seed(0)")[0], namespace)
    torch.manual_seed(0)
    reference = namespace["Tagger"]()
    both = [namespace["rows"](10, 12), namespace["rows"](11, 9)]
    joined = {key: torch.cat([part[key] for part in both]) for key in both[0]}
    reference(**joined).backward()  # the mean over both ranks' real tokens
    for result in results:
        for got, expected in zip(result["grads"], (p.grad for p in reference.parameters())):
            torch.testing.assert_close(torch.tensor(got), expected, rtol=1e-5, atol=1e-7)


@pytest.mark.slow
def test_under_a_real_cap_a_padding_free_row_trains_in_chunks_of_its_sequences_to_the_reference():
    """One packed row of 12 sequences (2,490 tokens, a vocabulary of 4,096) does not fit under the cap; no split by
    rows can cut it. Cut between its sequences, it trains the whole row's gradients."""
    run_python(
        """
        import torch
        torch.set_num_threads(1)
        from transformers import LlamaConfig, LlamaForCausalLM
        from toma import toma
        from toma.memory.cpu import predictable_heap, set_cpu_memory_headroom
        predictable_heap()
        def model():
            torch.manual_seed(0)
            config = LlamaConfig(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=512,
                                 attn_implementation="eager")
            return LlamaForCausalLM(config)
        lengths = [300, 120, 250, 200, 180, 260, 90, 310, 150, 220, 170, 240]
        ids = torch.randint(1, 4096, (1, sum(lengths)), generator=torch.Generator().manual_seed(1))
        positions = torch.cat([torch.arange(n) for n in lengths])[None]
        labels = ids.masked_fill(positions == 0, -100)
        batch = {"input_ids": ids, "position_ids": positions, "labels": labels, "use_cache": False}
        reference = model()
        reference(**batch).loss.backward()
        expected = [p.grad.clone() for p in reference.parameters()]
        del reference
        set_cpu_memory_headroom(0.1)
        net = model()
        try:
            net(**batch).loss.backward()
            raise SystemExit("the whole row fit under the cap")
        except RuntimeError as error:
            assert "can't allocate memory" in str(error), error
        for p in net.parameters():
            p.grad = None
        label_tokens = lambda b: (b["labels"][:, 1:] != -100).sum()
        seen = []
        def loss(b):
            seen.append(b["input_ids"].shape[1])
            assert b["position_ids"][0, 0] == 0, "a micro-batch starts at a sequence's start"
            return net(**b).loss
        step = toma.accumulate(model=net, lengths="position_ids", weight=label_tokens, initial_tokens=sum(lengths))(loss)
        step(batch)
        assert step.stats.oom_retries >= 1 and step.stats.micro_batch < sum(lengths), step.stats
        for p, e in zip(net.parameters(), expected):
            torch.testing.assert_close(p.grad, e, rtol=1e-4, atol=1e-6)
        print("ok", step.stats.micro_batch, seen)
        """,
        timeout=240,
    )


def test_a_context_shared_by_rows_and_tokens_keeps_sizes_apart(fresh_toma_state):
    """One `context=` and one call site for a function by rows and one by tokens: what either learns is in its own
    unit (8 rows are no budget of 8 tokens), so neither starts from the other's size."""
    model, batch = gpt2(), padded_batch()
    areas = []

    @toma.accumulate(model=model, initial_micro_batch=8, context="shared", policy=Halving())
    def by_rows(micro):
        if micro["input_ids"].shape[0] > 2:
            raise_fake_oom()
        return model(**micro).loss

    @toma.accumulate(
        model=model,
        lengths="attention_mask",
        initial_tokens=200,
        weight=label_tokens,
        context="shared",
        policy=Halving(),
    )
    def by_tokens(micro):
        if torch.is_grad_enabled():
            areas.append(micro["input_ids"].numel())
            if micro["input_ids"].numel() > 100:
                raise_fake_oom()
        return model(**micro).loss

    def step(run):
        model.zero_grad()
        run(batch)

    for run in (by_rows, by_tokens, by_rows, by_tokens):
        step(run)
    assert by_rows.stats.micro_batch == 2, "its own size, not the tokens' budget"
    assert by_tokens.stats.micro_batch == 100 and max(areas) == 200, "it started at its own budget, then halved"
    assert by_tokens.stats.oom_retries == 1 and by_rows.stats.oom_retries == 2, "each learned once, in its unit"
