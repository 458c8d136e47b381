"""Gradient caching (`toma.accumulation.gradient_cache`): losses that couple rows through the model's outputs trained
to the full batch's gradients with the model's calls in micro-batches; the random state replayed; refused where the
model mixes rows; evaluation on the whole batch's outputs."""

import json
import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from toma import CoupledRows, Halving, NoBatchsizeCache, toma
from toma.accumulation.gradient_cache import ModelMixesRows

from helpers import raise_fake_oom, run_python, run_ranks

RTOL, ATOL = 1e-5, 1e-6


class Encoder(nn.Module):
    """A small encoder whose forward runs out of memory (a stand-in) above `limit` rows; `calls` records the rows
    of every forward and whether it built a graph."""

    def __init__(self, dropout: float = 0.0, limit: int = 1 << 30) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inner = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Dropout(dropout), nn.Linear(32, 8))
        self.limit = limit
        self.calls = []

    def forward(self, x):
        self.calls.append((len(x), torch.is_grad_enabled()))
        if len(x) > self.limit:
            raise_fake_oom()
        return self.inner(x)


def info_nce(model, queries, documents):
    """In-batch negatives, the encoder called twice: each query against every document of the batch."""
    a, b = F.normalize(model(queries), dim=-1), F.normalize(model(documents), dim=-1)
    return F.cross_entropy(a @ b.T / 0.05, torch.arange(len(queries)))


def data(n=32, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(n, 16, generator=generator), torch.randn(n, 16, generator=generator)


def same_grads(model, reference):
    for (name, p), r in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, r.grad, rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")


def steps_of(model, loss, batches, lr=0.1):
    """Train `model` with SGD on `batches`, `loss(batch)` computing and backpropagating each step's loss."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for batch in batches:
        optimizer.zero_grad(set_to_none=True)
        loss(*batch)
        optimizer.step()


def test_info_nce_with_the_encoder_called_twice_trains_the_full_batch_for_four_steps_under_oom():
    reference, model = Encoder(), Encoder(limit=5)
    batches = [data(seed=s) for s in range(4)]
    steps_of(reference, lambda q, d: info_nce(reference, q, d).backward(), batches)
    step = toma.accumulate(model=model, policy=Halving())(lambda q, d: info_nce(model, q, d))
    steps_of(model, step, batches)
    for p, r in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, r, rtol=RTOL, atol=ATOL)
    assert step.stats.split_check.coupled and step.stats.micro_batch <= 4
    # the last step, its size remembered: each call in micro-batches of the rows chosen (at most 4: the size that
    # fits, or the fastest of its half and quarter), without a graph, then with one
    rows = model.calls[-1][0]  # the rows being timed (`ChunkSpeed`), or those chosen
    assert rows in (1, 2, 4), step.stats.split_check.speed
    count = 2 * 32 // rows
    assert model.calls[-2 * count :] == [(rows, False)] * count + [(rows, True)] * count, model.calls


class Clip(nn.Module):
    """Two inputs, two towers, a learned temperature the loss uses outside the forward."""

    def __init__(self, limit: int = 1 << 30) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.image = nn.Sequential(nn.Linear(12, 24), nn.GELU(), nn.Linear(24, 8))
        self.text = nn.Sequential(nn.Embedding(50, 8), nn.Flatten(), nn.Linear(40, 8))
        self.logit_scale = nn.Parameter(torch.tensor(2.0))
        self.limit = limit

    def forward(self, images, texts):
        if len(images) > self.limit:
            raise_fake_oom()
        return {"image_embeds": self.image(images), "text_embeds": self.text(texts)}


def clip_loss(model, images, texts):
    out = model(images, texts)
    a, b = F.normalize(out["image_embeds"], dim=-1), F.normalize(out["text_embeds"], dim=-1)
    logits = a @ b.T * model.logit_scale.exp()
    labels = torch.arange(len(images))
    return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2


def clip_data(seed):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(24, 12, generator=generator), torch.randint(0, 50, (24, 5), generator=generator)


def test_a_clip_like_model_with_two_inputs_a_dict_output_and_a_temperature_trains_the_full_batch():
    reference, model = Clip(), Clip(limit=7)
    batches = [clip_data(s) for s in range(4)]
    steps_of(reference, lambda i, t: clip_loss(reference, i, t).backward(), batches)
    step = toma.accumulate(model=model, initial_micro_batch=24, policy=Halving(), cache_type=NoBatchsizeCache)(
        lambda i, t: clip_loss(model, i, t)
    )
    steps_of(model, step, batches)
    for p, r in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, r, rtol=RTOL, atol=ATOL)
    assert step.stats.split_check.coupled and 6 <= step.stats.micro_batch <= 12  # chunks within the 7 rows that fit


class Features(nn.Module):
    """sentence-transformers' shape: one features dict in, the dict back with a sentence embedding added."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embedding = nn.Embedding(30, 16)
        self.dense = nn.Linear(16, 16)

    def forward(self, features):
        tokens = torch.tanh(self.dense(self.embedding(features["input_ids"])))
        mask = features["attention_mask"].unsqueeze(-1).float()
        pooled = (tokens * mask).sum(1) / mask.sum(1)
        return {**features, "token_embeddings": tokens, "sentence_embedding": pooled}


def features_data(seed, n=20, width=7):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 30, (n, width), generator=generator)
    lengths = torch.randint(2, width + 1, (n,), generator=generator)
    mask = (torch.arange(width)[None, :] < lengths[:, None]).long()
    return {"input_ids": ids * mask, "attention_mask": mask}


