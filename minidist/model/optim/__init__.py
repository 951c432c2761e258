"""Optimizers and everything around the update step.

One idea per module:

* :mod:`.functional` - the update rules as in-place array functions (``adamw_update``,
  ``sgd_update``), reusable on flat shards by ZeRO.
* :mod:`.optimizers` - ``SGD`` and ``AdamW`` classes: per-parameter state, ``step``,
  ``zero_grad``, ``state_dict``.
* :mod:`.clip` - global-norm gradient clipping, split so the squared norm can be all-reduced.
* :mod:`.schedule` - ``lr_at``: linear warmup + cosine decay.
* :mod:`.loss_scale` - ``DynamicLossScaler`` for float16.
* :mod:`.offload` - ``OffloadAdamW``: AdamW's state in pinned host memory, stepped by the CPU
  while the next forward runs (ZeRO-Offload; ``--offload optimizer``).
"""

from minidist.model.optim.clip import clip_coefficient, clip_grad_norm, grad_norm_sq, scale_grads
from minidist.model.optim.functional import adamw_update, sgd_update
from minidist.model.optim.loss_scale import DynamicLossScaler
from minidist.model.optim.optimizers import SGD, AdamW, Optimizer, no_decay_below_2d
from minidist.model.optim.schedule import lr_at

__all__ = [
    "SGD", "AdamW", "Optimizer", "no_decay_below_2d", "adamw_update", "sgd_update",
    "clip_grad_norm", "grad_norm_sq", "clip_coefficient", "scale_grads", "lr_at",
    "DynamicLossScaler",
]
