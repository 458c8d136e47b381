"""toma.integrations.accelerate.find_executable_batch_size: accelerate's signature and behaviour, side by side
with accelerate's own function, on toma's engine (no garbage collection on calls that fit, sizes remembered)."""

import gc

import pytest
import torch
import torch.nn.functional as F
from torch import nn

accelerate = pytest.importorskip("accelerate")

from accelerate import Accelerator  # noqa: E402
from accelerate.utils import find_executable_batch_size as accelerates  # noqa: E402

from toma import FitToMemory  # noqa: E402
from toma.integrations.accelerate import NO_BATCH_SIZE, find_executable_batch_size  # noqa: E402

from helpers import raise_fake_oom  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def quick_garbage_collection():
    """accelerate collects garbage before every call and after every error, and so does toma after an error: with
    what pytest, torch and accelerate hold frozen out of the collector's reach, each collection takes milliseconds
    instead of half a second."""
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


@pytest.fixture(autouse=True)
def freeze_what_earlier_tests_left(quick_garbage_collection):
    gc.freeze()  # what the tests before left alive (an Accelerator, its models) stays out of the way too


BOTH = pytest.mark.parametrize("decorator", [accelerates, find_executable_batch_size], ids=["accelerate", "toma"])

# accelerate's back-off (int(size * 0.9)) from 38 down to the first size that fits 32 (each retry collects garbage
# twice in the documented pattern, half a second each here, so the tests keep retries few)
SEQUENCE_TO_32 = [38, 34, 30]


# --- accelerate's documented usage --------------------------------------------------------------------------


def training_function(decorator, tried, fits=32, starting_batch_size=38):
    """accelerate's documented pattern: an inner training loop, decorated with the starting batch size, builds
    the model, optimizer and dataloaders for the batch size it is given and trains through the Accelerator. A
    device that fits `fits` rows at a time runs out of memory in the forward pass of larger batches."""
    accelerator = Accelerator(cpu=True)
    generator = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(
        torch.randn(256, 8, generator=generator), torch.randint(0, 3, (256,), generator=generator)
    )

    @decorator(starting_batch_size=starting_batch_size)
    def inner_training_loop(batch_size):
        nonlocal accelerator  # as accelerate's docs write it
        accelerator.free_memory()
        tried.append(batch_size)
        torch.manual_seed(1)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        loader = torch.utils.data.DataLoader(data, batch_size=batch_size)
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        for inputs, targets in loader:
            if len(inputs) > fits:
                raise_fake_oom()
            optimizer.zero_grad()
            accelerator.backward(F.cross_entropy(model(inputs), targets))
            optimizer.step()
        return [p.detach().clone() for p in accelerator.unwrap_model(model).parameters()]

    return inner_training_loop()


def test_accelerates_documented_usage_runs_the_same_sizes_and_trains_the_same_model_on_toma():
    tried_by_accelerate, tried_by_toma = [], []
    expected = training_function(accelerates, tried_by_accelerate)
    got = training_function(find_executable_batch_size, tried_by_toma)
    assert tried_by_accelerate == tried_by_toma == SEQUENCE_TO_32
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_an_inner_loop_decorated_anew_starts_at_the_size_that_worked_where_accelerate_starts_over():
    tried = {"accelerate": [], "toma": []}
    for _ in range(2):
        training_function(accelerates, tried["accelerate"])
        training_function(find_executable_batch_size, tried["toma"])
    assert tried["accelerate"] == SEQUENCE_TO_32 * 2
    assert tried["toma"] == SEQUENCE_TO_32 + [30]


# --- accelerate's behaviour -----------------------------------------------------------------------------------


@BOTH
def test_injected_out_of_memory_errors_give_accelerates_sequence_and_a_second_call_starts_where_it_fit(decorator):
    tried = []

    @decorator(starting_batch_size=64)
    def train(batch_size, model, optimizer):
        tried.append(batch_size)
        if batch_size > 40:
            raise_fake_oom()
        return batch_size, model, optimizer

    for _ in range(2):
        assert train("model", optimizer="sgd") == (40, "model", "sgd")
    assert tried == [64, 57, 51, 45, 40, 40]


def _epoch(train):
    return train()


@BOTH
def test_the_size_found_carries_to_calls_from_other_lines_and_functions(decorator):
    """accelerate keeps the size in the decorator: after 16, 14, ..., 8 every later call starts at 8, whatever
    line it comes from (toma's call-site cache started such a call over, with every out-of-memory error again)."""
    tried, fits = [], 8

    @decorator(starting_batch_size=16)
    def train(batch_size):
        tried.append(batch_size)
        if batch_size > fits:
            raise_fake_oom()
        return batch_size

    assert train() == 8 and tried == [16, 14, 12, 10, 9, 8]
    assert _epoch(train) == 8 and tried[6:] == [8], "called from another function"
    fits = 6
    assert train() == 6 and tried[7:] == [8, 7, 6], "less room: it goes on shrinking from 8, not from 16"
    assert _epoch(train) == 6 and tried[10:] == [6]


