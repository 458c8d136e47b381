"""The public forms against toma 1.1.0's contract: sequences, caching, return values, and its fixed bugs."""

import gc
import logging
import weakref

import pytest
import torch

import toma as toma_package
from toma import GlobalBatchsizeCache, NoBatchsizeCache, StacktraceMemoryBatchsizeCache, explicit, simple, toma
from toma.sizing.policies import Halving, ShrinkByFactor

from helpers import raise_fake_oom

ALL_CACHES = [NoBatchsizeCache, GlobalBatchsizeCache, StacktraceMemoryBatchsizeCache]


def oom_above(limit, log):
    """A batch function that records each batch size and runs out of memory above `limit`."""

    def f(batchsize, *args, **kwargs):
        log.append(batchsize)
        if batchsize > limit:
            raise_fake_oom()
        return batchsize, args, kwargs

    return f


def range_oom_above(limit, log):
    def f(start, end, *args, **kwargs):
        log.append((start, end))
        if end - start > limit:
            raise_fake_oom()

    return f


# --- batch -------------------------------------------------------------------------------------------


def test_simple_batch_halves_until_it_fits_and_returns_the_result():
    log = []
    assert simple.batch(oom_above(16, log), 64, "a", key=1) == (16, ("a",), {"key": 1})
    assert log == [64, 32, 16]
    simple.batch(oom_above(16, log), 64)
    assert log == [64, 32, 16, 64, 32, 16], "simple.* remembers nothing"


@pytest.mark.parametrize("cache_type", ALL_CACHES)
def test_toma_batch_sequence_for_every_cache(cache_type):
    log = []
    f = toma.batch(initial_batchsize=64, cache_type=cache_type)(oom_above(16, log))
    for _ in range(2):
        assert f("x", key=2) == (16, ("x",), {"key": 2})
    if cache_type is NoBatchsizeCache:
        assert log == [64, 32, 16, 64, 32, 16]
    else:
        assert log == [64, 32, 16, 16]


@pytest.mark.parametrize("cache_type", ALL_CACHES)
def test_explicit_batch_sequence_for_every_cache(cache_type):
    log = []
    f = oom_above(8, log)
    for _ in range(2):
        assert explicit.batch(f, 32, 1, toma_cache_type=cache_type, k=3) == (8, (1,), {"k": 3})
    expected = [32, 16, 8, 32, 16, 8] if cache_type is NoBatchsizeCache else [32, 16, 8, 8]
    assert log == expected


def test_stacktrace_cache_remembers_per_call_site():
    log = []
    f = toma.batch(initial_batchsize=64)(oom_above(16, log))
    f()
    f()  # another line: another call site, starts over
    assert log == [64, 32, 16, 64, 32, 16]
    log.clear()
    for _ in range(3):
        f()  # one call site, three calls
    assert log == [64, 32, 16, 16, 16]


