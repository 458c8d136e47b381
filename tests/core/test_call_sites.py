"""Tracebacks and call-site keys, with and without a watermark."""

import threading

from toma import stacktrace
from toma.core.call_sites import call_site_key, describe_call_site, get_simple_traceback, set_watermark, watermark


def outer(fn):
    return inner(fn)


def inner(fn):
    return fn()


def names(trace):
    return [entry[2] for entry in trace]


def test_simple_traceback_entries_are_hashable_and_readable():
    trace = inner(get_simple_traceback)
    hash(trace)
    filename, lineno, function, line, index = trace[0]
    assert (filename, function) == (__file__, "inner")
    assert line.strip() == "return fn()" and index == 0
    assert names(trace)[:2] == ["inner", "test_simple_traceback_entries_are_hashable_and_readable"]


def test_ignore_top_drops_inner_frames():
    assert names(outer(lambda: get_simple_traceback(1)))[0] == "inner"
    assert names(outer(lambda: get_simple_traceback(2)))[0] == "outer"


def test_watermark_cuts_frames_outside_the_with_block():
    def helper():
        with watermark():
            return outer(get_simple_traceback)

    assert names(helper()) == ["inner", "outer", "helper"]


def test_set_watermark_keeps_the_decorated_function_as_the_outermost_frame():
    @set_watermark
    def loop():
        return outer(get_simple_traceback)

    assert names(loop()) == ["inner", "outer", "loop"]
    assert len(names(outer(get_simple_traceback))) > 3, "the watermark is gone after the call"


def test_watermark_is_per_thread():
    results = {}
    inside = threading.Event()
    release = threading.Event()

    def watermarked():
        with watermark():
            inside.set()
            release.wait(10)
            results["watermarked"] = outer(get_simple_traceback)

    thread = threading.Thread(target=watermarked)
    thread.start()
    inside.wait(10)
    results["main"] = outer(get_simple_traceback)
    release.set()
    thread.join(10)
    assert names(results["watermarked"]) == ["inner", "outer", "watermarked"]
    assert "test_watermark_is_per_thread" in names(results["main"])


def test_call_site_key_tells_call_sites_apart():
    def key():
        return call_site_key()

    same = [key() for _ in range(2)]
    assert same[0] == same[1]
    assert key() != same[0]
    hash(same[0])


def test_call_site_key_is_bounded_and_honours_the_watermark():
    assert len(outer(lambda: call_site_key(max_frames=2))) == 4
    with watermark():
        key = outer(call_site_key)
    assert len(key) == 2 * 3, "inner, outer and this test's frame"


def test_describe_call_site_names_the_first_frame_outside_toma():
    assert describe_call_site().startswith(f"{__file__}:")
    assert describe_call_site().endswith("in test_describe_call_site_names_the_first_frame_outside_toma")
    assert stacktrace._is_toma_frame(stacktrace.sys._getframe(0)) is False


def test_code_run_after_other_code_was_freed_is_a_new_call_site_even_where_its_id_is_reused():
    """Code made one after another (notebook cells, `exec`, a reloaded module), each new: its code object may
    take the address of a freed one, and must not start from that one's learned size."""
    import gc

    import torch

    from toma import toma

    tried = []

    @toma.batch(initial_batchsize=512)
    def run(batchsize, limit):
        tried.append(batchsize)
        if batchsize > limit:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    starts, ids = [], set()
    for cell, limit in enumerate([100, 10_000, 10_000, 10_000, 10_000, 10_000]):
        namespace = {"run": run}
        # one file name and first line for all (`exec` of a string): only the code object tells them apart
        exec(compile(f"def cell():\n    return run({limit})\n", "<string>", "exec"), namespace)
        ids.add(id(namespace["cell"].__code__))
        tried.clear()
        namespace["cell"]()
        starts.append(tried[0])
        del namespace
        gc.collect()
    assert starts == [512] * 6, (starts, f"{len(ids)} distinct code ids over 6 cells")
