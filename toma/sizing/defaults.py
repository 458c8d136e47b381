"""Each capability's sizing policy where a call gives none, in one place. Once a policy is assigned to
`toma.DEFAULT_POLICY`, it is every capability's instead (read at call time)."""

from toma.core.policy import SizePolicy
from toma.sizing.fit_to_memory import FitToMemory
from toma.sizing.policies import DEFAULT_POLICY, ShrinkByFactor

__all__ = ["CALLS", "ACCUMULATION", "ACCELERATE"]

# toma.batch/range/chunked (every form of them), toma.map, HostedEmbedding: toma 1.1.0's halving sequences
CALLS: SizePolicy = DEFAULT_POLICY
# toma.accumulate, toma.Trainer (training and evaluation), TomaTrainer, MicroBatching: sized by measuring
ACCUMULATION: SizePolicy = FitToMemory()
# toma.integrations.accelerate.find_executable_batch_size: accelerate's int(batch_size * 0.9), 128, 115, 103, ...
ACCELERATE: SizePolicy = ShrinkByFactor(0.9)
