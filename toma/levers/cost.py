"""What the memory levers cost where they ran: the time per item (a row, or a token with a token budget) of calls
with levers on against calls without, measured on the first calls of each kind that ran once (a failed attempt's time is not the work's),
said once on the `toma` logger when both are known."""

import logging
from dataclasses import dataclass
from typing import Optional, Sequence

__all__ = ["LeverCost", "TIMED_CALLS"]

TIMED_CALLS = 8  # calls timed of each kind: enough for the figure, and later calls pay nothing for it

log = logging.getLogger("toma")


@dataclass
class LeverCost:
    """Seconds and items of the calls without levers (`plain_*`) and with them (`lever_*`, the levers named)."""

    plain_seconds: float = 0.0
    plain_items: int = 0
    plain_calls: int = 0
    lever_seconds: float = 0.0
    lever_items: int = 0
    lever_calls: int = 0
    levers: str = ""
    said: bool = False
    timing: bool = True  # whether the next call may be timed: plain calls still to time, or levers seen and theirs
    seen: bool = False  # whether a call ran with levers

    def timed(self, levers: Sequence[str], seconds: float, items: int) -> None:
        """A call of `items` that took `seconds` with `levers` on (none: plain)."""
        if levers:
            self.lever_seconds += seconds
            self.lever_items += items
            self.lever_calls += 1
            self.levers = ", ".join(levers)
        else:
            self.plain_seconds += seconds
            self.plain_items += items
            self.plain_calls += 1
        self._reopen()
        ratio = self.ratio
        if ratio is not None and not self.said:
            self.said = True
            log.info(
                "toma: with %s a step takes %.2fx the time per item (%.3g s against %.3g s without, on this device)",
                self.levers,
                ratio,
                self.per_item(True),
                self.per_item(False),
            )

    def saw(self, levers: Sequence[str]) -> None:
        """A call ran with `levers` (none: plain): calls with levers are timed from now on too."""
        if levers and not self.seen:
            self.seen = True
            self._reopen()

    def _reopen(self) -> None:
        self.timing = self.plain_calls < TIMED_CALLS or (self.seen and self.lever_calls < TIMED_CALLS)

    def per_item(self, levers: bool) -> Optional[float]:
        """Seconds per item with the levers on (True) or without (False); None before such a call ran."""
        seconds, items = (self.lever_seconds, self.lever_items) if levers else (self.plain_seconds, self.plain_items)
        return seconds / items if items else None

    @property
    def ratio(self) -> Optional[float]:
        """Time per item with the levers against without (None until both were measured)."""
        with_levers, plain = self.per_item(True), self.per_item(False)
        return None if with_levers is None or not plain else with_levers / plain