@BOTH
def test_a_reduce_batch_size_fn_s_last_size_carries_to_later_calls(decorator):
    sizes, tried = iter([50, 20, 10]), []

    @decorator(starting_batch_size=100, reduce_batch_size_fn=lambda: next(sizes))
    def train(batch_size):
        tried.append(batch_size)
        if batch_size > 20:
            raise_fake_oom()
        return batch_size

    assert train() == 20
    assert _epoch(train) == 20
    assert tried == [100, 50, 20, 20]


@BOTH
def test_out_of_memory_down_to_zero_raises_accelerates_runtime_error(decorator):
    tried = []

    @decorator(starting_batch_size=4)
    def train(batch_size):
        tried.append(batch_size)
        raise_fake_oom()

    with pytest.raises(RuntimeError, match="^No executable batch size found, reached zero.$") as raised:
        train()
    assert tried == [4, 3, 2, 1]
    assert type(raised.value) is RuntimeError and raised.value.__cause__ is None
    if decorator is find_executable_batch_size:
        assert isinstance(raised.value.__context__, torch.OutOfMemoryError), "toma keeps the original error"
    with pytest.raises(RuntimeError, match=NO_BATCH_SIZE):
        decorator(starting_batch_size=0)(lambda batch_size: batch_size)()


@BOTH
def test_an_inner_call_that_reached_zero_passes_through_the_outer_one_unshrunk(decorator):
    """accelerate's outer call does not take the inner one's RuntimeError for out of memory (nor its message):
    it re-raises at once. toma's raised it from the out-of-memory error, so the outer one shrank to 1 as well."""
    outer_sizes, inner_sizes = [], []

    @decorator(starting_batch_size=8)
    def outer(batch_size):
        outer_sizes.append(batch_size)

        @decorator(starting_batch_size=2)
        def inner(inner_size):
            inner_sizes.append(inner_size)
            raise_fake_oom()

        return inner()

    with pytest.raises(RuntimeError, match=NO_BATCH_SIZE):
        outer()
    assert outer_sizes == [8] and inner_sizes == [2, 1]


@BOTH
def test_passing_the_batch_size_is_a_type_error_naming_the_function(decorator):
    @decorator(starting_batch_size=8)
    def train(batch_size, model):
        return batch_size

    with pytest.raises(TypeError, match=r"Batch size was passed into `train`.*`train\(model="):
        train(8, "model")
    assert train("model") == 8


def test_the_guard_counts_positional_parameters_and_its_hint_names_every_argument_given():
    """Where toma's guard differs on purpose: a function taking *args is not refused extra arguments (accelerate
    counts `args` as one parameter and refuses), the hint writes keywords too, and the name is the function's."""

    @find_executable_batch_size(starting_batch_size=8)
    def gather(batch_size, *rows):
        """Gather."""
        return batch_size, rows

    assert gather(1, 2) == (8, (1, 2))
    assert (gather.__name__, gather.__doc__, gather.__wrapped__.__name__) == ("gather", "Gather.", "gather")

    @find_executable_batch_size(starting_batch_size=8)
    def train(batch_size, *, model):
        return batch_size

    with pytest.raises(TypeError, match=r"Batch size was passed into `train`.*`train\(model='m'\)`$"):
        train(8, model="m")
    assert train(model="m") == 8


@BOTH
def test_an_error_that_is_not_out_of_memory_passes_through_untouched(decorator):
    error = ValueError("a bug")
    tried = []

    @decorator(starting_batch_size=8)
    def train(batch_size):
        tried.append(batch_size)
        raise error

    with pytest.raises(ValueError) as raised:
        train()
    assert raised.value is error and tried == [8]


@BOTH
def test_without_arguments_it_starts_at_128_and_reduce_batch_size_fn_decides_the_next_size(decorator):
    @decorator
    def first(batch_size):
        return batch_size

    assert first() == 128
    sizes, tried = iter([50, 20, 0]), []

    @decorator(starting_batch_size=100, reduce_batch_size_fn=lambda: next(sizes))  # 100, 50, 20, then none
    def train(batch_size):
        tried.append(batch_size)
        raise_fake_oom()

    with pytest.raises(RuntimeError, match=NO_BATCH_SIZE):
        train()
    assert tried == [100, 50, 20]


# --- what toma's engine changes -------------------------------------------------------------------------------


