"""Learning-rate schedule: linear warmup, then cosine decay to ``min_lr`` (as in nanoGPT).

Warmup keeps Adam's first updates small while its second-moment estimate is still noisy
(Goyal et al. 2017; Liu et al. 2020); cosine decay (Loshchilov & Hutter 2017, SGDR without
restarts) anneals smoothly to ``min_lr``.
"""

from __future__ import annotations

import math
import numbers


def lr_at(step: int, base_lr: float, warmup_steps: int, total_steps: int, min_lr: float = 0.0) -> float:
    """The learning rate of optimizer step ``step`` (counted from 0).

    Exactly nanoGPT's ``get_lr`` with ``lr_decay_iters = total_steps``::

        step <  warmup_steps:  base_lr * (step + 1) / (warmup_steps + 1)
        step >= total_steps:   min_lr
        otherwise:             r = (step - warmup_steps) / (total_steps - warmup_steps)
                               min_lr + 0.5 * (1 + cos(pi * r)) * (base_lr - min_lr)

    So step 0 already trains (lr > 0), step ``warmup_steps`` is exactly ``base_lr``, the
    midpoint of the cosine is the mean of ``base_lr`` and ``min_lr``, and from
    ``total_steps`` on the rate stays at ``min_lr``.  The warmup rule is checked first, so a
    run shorter than its warmup (``total_steps < warmup_steps``, e.g. a quick smoke test with
    the default warmup) simply ends while the rate is still rising.
    """
    if not (isinstance(step, numbers.Integral) and step >= 0):
        raise ValueError(f"step must be a non-negative integer, got {step!r}")
    if warmup_steps < 0:
        raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps!r}")
    if total_steps < 0:
        raise ValueError(f"total_steps must be >= 0, got {total_steps!r}")
    if not 0.0 <= min_lr <= base_lr:
        raise ValueError(f"need 0 <= min_lr <= base_lr, got min_lr={min_lr!r}, base_lr={base_lr!r}")
    if step < warmup_steps:
        return base_lr * (step + 1) / (warmup_steps + 1)
    if step >= total_steps:
        return min_lr
    ratio = (step - warmup_steps) / (total_steps - warmup_steps)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (base_lr - min_lr)
