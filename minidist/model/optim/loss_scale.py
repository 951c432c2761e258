"""Dynamic loss scaling for float16 training (Micikevicius et al. 2018, "Mixed Precision Training").

fp16 cannot represent gradients below ~6e-8 (they flush to zero).  Multiplying the loss by a
large ``scale`` before backward shifts all gradients up into fp16's range; ``unscale_`` divides
them back before the optimizer sees them.  The scale is chosen dynamically: as large as possible
without overflowing.  If any gradient is inf/nan the step is skipped and the scale is cut
(``backoff_factor``); after ``growth_interval`` clean steps in a row it is raised again
(``growth_factor``).  One trainer step::

    loss_for_backward = loss * scaler.scale
    ... backward ...
    found_inf = scaler.unscale_(params)
    # distributed: found_inf = any(found_inf over all ranks holding different gradients)
    if not found_inf:
        optimizer.step()
    scaler.update(found_inf)

bfloat16 has float32's exponent range and needs no loss scaling.
"""

from __future__ import annotations

from minidist.model.backend import host_read, xp


class DynamicLossScaler:
    def __init__(self, init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000):
        if not init_scale > 0:
            raise ValueError(f"init_scale must be > 0, got {init_scale!r}")
        if not growth_factor > 1:
            raise ValueError(f"growth_factor must be > 1, got {growth_factor!r}")
        if not 0 < backoff_factor < 1:
            raise ValueError(f"backoff_factor must be in (0, 1), got {backoff_factor!r}")
        if not (isinstance(growth_interval, int) and growth_interval >= 1):
            raise ValueError(f"growth_interval must be a positive integer, got {growth_interval!r}")
        self.scale = float(init_scale)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = growth_interval
        self.clean_steps = 0  # consecutive steps without overflow since the last change

    def unscale_(self, params) -> bool:
        """Divide every present gradient by ``scale`` in place; return True if any is inf/nan.

        Each gradient is checked with one float64 sum instead of an elementwise ``isfinite``
        array: a sum of finite fp16/fp32 values cannot overflow float64, while any inf or nan
        makes it non-finite.  Keep gradients in float32 (master gradients) here: dividing an
        fp16 gradient in place would flush its small entries to zero again.
        """
        sums = []  # each gradient's float64 sum, kept on the device: one synchronisation below
        inv_scale = 1.0 / self.scale
        for p in params:
            if p.grad is None:
                continue
            sums.append(xp.sum(p.grad, dtype=xp.float64))
            p.grad *= inv_scale
        return bool(sums) and not bool(host_read(xp.isfinite(xp.stack(sums)).all(), "overflow check"))

    def update(self, found_inf: bool):
        """Back off after an overflow; grow after ``growth_interval`` clean steps in a row."""
        if found_inf:
            self.scale *= self.backoff_factor
            self.clean_steps = 0
            return
        self.clean_steps += 1
        if self.clean_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self.clean_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps}

    def load_state_dict(self, sd: dict):
        self.scale = float(sd["scale"])
        self.clean_steps = int(sd["clean_steps"])
