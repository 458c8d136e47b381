"""toma.HostedEmbedding: the table and optimizer state on the host, lazy updates of the touched rows."""

import gc
import io
import json
import weakref

import pytest
import torch

import toma
import toma.offload.pinned
from toma import HostedEmbedding

from helpers import COLLECT_TOMA_LOG, raise_fake_oom, requires_cuda, run_python

N, D = 60, 8


def batches(steps=50, shape=(6, 3), seed=1):
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        yield torch.randint(0, N, shape, generator=generator), torch.randn(*shape, D, generator=generator)


def hosted(factory, device="cpu", **options):
    torch.manual_seed(0)
    return HostedEmbedding(N, D, optimizer=factory, device=device, **options)


def train_hosted(module, steps=50, seed=1):
    for indices, target in batches(steps, seed=seed):
        ((module(indices) - target) ** 2).sum().backward()
        module.step()
    return module.weight.detach()


def adam_and_its_sparse_reference():
    """A hosted table with Adam, and `nn.Embedding(sparse=True)` + `SparseAdam` from the same values."""
    module = hosted(lambda params: torch.optim.Adam(params, lr=1e-2))
    reference = torch.nn.Embedding(N, D, sparse=True)
    with torch.no_grad():
        reference.weight.copy_(module.weight)
    return module, reference, torch.optim.SparseAdam(reference.parameters(), lr=1e-2)


def test_adam_equals_sparse_adam_on_a_sparse_embedding():
    module, reference, optimizer = adam_and_its_sparse_reference()
    for indices, target in batches():
        optimizer.zero_grad()
        ((reference(indices) - target) ** 2).sum().backward()
        optimizer.step()
    torch.testing.assert_close(train_hosted(module), reference.weight.detach(), rtol=1e-5, atol=1e-6)


def sgd_and_its_dense_reference():
    """A hosted table with SGD, and `nn.Embedding` + SGD from the same values."""
    module = hosted(lambda params: torch.optim.SGD(params, lr=0.05))
    reference = torch.nn.Embedding(N, D)
    with torch.no_grad():
        reference.weight.copy_(module.weight)
    return module, reference, torch.optim.SGD(reference.parameters(), lr=0.05)


def test_sgd_equals_a_dense_embedding_with_sgd():
    module, reference, optimizer = sgd_and_its_dense_reference()
    for indices, target in batches():
        optimizer.zero_grad()
        ((reference(indices) - target) ** 2).sum().backward()
        optimizer.step()
    torch.testing.assert_close(train_hosted(module), reference.weight.detach(), rtol=1e-5, atol=1e-6)


def test_lookups_no_backward_reaches_are_freed_with_their_output_and_never_stepped():
    # evaluation without torch.no_grad(): each lookup's rows live only as long as its output
    module, reference, optimizer = sgd_and_its_dense_reference()
    freed = []
    for indices, _ in batches(steps=20, seed=5):
        output = module(indices)
        (leaf,) = [node.variable for node, _ in output.grad_fn.next_functions if node is not None]
        freed.append(weakref.ref(leaf))
        del output, leaf
    gc.collect()
    assert all(ref() is None for ref in freed) and module._pending == []
    module.step()  # nothing a backward pass reached: nothing changes
    torch.testing.assert_close(module.weight, reference.weight.detach())
    # the next training step updates that batch's rows only, as the dense table's does
    for indices, target in batches(steps=1, seed=6):
        ((reference(indices) - target) ** 2).sum().backward()
        optimizer.step()
    torch.testing.assert_close(train_hosted(module, steps=1, seed=6), reference.weight.detach(), rtol=1e-5, atol=1e-6)


def test_two_backward_passes_through_one_lookup_step_their_summed_gradient_once():
    module, reference, optimizer = sgd_and_its_dense_reference()
    indices, target = next(batches(steps=1, seed=7))
    for table in (module, reference):
        loss = ((table(indices) - target) ** 2).sum()
        loss.backward(retain_graph=True)
        (2 * loss).backward()
    optimizer.step()
    module.step()
    assert module._pending == []
    torch.testing.assert_close(module.weight, reference.weight.detach(), rtol=1e-5, atol=1e-6)


