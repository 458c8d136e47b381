"""Losses that couple rows: found before a split batch trains anything, then trained exactly by gradient caching
(`tests/accumulation/test_gradient_cache.py` tests it further) or, where `groups=` says how the rows belong together,
in micro-batches of whole groups (pairs, groups); refused where neither is exact; the one check and what it leaves
behind."""

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from toma import CoupledRows, Halving, NoBatchsizeCache, explicit, toma
from toma.accumulation.per_function import learned_about

from helpers import raise_fake_oom, run_python

RTOL, ATOL = 1e-5, 1e-7


def encoder():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 8))


def info_nce(model, queries, documents):
    """In-batch negatives: each query against every document of the batch."""
    a, b = F.normalize(model(queries), dim=-1), F.normalize(model(documents), dim=-1)
    return F.cross_entropy(a @ b.T / 0.05, torch.arange(len(queries)))


def pairs_data(n=32):
    torch.manual_seed(1)
    return torch.randn(n, 16), torch.randn(n, 16)


class OutOfMemoryAbove(nn.Module):
    """`model` whose forward runs out of memory above `rows` rows (a stand-in for a real cap)."""

    def __init__(self, model, rows):
        super().__init__()
        self.model, self.rows = model, rows

    def forward(self, x):
        if len(x) > self.rows:
            raise_fake_oom()
        return self.model(x)


def test_in_batch_negatives_split_by_an_oom_train_the_full_batch_by_gradient_caching(caplog):
    reference, model = encoder(), OutOfMemoryAbove(encoder(), 8)
    queries, documents = pairs_data()
    info_nce(reference, queries, documents).backward()

    @toma.accumulate(model=model, initial_micro_batch=32, policy=Halving())
    def loss(queries, documents):
        return info_nce(model, queries, documents)

    with caplog.at_level(logging.INFO, logger="toma"):
        value = loss(queries, documents)
    assert "trains by gradient caching" in caplog.text and "8 rows together is" in caplog.text
    assert loss.stats.split_check.coupled and loss.stats.micro_batch == 8
    torch.testing.assert_close(value, info_nce(reference, queries, documents).detach(), rtol=RTOL, atol=ATOL)
    for p, r in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, r.grad, rtol=RTOL, atol=ATOL)


def batchnorm_encoder():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.Tanh(), nn.Linear(32, 8))


@pytest.mark.parametrize("form", ["decorated", "inline", "explicit"])
def test_a_refused_loss_is_refused_at_every_later_call_and_never_trains_split(form):
    """Catching `CoupledRows` and calling again (a retry loop, a notebook cell run twice) must not train it: in-batch
    negatives through a model that mixes rows (BatchNorm in training mode), which gradient caching cannot cut."""
    model = batchnorm_encoder()
    queries, documents = pairs_data()

    def loss(queries, documents):
        return info_nce(model, queries, documents)

    decorated = toma.accumulate(model=model, initial_micro_batch=8)(loss)
    for _ in range(3):
        with pytest.raises(CoupledRows):
            if form == "decorated":
                decorated(queries, documents)
            elif form == "inline":
                toma.accumulate(model=model, initial_micro_batch=8)(loss)(queries, documents)
            else:
                explicit.accumulate(loss, model, 8, queries, documents)
    assert all(p.grad is None for p in model.parameters())


def test_a_loss_function_wrapped_anew_at_every_call_is_checked_once():
    """`explicit.accumulate` and an inline `toma.accumulate(...)(f)(...)` wrap the function at every call: the
    check is the function's (its code's), so it runs once (three passes without gradients), not once per call;
    another function is checked on its own."""
    model = encoder()
    inputs, targets = torch.randn(12, 16), torch.randint(0, 8, (12,))
    unchecked = []

    def first(inputs, targets):
        if not torch.is_grad_enabled():
            unchecked.append("first")
        return F.cross_entropy(model(inputs), targets)

    def second(inputs, targets):
        if not torch.is_grad_enabled():
            unchecked.append("second")
        return F.cross_entropy(model(inputs), targets)

    for _ in range(3):
        toma.accumulate(model=model, initial_micro_batch=4)(first)(inputs, targets)
    for _ in range(3):
        explicit.accumulate(second, model, 4, inputs, targets)
    assert unchecked == ["first"] * 3 + ["second"] * 3


