"""The room kept for right after an out-of-memory error, and the room checked before gloo allocates inside a
collective: under a real address-space cap (a subprocess), and nothing at all without one."""

import pytest

from toma.memory import reserve
from toma.memory.reserve import AddressSpaceReserve, room_for

from helpers import run_python


def test_without_an_address_space_limit_nothing_is_held_or_checked(monkeypatch):
    monkeypatch.setattr(reserve, "address_space_limit", lambda: None)
    kept = AddressSpaceReserve()
    kept.hold()
    assert not kept.held
    room_for(2**50, "a test")  # a petabyte: not even tried


@pytest.mark.slow
def test_under_a_real_cap_the_reserve_is_what_lets_an_allocation_after_the_error_through():
    run_python(
        """
        import torch
        from toma.memory.cpu import predictable_heap, set_cpu_memory_headroom
        from toma.memory.reserve import AddressSpaceReserve, room_for
        predictable_heap(64 * 1024)
        kept = AddressSpaceReserve(8 * 2**20)
        set_cpu_memory_headroom(10 / 1024)  # 10 MiB
        kept.hold()
        assert kept.held
        try:  # what the attempt may use: the cap less the reserve
            torch.empty(6 * 2**20, dtype=torch.uint8)
            raise SystemExit("6 MiB fit beside a reserve of 8 MiB under a cap of 10")
        except RuntimeError as error:
            assert "can't allocate memory" in str(error), error
        kept.release()  # right after the error: the room is back
        torch.empty(6 * 2**20, dtype=torch.uint8)
        room_for(6 * 2**20, "a test")
        try:
            room_for(16 * 2**20, "gloo inside a test's collective")
            raise SystemExit("room for 16 MiB under a cap of 10")
        except MemoryError as error:
            assert "16777216 bytes kept for gloo inside a test's collective" in str(error), error
        blocker = torch.empty(6 * 2**20, dtype=torch.uint8)
        try:
            AddressSpaceReserve(8 * 2**20).hold()
            raise SystemExit("a reserve held where there was no room for it")
        except MemoryError as error:
            assert "8 MiB of address space kept" in str(error), error
        """
    )