def test_a_lookup_made_before_zero_grad_and_backpropagated_after_it_is_stepped():
    # as with nn.Embedding: zero_grad() discards the gradients so far; a backward pass after it counts
    module = hosted(lambda params: torch.optim.SGD(params, lr=0.05))
    before = module.weight.clone()
    discarded = module(torch.tensor([1, 2])).sum()
    discarded.backward()
    kept = module(torch.tensor([3])).sum()
    module.zero_grad()
    kept.backward()
    module.step()
    changed = (module.weight != before).any(1).nonzero().flatten().tolist()
    assert changed == [3]


def lazy_reference(update, weight, steps=50):
    """The optimizer written out by hand on a dense table, applied to the touched rows only."""
    weight, state = weight.clone(), {}
    for indices, target in batches(steps):
        rows = weight.clone().requires_grad_(True)
        ((rows[indices] - target) ** 2).sum().backward()
        touched = torch.unique(indices)
        update(weight, rows.grad, touched, state)
    return weight


def adagrad(lr, eps=1e-10, initial=0.0):
    def update(weight, grad, touched, state):
        sums = state.setdefault("sum", torch.full_like(weight, initial))
        g = grad[touched]
        sums[touched] += g * g
        weight[touched] -= lr * g / (sums[touched].sqrt() + eps)

    return update


def rmsprop(lr, alpha=0.99, eps=1e-8):
    def update(weight, grad, touched, state):
        square = state.setdefault("square_avg", torch.zeros_like(weight))
        g = grad[touched]
        square[touched] = alpha * square[touched] + (1 - alpha) * g * g
        weight[touched] -= lr * g / (square[touched].sqrt() + eps)

    return update


@pytest.mark.parametrize(
    "factory, update",
    [
        (lambda params: torch.optim.Adagrad(params, lr=0.1), adagrad(0.1)),
        (lambda params: torch.optim.Adagrad(params, lr=0.1, initial_accumulator_value=0.5), adagrad(0.1, initial=0.5)),
        (lambda params: torch.optim.RMSprop(params, lr=1e-2), rmsprop(1e-2)),
    ],
    ids=["adagrad", "adagrad-initial-accumulator", "rmsprop"],
)
def test_adagrad_and_rmsprop_equal_a_lazy_reference(factory, update):
    module = hosted(factory)
    expected = lazy_reference(update, module.weight.detach())
    torch.testing.assert_close(train_hosted(module), expected, rtol=1e-5, atol=1e-6)


def test_rows_not_in_a_batch_and_their_state_are_untouched():
    module = hosted(lambda params: torch.optim.Adam(params, lr=0.1, weight_decay=0.1))
    train_hosted(module, steps=3)
    before = module.weight.clone()
    state_before = {key: table.clone() for key, table in module._rows.items()}
    indices = torch.tensor([[1, 2, 2]])
    module(indices).sum().backward()
    module.step()
    untouched = torch.ones(N, dtype=torch.bool)
    untouched[[1, 2]] = False
    assert torch.equal(module.weight[untouched], before[untouched])
    assert not torch.equal(module.weight[1], before[1])
    for key, table in module._rows.items():
        assert torch.equal(table[untouched], state_before[key][untouched])


def test_the_output_has_the_shape_and_values_of_an_embedding_lookup():
    module = hosted(lambda params: torch.optim.SGD(params, lr=0.1))
    indices = torch.tensor([[3, 1], [3, 59]], dtype=torch.int32)
    out = module(indices)
    assert out.shape == (2, 2, D) and torch.equal(out, module.weight[indices.long()])
    assert module.resident_rows == 3


def test_two_lookups_before_a_step_add_their_gradients():
    module, reference, optimizer = sgd_and_its_dense_reference()
    first, second = torch.tensor([1, 2, 3]), torch.tensor([3, 4])
    (module(first).sum() + (module(second) ** 2).sum()).backward()
    module.step()
    (reference(first).sum() + (reference(second) ** 2).sum()).backward()
    optimizer.step()
    torch.testing.assert_close(module.weight, reference.weight.detach())


def test_prefetch_gives_the_same_training_also_across_a_step():
    plain = hosted(lambda params: torch.optim.Adam(params, lr=1e-2))
    ahead = hosted(lambda params: torch.optim.Adam(params, lr=1e-2))
    data = list(batches(20))
    for i, (indices, target) in enumerate(data):
        ((plain(indices) - target) ** 2).sum().backward()
        plain.step()
        loss = ((ahead(indices) - target) ** 2).sum()
        if i + 1 < len(data):
            ahead.prefetch(data[i + 1][0])  # before this step updates rows the next batch shares
        loss.backward()
        ahead.step()
    assert torch.equal(plain.weight, ahead.weight)