def test_the_same_function_under_other_settings_is_checked_again():
    """A token mean passes the check with weight= counting its tokens; the same function's code without weight= (or
    with another reduction) is another check, which finds the parts do not add up: those train by gradient caching,
    each to the full batch's gradients."""
    model, reference = encoder(), encoder()
    inputs = torch.randn(12, 16)
    targets = torch.randint(0, 8, (12, 3))
    targets[::4, 1:] = targets[1::4, 1:] = -100  # rows count 1, 1, 3, 3 targets: halves of 2 and 6

    def token_mean_of(net, inputs, targets):
        logits = net(inputs)[:, None, :].expand(-1, 3, -1)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def token_mean(inputs, targets):
        return token_mean_of(model, inputs, targets)

    def counted(inputs, targets):
        return (targets != -100).sum()

    token_mean_of(reference, inputs, targets).backward()
    coupled = []
    for reduction, weight in (("mean", counted), ("mean", None), ("sum", None)):
        model.zero_grad(set_to_none=True)
        explicit.accumulate(token_mean, model, 4, inputs, targets, toma_weight=weight, toma_reduction=reduction)
        for p, r in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, r.grad, rtol=RTOL, atol=ATOL)
        coupled.append(learned_about(token_mean, reduction, weight, None).split_check.coupled)
    assert coupled == [False, True, True]


@pytest.mark.parametrize("given, loss_reduction", [("mean", "sum"), ("sum", "mean")])
def test_a_loss_reduced_otherwise_than_reduction_says_is_refused_naming_reduction(given, loss_reduction):
    model = encoder()
    inputs, targets = torch.randn(12, 16), torch.randint(0, 8, (12,))
    step = toma.accumulate(model=model, initial_micro_batch=4, reduction=given)(
        lambda inputs, targets: F.cross_entropy(model(inputs), targets, reduction=loss_reduction)
    )
    with pytest.raises(CoupledRows, match=f"the loss is a {loss_reduction}, .*pass reduction='{loss_reduction}'"):
        step(inputs, targets)
    assert all(p.grad is None for p in model.parameters()), "refused before anything trained"
    # a loss that couples rows is not told to change its reduction: it trains by gradient caching
    step = toma.accumulate(model=model, initial_micro_batch=8)(lambda q, d: info_nce(model, q, d))
    step(*pairs_data())
    assert step.stats.split_check.coupled


def test_how_far_a_split_trains_from_the_full_batch_when_told_the_rows_are_independent():
    """What the refusal prevents: split into micro-batches of 8 rows, InfoNCE's gradients are far from the full
    batch's (the issue measured 0.75 of their norm)."""
    reference, model = encoder(), encoder()
    queries, documents = pairs_data()
    info_nce(reference, queries, documents).backward()
    toma.accumulate(model=model, initial_micro_batch=8, groups="rows")(lambda q, d: info_nce(model, q, d))(
        queries, documents
    )
    apart = sum(float((p.grad - r.grad).norm() ** 2) for p, r in zip(model.parameters(), reference.parameters()))
    norm = sum(float(r.grad.norm() ** 2) for r in reference.parameters())
    assert (apart / norm) ** 0.5 > 0.3


def test_a_batch_that_must_stay_whole_runs_whole_and_is_never_split():
    reference, model = encoder(), encoder()
    queries, documents = pairs_data()
    info_nce(reference, queries, documents).backward()
    loss = toma.accumulate(model=model, initial_micro_batch=8, groups="batch")(lambda q, d: info_nce(model, q, d))
    loss(queries, documents)
    for p, r in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, r.grad, rtol=RTOL, atol=ATOL)

    def too_big(q, d):
        raise_fake_oom()

    with pytest.raises(torch.OutOfMemoryError) as raised:
        toma.accumulate(model=model, initial_micro_batch=32, groups="batch", cache_type=NoBatchsizeCache)(too_big)(
            queries, documents
        )
    assert "smallest micro-batch" in "".join(raised.value.__notes__)


def preference_loss(model, inputs):
    """DPO's shape: chosen rows first, rejected second, paired by halving the batch; a mean over pairs."""
    scores = model(inputs).sum(-1)
    chosen, rejected = scores.chunk(2)
    return -F.logsigmoid(chosen - rejected).mean()