def mnrl(model, anchors, positives):
    a = model(anchors)["sentence_embedding"]
    p = model(positives)["sentence_embedding"]
    scores = F.normalize(a, dim=-1) @ F.normalize(p, dim=-1).T * 20
    return F.cross_entropy(scores, torch.arange(len(a)))


def test_a_features_dict_forward_called_positionally_trains_the_full_batch():
    reference, model = Features(), Features()
    anchors, positives = features_data(1), features_data(2)
    mnrl(reference, anchors, positives).backward()
    step = toma.accumulate(model=model, initial_micro_batch=6)(lambda a, p: mnrl(model, a, p))
    loss = step(anchors, positives)
    same_grads(model, reference)
    torch.testing.assert_close(loss, mnrl(reference, anchors, positives).detach(), rtol=RTOL, atol=ATOL)
    assert step.stats.split_check.coupled


def masks_of(model):
    """Every dropout mask drawn in `model`'s Dropout modules, in order, with whether a graph was built."""
    masks = []

    def record(module, inputs, output):
        masks.append(((output != 0) | (inputs[0] == 0), torch.is_grad_enabled()))

    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.register_forward_hook(record)
    return masks


def test_dropout_draws_the_same_masks_in_both_passes_and_the_gradients_of_the_model_called_in_micro_batches():
    """With dropout on, no split gives the unsplit run's masks; gradient caching gives those of the model called in
    micro-batches of its size, the same in its first pass (no graph) and its second (with graph): the gradients are
    exactly those of that loss."""
    queries, documents = data()
    model = Encoder(dropout=0.3)
    masks = masks_of(model)
    step = toma.accumulate(model=model, initial_micro_batch=8)(lambda q, d: info_nce(model, q, d))
    torch.manual_seed(7)
    step(queries, documents)
    assert step.stats.split_check.coupled
    first = [mask for mask, graph in masks if not graph and mask.shape[0] == 8 and model.training]
    second = [mask for mask, graph in masks if graph]
    assert len(second) == 8 and len(first) >= 8  # 4 micro-batches a call, 2 calls (the checks ran in eval mode)
    for a, b in zip(first[-8:], second):
        assert torch.equal(a, b)
    assert not all(torch.equal(second[0], mask) for mask in second[1:]), "masks differ between micro-batches"

    reference = Encoder(dropout=0.3)
    torch.manual_seed(7)

    def chunked(x):  # the model called in micro-batches of 8, with graph, from the same random state
        return torch.cat([reference(part) for part in x.split(8)])

    a, b = F.normalize(chunked(queries), dim=-1), F.normalize(chunked(documents), dim=-1)
    F.cross_entropy(a @ b.T / 0.05, torch.arange(32)).backward()
    same_grads(model, reference)
    with_seed_after = torch.rand(3)
    torch.manual_seed(7)
    model.zero_grad(set_to_none=True)
    step(queries, documents)
    assert torch.equal(torch.rand(3), with_seed_after), "the random state after the call as after the first pass"