def test_stacktrace_cache_separates_free_memory_levels(fresh_toma_state):
    """Each free-memory level has its own size; a level met for the first time starts from the nearest
    one the call site knows (not from the initial size again), and shrinking it leaves the others."""
    gauge = fresh_toma_state
    log = []
    limit = {8: 16, 4: 8}  # GiB free -> the largest batch that fits
    f = toma.batch(initial_batchsize=64)(lambda bs: oom_above(limit[gauge.cpu // 2**30], log)(bs))
    for cpu in (8, 8, 4, 4, 8):
        gauge.cpu = cpu * 2**30
        f()
    assert log == [64, 32, 16, 16, 16, 8, 8, 16]


def test_global_cache_is_shared_between_call_sites():
    log = []
    f = toma.batch(initial_batchsize=64, cache_type=GlobalBatchsizeCache)(oom_above(16, log))
    f()
    f()
    assert log == [64, 32, 16, 16]


def test_a_smaller_initial_size_than_the_cached_one_is_honoured():
    log = []
    f = toma.batch(initial_batchsize=64, cache_type=GlobalBatchsizeCache)(oom_above(16, log))
    f()
    f(toma_initial_batchsize=4)
    f(toma_initial_batchsize=128)
    assert log == [64, 32, 16, 4, 16]


def test_batch_factory_keeps_context_so_functions_can_share_a_cache():
    log_a, log_b = [], []
    a = toma.batch(initial_batchsize=64, cache_type=GlobalBatchsizeCache, context="shared")(oom_above(16, log_a))
    b = toma.batch(initial_batchsize=64, cache_type=GlobalBatchsizeCache, context="shared")(oom_above(16, log_b))
    a()
    b()
    assert log_a == [64, 32, 16]
    assert log_b == [16]


def test_call_time_context_overrides():
    log = []
    f = toma.batch(initial_batchsize=64, cache_type=GlobalBatchsizeCache)(oom_above(16, log))
    f(toma_context="one")
    f(toma_context="two")
    f(toma_context="one")
    assert log == [64, 32, 16, 64, 32, 16, 16]


def test_falsy_context_is_a_context():
    log = []
    f = toma.batch(initial_batchsize=64, cache_type=GlobalBatchsizeCache)(oom_above(16, log))
    f(toma_context=0)
    f()
    assert log == [64, 32, 16, 64, 32, 16], "context 0 must not fall back to the function's own cache"


def test_bare_decorator_needs_a_size_at_call_time():
    log = []
    f = toma.batch(oom_above(64, log))
    with pytest.raises(TypeError, match="initial_batchsize"):
        f()
    assert log == [], "toma 1.1.0 called the function with None"
    assert f(toma_initial_batchsize=8)[0] == 8


def test_default_cache_type_is_honoured_when_set_on_the_module():
    log = []
    f = toma.batch(initial_batchsize=64)(oom_above(16, log))  # decorated before the change
    toma_package.DEFAULT_CACHE_TYPE = GlobalBatchsizeCache
    assert toma_package.DEFAULT_CACHE_TYPE is GlobalBatchsizeCache
    f()
    f()
    assert log == [64, 32, 16, 16], "a global cache remembers across call sites"
    toma_package.DEFAULT_CACHE_TYPE = NoBatchsizeCache
    log.clear()
    for _ in range(2):
        f()
    assert log == [64, 32, 16, 64, 32, 16]


def test_default_cache_type_is_honoured_when_set_on_the_toma_class():
    log = []
    toma.DEFAULT_CACHE_TYPE = NoBatchsizeCache
    assert toma_package.DEFAULT_CACHE_TYPE is NoBatchsizeCache
    for _ in range(2):
        explicit.batch(oom_above(16, log), 64)
    assert log == [64, 32, 16, 64, 32, 16]
    with pytest.raises(TypeError, match="DEFAULT_CACHE_TYPE"):
        toma.DEFAULT_CACHE_TYPE = "global"


def test_readme_spelling_of_cache_types_works():
    assert toma.GlobalBatchsizeCache is GlobalBatchsizeCache
    f = toma.batch(initial_batchsize=4, cache_type=toma.GlobalBatchsizeCache)(lambda bs: bs)
    assert f() == 4


def test_explicit_keys_functions_by_code_so_fresh_lambdas_share_a_cache():
    log = []
    for _ in range(3):
        explicit.batch(lambda bs: oom_above(16, log)(bs), 64, toma_cache_type=GlobalBatchsizeCache)
    assert log == [64, 32, 16, 16, 16]


def test_shrink_policy_is_pluggable():
    log = []
    f = toma.batch(initial_batchsize=256, policy=ShrinkByFactor(0.9))(oom_above(190, log))
    f()
    assert log == [256, 230, 207, 186]
    log.clear()
    with pytest.raises(torch.OutOfMemoryError, match="smallest batch size \\(200\\)"):
        explicit.batch(oom_above(190, log), 256, toma_policy=ShrinkByFactor(0.9, minimum=200))
    assert log == [256, 230, 207, 200], "the policy's floor stops the shrinking"


# --- range -------------------------------------------------------------------------------------------


def test_simple_range_shrinks_mid_loop_without_redoing_finished_chunks():
    log = []
    calls = []

    def f(start, end, tag):
        calls.append((start, end, tag))
        if end - start > 8 and start >= 32:
            raise_fake_oom()

    simple.range(f, 0, 70, 32, "t")
    assert calls == [(0, 32, "t"), (32, 64, "t"), (32, 48, "t"), (32, 40, "t")] + [
        (s, min(s + 8, 70), "t") for s in range(40, 70, 8)
    ]
    assert log == []


@pytest.mark.parametrize("cache_type", ALL_CACHES)
def test_toma_range_sequence_for_every_cache(cache_type):
    log = []
    f = toma.range(initial_step=32, cache_type=cache_type)(range_oom_above(8, log))
    for _ in range(2):
        assert f(0, 24) is None
    first = [(0, 24), (0, 16), (0, 8), (8, 16), (16, 24)]
    second = first if cache_type is NoBatchsizeCache else [(0, 8), (8, 16), (16, 24)]
    assert log == first + second


def test_range_passes_extra_arguments():
    seen = []
    explicit.range(lambda s, e, a, b=None: seen.append((s, e, a, b)), 0, 5, 2, "a", b="b")
    assert seen == [(0, 2, "a", "b"), (2, 4, "a", "b"), (4, 5, "a", "b")]


def test_empty_and_reversed_ranges_run_nothing():
    seen = []
    f = toma.range(initial_step=4)(lambda s, e: seen.append((s, e)))
    f(5, 5)
    f(9, 3)
    simple.range(lambda s, e: seen.append((s, e)), 3, 3, 4)
    explicit.range(lambda s, e: seen.append((s, e)), 3, 1, 4)
    assert seen == []


def test_execute_range_runs_at_once():
    seen = []

    @toma.execute.range(0, 10, 4)
    def result(start, end):
        seen.append((start, end))

    assert result is None
    assert seen == [(0, 4), (4, 8), (8, 10)]


# --- chunked -----------------------------------------------------------------------------------------


def chunk_oom_above(limit, log):
    def f(chunk, start, end, *args, **kwargs):
        log.append((start, end, tuple(chunk.shape), args, kwargs))
        if end - start > limit:
            raise_fake_oom()
        chunk.fill_(start)

    return f


@pytest.mark.parametrize("form", ["toma.range", "explicit.range", "simple.range", "toma.execute.range"])
def test_a_chunk_shorter_than_the_step_is_never_retried_unchanged(form):
    log = []
    f = range_oom_above(2, log)
    if form == "toma.range":
        toma.range(initial_step=1024)(f)(16, 26)
    elif form == "explicit.range":
        explicit.range(f, 16, 26, 1024)
    elif form == "simple.range":
        simple.range(f, 16, 26, 1024)
    else:
        toma.execute.range(16, 26, 1024)(f)
    assert log.count((16, 26)) == 1, "the failed 10-row chunk is not tried again as it was"
    assert log[:2] == [(16, 26), (16, 24)], "halving goes on from 1024 to the first size below the 10 rows"
    finished = [(s, e) for s, e in log if e - s <= 2]
    assert finished == [(16, 18), (18, 20), (20, 22), (22, 24), (24, 26)]


def test_the_last_short_chunk_that_fails_shrinks_below_itself():
    log = []
    toma.chunked(initial_step=4)(lambda chunk, s, e: (log.append((s, e)), e - s > 1 and s >= 8 and raise_fake_oom()))(
        torch.zeros(11)
    )
    assert log == [(0, 4), (4, 8), (8, 11), (8, 10), (8, 9), (9, 10), (10, 11)]


def test_toma_chunked_fills_every_chunk_once():
    log = []
    f = toma.chunked(initial_step=8)(chunk_oom_above(2, log))
    t = torch.zeros(7, 3)
    assert f(t) is None
    assert [entry[:2] for entry in log] == [(0, 7), (0, 4), (0, 2), (2, 4), (4, 6), (6, 7)]
    assert torch.equal(t[:, 0], torch.tensor([0.0, 0, 2, 2, 4, 4, 6]))


def test_toma_chunked_honours_dimension():
    log = []
    f = toma.chunked(initial_step=2, dimension=1)(chunk_oom_above(2, log))
    f(torch.zeros(3, 5))
    assert [(s, e, shape) for s, e, shape, *_ in log] == [(0, 2, (3, 2)), (2, 4, (3, 2)), (4, 5, (3, 1))]


def test_toma_chunked_call_time_dimension_zero_is_not_ignored():
    log = []
    f = toma.chunked(initial_step=2, dimension=1)(chunk_oom_above(2, log))
    f(torch.zeros(3, 5), toma_dimension=0)
    assert [shape for _, _, shape, *_ in log] == [(2, 5), (1, 5)]


def test_negative_dimension():
    log = []
    simple.chunked(chunk_oom_above(4, log), torch.zeros(2, 3), 2, -1)
    assert [shape for _, _, shape, *_ in log] == [(2, 2), (2, 1)]


def test_explicit_chunked_passes_extra_arguments():
    log = []
    explicit.chunked(chunk_oom_above(4, log), torch.zeros(4), 4, "extra", toma_dimension=0, key="k")
    assert log == [(0, 4, (4,), ("extra",), {"key": "k"})]


def test_chunked_forms_agree():
    expected = torch.arange(10.0).unsqueeze(1).expand(10, 2).floor_divide(3).mul(3)
    for run in (
        lambda f, t: simple.chunked(f, t, 3),
        lambda f, t: explicit.chunked(f, t, 3),
        lambda f, t: toma.chunked(initial_step=3)(f)(t),
        lambda f, t: toma.execute.chunked(t, 3)(f),
    ):
        t = torch.full((10, 2), -1.0)
        run(chunk_oom_above(3, []), t)
        assert torch.equal(t, expected)


def test_chunked_over_an_empty_dimension_runs_nothing():
    log = []
    toma.chunked(initial_step=4)(chunk_oom_above(4, log))(torch.zeros(0, 3))
    assert log == []


@pytest.mark.parametrize("cache_type", ALL_CACHES)
def test_explicit_chunked_sequence_for_every_cache(cache_type):
    log = []
    f = chunk_oom_above(2, log)
    for _ in range(2):
        explicit.chunked(f, torch.zeros(4), 4, toma_cache_type=cache_type)
    first = [(0, 4), (0, 2), (2, 4)]
    second = first if cache_type is NoBatchsizeCache else [(0, 2), (2, 4)]
    assert [entry[:2] for entry in log] == first + second


# --- execute -----------------------------------------------------------------------------------------


def test_execute_batch_returns_the_result_and_caches_per_call_site():
    log = []
    results = []
    for _ in range(3):

        @toma.execute.batch(64)
        def result(batchsize):
            return oom_above(16, log)(batchsize)[0]

        results.append(result)
    assert results == [16, 16, 16]
    assert log == [64, 32, 16, 16, 16]


# --- errors ------------------------------------------------------------------------------------------


def test_oom_at_size_one_reraises_the_original_error_with_a_note():
    original = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB")
    sizes = []

    def f(batchsize):
        sizes.append(batchsize)
        raise original

    with pytest.raises(torch.OutOfMemoryError) as info:
        toma.batch(initial_batchsize=4)(f)()
    assert info.value is original
    assert sizes == [4, 2, 1]
    (note,) = info.value.__notes__
    assert "smallest batch size (1)" in note and __file__ in note and "test_oom_at_size_one" in note


def test_oom_at_step_one_reraises_for_ranges():
    def f(start, end):
        raise_fake_oom()

    with pytest.raises(torch.OutOfMemoryError) as info:
        simple.range(f, 0, 10, 2)
    assert "smallest step (1)" in info.value.__notes__[0]


def test_reductions_are_logged_with_call_site_and_new_size(caplog):
    caplog.set_level(logging.INFO, logger="toma")
    toma.batch(initial_batchsize=8)(oom_above(4, []))()
    messages = [r.getMessage() for r in caplog.records if r.name == "toma"]
    assert len(messages) == 1
    assert "batch size 8; retrying with 4" in messages[0]
    assert __file__ in messages[0] and "CUDA out of memory" in messages[0]


BAD_SIZES = [
    (0, ValueError),
    (-3, ValueError),
    (True, TypeError),
    (torch.tensor(True), TypeError),
    (2.0, TypeError),
    ("8", TypeError),
]


@pytest.mark.parametrize("value, error", BAD_SIZES)
def test_bad_sizes_fail_at_decoration_time_naming_the_argument(value, error):
    for make in (
        lambda: toma.batch(initial_batchsize=value),
        lambda: toma.batch(lambda bs: bs, initial_batchsize=value),
        lambda: toma.range(initial_step=value),
        lambda: toma.chunked(initial_step=value),
        lambda: toma.execute.batch(value),
        lambda: toma.execute.range(0, 4, value),
        lambda: toma.execute.chunked(torch.zeros(3), value),
    ):
        with pytest.raises(error, match="initial_"):
            make()


@pytest.mark.parametrize("value, error", BAD_SIZES)
def test_bad_sizes_fail_at_call_time_naming_the_argument(value, error):
    never = []
    with pytest.raises(error, match="initial_batchsize"):
        simple.batch(never.append, value)
    with pytest.raises(error, match="initial_batchsize"):
        explicit.batch(never.append, value)
    with pytest.raises(error, match="initial_step"):
        explicit.range(never.append, 0, 4, value)
    with pytest.raises(error, match="initial_step"):
        simple.chunked(never.append, torch.zeros(3), value)
    with pytest.raises(error, match="toma_initial_batchsize"):
        toma.batch(initial_batchsize=4)(never.append)(toma_initial_batchsize=value)
    with pytest.raises(error, match="toma_initial_step"):
        toma.range(initial_step=4)(never.append)(0, 4, toma_initial_step=value)
    assert never == []


def test_missing_initial_step():
    with pytest.raises(TypeError, match="initial_step"):
        toma.range(lambda s, e: None)(0, 4)
    with pytest.raises(TypeError, match="initial_step"):
        toma.execute.chunked(torch.zeros(3))


def test_decorating_a_number_explains_the_keyword():
    with pytest.raises(TypeError, match="initial_batchsize=64"):
        toma.batch(64)


def test_bad_range_bounds_name_the_argument():
    with pytest.raises(TypeError, match="start"):
        simple.range(lambda s, e: None, 0.5, 4, 2)
    with pytest.raises(TypeError, match="end"):
        toma.range(initial_step=2)(lambda s, e: None)(0, "4")


def test_chunked_needs_a_tensor_and_a_valid_dimension():
    f = toma.chunked(initial_step=2)(lambda chunk, s, e: None)
    with pytest.raises(TypeError, match="tensor"):
        f([1, 2, 3])
    with pytest.raises(ValueError, match="toma_dimension=2"):
        f(torch.zeros(2, 2), toma_dimension=2)
    with pytest.raises(ValueError, match="dimension=-3"):
        simple.chunked(lambda chunk, s, e: None, torch.zeros(2, 2), 2, -3)
    with pytest.raises(TypeError, match="dimension"):
        toma.chunked(initial_step=2, dimension="rows")
    with pytest.raises(ValueError, match="0-dimensional"):
        explicit.chunked(lambda chunk, s, e: None, torch.tensor(1.0), 2)


def test_bad_cache_type_and_policy_name_the_argument():
    with pytest.raises(TypeError, match="cache_type"):
        toma.batch(initial_batchsize=2, cache_type="global")
    with pytest.raises(TypeError, match="toma_cache_type"):
        explicit.batch(lambda bs: bs, 2, toma_cache_type=GlobalBatchsizeCache())
    with pytest.raises(TypeError, match="policy"):
        toma.range(initial_step=2, policy=0.5)


def test_explicit_cache_keeps_no_closure_or_callable_object_alive():
    class Model:
        def __call__(self, batchsize):
            return batchsize

    refs = []

    def closure_over_a_tensor():
        big = torch.zeros(1024)
        refs.append(weakref.ref(big))
        return lambda batchsize: big.numel() + batchsize

    model = Model()
    refs.append(weakref.ref(model))
    explicit.batch(closure_over_a_tensor(), 4, toma_cache_type=GlobalBatchsizeCache)
    explicit.batch(model, 4, toma_cache_type=GlobalBatchsizeCache)
    del model
    gc.collect()
    assert [ref() for ref in refs] == [None, None]


# --- functions a form cannot run, methods, messages ----------------------------------------------------


async def async_batch(batchsize):
    return batchsize


def generator_batch(batchsize):
    yield batchsize


async def async_generator_batch(batchsize):
    yield batchsize


class AsyncCallable:
    async def __call__(self, batchsize):
        return batchsize


@pytest.mark.parametrize(
    "func, kind",
    [
        (async_batch, "async function"),
        (generator_batch, "generator function"),
        (async_generator_batch, "async generator function"),
        (AsyncCallable(), "async function"),
        (__import__("functools").partial(async_batch), "async function"),
    ],
    ids=["async def", "generator", "async generator", "async __call__", "partial"],
)
def test_async_and_generator_functions_are_refused_naming_the_form(func, kind):
    forms = {
        "toma.batch": lambda: toma.batch(initial_batchsize=4)(func),
        "toma.range": lambda: toma.range(initial_step=4)(func),
        "toma.chunked": lambda: toma.chunked(initial_step=4)(func),
        "toma.accumulate": lambda: toma.accumulate(model=torch.nn.Linear(1, 1), initial_micro_batch=4)(func),
        "toma.execute.batch": lambda: toma.execute.batch(4)(func),
        "toma.execute.range": lambda: toma.execute.range(0, 4, 2)(func),
        "toma.execute.chunked": lambda: toma.execute.chunked(torch.zeros(4), 2)(func),
        "explicit.batch": lambda: explicit.batch(func, 4),
        "explicit.range": lambda: explicit.range(func, 0, 4, 2),
        "explicit.chunked": lambda: explicit.chunked(func, torch.zeros(4), 2),
        "explicit.accumulate": lambda: explicit.accumulate(func, torch.nn.Linear(1, 1), 2, torch.zeros(4, 1)),
        "simple.batch": lambda: simple.batch(func, 4),
        "simple.range": lambda: simple.range(func, 0, 4, 2),
        "simple.chunked": lambda: simple.chunked(func, torch.zeros(4), 2),
    }
    for form, make in forms.items():
        with pytest.raises(TypeError, match=rf"^{form} cannot retry the {kind}") as info:
            make()
        assert "outside toma" in str(info.value)


def test_a_decorated_staticmethod_works_through_the_class_and_an_instance():
    log = []

    class Model:
        @toma.batch(initial_batchsize=8, cache_type=GlobalBatchsizeCache)
        @staticmethod
        def infer(batchsize, scale):
            log.append(batchsize)
            if batchsize > 2:
                raise_fake_oom()
            return batchsize * scale

        @toma.range(initial_step=4)
        @staticmethod
        def fill(start, end, out):
            out[start:end] = 1

    assert Model.infer(10) == 20
    assert Model().infer(10) == 20, "through an instance the wrapper must not receive the instance"
    out = torch.zeros(6)
    Model().fill(0, 6, out)
    assert torch.equal(out, torch.ones(6)) and log == [8, 4, 2, 2]


def test_log_lines_do_not_repeat_the_logger_name(caplog):
    caplog.set_level(logging.INFO, logger="toma")
    toma.batch(initial_batchsize=8)(oom_above(4, []))()
    (record,) = [r for r in caplog.records if r.name == "toma"]
    assert not record.getMessage().startswith("toma:"), "the logger is named toma already: INFO:toma:toma: ..."


def test_sizes_accept_numpy_integers_everywhere():
    np = pytest.importorskip("numpy")
    log = []
    assert toma.batch(initial_batchsize=np.int64(8), policy=Halving(minimum=np.int64(4)))(oom_above(1, log)) is not None
    assert Halving(minimum=np.int32(4)).minimum == 4 and type(Halving(minimum=np.int64(4)).minimum) is int
    assert ShrinkByFactor(np.float32(0.75)).shrink(8) == 6
    assert explicit.batch(oom_above(4, log), np.int64(16)) == (4, (), {})
    with pytest.raises(TypeError, match="minimum"):
        Halving(minimum=torch.tensor(True))