def test_pairs_train_the_full_batch_gradients_and_rows_alone_train_it_by_gradient_caching():
    reference, model = encoder(), encoder()
    torch.manual_seed(2)
    inputs = torch.randn(32, 16)  # 16 chosen rows, then their 16 rejected rows
    preference_loss(reference, inputs).backward()
    seen = []

    def loss(inputs):
        if torch.is_grad_enabled():
            seen.append(len(inputs))
        return preference_loss(model, inputs)

    cached = toma.accumulate(model=model, initial_micro_batch=8)(loss)  # rows alone: coupled, gradient caching
    cached(inputs)
    assert cached.stats.split_check.coupled and seen == [32], "the loss once, on the whole batch"
    for p, r in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, r.grad, rtol=RTOL, atol=ATOL)
    model.zero_grad(set_to_none=True)
    seen.clear()
    toma.accumulate(model=model, initial_micro_batch=8, groups="pairs")(loss)(inputs)
    assert seen == [8, 8, 8, 8], "4 pairs per micro-batch"
    for p, r in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, r.grad, rtol=RTOL, atol=ATOL)


def test_groups_from_a_function_keep_each_query_with_its_documents():
    """A listwise loss: each query's documents softmaxed against each other, rows grouped by query id."""
    torch.manual_seed(3)
    model = nn.Linear(6, 1)
    reference = nn.Linear(6, 1)
    reference.load_state_dict(model.state_dict())
    features, query = torch.randn(30, 6), torch.arange(10).repeat_interleave(3)
    relevant = torch.zeros(30)
    relevant[::3] = 1

    def listwise(net, features, query, relevant):
        scores = net(features).squeeze(-1)
        groups = query.unique()
        losses = [-(F.log_softmax(scores[query == g], 0) * relevant[query == g]).sum() for g in groups]  # one per query
        return torch.stack(losses).mean()

    listwise(reference, features, query, relevant).backward()
    by_query = lambda features, query, relevant: query  # noqa: E731
    loss = toma.accumulate(model=model, initial_micro_batch=7, groups=by_query, policy=Halving())
    loss(lambda f, q, r: listwise(model, f, q, r))(features, query, relevant)
    for p, r in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, r.grad, rtol=RTOL, atol=ATOL)
    # cut by rows, a query's documents would land in two micro-batches: found coupled, trained by gradient caching
    model.zero_grad(set_to_none=True)
    step = toma.accumulate(model=model, initial_micro_batch=7, policy=Halving(), cache_type=NoBatchsizeCache)(
        lambda f, q, r: listwise(model, f, q, r)
    )
    step(features, query, relevant)
    assert step.stats.split_check.coupled
    for p, r in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, r.grad, rtol=RTOL, atol=ATOL)


def test_the_check_runs_once_per_call_site_and_leaves_nothing_behind(caplog):
    """Random state, BatchNorm statistics and gradients as if it never ran: the gradients equal a run told the rows
    are independent (no check), bit for bit, dropout and all."""

    def dropout_model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Dropout(0.3), nn.Linear(16, 4))

    torch.manual_seed(4)
    inputs, targets = torch.randn(32, 6), torch.randint(0, 4, (32,))
    results = []
    for groups in (None, "rows"):
        model = dropout_model()
        unchecked = []

        def loss(inputs, targets):
            if not torch.is_grad_enabled():
                unchecked.append(len(inputs))
            return F.cross_entropy(model(inputs), targets)

        step = toma.accumulate(model=model, initial_micro_batch=8, groups=groups)(loss)
        torch.manual_seed(5)
        with caplog.at_level(logging.INFO, logger="toma"):
            step(inputs, targets)
            step(inputs, targets)
        results.append((model, unchecked, step.stats.split_check))
    (checked, calls, check), (plain, none, _) = results
    assert calls == [8, 4, 4] and none == [], "once: the first micro-batch whole and in halves, no gradients"
    assert check.done and check.difference is not None and check.difference < 1e-5
    assert "its loss is what its parts add up to" in caplog.text
    for p, q in zip(checked.parameters(), plain.parameters()):
        assert torch.equal(p.grad, q.grad)
    for a, b in zip(checked.buffers(), plain.buffers()):
        assert torch.equal(a, b), "BatchNorm's statistics count the training passes only"


