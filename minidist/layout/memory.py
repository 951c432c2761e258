"""ZeRO's memory table: what each stage partitions of a rank's training state.

Rajbhandari et al. 2020 (*ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models*, figure 1): stage 1 partitions the optimizer state over the data-parallel group,
stage 2 also the gradients, stage 3 also the parameters; a rank holds 1/N of what is
partitioned and all of the rest.  The training command's memory estimate (flags.py) and the
planner's cost model (plan/cost.py) divide by it.
"""

from __future__ import annotations


def zero_divisors(stage: int, shard: int) -> dict[str, int]:
    """By how much ZeRO ``stage`` divides what one rank holds of the parameters, the
    gradients and the optimizer state, over a partition of ``shard`` ranks (1: held whole)."""
    return {"params": shard if stage >= 3 else 1,
            "grads": shard if stage >= 2 else 1,
            "optimizer": shard if stage >= 1 else 1}
