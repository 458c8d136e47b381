"""Call-site keys kept on running frames: always the key a walk of the stack gives, read without walking in a loop,
never kept where a frame's callers can change (generators), never in a trace function's place, and holding nothing
alive."""

import contextlib
import gc
import os
import subprocess
import sys
import threading
import weakref
from types import FrameType

import pytest

from toma import StacktraceMemoryBatchsizeCache, toma
from toma.core import call_sites
from toma.core.call_sites import call_site_key
from toma.core.kept_keys import MAX_KEPT, KeptKeys, code_identity

from helpers import REPO

# A tracer that runs already (coverage) holds the frames' slots: then every key is walked, which other tests check
pytestmark = pytest.mark.skipif(sys.gettrace() is not None, reason="a tracer holds the frames' f_trace slots")


def walked(frame, max_frames=16):
    """The key by a plain walk from `frame`, the reference (its own frame's offset is where it was called from)."""
    key = []
    while frame is not None and len(key) < 2 * max_frames:
        key += [code_identity(frame.f_code), frame.f_lasti]
        frame = frame.f_back
    return tuple(key)


def site(max_frames=16):
    """This frame's call site key, and the walked reference beside it."""
    key = call_site_key(max_frames)
    return key, walked(sys._getframe(0), max_frames)


def agrees(pair):
    """The key equals the walk's but for its first frame's offset (the two calls are two instructions)."""
    key, reference = pair
    return len(key) == len(reference) and key[0] == reference[0] and key[2:] == reference[2:]


def via_a():
    return shared()


def via_b():
    return shared()


def shared():
    return site()


def test_frames_made_anew_at_the_same_address_get_their_own_callers_keys():
    keys_a, keys_b = set(), set()
    for _ in range(200):  # each call's frames are new, mostly where the last call's were
        a, b = via_a(), via_b()
        assert agrees(a) and agrees(b)
        keys_a.add(a[0])
        keys_b.add(b[0])
    assert len(keys_a) == len(keys_b) == 1 and keys_a != keys_b


def test_a_loop_reads_its_key_without_walking_at_every_depth(monkeypatch):
    walks = []
    real = call_sites.kept_key

    def counting(frame, max_frames):
        walks.append(max_frames)
        return real(frame, max_frames)

    monkeypatch.setattr(call_sites, "kept_key", counting)
    frame = sys._getframe(0)
    for _ in range(50):
        whole, short = call_site_key(), call_site_key(3)
        assert whole[2:] == walked(frame)[2:] and short[2:] == walked(frame, 3)[2:] and len(short) == 6
    assert walks == [16, 3], "one walk per call instruction, then the frame's kept key"
    assert isinstance(frame.f_trace, KeptKeys)


def test_a_new_loop_frame_soon_reads_a_kept_key(monkeypatch):
    walks = []
    real = call_sites.kept_key
    monkeypatch.setattr(call_sites, "kept_key", lambda frame, depth: walks.append(depth) or real(frame, depth))

    def epoch():
        keys = []
        for _ in range(20):
            keys.append(call_site_key(4))
        return keys

    epochs = [epoch() for _ in range(3)]
    # epoch 1: the first call walks; epoch 2: the key moves in from the outermost frame kept (3 frames, a call
    # each); epoch 3: the loop's frame is handed the key at the 8th call
    assert len(walks) <= 1 + 3 + 8, walks
    assert epochs[0] == epochs[1] == epochs[2] and len(set(epochs[0])) == 1


def test_a_key_read_from_an_outer_frame_is_the_walked_one_and_moves_inwards():
    def helper():  # a new frame at every call
        return site()

    def loop():
        pairs = []
        for _ in range(20):
            pairs.append(helper())
        return pairs, sys._getframe(0).f_trace

    pairs, kept = loop()
    assert all(agrees(pair) for pair in pairs) and len({key for key, _ in pairs}) == 1
    assert isinstance(kept, KeptKeys), "the frame that runs on keeps the key after a few calls"
    assert pairs[-1][0] is pairs[-2][0], "the same tuple again: a cache finds it without hashing its ints"


def test_a_frame_keeps_a_bounded_number_of_keys():
    helpers = []
    for number in range(2 * MAX_KEPT):  # as many code objects, so as many paths into this frame
        namespace = {"site": site}
        exec(f"def helper_{number}():\n    return site()", namespace)
        helpers.append(namespace[f"helper_{number}"])
    frame = sys._getframe(0)
    pairs = []
    for helper in helpers:
        for _ in range(2):
            pairs.append(helper())
    assert all(agrees(pair) for pair in pairs) and len({key for key, _ in pairs}) == 2 * MAX_KEPT
    assert len(frame.f_trace) <= MAX_KEPT