def test_batchnorm_in_training_mode_is_refused_by_name_before_anything_trains():
    model = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.Linear(32, 8))
    before = [b.clone() for b in model.buffers()]
    with pytest.raises(ModelMixesRows, match=r"BatchNorm.*: 1") as raised:
        toma.accumulate(model=model, initial_micro_batch=8)(lambda q, d: info_nce(model, q, d))(*data())
    assert isinstance(raised.value, CoupledRows) and "groups=" in str(raised.value)
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, model.buffers()))
    model.eval()  # BatchNorm in eval mode treats rows independently: trained by gradient caching, exactly
    reference = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.Linear(32, 8))
    reference.load_state_dict(model.state_dict())
    reference.eval()
    info_nce(reference, *data()).backward()
    toma.accumulate(model=model, initial_micro_batch=8)(lambda q, d: info_nce(model, q, d))(*data())
    same_grads(model, reference)


class Centred(nn.Module):
    """A forward that mixes rows: each row's output against the batch's mean."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(16, 8)

    def forward(self, x):
        out = self.linear(x)
        return out - out.mean(0)


class Pooled(nn.Module):
    """Outputs that are not by rows: one vector for the whole batch."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 8)

    def forward(self, x):
        return self.linear(x).mean(0)


@pytest.mark.parametrize("model, says", [(Centred(), "mixes rows"), (Pooled(), "not one row per input row")])
def test_a_forward_that_mixes_rows_or_outputs_not_by_rows_is_refused_naming_it(model, says):
    def loss(q, d):
        a, b = model(q), model(d)
        return (a - b).pow(2).sum() + torch.logsumexp(a.flatten(), 0)

    with pytest.raises(ModelMixesRows, match=says):
        toma.accumulate(model=model, initial_micro_batch=8)(loss)(*data())
    assert all(p.grad is None for p in model.parameters())


def test_a_coupled_loss_that_never_calls_the_model_is_refused_naming_the_model():
    model = Encoder()
    other = Encoder()
    with pytest.raises(CoupledRows, match="never called the model= given"):
        toma.accumulate(model=model, initial_micro_batch=8)(lambda q, d: info_nce(other, q, d))(*data())


def test_without_gradients_a_coupled_loss_is_the_whole_batchs_never_an_average_of_parts():
    model = Encoder(limit=8)
    queries, documents = data()
    with torch.no_grad():
        plain = info_nce(Encoder(), queries, documents)
        step = toma.accumulate(model=model, policy=Halving(), cache_type=NoBatchsizeCache)(
            lambda q, d: info_nce(model, q, d)
        )
        value = step(queries, documents)
    torch.testing.assert_close(value, plain, rtol=RTOL, atol=ATOL)
    with torch.no_grad():
        parts = torch.stack([info_nce(model.inner, q, d) for q, d in zip(queries.split(8), documents.split(8))]).mean()
    assert abs(float(parts) - float(plain)) > 0.1, "the average of the parts' losses is another number"
    assert all(p.grad is None for p in model.parameters())


def test_without_gradients_an_independent_loss_is_its_parts_weighted():
    model = Encoder(limit=8)
    inputs, targets = torch.randn(30, 16), torch.randint(0, 8, (30,))
    with torch.no_grad():
        value = toma.accumulate(model=model, policy=Halving(), cache_type=NoBatchsizeCache)(
            lambda x, y: F.cross_entropy(model(x), y)
        )(inputs, targets)
        plain = F.cross_entropy(model.inner(inputs), targets)
    torch.testing.assert_close(value, plain, rtol=RTOL, atol=ATOL)


