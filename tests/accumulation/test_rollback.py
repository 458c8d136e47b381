"""What a failed attempt changed besides gradients is undone before the retry: module buffers and randomness."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from toma import HostedEmbedding, NoBatchsizeCache, explicit, toma
from toma.accumulation.rollback import BufferStash, PendingState, RandomRollback, RandomState, Rollback, Rollbacks

from helpers import raise_fake_oom, requires_cuda

N = 64


def bn_dropout_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 4))


def data(seed=1):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(N, 6, generator=generator), torch.randint(0, 4, (N,), generator=generator)


def run(initial, fail_above=None, seed=5):
    """One accumulated call from a fixed seed; micro-batches above `fail_above` rows run out of memory in
    their backward pass, after the forward passes have updated BatchNorm's statistics and drawn dropout."""
    model = bn_dropout_model()
    inputs, targets = data()
    sizes = []

    def compute_loss(inputs, targets):
        if not torch.is_grad_enabled():  # toma's one check, without gradients, that the loss adds up
            return F.cross_entropy(model(inputs), targets)
        sizes.append(len(inputs))
        loss = F.cross_entropy(model(inputs), targets)
        if fail_above is not None and len(inputs) > fail_above and len(sizes) > 1:
            raise_fake_oom()  # in the second micro-batch: the first one already changed everything
        return loss

    torch.manual_seed(seed)
    explicit.accumulate(compute_loss, model, initial, inputs, targets, toma_cache_type=NoBatchsizeCache)
    after = torch.rand(3)  # where the random stream stands after the call
    return model, sizes, after


def test_batchnorm_statistics_count_only_the_attempt_that_finished():
    retried, sizes, _ = run(32, fail_above=16)
    reference, reference_sizes, _ = run(16)
    assert sizes == [32, 32, 16, 16, 16, 16] and reference_sizes == [16] * 4
    bn, reference_bn = retried[1], reference[1]
    assert int(bn.num_batches_tracked) == 4, "the failed attempt's forward passes are not counted again"
    torch.testing.assert_close(bn.running_mean, reference_bn.running_mean, rtol=0, atol=0)
    torch.testing.assert_close(bn.running_var, reference_bn.running_var, rtol=0, atol=0)


def test_a_retry_draws_the_same_random_numbers_as_a_call_that_fit_at_the_final_size():
    retried, _, after = run(32, fail_above=16)
    reference, _, reference_after = run(16)
    for p, q in zip(retried.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)
    assert torch.equal(after, reference_after), "the random stream goes on from where the final attempt left it"


def test_an_error_that_is_not_oom_leaves_the_buffers_as_they_were():
    model = bn_dropout_model()
    inputs, targets = data()
    before = {name: buffer.clone() for name, buffer in model.named_buffers()}

    @toma.accumulate(model=model, initial_micro_batch=16)
    def compute_loss(inputs, targets):
        loss = F.cross_entropy(model(inputs), targets)
        if int(model[1].num_batches_tracked) == 3:
            raise ValueError("a bug in the loss")
        return loss

    with pytest.raises(ValueError, match="a bug"):
        compute_loss(inputs, targets)
    for name, buffer in model.named_buffers():
        assert torch.equal(buffer, before[name]), name


def test_buffers_of_modules_in_eval_mode_are_saved_too():
    """The function may switch the model to training mode itself: the mode when the call starts says nothing."""
    model = bn_dropout_model()
    model.eval()
    assert {name for _, name, _ in BufferStash(model).slots} == {"running_mean", "running_var", "num_batches_tracked"}


def test_a_function_that_puts_the_model_in_training_mode_itself_counts_only_the_attempt_that_finished():
    """The model comes in eval mode (an evaluation before); the function calls `model.train()`: the failed
    attempt's forward passes do not count in BatchNorm's statistics, as if the call had fit at 4 rows."""
    inputs, targets = data()

    def call(model, initial):
        @toma.accumulate(model=model, initial_micro_batch=initial, groups="rows", cache_type=NoBatchsizeCache)
        def compute_loss(inputs, targets):
            model.train()
            out = model(inputs)
            if len(inputs) > 16:
                raise_fake_oom()
            return F.cross_entropy(out, targets)

        model.eval()
        torch.manual_seed(5)
        compute_loss(inputs, targets)
        return model[1]

    retried, reference = call(bn_dropout_model(), 64), call(bn_dropout_model(), 16)
    assert int(retried.num_batches_tracked) == int(reference.num_batches_tracked) == 4
    torch.testing.assert_close(retried.running_mean, reference.running_mean, rtol=0, atol=0)
    torch.testing.assert_close(retried.running_var, reference.running_var, rtol=0, atol=0)