def test_a_generator_keeps_nothing_its_next_driver_would_see():
    def generator():
        while True:  # its own frame calls toma: the innermost frame of the key
            yield call_site_key(), walked(sys._getframe(0))

    running = generator()

    def drive_a():
        return next(running)

    def drive_b():
        return next(running)

    pairs = [drive() for _ in range(20) for drive in (drive_a, drive_b)]
    assert all(agrees(pair) for pair in pairs)
    assert not {key for key, _ in pairs[0::2]} & {key for key, _ in pairs[1::2]}, "each driver's own keys"
    assert running.gi_frame.f_trace is None


def test_a_trace_function_in_a_frames_slot_is_left_alone():
    def local_tracer(frame, event, arg):
        return local_tracer

    frame = sys._getframe(0)
    frame.f_trace = local_tracer
    try:
        for _ in range(3):
            assert call_site_key()[2:] == walked(frame)[2:]
        assert frame.f_trace is local_tracer
    finally:
        frame.f_trace = None


def test_a_tracer_started_later_still_traces_and_the_keys_stay_right():
    calls = []

    def tracer(frame, event, arg):
        calls.append(frame.f_code.co_name)
        return None

    frame = sys._getframe(0)
    before = [site() for _ in range(3)]
    call_site_key()  # this frame keeps a key: the tracer will ask it about this frame's lines
    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        during = [site() for _ in range(3)]
        call_site_key()
    finally:
        sys.settrace(previous)
    assert "site" in calls, "the tracer saw the calls"
    assert all(agrees(pair) for pair in before + during)
    assert isinstance(frame.f_trace, KeptKeys)


@toma.batch(initial_batchsize=8)
def sized(batch_size):
    return batch_size


def test_a_kept_key_holds_no_frame_and_a_returning_frame_frees_its_locals():
    class Payload:
        pass

    def caller():
        payload = Payload()
        for _ in range(3):
            sized()
        return weakref.ref(payload), sys._getframe(0).f_trace

    gc.disable()  # freed by reference counting alone, or the test fails
    try:
        payload, kept = caller()
        assert payload() is None
    finally:
        gc.enable()
    assert isinstance(kept, KeptKeys)
    assert not any(isinstance(referent, FrameType) for referent in gc.get_referents(kept))
    assert all(isinstance(number, int) for key in kept.values() for number in key)


def test_threads_get_their_own_keys():
    results = {}

    def worker(name):
        results[name] = [site() for _ in range(50)]

    threads = [threading.Thread(target=worker, args=(name,)) for name in "ab"]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    for pairs in results.values():
        assert all(agrees(pair) for pair in pairs)


def test_a_watermark_still_cuts_the_key_and_leaves_the_kept_ones():
    def here():
        return call_site_key()

    frame, keys = sys._getframe(0), []
    for watermarked in (False, True, False, False):
        with call_sites.watermark() if watermarked else contextlib.nullcontext():
            keys.append(here())
    assert len(keys[1]) == 4 and keys[1][2] == code_identity(frame.f_code), "this frame is the outermost"
    assert len(keys[0]) > 4 and keys[0] == keys[2] == keys[3]


def test_the_default_cache_hands_a_loop_one_entry_and_another_call_site_its_own(fresh_toma_state):
    cache = StacktraceMemoryBatchsizeCache()
    looped = [cache.get_batchsize(8) for _ in range(5)]

    def elsewhere():
        return cache.get_batchsize(8)

    others = [elsewhere() for _ in range(3)]
    assert all(entry is looped[0] for entry in looped) and all(entry is others[0] for entry in others)
    assert others[0] is not looped[0]
    assert [cache.get_batchsize(8) for _ in range(2)][1] is not looped[0], "a third call site"


def test_pdb_stepping_out_of_a_function_stops_in_a_caller_that_keeps_keys(tmp_path):
    """bdb sets its tracer on the caller a step returns into only where `not caller.f_trace`: kept keys count as
    an empty slot, or the step would run past the rest of the caller."""
    assert not KeptKeys({(0, 16): (1, 2)})
    (tmp_path / "callee.py").write_text("def helper():\n    x = 1\n    return x\n")
    (tmp_path / "main.py").write_text(
        "from toma.core.call_sites import call_site_key\n"
        "from callee import helper\n"
        "def loop():\n"
        "    for i in range(2):\n"
        "        call_site_key()\n"
        "        helper()\n"
        "        print('after helper', i)\n"
        "loop()\n"
    )
    commands = "b callee.py:3\nc\nstep\nstep\nq\n"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, str(tmp_path)]))
    result = subprocess.run(
        [sys.executable, "-m", "pdb", "main.py"], input=commands, capture_output=True, text=True,
        cwd=tmp_path, env=env, timeout=60,
    )  # fmt: skip
    before_print = result.stdout.split("after helper 0")[0]
    assert "main.py(7)loop()" in before_print, result.stdout