def test_an_oom_in_the_second_pass_drops_what_it_added_and_the_retry_trains_the_full_batch():
    """The first pass fits at 8 rows; the second runs out of memory on its third micro-batch with graph (once):
    the gradients it added are dropped, the retry at 4 rows trains the full batch's."""
    reference, model = Encoder(), Encoder()
    queries, documents = data()
    info_nce(reference, queries, documents).backward()
    graphs = []
    original = model.inner.forward

    def failing(x):
        if torch.is_grad_enabled():
            graphs.append(len(x))
            if len(graphs) == 3 and len(x) == 8:
                raise_fake_oom()
        return original(x)

    model.inner.forward = failing
    step = toma.accumulate(model=model, initial_micro_batch=8, policy=Halving(), cache_type=NoBatchsizeCache)(
        lambda q, d: info_nce(model, q, d)
    )
    step(queries, documents)
    assert step.stats.oom_retries == 1 and step.stats.micro_batch == 4
    same_grads(model, reference)


def test_an_error_that_is_not_out_of_memory_in_either_pass_passes_through_untouched():
    model = Encoder()
    error = ValueError("not about memory")
    original = model.inner.forward

    def failing(x):
        if torch.is_grad_enabled():
            raise error
        return original(x)

    model.inner.forward = failing
    step = toma.accumulate(model=model, initial_micro_batch=8)(lambda q, d: info_nce(model, q, d))
    with pytest.raises(ValueError) as raised:
        step(*data())
    assert raised.value is error
    assert "forward" not in model.__dict__, "the model's forward as it was"


def test_keyboard_interrupt_in_the_first_pass_is_never_swallowed_and_the_forward_is_put_back():
    model = Encoder()
    step = toma.accumulate(model=model, initial_micro_batch=8)(lambda q, d: info_nce(model, q, d))
    step(*data())  # coupled: the next call caches
    original = model.inner.forward

    def interrupted(x):
        if not torch.is_grad_enabled():
            raise KeyboardInterrupt
        return original(x)

    model.inner.forward = interrupted
    with pytest.raises(KeyboardInterrupt):
        step(*data())
    assert "forward" not in model.__dict__


def test_groups_still_override_gradient_caching():
    model = Encoder()
    seen = []

    def loss(q, d):
        if torch.is_grad_enabled():
            seen.append(len(q))
        return info_nce(model, q, d)

    toma.accumulate(model=model, initial_micro_batch=8, groups="rows")(loss)(*data())
    assert seen == [8, 8, 8, 8], "rows declared independent: micro-batches of the loss, no gradient caching"


def test_choosing_gradient_caching_is_said_once(caplog):
    model = Encoder()
    step = toma.accumulate(model=model, initial_micro_batch=8)(lambda q, d: info_nce(model, q, d))
    with caplog.at_level(logging.INFO, logger="toma"):
        step(*data())
        step(*data())
    assert caplog.text.count("trains by gradient caching") == 1


@pytest.mark.slow
def test_under_a_real_cap_info_nce_and_clip_train_the_full_batch_by_gradient_caching():
    """Real out-of-memory errors under an address-space cap: the whole batch does not fit, toma finds the coupled
    loss and trains it by gradient caching, to the full batch's parameters after two steps."""
    out = run_python(
        """
        import torch, torch.nn as nn, torch.nn.functional as F
        from toma import toma
        from toma.memory.cpu import predictable_heap, set_cpu_memory_headroom
        torch.set_num_threads(1)
        predictable_heap()
        N, WIDTH = 2048, 8192  # one call's activations: 64 MiB
        def model():
            torch.manual_seed(0)
            return nn.Sequential(nn.Linear(32, WIDTH), nn.Dropout(0.0), nn.ReLU(), nn.Linear(WIDTH, 16))
        def info_nce(net, q, d):
            a, b = F.normalize(net(q), dim=-1), F.normalize(net(d), dim=-1)
            return F.cross_entropy(a @ b.T / 0.05, torch.arange(len(q)))
        batches = [(torch.randn(N, 32), torch.randn(N, 32)) for _ in range(2)]
        reference = model()
        optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
        for q, d in batches:  # uncapped: the full batch
            optimizer.zero_grad()
            info_nce(reference, q, d).backward()
            optimizer.step()
        expected = [p.detach().clone() for p in reference.parameters()]
        del reference, optimizer
        set_cpu_memory_headroom(0.2)  # 200 MiB: the full batch's two calls with their graphs do not fit
        net = model()
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
        step = toma.accumulate(model=net, initial_micro_batch=N)(lambda q, d: info_nce(net, q, d))
        for q, d in batches:
            optimizer.zero_grad()
            step(q, d)
            optimizer.step()
        assert step.stats.oom_retries >= 1 and step.stats.split_check.coupled, step.stats
        for p, e in zip(net.parameters(), expected):
            torch.testing.assert_close(p.detach(), e, rtol=1e-4, atol=1e-6)
        print("ok", step.stats.micro_batch, step.stats.oom_retries)
        """,
        timeout=240,
    )
    assert "ok" in out.stdout