@BOTH
def test_a_call_that_fits_collects_no_garbage_on_toma(decorator, monkeypatch):
    collections = []
    collect = gc.collect
    monkeypatch.setattr(gc, "collect", lambda *args: collections.append(1) or collect(*args))

    @decorator(starting_batch_size=64)
    def predict(batch_size, inputs):
        return torch.cat([chunk.sum(1) for chunk in inputs.split(batch_size)])

    inputs = torch.randn(256, 4)
    for _ in range(3):
        torch.testing.assert_close(predict(inputs), inputs.sum(1))
    assert len(collections) == (0 if decorator is find_executable_batch_size else 3)


def _raised_from(error, cause):
    error.__cause__ = cause
    return error


@pytest.mark.parametrize(
    "error",
    [
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
        RuntimeError("MPS backend out of memory (MPS allocated: 1.00 GB)"),
        RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory: you tried"),
        RuntimeError("CUDA error: out of memory"),  # cudaMallocAsync's wording, without accelerate's full stop
        MemoryError(),  # Python's own
        # Intel Gaudi's (in accelerate's list): no "out of memory" in it
        RuntimeError("[Rank:0] FATAL ERROR :: MODULE:PT_DEVMEM Allocation failed for size::1073741824 (1024)MB"),
        RuntimeError("CUDA out of memory.", 2),  # accelerate reads only a RuntimeError with one argument
        _raised_from(ValueError("a wrapper's error"), torch.OutOfMemoryError("CUDA out of memory.")),
    ],
    ids=["cuda", "mps", "cpu", "cuda-async", "python", "hpu", "two-arguments", "raised-from"],
)
def test_out_of_memory_errors_of_every_backend_shrink_the_size(error):
    tried = []

    @find_executable_batch_size(starting_batch_size=8)
    def train(batch_size):
        tried.append(batch_size)
        if batch_size > 4:
            raise error
        return batch_size

    assert train() == 4 and tried == [8, 7, 6, 5, 4]


def test_a_reduce_batch_size_fn_must_shrink_and_a_size_below_1_means_none_is_left():
    """accelerate retries a size no smaller than the one that failed, and calls the function with -5."""
    for sizes, error in (([8, 4], ValueError), ([12, 4], ValueError), ([-5, 4], RuntimeError)):
        tried, given = [], iter(sizes)

        @find_executable_batch_size(starting_batch_size=8, reduce_batch_size_fn=lambda: next(given))
        def train(batch_size):
            tried.append(batch_size)
            raise_fake_oom()

        with pytest.raises(error, match="returned|reached zero"):
            train()
        assert tried == [8]


def test_after_reaching_zero_a_later_call_tries_size_1_again():
    """accelerate's size stays at 0 and every later call raises at once; memory may have been freed since."""
    tried, fits = [], 0

    @find_executable_batch_size(starting_batch_size=2)
    def train(batch_size):
        tried.append(batch_size)
        if batch_size > fits:
            raise_fake_oom()
        return batch_size

    with pytest.raises(RuntimeError, match=NO_BATCH_SIZE):
        train()
    fits = 4
    assert train() == 1 and tried == [2, 1, 1]


def test_policy_takes_a_toma_sizing_policy():
    tried = []

    @find_executable_batch_size(starting_batch_size=4096, policy=FitToMemory())
    def train(batch_size):
        tried.append(batch_size)
        if batch_size > 100:
            raise_fake_oom()
        return batch_size

    assert 1 <= train() <= 100 and tried[0] == 4096 and len(tried) < 30  # accelerate's back-off: 36 tries


def test_bad_arguments_are_refused_when_decorating():
    """accelerate calls the function with -1 or 12.5, fails at the first out-of-memory error on a
    reduce_batch_size_fn that is no function, and lets a generator's errors escape after the call."""
    for bad in (-1, 12.5, True):
        with pytest.raises(ValueError, match="starting_batch_size"):
            find_executable_batch_size(lambda batch_size: None, starting_batch_size=bad)
    with pytest.raises(TypeError, match="reduce_batch_size_fn must be a function"):
        find_executable_batch_size(lambda batch_size: None, reduce_batch_size_fn=10)
    with pytest.raises(TypeError, match="runs a function; got 5"):
        find_executable_batch_size(5)

    def rows(batch_size):
        yield batch_size

    with pytest.raises(TypeError, match="cannot retry the generator function"):
        find_executable_batch_size(rows)
    with pytest.raises(ValueError, match="reduce_batch_size_fn or policy"):
        find_executable_batch_size(lambda b: None, reduce_batch_size_fn=lambda: 1, policy=FitToMemory())
    with pytest.raises(TypeError, match="policy"):
        find_executable_batch_size(lambda b: None, policy="halving")
