"""ZeRO's memory table: what each stage partitions of a rank's training state.

Rajbhandari et al. 2020 (*ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models*, figure 1): stage 1 partitions the optimizer state over the data-parallel group,
stage 2 also the gradients, stage 3 also the parameters; a rank holds 1/N of what is
partitioned and all of the rest.  The training command's memory estimate (flags.py) and the
planner's cost model (plan/cost.py) divide by it.
"""

from __future__ import annotations


#: What each ZeRO stage partitions (stage 0 is plain data parallelism: nothing).
PARTITIONED = {0: (), 1: ("optimizer",), 2: ("optimizer", "grads"), 3: ("optimizer", "grads", "params")}


def zero_divisors(stage: int, shard: int) -> dict[str, int]:
    """By how much ZeRO ``stage`` divides what one rank holds of the parameters, the
    gradients and the optimizer state, over a partition of ``shard`` ranks (1: held whole)."""
    return {k: shard if k in PARTITIONED[stage] else 1 for k in ("params", "grads", "optimizer")}


def memory_formula(stage: int, numel: int, shard_numel: int, itemsize: int, state_arrays: int) -> dict:
    """Per-rank bytes of parameters, gradients and optimizer state at ``stage`` (the table of
    parallel/data/zero.py), for Ψ = ``numel`` parameters of which this rank's shards hold exactly
    Ψ_r = ``shard_numel`` elements, ``itemsize`` bytes each, the optimizer keeping
    ``state_arrays`` arrays per parameter (AdamW 2)."""
    held = {k: shard_numel if k in PARTITIONED[stage] else numel for k in ("params", "grads", "optimizer")}
    return {"params": itemsize * held["params"], "grads": itemsize * held["grads"],
            "optimizer": itemsize * state_arrays * held["optimizer"]}