def test_a_refused_check_leaves_batchnorm_as_it_was_when_the_function_puts_the_model_in_training_mode():
    """The model comes in eval mode and the loss function calls `model.train()`: the check's passes still count
    nothing in BatchNorm's statistics once the coupled loss is refused."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 3))
    model.eval()
    before = [buffer.clone() for buffer in model.buffers()]

    def in_batch_scores(inputs):
        model.train()
        embedded = F.normalize(model(inputs), dim=-1)
        return torch.logsumexp(embedded @ embedded.T, dim=-1).mean()

    with pytest.raises(CoupledRows):
        toma.accumulate(model=model, initial_micro_batch=8)(in_batch_scores)(torch.randn(16, 4))
    assert all(torch.equal(a, b) for a, b in zip(before, model.buffers()))


def test_a_check_that_runs_out_of_memory_says_so_and_the_batch_trains(caplog):
    model = encoder()
    queries, documents = pairs_data()

    def loss(q, d):
        if not torch.is_grad_enabled():
            raise_fake_oom()
        return F.mse_loss(model(q), model(d))

    with caplog.at_level(logging.WARNING, logger="toma"):
        toma.accumulate(model=model, initial_micro_batch=8)(loss)(queries, documents)
    assert "could not check that its loss is what its parts add up to" in caplog.text
    assert all(p.grad is not None for p in model.parameters())


def test_an_error_of_the_users_own_in_the_check_passes_through_untouched():
    model = encoder()
    error = ValueError("not about memory")

    def loss(q, d):
        raise error

    with pytest.raises(ValueError) as raised:
        toma.accumulate(model=model, initial_micro_batch=8)(loss)(*pairs_data())
    assert raised.value is error


def test_under_autocast_rounding_is_not_taken_for_coupling():
    model = encoder()
    queries, documents = pairs_data()
    step = toma.accumulate(model=model, initial_micro_batch=8)(lambda q, d: F.mse_loss(model(q), model(d)))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        step(queries, documents)
    assert step.stats.split_check.done and step.stats.split_check.difference < 2e-2


@pytest.mark.slow
def test_under_a_real_cap_in_batch_negatives_and_an_independent_loss_both_train_the_reference():
    """The whole batch does not fit under a real address-space cap: toma splits it; the check finds the coupled loss
    and trains it by gradient caching, and lets the independent one through in micro-batches, both to the full
    batch's gradients."""
    run_python(
        """
        import torch, torch.nn as nn, torch.nn.functional as F
        from toma import toma, CoupledRows
        from toma.memory.cpu import predictable_heap, set_cpu_memory_headroom
        torch.set_num_threads(1)
        predictable_heap()
        N, WIDTH = 2048, 8192
        def model():
            torch.manual_seed(0)
            return nn.Sequential(nn.Linear(32, WIDTH), nn.ReLU(), nn.Linear(WIDTH, 16))
        torch.manual_seed(1)
        q, d = torch.randn(N, 32), torch.randn(N, 32)
        def info_nce(net, q, d):
            a, b = F.normalize(net(q), dim=-1), F.normalize(net(d), dim=-1)
            return F.cross_entropy(a @ b.T / 0.05, torch.arange(len(q)))
        expected = {}
        for name, loss in (("coupled", info_nce), ("independent", lambda net, q, d: F.mse_loss(net(q), net(d)))):
            reference = model()
            loss(reference, q, d).backward()  # uncapped: what the full batch gives
            expected[name] = [p.grad.clone() for p in reference.parameters()]
            del reference
        set_cpu_memory_headroom(0.2)  # 200 MiB: a full batch's activations (2 x 64 MiB each, and their grads) do not fit
        net = model()
        coupled = toma.accumulate(model=net, initial_micro_batch=N)(lambda q, d: info_nce(net, q, d))
        coupled(q, d)
        assert coupled.stats.oom_retries >= 1 and coupled.stats.split_check.coupled, coupled.stats
        for p, e in zip(net.parameters(), expected["coupled"]):
            torch.testing.assert_close(p.grad, e, rtol=1e-4, atol=1e-6)
        net.zero_grad(set_to_none=True)
        step = toma.accumulate(model=net, initial_micro_batch=N)(lambda q, d: F.mse_loss(net(q), net(d)))
        step(q, d)
        assert step.stats.oom_retries >= 1 and step.stats.split_check.done, step.stats
        assert not step.stats.split_check.coupled, step.stats
        for p, e in zip(net.parameters(), expected["independent"]):
            torch.testing.assert_close(p.grad, e, rtol=1e-4, atol=1e-6)
        print("ok", coupled.stats.micro_batch, step.stats.micro_batch)
        """,
        timeout=240,
    )


