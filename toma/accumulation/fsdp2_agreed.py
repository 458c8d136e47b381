"""FSDP2's own collectives made retry-safe: each all-gather and reduce-scatter a pass issues runs only once every
rank agreed that all got there (`Agreement.all_finished`), after FSDP2 allocated its buffers. A rank that ran out
of memory (computing, or allocating a collective's buffer) meets the others at their next collective through its
`after_attempt`, and every rank leaves the attempt: no rank is left waiting in an all-gather.

The wrappers keep the group's own communication (FSDP2's default, or what the user set with
`set_custom_all_gather`/`set_custom_reduce_scatter`): its `allocate`, then the agreement, then its call.
`toma.accumulation.fsdp2.ShardedUnits.agree_before_collectives` installs them for an attempt.

Gloo (CPU tensors) allocates inside its all-gather and reduce-scatter about their output or input: under an
address-space limit, room for twice both is allocated and freed before the agreement, so a rank short of it says so
there rather than failing inside the collective with the others waiting in it. An error inside a collective itself
no agreement can cover: it is marked so (`toma.core.oom.failed_inside_collective`), never retried, and raised at
once with a note naming the collective (the other ranks stop when the collective fails for them: where this
rank's process ends, or at the process group's timeout)."""

from typing import Any, Callable, Sequence

import torch

from toma.core.agreement import Agreement
from toma.core.oom import collective
from toma.memory.reserve import room_for

__all__ = ["CollectiveAgreements", "AgreedAllGather", "AgreedReduceScatter"]


class CollectiveAgreements:
    """What an attempt in FSDP2's own schedule agrees with: the ranks' `agreement` at the attempt's `size`,
    this rank's `scale` of its gradients before the reduce-scatter's average (its share of the ranks' items,
    where `weight=` weighs ranks), whether this rank's passes only join the others' rounds now (`joining`: its
    gradients count nothing), and the agreements met so far (`count`)."""

    __slots__ = ("agreement", "size", "scale", "joining", "count")

    def __init__(self, agreement: Agreement, size: int, scale: float) -> None:
        self.agreement, self.size, self.scale = agreement, size, scale
        self.joining = False
        self.count = 0

    def agree(self) -> None:
        """Returns once every rank got to this collective; raises as the agreement decides where one failed."""
        self.count += 1
        self.agreement.all_finished(self.size)


def _room_for(output: torch.Tensor, input: torch.Tensor) -> None:
    """Where the collective allocates copies of its output and input inside (gloo, on the CPU): as much allocated
    and freed now, before the agreement (an out-of-memory error here is an ordinary failure of this rank's
    attempt)."""
    if output.device.type == "cpu":
        # Under an address-space limit: gloo allocates about its output (an all-gather) or its input (a
        # reduce-scatter) on its own threads, through malloc as this check does (16.3 of 16 MiB, 8.5-10.5 of 8 MiB,
        # seen); twice both, as a margin for what its threads take around them (room for both once was seen to
        # leave an all-gather of 1 MiB without room inside)
        room_for(2 * (output.nbytes + input.nbytes), "gloo inside FSDP2's next collective")


def _inside(name: str, call: Callable[..., Any], **arguments: Any) -> Any:
    """`call(**arguments)`, an error inside it marked as one no agreement covers."""
    with collective(f"FSDP2's {name}"):
        return call(**arguments)


class _AgreedComm:
    """An FSDP2 group's communication object (`inner`: its `allocate`, then its call) with the agreements an
    attempt meets before the call."""

    __slots__ = ("inner", "agreements")

    def __init__(self, inner: Any, agreements: CollectiveAgreements) -> None:
        self.inner, self.agreements = inner, agreements

    def allocate(self, size: Sequence[Any], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self.inner.allocate(size, dtype=dtype, device=device)  # type: ignore[no-any-return]


class AgreedAllGather(_AgreedComm):
    """An FSDP2 group's all-gather (`inner`), run after the ranks' agreement."""

    __slots__ = ()

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, async_op: bool = False
    ) -> Any:
        _room_for(output_tensor, input_tensor)
        self.agreements.agree()
        return _inside(
            "all-gather", self.inner, output_tensor=output_tensor, input_tensor=input_tensor, group=group,
            async_op=async_op,
        )  # fmt: skip


class AgreedReduceScatter(_AgreedComm):
    """An FSDP2 group's reduce-scatter (`inner`), run after the ranks' agreement, this rank's gradients (FSDP2's
    flat input, copied in already) multiplied by the agreements' `scale` first, or zeroed in the rounds it only
    joins (`CollectiveAgreements.joining`: a zero-weighted loss does not clear a NaN)."""

    __slots__ = ()

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any, async_op: bool = False
    ) -> Any:
        _room_for(output_tensor, input_tensor)
        self.agreements.agree()
        with collective("FSDP2's reduce-scatter"):  # every rank agreed to run it: no error is retried from here
            if self.agreements.joining:  # a round this rank runs only to match the others': it counts nothing
                input_tensor.zero_()
            elif self.agreements.scale != 1.0:
                input_tensor.mul_(self.agreements.scale)
        return _inside(
            "reduce-scatter", self.inner, output_tensor=output_tensor, input_tensor=input_tensor, group=group, op=op,
            async_op=async_op,
        )  # fmt: skip