class Pooling(nn.Module):
    """A mean over each row's tokens (its attention mask), as a sentence embedding."""

    def __init__(self, limit_tokens: int = 1 << 30) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embedding = nn.Embedding(30, 16)
        self.dense = nn.Linear(16, 8)
        self.limit_tokens = limit_tokens
        self.shapes = []

    def forward(self, input_ids, attention_mask):
        self.shapes.append(tuple(input_ids.shape))
        if input_ids.numel() > self.limit_tokens:
            raise_fake_oom()
        tokens = torch.tanh(self.dense(self.embedding(input_ids)))
        mask = attention_mask.unsqueeze(-1).float()
        return (tokens * mask).sum(1) / mask.sum(1)


def test_with_a_token_budget_each_call_holds_the_rows_of_its_width_that_fit():
    """`lengths="attention_mask"`: the budget counts tokens; each call of the model is cut into micro-batches of as
    many rows as a micro-batch of the longest rows holds at that budget (sorted by length, trimmed): within it."""
    features = features_data(3, n=24, width=6)
    reference, model = Pooling(), Pooling(limit_tokens=40)

    def halves_nce(net, input_ids, attention_mask):  # every row against every other: any number of rows
        embedded = F.normalize(net(input_ids, attention_mask), dim=-1)
        return torch.logsumexp((embedded @ embedded.T * 20).flatten(), 0) - 20

    halves_nce(reference, features["input_ids"], features["attention_mask"]).backward()
    step = toma.accumulate(model=model, lengths="attention_mask", policy=Halving(), cache_type=NoBatchsizeCache)(
        lambda input_ids, attention_mask: halves_nce(model, input_ids, attention_mask)
    )
    step(input_ids=features["input_ids"], attention_mask=features["attention_mask"])
    same_grads(model, reference)
    assert step.stats.split_check.coupled
    # the last attempt's two passes: each a call of 24 rows cut into micro-batches of at most 40 tokens
    passes = model.shapes[-2 * (24 // (40 // 6)) :]
    assert all(rows * width <= 40 for rows, width in passes) and sum(rows for rows, _ in passes) == 2 * 24, passes


class Tokens(Features):
    """A features dict in, the dict back (its inputs passed through, as sentence-transformers' modules do) with token
    and sentence embeddings; records each call's `(rows, width)`."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes = []

    def forward(self, features):
        self.shapes.append(tuple(features["input_ids"].shape))
        return super().forward(features)


def late_interaction(model, queries, documents):
    """ColBERT-like: each query token's best match among a document's real tokens, summed, every query against every
    document of the batch; plus the sentence embeddings' in-batch negatives."""
    q, d = model(queries), model(documents)
    assert torch.equal(q["input_ids"], queries["input_ids"]) and torch.equal(
        d["attention_mask"], documents["attention_mask"]
    )
    qt, dt = F.normalize(q["token_embeddings"], dim=-1), F.normalize(d["token_embeddings"], dim=-1)
    similarity = torch.einsum("qid,ejd->qeij", qt, dt).masked_fill(
        documents["attention_mask"][None, :, None, :] == 0, -1
    )
    scores = (similarity.max(-1).values * queries["attention_mask"][:, None, :]).sum(-1)
    labels = torch.arange(len(scores))
    return F.cross_entropy(scores, labels) + mnrl(model, queries, documents)


def padded_with(features, pad_id):
    return {**features, "input_ids": torch.where(features["attention_mask"] == 1, features["input_ids"], pad_id)}


def test_inside_each_call_rows_are_grouped_by_length_trimmed_and_their_outputs_come_back_in_the_calls_order():
    """A call carrying an `attention_mask` that is cut: its rows sorted by length, each micro-batch trimmed to its
    longest row, the outputs (token embeddings padded back, the inputs passed through as the call gave them, pad id 7
    included) in the call's row order: the full batch's gradients and loss, in training and in evaluation."""
    queries, documents = (
        padded_with(features_data(4, n=16, width=9), 7),
        padded_with(features_data(5, n=16, width=9), 7),
    )
    reference, model = Tokens(), Tokens()
    expected = late_interaction(reference, queries, documents)
    expected.backward()
    step = toma.accumulate(model=model, initial_micro_batch=4, cache_type=NoBatchsizeCache)(
        lambda q, d: late_interaction(model, q, d)
    )
    loss = step(queries, documents)
    same_grads(model, reference)
    torch.testing.assert_close(loss, expected.detach(), rtol=RTOL, atol=ATOL)
    assert step.stats.split_check.coupled
    widths = [width for rows, width in model.shapes if rows == 4]
    longest = sorted((int(m.sum()) for m in queries["attention_mask"]), reverse=True)
    assert widths and min(widths) < 9, model.shapes  # the short rows' micro-batches were trimmed
    assert longest[0] in widths and longest[-4] in widths, (longest, widths)  # each trimmed to its longest row

    with torch.no_grad():
        model.shapes.clear()
        evaluated = step(queries, documents)
        torch.testing.assert_close(evaluated, late_interaction(reference, queries, documents), rtol=RTOL, atol=ATOL)
        assert min(width for _, width in model.shapes) < 9


def test_where_every_micro_batch_has_one_width_an_output_as_wide_by_chance_is_not_padded_back():
    """Rows all 16 tokens long padded to 20 (a collator's max_length): every micro-batch trimmed to 16, the width of the
    sentence embedding too; a probe one position wider tells the token embeddings (by position) from it."""
    generator = torch.Generator().manual_seed(6)
    mask = torch.zeros(12, 20, dtype=torch.long)
    mask[:, :16] = 1
    queries = {"input_ids": torch.randint(1, 30, (12, 20), generator=generator) * mask, "attention_mask": mask}
    documents = {"input_ids": torch.randint(1, 30, (12, 20), generator=generator) * mask, "attention_mask": mask}
    reference, model = Tokens(), Tokens()
    expected = late_interaction(reference, queries, documents)
    expected.backward()
    step = toma.accumulate(model=model, initial_micro_batch=4, cache_type=NoBatchsizeCache)(
        lambda q, d: late_interaction(model, q, d)
    )
    torch.testing.assert_close(step(queries, documents), expected.detach(), rtol=RTOL, atol=ATOL)
    same_grads(model, reference)
    assert model.shapes.count((4, 16)) >= 12  # 3 micro-batches a call, 2 calls, 2 passes (the split check ran whole)
    assert (1, 17) in model.shapes  # the probe


class Timed(Encoder):
    """An encoder whose forward takes `seconds(rows)` more (a sleep): per-row cost that grows or falls with the rows."""

    def __init__(self, seconds) -> None:
        super().__init__()
        self.seconds = seconds

    def forward(self, x):
        if not torch.is_grad_enabled():
            __import__("time").sleep(self.seconds(len(x)))
        return super().forward(x)


@pytest.mark.parametrize(
    "seconds, fastest",
    [(lambda rows: 0.0004 * rows * rows, 2), (lambda rows: 0.01, 16)],
    ids=["smaller-is-faster", "larger-is-faster"],
)
def test_the_micro_batch_rows_are_chosen_by_speed_and_every_choice_trains_the_full_batch(seconds, fastest):
    """Any micro-batch rows give gradient caching the same gradients: the first calls time the size that fits (16), its
    half, quarter and eighth (two rounds), and the smallest within 2% of the fastest per row is kept."""
    batches = [data(seed=s) for s in range(9)]
    reference, model = Encoder(), Timed(seconds)
    # a loss function of its own per case: what a call site learned (its split check, its rows) is kept per function
    loss = (lambda q, d: info_nce(model, q, d)) if fastest == 2 else (lambda q, d: info_nce(model, q, d) * 1.0)
    step = toma.accumulate(model=model, initial_micro_batch=16, cache_type=NoBatchsizeCache)(loss)
    for queries, documents in batches:
        reference.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)
        info_nce(reference, queries, documents).backward()
        step(queries, documents)
        same_grads(model, reference)
    speed = step.stats.split_check.speed
    assert speed.candidates == [16, 8, 4, 2] and speed.chosen == fastest, speed.seconds_per_row
    assert model.calls[-1] == (fastest, True) and f"micro-batches of {fastest} rows, the fastest" in str(step.stats)


def test_where_two_rows_do_not_fit_even_without_gradients_the_check_cuts_the_models_calls_and_caching_trains():
    """The encoder refuses more than one row with or without gradients: the split check's whole (two rows) runs with
    the model's calls cut into single rows, finds the coupling, and gradient caching trains the full batch's gradients
    one row at a time (the model's rows cannot be compared: a warning says so)."""
    queries, documents = data(n=8)
    reference, model = Encoder(), Encoder(limit=1)
    info_nce(reference, queries, documents).backward()
    step = toma.accumulate(model=model, policy=Halving(), cache_type=NoBatchsizeCache)(
        lambda q, d: info_nce(model, q, d)
    )
    step(queries, documents)
    same_grads(model, reference)
    assert step.stats.split_check.coupled


DDP_CODE = """
import json, os
import torch, torch.distributed as dist, torch.nn as nn, torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from toma import toma, StacktraceMemoryBatchsizeCache
torch.set_num_threads(1)
StacktraceMemoryBatchsizeCache.TRACK_RAM = False
dist.init_process_group("gloo", timeout=__import__("datetime").timedelta(seconds=60))
rank = dist.get_rank()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 8))
generator = torch.Generator().manual_seed(1)
queries, documents = torch.randn(64, 16, generator=generator), torch.randn(64, 16, generator=generator)
mine = slice(rank * 32, (rank + 1) * 32)
ddp = nn.parallel.DistributedDataParallel(model)
reducer_allreduces = []
def counting_hook(state, bucket):
    reducer_allreduces.append(bucket.index())
    return allreduce_hook(state, bucket)
ddp.register_comm_hook(None, counting_hook)
collectives = []
_all_reduce = dist.all_reduce
def counting_all_reduce(tensor, *args, **kwargs):
    collectives.append(tensor.numel())
    return _all_reduce(tensor, *args, **kwargs)
dist.all_reduce = counting_all_reduce

@toma.accumulate(model=ddp, initial_micro_batch=8)
def info_nce(q, d):
    a, b = F.normalize(ddp(q), dim=-1), F.normalize(ddp(d), dim=-1)
    return F.cross_entropy(a @ b.T / 0.05, torch.arange(len(q)))

counts = []
for _ in range(2):
    ddp.zero_grad(set_to_none=True)
    collectives.clear()
    info_nce(queries[mine], documents[mine])
    counts.append([len(reducer_allreduces), sum(n > 1 for n in collectives)])
    reducer_allreduces.clear()
print(json.dumps(dict(counts=counts, coupled=info_nce.stats.split_check.coupled,
                      grads=[p.grad.tolist() for p in model.parameters()])), flush=True)
dist.barrier()
dist.destroy_process_group()
os._exit(0)
"""


@pytest.mark.multiprocess
def test_under_ddp_gradient_caching_all_reduces_once_per_logical_batch_and_each_rank_sees_its_batch():
    outputs = run_ranks(DDP_CODE, 2, timeout=120)
    results = [json.loads(out.strip().splitlines()[-1]) for out in outputs]
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 8))
    generator = torch.Generator().manual_seed(1)
    queries, documents = torch.randn(64, 16, generator=generator), torch.randn(64, 16, generator=generator)
    for rank in range(2):  # DDP averages the ranks' gradients, each of its own batch's loss
        (
            info_nce(reference, queries[rank * 32 : (rank + 1) * 32], documents[rank * 32 : (rank + 1) * 32]) / 2
        ).backward()
    for result in results:
        assert result["coupled"]
        assert result["counts"] == [[0, 1], [0, 1]], "one gradient all-reduce per logical batch, none per micro-batch"
        for got, r in zip(result["grads"], reference.parameters(), strict=True):
            torch.testing.assert_close(torch.tensor(got), r.grad, rtol=RTOL, atol=ATOL)


