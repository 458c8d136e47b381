"""toma.HostedEmbedding: the table and optimizer state on the host, lazy updates of the touched rows."""

import json

import pytest
import torch
from helpers import COLLECT_TOMA_LOG, raise_fake_oom, requires_cuda, run_python

import toma
from toma import HostedEmbedding

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


def test_adam_equals_sparse_adam_on_a_sparse_embedding():
    module = hosted(lambda params: torch.optim.Adam(params, lr=1e-2))
    reference = torch.nn.Embedding(N, D, sparse=True)
    with torch.no_grad():
        reference.weight.copy_(module.weight)
    optimizer = torch.optim.SparseAdam(reference.parameters(), lr=1e-2)
    for indices, target in batches():
        optimizer.zero_grad()
        ((reference(indices) - target) ** 2).sum().backward()
        optimizer.step()
    torch.testing.assert_close(train_hosted(module), reference.weight.detach(), rtol=1e-5, atol=1e-6)


def test_sgd_equals_a_dense_embedding_with_sgd():
    module = hosted(lambda params: torch.optim.SGD(params, lr=0.05))
    reference = torch.nn.Embedding(N, D)
    with torch.no_grad():
        reference.weight.copy_(module.weight)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.05)
    for indices, target in batches():
        optimizer.zero_grad()
        ((reference(indices) - target) ** 2).sum().backward()
        optimizer.step()
    torch.testing.assert_close(train_hosted(module), reference.weight.detach(), rtol=1e-5, atol=1e-6)


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
    module = hosted(lambda params: torch.optim.SGD(params, lr=0.05))
    reference = torch.nn.Embedding(N, D)
    with torch.no_grad():
        reference.weight.copy_(module.weight)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.05)
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
        def step(self, closure=None):
            raise ArithmeticError("mine")

    module = hosted(lambda params: Broken(params, lr=0.1))
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
        loss = module(indices).pow(2).sum()
        (rows,) = [rows for _, rows in module._pending]
        assert rows.shape == (len(torch.unique(indices)), 64) == (module.resident_rows, 64)
        loss.backward()
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
from toma.cpu_memory import predictable_heap, set_cpu_memory_headroom
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