def test_step_without_backward_does_nothing():
    module = hosted(lambda params: torch.optim.Adam(params, lr=0.1))
    before = module.weight.clone()
    module.step()
    module(torch.tensor([1, 2]))  # looked up, but no backward pass
    module.step()
    with torch.no_grad():
        module(torch.tensor([3]))
    module.step()
    assert torch.equal(module.weight, before) and module._rows is None


def test_a_state_dict_round_trip_restores_table_and_optimizer_state():
    factory = lambda params: torch.optim.Adam(params, lr=1e-2)  # noqa: E731
    first = hosted(factory)
    train_hosted(first, steps=10)
    saved = first.state_dict()
    second = HostedEmbedding(N, D, optimizer=factory, device="cpu")
    second.load_state_dict(saved)
    assert torch.equal(second.weight, first.weight)
    train_hosted(first, steps=10, seed=5)
    train_hosted(second, steps=10, seed=5)
    assert torch.equal(second.weight, first.weight)
    for key, table in first._rows.items():
        assert torch.equal(second._rows[key], table)


def test_the_table_stays_on_the_host_under_to():
    module = hosted(lambda params: torch.optim.SGD(params, lr=0.1))
    weight = module.weight
    model = torch.nn.Sequential(module).to(torch.device("cpu"))
    assert model[0].weight is weight and module.device == torch.device("cpu")


def test_a_step_with_more_rows_than_fit_runs_in_parts_with_the_same_result():
    class Shy(torch.optim.Adam):
        def step(self, closure=None):
            if self.param_groups[0]["params"][0].shape[0] > 8:
                raise_fake_oom()
            return super().step(closure)

    whole = hosted(lambda params: torch.optim.Adam(params, lr=1e-2))
    parts = hosted(lambda params: Shy(params, lr=1e-2))
    data = list(batches(10, shape=(40,)))
    for module in (whole, parts):
        for indices, target in data:
            ((module(indices) - target) ** 2).sum().backward()
            module.step()
    assert parts.step_rows <= 8 and whole.step_rows > 8

    small_first = hosted(lambda params: torch.optim.Adam(params, lr=1e-2))
    small_first(torch.tensor([1])).sum().backward()
    small_first.step()
    small_first(torch.arange(30)).sum().backward()
    small_first.step()
    assert small_first.step_rows == 30  # a step of one row does not cap the parts of a later one
    torch.testing.assert_close(parts.weight, whole.weight, rtol=1e-6, atol=1e-7)


def test_a_non_oom_error_in_the_optimizer_passes_through():
    class Broken(torch.optim.SGD):
        broken = False  # from the first step() on: the probe at construction passes

        def step(self, closure=None):
            if Broken.broken:
                raise ArithmeticError("mine")
            return super().step(closure)

    module = hosted(lambda params: Broken(params, lr=0.1))
    Broken.broken = True
    module(torch.tensor([1])).sum().backward()
    with pytest.raises(ArithmeticError, match="mine"):
        module.step()


@pytest.mark.parametrize(
    "indices, error, message",
    [
        (torch.tensor([0.0, 1.0]), TypeError, "indices"),
        (torch.tensor([True]), TypeError, "indices"),
        ([1, 2], TypeError, "indices"),
        (torch.tensor([1, N]), IndexError, "indices"),
        (torch.tensor([-1, 2]), IndexError, "indices"),
    ],
)
def test_bad_indices_are_refused_before_any_transfer(indices, error, message):
    module = hosted(lambda params: torch.optim.SGD(params, lr=0.1))
    with pytest.raises(error, match=message):
        module(indices)
    with pytest.raises(error, match=message):
        module.prefetch(indices)
    assert module._pending == [] and module._prefetched is None and module.resident_rows == 0


@pytest.mark.parametrize(
    "options, name",
    [
        (dict(optimizer=torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)), "optimizer"),
        (dict(optimizer=lambda params: params), "optimizer"),
        (dict(optimizer="adam"), "optimizer"),
        (dict(optimizer=lambda params: torch.optim.Adam(params), dtype=torch.int64), "dtype"),
        (dict(optimizer=lambda params: torch.optim.Adam(params), device="cuda:77"), "device"),
    ],
)
def test_bad_arguments_are_named(options, name):
    with pytest.raises((TypeError, ValueError), match=name):
        HostedEmbedding(N, D, **options)
    with pytest.raises((TypeError, ValueError), match="num_embeddings"):
        HostedEmbedding(0, D, optimizer=lambda params: torch.optim.Adam(params))