def test_a_frozen_tower_and_a_call_under_no_grad_are_not_replayed_and_the_rest_trains_the_full_batch():
    """LiT's shape: the image tower frozen (its outputs take no gradient), and a teacher call under no_grad inside the
    loss: neither is run again with a graph; the text tower trains the full batch's gradients."""
    reference, model = Clip(), Clip()
    for clip in (reference, model):
        clip.image.requires_grad_(False)
    teacher = Encoder()
    images, texts = clip_data(3)

    def loss(net, images, texts):
        with torch.no_grad():
            target = teacher(torch.randn(len(images), 16, generator=torch.Generator().manual_seed(9)))
        return clip_loss(net, images, texts) + 0.0 * target.sum()

    loss(reference, images, texts).backward()
    teacher.calls.clear()
    step = toma.accumulate(model=model, initial_micro_batch=6)(lambda i, t: loss(model, i, t))
    step(images, texts)
    assert step.stats.split_check.coupled
    for p, r in zip(model.parameters(), reference.parameters()):
        if r.requires_grad:
            torch.testing.assert_close(p.grad, r.grad, rtol=RTOL, atol=ATOL)


class KeysInTurn(nn.Module):
    """A dict output whose keys come in another order at every call."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(16, 8), nn.Linear(16, 8)
        self.turn = 0

    def forward(self, x):
        self.turn += 1
        pairs = [("first", self.a(x)), ("second", self.b(x))]
        return dict(pairs if self.turn % 2 else pairs[::-1])


def test_a_dict_whose_keys_come_in_another_order_at_each_call_pairs_each_gradient_with_its_output():
    reference, model = KeysInTurn(), KeysInTurn()

    def loss(net, q):
        out = net(q)
        a, b = F.normalize(out["first"], dim=-1), F.normalize(out["second"], dim=-1)
        return F.cross_entropy(a @ b.T * 10, torch.arange(len(q)))

    queries, _ = data()
    loss(reference, queries).backward()
    toma.accumulate(model=model, initial_micro_batch=8)(lambda q: loss(model, q))(queries)
    same_grads(model, reference)


def test_a_call_whose_inputs_require_gradients_is_refused_naming_why():
    model = Encoder()
    with pytest.raises(ModelMixesRows, match="inputs that require gradients"):
        toma.accumulate(model=model, initial_micro_batch=8)(
            lambda q, d: info_nce(model, F.pad(model(q), (0, 8)), d)  # a call on another call's outputs
        )(*data())
    assert all(p.grad is None for p in model.parameters())


class OwnLoss(nn.Module):
    """A model that computes its loss itself (a Hugging Face model given labels): a scalar, not rows."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(16, 8)

    def forward(self, x):
        scores = F.normalize(self.linear(x), dim=-1)
        return (scores @ scores.T).logsumexp(-1).mean()


def test_a_loss_the_model_computes_itself_is_refused_naming_the_remedies():
    model = OwnLoss()
    with pytest.raises(ModelMixesRows, match="compute the loss outside the model.*weight="):
        toma.accumulate(model=model, initial_micro_batch=8)(lambda q: model(q))(data()[0])


def test_the_stats_print_a_short_summary_naming_gradient_caching():
    model = Encoder()
    step = toma.accumulate(model=model, initial_micro_batch=8)(lambda q, d: info_nce(model, q, d))
    step(*data())
    assert (
        str(step.stats)
        == "toma: micro-batch 8; 0 out-of-memory retries over 1 call; the loss couples rows: gradient caching"
    )
    assert repr(step.stats).startswith("AccumulationStats(")