def test_a_hosted_embeddings_table_is_not_copied_for_a_retry(monkeypatch):
    """Its forward pass changes no buffer (its rows queue as pending state): copying a table of millions of rows
    once per call would cost its size in host memory and time. BatchNorm's statistics beside it are saved."""
    saved = []
    real_save = BufferStash.save
    monkeypatch.setattr(BufferStash, "save", lambda self: (saved.append(self.names()), real_save(self)))
    table = HostedEmbedding(1000, 4, optimizer=lambda params: torch.optim.SGD(params, lr=0.1))
    model = nn.ModuleDict({"table": table, "norm": nn.BatchNorm1d(4)})
    ids = torch.randint(0, 1000, (8,))
    toma.accumulate(model=model, initial_micro_batch=4, groups="rows")(lambda ids: model["norm"](table(ids)).sum())(ids)
    assert saved == [["running_mean", "running_var", "num_batches_tracked"]]
    assert BufferStash(model).names() == ["running_mean", "running_var", "num_batches_tracked"]


def test_the_buffer_stash_puts_back_values_and_the_tensor_objects():
    model = bn_dropout_model()
    bn = model[1]
    mean = bn.running_mean
    stash = BufferStash(model)
    stash.save()
    mean.add_(1.0)
    bn.running_var = torch.full_like(bn.running_var, 7.0)  # an attempt that assigned a new tensor
    stash.restore()
    assert bn.running_mean is mean and torch.equal(mean, torch.zeros(16))
    assert torch.equal(bn.running_var, torch.ones(16))


def test_random_state_restores_the_cpu_generator():
    torch.manual_seed(3)
    state = RandomState([torch.zeros(2)])
    first = torch.rand(4)
    state.restore()
    assert torch.equal(torch.rand(4), first)


@pytest.mark.cuda
@requires_cuda
def test_random_state_restores_the_generator_of_the_cuda_device_in_use():
    torch.manual_seed(3)
    state = RandomState([torch.zeros(2, device="cuda")])
    assert [device.type for _, device, _ in state.devices] == ["cuda"]
    first = torch.rand(4, device="cuda")
    state.restore()
    assert torch.equal(torch.rand(4, device="cuda"), first)


class Rotary(nn.Module):
    """A lazily grown, non-persistent cache (as rotary embeddings keep): re-registered, with a Python
    attribute that must agree with it, whenever a longer sequence comes."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.cached = 0
        self.register_buffer("table", torch.zeros(0, 4), persistent=False)

    def forward(self, x):
        if x.shape[1] > self.cached:
            self.cached = x.shape[1]
            self.register_buffer("table", torch.ones(self.cached, 4), persistent=False)
        return self.linear(x + self.table[: x.shape[1]])


def test_a_cache_the_attempt_rebuilt_is_kept_and_only_state_is_rolled_back():
    torch.manual_seed(0)
    model = Rotary()
    short, long = torch.randn(8, 2, 4), torch.randn(8, 6, 4)
    calls = []

    @toma.accumulate(model=model, initial_micro_batch=4, reduction="sum", cache_type=NoBatchsizeCache)
    def compute_loss(x):
        if not torch.is_grad_enabled():  # toma's one check, without gradients, that the loss adds up
            return model(x).sum()
        calls.append(len(x))
        out = model(x).sum()
        if len(x) > 2 and len(calls) == 2:
            raise_fake_oom()
        return out

    compute_loss(short)
    calls.clear()
    compute_loss(long)  # the cache grows to 6 in the failed attempt; the retry must still find it
    assert calls == [4, 4, 2, 2, 2, 2]
    assert model.cached == 6 and model.table.shape == (6, 4)
    assert "table" not in BufferStash(model).names(), "non-persistent buffers are not saved"


def test_an_out_of_memory_error_while_saving_still_rolls_back_the_retry(monkeypatch):
    model = bn_dropout_model()
    inputs, targets = data()
    real_save, saves = BufferStash.save, []

    def save(self):
        saves.append(1)
        if len(saves) == 1:
            raise_fake_oom()
        real_save(self)

    monkeypatch.setattr(BufferStash, "save", save)
    sizes = []

    @toma.accumulate(model=model, initial_micro_batch=32, cache_type=NoBatchsizeCache)
    def compute_loss(inputs, targets):
        if not torch.is_grad_enabled():  # toma's one check, without gradients, that the loss adds up
            return F.cross_entropy(model(inputs), targets)
        sizes.append(len(inputs))
        loss = F.cross_entropy(model(inputs), targets)
        if len(inputs) > 8 and len(sizes) > 1:
            raise_fake_oom()
        return loss

    compute_loss(inputs, targets)
    assert sizes[-8:] == [8] * 8 and int(model[1].num_batches_tracked) == 8


# --- pending state: what a module queues for a later step besides gradients -------------------------------

ROWS, DIM = 40, 6


class EmbeddingModel(nn.Module):
    """A table and a linear head: the table is a `HostedEmbedding` (its rows queue for `step()`) or, as the
    full-batch reference, a dense `nn.Embedding` with the same starting values."""

    def __init__(self, hosted):
        super().__init__()
        torch.manual_seed(0)
        self.table = HostedEmbedding(ROWS, DIM, optimizer=lambda p: torch.optim.SGD(p, lr=0.5), device="cpu")
        if not hosted:
            dense = nn.Embedding(ROWS, DIM)
            with torch.no_grad():
                dense.weight.copy_(self.table.weight)
            self.table = dense
        torch.manual_seed(1)
        self.head = nn.Linear(DIM, 3)

    def forward(self, ids):
        return self.head(self.table(ids).mean(1))


def embedding_batches(steps=4):
    generator = torch.Generator().manual_seed(2)
    for _ in range(steps):
        yield torch.randint(0, ROWS, (32, 5), generator=generator), torch.randint(0, 3, (32,), generator=generator)


def train_embedding_model(hosted, fail_second_micro_batch):
    model = EmbeddingModel(hosted)
    head_optimizer = torch.optim.SGD(model.head.parameters() if hosted else model.parameters(), lr=0.5)
    for ids, labels in embedding_batches():
        seen = []

        def compute_loss(ids, labels):
            seen.append(len(ids))
            loss = F.cross_entropy(model(ids), labels)
            if fail_second_micro_batch and len(seen) == 2 and len(ids) > 8:
                raise_fake_oom()  # after the first micro-batch's rows were queued and got their gradients
            return loss

        head_optimizer.zero_grad()
        if hosted:
            explicit.accumulate(compute_loss, model, 16, ids, labels, toma_cache_type=NoBatchsizeCache)
            model.table.step()
        else:
            compute_loss(ids, labels).backward()
        head_optimizer.step()
    return model.table.weight.detach().clone(), model.head.weight.detach().clone()


def test_a_hosted_embedding_under_accumulate_counts_a_failed_micro_batch_once():
    table, head = train_embedding_model(hosted=True, fail_second_micro_batch=True)
    reference_table, reference_head = train_embedding_model(hosted=False, fail_second_micro_batch=False)
    torch.testing.assert_close(head, reference_head, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(table, reference_table, rtol=1e-5, atol=1e-6)


class QueueingModule(nn.Module):
    """Any module with pending work: it queues every row it saw in forward for later use."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(6, 4)
        self.queue = []

    def forward(self, x):
        self.queue.append(x.detach().clone())
        return self.linear(x)

    def pending_mark(self):
        return len(self.queue)

    def pending_rewind(self, mark):
        del self.queue[mark:]