def test_a_check_whose_parts_all_give_the_same_loss_says_nothing_and_the_next_split_checks_again():
    """A loss that is constant at the start (DPO's while the policy is its reference) gives the same value for the
    whole and its halves whatever relates them; the next split checks again, and finds the coupling then."""
    model = nn.Linear(4, 1)
    nn.init.zeros_(model.weight)
    nn.init.zeros_(model.bias)

    def centred(x):  # a batch statistic: each row's output against the batch's mean
        out = model(x).squeeze(-1)
        return (out - out.mean()).pow(2).mean()

    step = toma.accumulate(model=model, initial_micro_batch=8, policy=Halving(), cache_type=NoBatchsizeCache)(centred)
    torch.manual_seed(6)
    x = torch.randn(32, 4)
    step(x)  # every output 0: every part's loss is 0
    assert not step.stats.split_check.done and step.stats.split_check.inconclusive == 1
    with torch.no_grad():
        model.weight.normal_()
    model.zero_grad(set_to_none=True)
    step(x)  # the coupling found now: trained by gradient caching, the full batch's gradients
    assert step.stats.split_check.coupled
    reference = nn.Linear(4, 1)
    reference.load_state_dict(model.state_dict())
    out = reference(x).squeeze(-1)
    (out - out.mean()).pow(2).mean().backward()
    for p, r in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, r.grad, rtol=RTOL, atol=ATOL)


@pytest.mark.slow
def test_under_a_real_cap_pairs_train_the_full_batch_gradients_each_chosen_row_with_its_rejected_row():
    """A preference loss over 2,048 pairs whose activations do not fit under the cap: cut by pairs, each micro-batch
    its chosen rows then their rejected rows, it trains the full batch's gradients."""
    run_python(
        """
        import torch, torch.nn as nn, torch.nn.functional as F
        from toma import toma
        from toma.memory.cpu import predictable_heap, set_cpu_memory_headroom
        torch.set_num_threads(1)
        predictable_heap()
        N, WIDTH = 4096, 8192  # an activation of all rows: 128 MiB
        def model():
            torch.manual_seed(0)
            return nn.Sequential(nn.Linear(32, WIDTH), nn.ReLU(), nn.Linear(WIDTH, 1))
        inputs = torch.randn(N, 32, generator=torch.Generator().manual_seed(1))  # N/2 chosen rows, then N/2 rejected
        reference_rows = torch.randn(N // 2, generator=torch.Generator().manual_seed(2))  # one per pair
        def preference(net, x, margin):
            chosen, rejected = net(x).squeeze(-1).chunk(2)
            return -F.logsigmoid(chosen - rejected - margin).mean()
        reference = model()
        preference(reference, inputs, reference_rows).backward()
        expected = [p.grad.clone() for p in reference.parameters()]
        del reference
        set_cpu_memory_headroom(0.2)
        net = model()
        step = toma.accumulate(model=net, initial_micro_batch=N, groups="pairs")(lambda x, m: preference(net, x, m))
        step(inputs, reference_rows)
        assert step.stats.oom_retries >= 1 and step.stats.micro_batch < N, step.stats
        for p, e in zip(net.parameters(), expected):
            torch.testing.assert_close(p.grad, e, rtol=1e-4, atol=1e-6)
        print("ok", step.stats.micro_batch)
        """,
        timeout=240,
    )


def test_a_function_that_fails_in_eval_mode_is_not_checked_and_trains_exactly(caplog):
    """A detection model returns losses in training mode and predictions in eval mode: the check's eval-mode pass
    fails on a function that trains fine. toma says the loss was not checked, and the batch trains (the full batch's
    gradients)."""

    class Detector(nn.Module):
        def __init__(self):
            super().__init__()
            self.head = nn.Linear(4, 3)

        def forward(self, x, targets):
            out = self.head(x)
            if self.training:
                return {"classes": F.cross_entropy(out, targets), "boxes": out.pow(2).mean()}
            return [{"scores": row.softmax(-1)} for row in out]

    def make():
        torch.manual_seed(0)
        return Detector()

    torch.manual_seed(1)
    x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
    model, reference = make(), make()
    with caplog.at_level(logging.WARNING, logger="toma"):
        toma.accumulate(model=model, initial_micro_batch=4)(lambda x, y: sum(model(x, y).values()))(x, y)
    assert "could not check" in caplog.text and "AttributeError" in caplog.text
    sum(reference(x, y).values()).backward()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=RTOL, atol=ATOL)
    assert model.training