@pytest.mark.slow
def test_a_table_of_2m_rows_trains_with_only_the_touched_rows_on_the_device():
    torch.manual_seed(0)
    module = HostedEmbedding(2_000_000, 64, optimizer=lambda params: torch.optim.Adam(params, lr=1e-2), device="cpu")
    generator = torch.Generator().manual_seed(3)
    before = module.weight[:1000].clone()
    touched = set()
    for _ in range(3):
        indices = torch.randint(0, 2_000_000, (4096,), generator=generator)
        touched.update(indices.tolist())
        module(indices).pow(2).sum().backward()
        (rows,) = [rows for _, rows in module._pending]
        assert rows.shape == (len(torch.unique(indices)), 64) == (module.resident_rows, 64)
        module.step()
    assert all(table.shape == (2_000_000, 64) for table in module._rows.values())
    changed = (module.weight[:1000] != before).any(1)
    expected = torch.tensor([i in touched for i in range(1000)])
    assert torch.equal(changed, expected)


@pytest.mark.slow
def test_a_real_cpu_oom_in_the_step_updates_in_parts_exactly():
    out = run_python(
        COLLECT_TOMA_LOG
        + """
import json, torch
torch.set_num_threads(1)
from toma import HostedEmbedding
from toma.memory.cpu import predictable_heap, set_cpu_memory_headroom
predictable_heap()
ROWS, WIDTH, TOUCHED = 50_000, 512, 24_576
def make():
    torch.manual_seed(0)
    return HostedEmbedding(ROWS, WIDTH, optimizer=lambda p: torch.optim.Adam(p, lr=1e-2), device="cpu")
generator = torch.Generator().manual_seed(1)
batches = [torch.randperm(ROWS, generator=generator)[:TOUCHED] for _ in range(3)]
def train(module, batches):
    for indices in batches:
        module(indices).sum().backward()
        module.step()
    return module
reference = train(make(), batches).weight.clone()
capped = train(make(), batches[:1])  # the optimizer's state tables (host memory like the table) made before the cap
set_cpu_memory_headroom(200 / 1024)
train(capped, batches[1:])
print(json.dumps(dict(parts=capped.step_rows, equal=bool(torch.equal(capped.weight, reference)), messages=messages)))
""",
        timeout=240,
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    ooms = [m for m in result["messages"] if "ran out of memory" in m]
    assert ooms and all("can't allocate memory" in m for m in ooms), result["messages"]
    assert result["parts"] < 24_576 and result["equal"]


@pytest.mark.cuda
@requires_cuda
def test_on_cuda_rows_move_to_the_device_and_match_the_cpu():
    factory = lambda params: torch.optim.Adam(params, lr=1e-2)  # noqa: E731
    on_gpu, on_cpu = hosted(factory, device="cuda"), hosted(factory, device="cpu")
    assert on_gpu.weight.is_pinned() and not on_gpu.weight.is_cuda
    data = list(batches(20))
    for i, (indices, target) in enumerate(data):
        out = on_gpu(indices.cuda())
        assert out.is_cuda
        if i + 1 < len(data):
            on_gpu.prefetch(data[i + 1][0])
        ((out - target.cuda()) ** 2).sum().backward()
        on_gpu.step()
    train_hosted(on_cpu, steps=20)
    torch.testing.assert_close(on_gpu.weight, on_cpu.weight, rtol=1e-4, atol=1e-5)


# --- a part that fails after its optimizer step (issue 19, item 2) ---------------------------------------------


def copy_back_fails_once(module, monkeypatch, failures):
    original = module._transfers.to_host

    def to_host(obj):
        if not failures:
            failures.append("copy back")
            raise_fake_oom()
        return original(obj)

    monkeypatch.setattr(module._transfers, "to_host", to_host)


def state_tables_fail_once(module, monkeypatch, failures):
    original = module._host_empty

    def host_empty(shape, dtype):
        if not failures:
            failures.append("state tables")
            raise RuntimeError("CUDA out of memory. Tried to allocate 1.00 GiB (pinned host memory)")
        return original(shape, dtype)

    monkeypatch.setattr(module, "_host_empty", host_empty)


@pytest.mark.parametrize("inject", [copy_back_fails_once, state_tables_fail_once], ids=["copy-back", "state-tables"])
def test_a_part_that_fails_after_its_optimizer_step_is_retried_from_the_rows_and_state_as_they_were(
    inject, monkeypatch
):
    factory = lambda params: torch.optim.Adam(params, lr=0.1)  # noqa: E731
    data = list(batches(4, shape=(16,)))
    touched = len(torch.unique(data[0][0]))
    failures = []
    injected = hosted(factory)
    inject(injected, monkeypatch, failures)
    sizes = []
    for indices, target in data:
        ((injected(indices) - target) ** 2).sum().backward()
        injected.step()
        sizes.append(injected.step_rows)
    assert failures and sizes[0] < touched  # the first step ran out of memory once and ran again in parts

    plain = hosted(factory)  # the same parts from the start, nothing failing
    plain._sizes.get_batchsize(N).set(injected._sizes.get_batchsize(N).value)
    for indices, target in data:
        ((plain(indices) - target) ** 2).sum().backward()
        plain.step()
    assert torch.equal(injected.weight, plain.weight)
    assert injected._rows.keys() == plain._rows.keys() == {"exp_avg", "exp_avg_sq"}
    for key, table in plain._rows.items():
        assert torch.equal(injected._rows[key], table)
    assert torch.equal(injected._shared["step"], plain._shared["step"])


# --- every optimizer of torch.optim (issue 19, item 3) ------------------------------------------------------------

OPTIMIZERS = sorted(
    (kind for kind in vars(torch.optim).values() if isinstance(kind, type) and issubclass(kind, torch.optim.Optimizer)),
    key=lambda kind: kind.__name__,
)
OPTIMIZERS.remove(torch.optim.Optimizer)
TRAINED = {"ASGD", "Adadelta", "Adagrad", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop", "Rprop", "SGD"}
REFUSED = {"LBFGS": "closure", "SparseAdam": "torch.optim.Adam", "Muon": "independently", "Adafactor": "col_var"}
OPTIONS = {  # options that give the optimizers more state to carry
    "ASGD": dict(lr=0.05, t0=2.0),
    "Adagrad": dict(lr=0.1, lr_decay=0.01, initial_accumulator_value=0.1),
    "Adam": dict(lr=0.05, weight_decay=0.01, amsgrad=True),
    "RMSprop": dict(lr=0.01, momentum=0.5, centered=True),
    "SGD": dict(lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.01),
}
# Batches that touch 6, 3, 10, 2 and 7 rows (never 1 or D), rows first touched at later steps among them.
VARIED = [[0, 1, 2, 3, 4, 5], [4, 5, 6, 6], [0, 7, 9, 11, 13, 15, 17, 19, 21, 2], [6, 30, 6], [1, 2, 3, 4, 5, 30, 31]]


def varied_batches():
    generator = torch.Generator().manual_seed(4)
    return [(torch.tensor(rows), torch.randn(len(rows), D, generator=generator)) for rows in VARIED]


def is_per_row(value, rows):
    return isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == rows


def lazy_reference_run(factory, weight, data):
    """Each step: the optimizer on a plain tensor of just the touched rows, with their carried state (a row
    touched for the first time: as the optimizer leaves a zero row after a zero gradient), and the shared
    state the previous step left."""
    zero = torch.zeros(1, D)
    empty_optimizer = factory([zero])
    built = dict(empty_optimizer.state[zero])
    zero.grad = torch.zeros_like(zero)
    empty_optimizer.step()
    after = empty_optimizer.state[zero]
    fresh = {key: built.get(key, value)[0] for key, value in after.items() if is_per_row(value, 1)}
    weight, carried, shared = weight.clone(), {}, None
    for indices, target in data:
        touched, inverse = torch.unique(indices, return_inverse=True)
        rows = weight[touched].clone().requires_grad_(True)
        ((rows[inverse] - target) ** 2).sum().backward()
        optimizer = factory([rows])
        if shared is not None:
            state = {key: value.clone() if isinstance(value, torch.Tensor) else value for key, value in shared.items()}
            for key in fresh:
                state[key] = torch.stack([carried.get(int(row), fresh)[key] for row in touched])
            optimizer.state[rows] = state
        optimizer.step()
        after = optimizer.state[rows]
        per_row = {key for key, value in after.items() if is_per_row(value, len(touched))}
        for i, row in enumerate(touched.tolist()):
            carried[row] = {key: after[key][i].clone() for key in per_row}
        shared = {key: value for key, value in after.items() if key not in per_row}
        weight[touched] = rows.detach()
    return weight, carried


@pytest.mark.parametrize("kind", OPTIMIZERS, ids=lambda kind: kind.__name__)
def test_every_torch_optimizer_trains_lazily_or_is_refused_at_construction(kind):
    name = kind.__name__
    factory = lambda params: kind(params, **OPTIONS.get(name, {}))  # noqa: E731
    if name in REFUSED:
        with pytest.raises(ValueError, match=name) as refused:
            hosted(factory)
        assert REFUSED[name] in str(refused.value)
        return
    try:
        whole, parts = hosted(factory), hosted(factory)
    except (ValueError, TypeError) as error:  # an optimizer newer than this test: refusing it is allowed
        assert name not in TRAINED and name in str(error)
        return
    parts._sizes.get_batchsize(N).set(2)  # every step in parts of two rows
    data = varied_batches()
    expected, carried = lazy_reference_run(factory, whole.weight, data)
    for module in (whole, parts):
        for indices, target in data:
            ((module(indices) - target) ** 2).sum().backward()
            module.step()
        torch.testing.assert_close(module.weight, expected, rtol=1e-5, atol=1e-6)
        for row, state in carried.items():
            for key, value in state.items():
                torch.testing.assert_close(module._rows[key][row], value, rtol=1e-5, atol=1e-6)
    assert parts.step_rows == 2 and whole.step_rows == 7


def test_the_probe_sees_rows_depend_on_each_other_also_at_a_learning_rate_of_zero():
    with pytest.raises(ValueError, match="Muon"):
        hosted(lambda params: torch.optim.Muon(params, lr=0.0))  # a scheduler would raise it later


# --- a batch that looks up no rows (issue 19, item 4) -----------------------------------------------------------


def test_a_backward_through_a_lookup_of_no_rows_is_a_step_as_sparse_adam_counts_it():
    module, reference, optimizer = adam_and_its_sparse_reference()
    nothing = (torch.zeros(0, dtype=torch.long), torch.zeros(0, D))
    data = list(batches(6))
    plan = [nothing, data[0], nothing, nothing, data[1], "no backward", data[2], nothing, data[3], data[4]]
    for batch in plan:
        optimizer.zero_grad()
        if isinstance(batch, str):  # no gradient at all: neither counts a step
            module(data[5][0])
            reference(data[5][0])
        else:
            indices, target = batch
            ((module(indices) - target) ** 2).sum().backward()
            ((reference(indices) - target) ** 2).sum().backward()
        module.step()
        optimizer.step()
    assert int(module._shared["step"]) == optimizer.state[reference.weight]["step"] == 9
    torch.testing.assert_close(module.weight, reference.weight.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(module._rows["exp_avg_sq"], optimizer.state[reference.weight]["exp_avg_sq"])


# --- a table used on the CPU (issue 19, item 6) -----------------------------------------------------------------


class RecordingRegistrar:
    def __init__(self, fail=False):
        self.calls, self.fail = [], fail

    def register(self, address, nbytes, device):
        self.calls.append(("register", address, nbytes))
        if self.fail:
            raise RuntimeError("out of memory (page-locking refused)")

    def unregister(self, address):
        self.calls.append(("unregister", address))


def test_a_cpu_table_never_pins_or_touches_cuda_even_where_cuda_is_available(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    # torch 2.11's optimizers ask whether a CUDA graph is being captured whenever CUDA is available
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    touched = []

    def forbidden(name):
        def call(*args, **kwargs):
            touched.append(name)
            raise AssertionError(f"{name} called for a table on the CPU")

        return call

    for name in ("_lazy_init", "init", "cudart", "current_device", "set_device", "Stream"):
        monkeypatch.setattr(torch.cuda, name, forbidden(name))
    monkeypatch.setattr(torch.Tensor, "pin_memory", forbidden("Tensor.pin_memory"))
    registrar = RecordingRegistrar()
    monkeypatch.setattr(toma.offload.pinned, "HOST", toma.offload.pinned.PinnedHost(registrar))
    factory = lambda params: torch.optim.Adam(params, lr=1e-2)  # noqa: E731
    module = hosted(factory)
    train_hosted(module, steps=3)
    loaded = HostedEmbedding(N, D, optimizer=factory, device="cpu")
    loaded.load_state_dict(module.state_dict())
    train_hosted(loaded, steps=2)
    tables = [module.weight, loaded.weight, *module._rows.values(), *loaded._rows.values()]
    assert touched == [] and registrar.calls == []
    assert not any(table.is_pinned() for table in tables)


# --- tables page-locked at their own size (issue 19, item 5) ----------------------------------------------------


def pinned_tables(monkeypatch, fail=False):
    """Tables made as for a CUDA device (`_pin`), page-locked by a recording registrar."""
    registrar = RecordingRegistrar(fail)
    host = toma.offload.pinned.PinnedHost(registrar)
    monkeypatch.setattr(toma.offload.pinned, "HOST", host)
    monkeypatch.setattr(HostedEmbedding, "_pin", property(lambda self: True))
    return registrar, host


def test_tables_and_state_tables_are_page_locked_at_their_size_also_after_loading(monkeypatch):
    registrar, host = pinned_tables(monkeypatch)
    factory = lambda params: torch.optim.Adam(params, lr=1e-2)  # noqa: E731
    module = hosted(factory)
    table_bytes = N * D * 4
    assert registrar.calls == [("register", module.weight.data_ptr(), table_bytes)]
    train_hosted(module, steps=3)
    registered = {address: nbytes for _, address, nbytes in registrar.calls}
    assert registered == {table.data_ptr(): table_bytes for table in (module.weight, *module._rows.values())}
    assert host.registered_bytes == 3 * table_bytes

    other = hosted(factory)
    train_hosted(other, steps=2, seed=3)
    buffer = io.BytesIO()
    torch.save(other.state_dict(), buffer)
    del other
    gc.collect()
    assert host.registered_bytes == 3 * table_bytes  # the other table's memory unlocked when freed
    old = [table.data_ptr() for table in module._rows.values()]
    registrar.calls.clear()
    buffer.seek(0)
    module.load_state_dict(torch.load(buffer))
    gc.collect()
    new = [table.data_ptr() for table in module._rows.values()]
    assert new == old and registrar.calls == [], "loaded into the locked tables in use: nothing locked twice"
    assert host.registered_bytes == 3 * table_bytes

    fresh = hosted(factory)  # no state tables yet: loading makes them, locked at their size
    registrar.calls.clear()
    buffer.seek(0)
    fresh.load_state_dict(torch.load(buffer))
    made = sorted(table.data_ptr() for table in fresh._rows.values())
    assert sorted(call[:2] for call in registrar.calls) == [("register", address) for address in made]
    assert host.registered_bytes == 3 * table_bytes + 3 * table_bytes
    del fresh
    gc.collect()
    assert host.registered_bytes == 3 * table_bytes
    saved = torch.load(io.BytesIO(buffer.getvalue()))["_extra_state"]["rows"]
    assert all(torch.equal(module._rows[key], table) for key, table in saved.items())
    del saved
    remaining = {module.weight.data_ptr(), *new}
    registrar.calls.clear()
    del module
    gc.collect()
    assert {address for _, address in registrar.calls} == remaining and host.registered_bytes == 0


def test_a_table_that_cannot_be_page_locked_trains_in_pageable_memory_with_one_warning(monkeypatch, caplog):
    registrar, host = pinned_tables(monkeypatch, fail=True)
    factory = lambda params: torch.optim.Adam(params, lr=1e-2)  # noqa: E731
    with caplog.at_level("DEBUG", logger="toma"):
        module = hosted(factory)
        trained = train_hosted(module, steps=5)
    warnings = [record for record in caplog.records if record.levelname == "WARNING"]
    assert len(warnings) == 1 and "page-lock" in warnings[0].getMessage()
    assert len(registrar.calls) == 3 and host.registered_bytes == 0  # weight and Adam's two tables, each failed
    assert not any("ran out of memory" in record.getMessage() for record in caplog.records)
    assert module._sizes.get_batchsize(N).value == N  # never shrunk for host memory
    assert module.step_rows == len(torch.unique(list(batches(5))[-1][0]))
    monkeypatch.undo()
    assert torch.equal(trained, train_hosted(hosted(factory), steps=5))


@pytest.mark.cuda
@requires_cuda
def test_on_cuda_pinned_memory_is_the_tables_size_also_after_loading_a_state_dict():
    rows, width = 2**16 + 100, 64  # just above a power of two: the pinned allocator would take twice as much
    factory = lambda params: torch.optim.Adam(params, lr=1e-2)  # noqa: E731
    torch.cuda.init()
    stats_before = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)
    registered_before = toma.offload.pinned.HOST.registered_bytes

    def pinned_bytes():
        stats = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0) - stats_before
        return stats + toma.offload.pinned.HOST.registered_bytes - registered_before

    module = HostedEmbedding(rows, width, optimizer=factory, device="cuda")
    for _ in range(2):
        module(torch.randint(0, rows, (64,), device="cuda")).sum().backward()
        module.step()
    tables = [module.weight, *module._rows.values()]
    table_bytes = sum(table.numel() * table.element_size() for table in tables)
    assert len(tables) == 3 and all(table.is_pinned() for table in tables)
    assert pinned_bytes() <= 1.05 * table_bytes

    buffer = io.BytesIO()
    torch.save(module.state_dict(), buffer)
    buffer.seek(0)
    module.load_state_dict(torch.load(buffer))
    assert all(table.is_pinned() for table in module._rows.values())
    assert pinned_bytes() <= 1.05 * table_bytes


# --- mixed precision (issue 19, item 7) -------------------------------------------------------------------------


def test_under_a_grad_scaler_the_rows_are_unscaled_and_an_inf_skips_the_step_and_lowers_the_scale():
    factory = lambda params: torch.optim.Adam(params, lr=1e-2)  # noqa: E731
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    scaled, plain = hosted(factory), hosted(factory)
    for indices, target in batches(5):
        scaler.scale(((scaled(indices) - target) ** 2).sum()).backward()
        scaled.step(scaler)
        scaler.update()
        ((plain(indices) - target) ** 2).sum().backward()
        plain.step()
    torch.testing.assert_close(scaled.weight, plain.weight, rtol=1e-6, atol=1e-7)
    assert scaler.get_scale() == 2.0**10

    weight, step = scaled.weight.clone(), scaled._shared["step"].clone()
    state = {key: table.clone() for key, table in scaled._rows.items()}
    scaler.scale((scaled(torch.tensor([1, 2])) * float("inf")).sum()).backward()
    scaled.step(scaler)
    scaler.update()
    assert torch.equal(scaled.weight, weight) and scaled._shared["step"] == step
    assert all(torch.equal(scaled._rows[key], table) for key, table in state.items())
    assert scaler.get_scale() == 2.0**9 and scaled._pending == []


def test_a_scaler_that_is_not_a_grad_scaler_is_named():
    module = hosted(lambda params: torch.optim.SGD(params, lr=0.1))
    module(torch.tensor([1])).sum().backward()
    with pytest.raises(TypeError, match="scaler"):
        module.step(scaler=2.0**10)
    assert len(module._pending) == 1  # the rows wait for a proper step


def test_a_float16_table_under_a_grad_scaler_is_refused_with_a_reason():
    module = HostedEmbedding(
        N, D, optimizer=lambda params: torch.optim.SGD(params, lr=0.1), device="cpu", dtype=torch.float16
    )
    before = module.weight.clone()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    module(torch.tensor([1, 2])).float().sum().backward()
    with pytest.raises(TypeError, match="float16"):
        module.step(scaler=scaler)
    assert torch.equal(module.weight, before)


def test_an_interrupt_in_a_later_part_leaves_a_table_that_trains_on(monkeypatch):
    """Parts written before a KeyboardInterrupt stepped with this step's shared state (Adam's count): it is
    kept, so the table stays consistent and the next step works."""
    from toma.offload.hosted_embedding import _RowUpdate

    module = hosted(lambda params: torch.optim.Adam(params, lr=1e-2))
    calls = []
    original = _RowUpdate.call

    def call(self, start, stop):
        calls.append((start, stop))
        if len(calls) == 1:
            raise_fake_oom()  # all rows at once do not fit: smaller parts
        if len(calls) == 3:
            raise KeyboardInterrupt  # after the first part was written
        return original(self, start, stop)

    monkeypatch.setattr(_RowUpdate, "call", call)
    module(torch.arange(10)).sum().backward()
    with pytest.raises(KeyboardInterrupt):
        module.step()
    (first, _), (start, middle), later = calls
    assert (first, start) == (0, 0) and later == (middle, 10) and 0 < middle < 10
    monkeypatch.setattr(_RowUpdate, "call", original)
    assert module._shared is not None and int(module._shared["step"]) == 1
    module(torch.arange(10)).sum().backward()
    module.step()  # a KeyError ('step') when the shared state was lost
    assert int(module._shared["step"]) == 2
