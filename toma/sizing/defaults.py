"""The registry of default sizing policies, the one place that says which policy each capability uses where a call
gives none, and what `toma.DEFAULT_POLICY` reads and assigns.

Each capability has its own default: the forms, `toma.map` and `HostedEmbedding` halve (toma 1.1.0's sequences),
accumulation and the trainers measure (`FitToMemory`), accelerate's drop-in shrinks as accelerate does. Reading
`toma.DEFAULT_POLICY` gives the forms' policy; assigning it makes the assigned policy every capability's, read at
the start of each run. `print(toma.sizing.defaults.DEFAULTS)` lists them all and how to change each."""

from typing import Dict, Optional

from toma.core.policy import SizePolicy, check_policy
from toma.sizing.fit_to_memory import FitToMemory
from toma.sizing.policies import Halving, ShrinkByFactor

__all__ = [
    "CapabilityDefault",
    "DefaultPolicies",
    "DEFAULTS",
    "CALLS",
    "ACCUMULATION",
    "ACCELERATE",
    "DEFAULT_POLICY",
    "get_default_policy",
    "set_default_policy",
]


class CapabilityDefault:
    """One capability's policy where a call gives none: the policy assigned to `toma.DEFAULT_POLICY`, else its own
    (`own`). `current` is that policy, kept up to date by the registry, so that a `toma.core.runner.Runner` reads
    it at the start of each run with one attribute load."""

    __slots__ = ("name", "users", "own", "current")

    def __init__(self, name: str, users: str, own: SizePolicy) -> None:
        self.name, self.users, self.own = name, users, own
        self.current: SizePolicy = own

    def resolve(self) -> SizePolicy:
        """The policy of a run starting now."""
        return self.current

    def __repr__(self) -> str:
        return f"<default policy of {self.users}: {self.resolve()!r}>"


class DefaultPolicies:
    """The registry: each capability's own default, and the one assigned over all of them (`assigned`, None until
    `toma.DEFAULT_POLICY` is assigned)."""

    def __init__(self) -> None:
        self.calls = CapabilityDefault(
            "calls", "toma.batch/range/chunked (every form), toma.map, HostedEmbedding", Halving()
        )
        self.accumulation = CapabilityDefault(
            "accumulation", "toma.accumulate, toma.Trainer, TomaTrainer, MicroBatching", FitToMemory()
        )
        self.accelerate = CapabilityDefault(
            "accelerate", "toma.integrations.accelerate.find_executable_batch_size", ShrinkByFactor(0.9)
        )
        self._assigned: Optional[SizePolicy] = None

    @property
    def assigned(self) -> Optional[SizePolicy]:
        """The policy assigned over all capabilities (None: each uses its own)."""
        return self._assigned

    @assigned.setter
    def assigned(self, policy: Optional[SizePolicy]) -> None:
        self._assigned = policy
        for entry in self.capabilities.values():
            entry.current = policy or entry.own

    @property
    def capabilities(self) -> Dict[str, CapabilityDefault]:
        return {entry.name: entry for entry in (self.calls, self.accumulation, self.accelerate)}

    def assign(self, policy: Optional[SizePolicy]) -> None:
        """`toma.DEFAULT_POLICY = policy`: from the next run on, the policy of every capability's runs given none;
        `= None` gives each capability its own default again."""
        self.assigned = check_policy(policy, "DEFAULT_POLICY")

    def __repr__(self) -> str:
        lines = [f"{entry.name}: {entry.resolve()!r} ({entry.users})" for entry in self.capabilities.values()]
        assigned = "none" if self.assigned is None else repr(self.assigned)
        lines.append(
            f"assigned over all: {assigned}. Change one call with policy= (toma_policy= on explicit.*, TomaTrainer; "
            "policy= on toma.Trainer, MicroBatching, HostedEmbedding); every capability with toma.DEFAULT_POLICY = ... "
            "(= None: each its own again)"
        )
        return "DefaultPolicies(\n  " + "\n  ".join(lines) + "\n)"


DEFAULTS = DefaultPolicies()
CALLS = DEFAULTS.calls
ACCUMULATION = DEFAULTS.accumulation
ACCELERATE = DEFAULTS.accelerate
DEFAULT_POLICY: SizePolicy = CALLS.own  # toma 1.1.0's sequences: the forms' own default


def get_default_policy() -> SizePolicy:
    """What `toma.DEFAULT_POLICY` reads: the policy the forms use (the assigned one, else Halving)."""
    return CALLS.resolve()


def set_default_policy(policy: Optional[SizePolicy]) -> None:
    """What assigning `toma.DEFAULT_POLICY` does: every capability's policy where none is given, from now on
    (None: each capability's own again)."""
    DEFAULTS.assign(policy)