def test_any_module_with_pending_state_is_rewound_after_a_failed_attempt():
    module = QueueingModule()
    model = nn.Sequential(module)
    inputs, targets = data()
    calls = []

    def compute_loss(inputs, targets):
        if not torch.is_grad_enabled():  # toma's one check, without gradients, that the loss adds up
            return F.cross_entropy(model(inputs), targets)
        calls.append(len(inputs))
        loss = F.cross_entropy(model(inputs), targets)
        if len(inputs) == 32 and len(calls) == 2:
            raise_fake_oom()
        return loss

    explicit.accumulate(compute_loss, model, 32, inputs, targets, toma_cache_type=NoBatchsizeCache)
    assert calls == [32, 32, 16, 16, 16, 16]
    assert torch.equal(torch.cat(module.queue), inputs)  # each row queued once, in order, whatever failed
    assert isinstance(module, PendingState) and not isinstance(nn.Linear(1, 1), PendingState)


def test_pending_state_of_a_failed_non_oom_attempt_is_rewound_too():
    module = QueueingModule()
    inputs, targets = data()

    def compute_loss(inputs, targets):
        loss = F.cross_entropy(module(inputs), targets)
        if len(module.queue) == 2:
            raise ValueError("a bug in the loss")
        return loss

    with pytest.raises(ValueError, match="a bug in the loss"):
        explicit.accumulate(compute_loss, module, 16, inputs, targets, toma_cache_type=NoBatchsizeCache)
    assert module.queue == []


# --- Rollback, the interface, and the rollbacks as one ------------------------------------------------------


class Recording(Rollback):
    def __init__(self, name, log, fail=False):
        self.name, self.log, self.fail = name, log, fail

    def begin(self):
        if self.fail:
            raise MemoryError(self.name)
        self.log.append(f"begin {self.name}")

    def undo(self):
        self.log.append(f"undo {self.name}")

    def keep(self):
        self.log.append(f"keep {self.name}")


def test_rollbacks_begin_in_order_undo_in_reverse_and_keep_in_order():
    log = []
    both = Rollbacks([Recording("a", log), Recording("b", log)])
    both.begin()
    both.undo()
    both.keep()
    assert log == ["begin a", "begin b", "undo b", "undo a", "keep a", "keep b"]


def test_a_rollback_whose_begin_fails_undoes_those_begun_before_it():
    log = []
    with pytest.raises(MemoryError):
        Rollbacks([Recording("a", log), Recording("b", log, fail=True), Recording("c", log)]).begin()
    assert log == ["begin a", "undo a"]


def test_the_random_state_is_taken_at_the_first_begin_and_put_back_at_the_next():
    rollback = RandomRollback([torch.zeros(1)])
    rollback.begin()
    first = torch.rand(3)
    rollback.undo()  # a failed attempt that is not retried leaves the generator where it is
    rollback.begin()
    assert torch.equal(torch.rand(3), first)
