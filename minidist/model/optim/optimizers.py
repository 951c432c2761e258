"""SGD and AdamW over a list of :class:`~minidist.model.autograd.Parameter`.

The classes only keep state and loop; the arithmetic is in :mod:`minidist.model.optim.functional`.

* ``.data`` of each parameter is its master copy (float32 or float64); ``.grad`` must have the
  same shape (it may be of lower precision; the in-place update casts it).
* Parameters whose ``.grad`` is ``None`` are skipped (their state and step count do not move,
  as in PyTorch).
* ``.lr`` is a plain attribute: the trainer sets it from the schedule before each ``step()``.
* Weight decay can be switched off per parameter with a predicate, e.g.
  ``no_decay=lambda p: p.data.ndim < 2`` for biases and LayerNorm gains (the GPT-2/nanoGPT
  convention).  One predicate is simpler than PyTorch-style param groups and covers that case.
* ``state_dict()`` is a plain dict of copied arrays and integers keyed by parameter name, so a
  checkpoint can store it and ``load_state_dict`` continues bit-identically.
"""

from __future__ import annotations

from minidist.model.backend import xp
from minidist.model.ops.cuda import multi_tensor

from minidist.model.optim.functional import adamw_hyper, adamw_update, sgd_update


def no_decay_below_2d(p) -> bool:
    """The usual ``no_decay`` predicate: vectors (biases, norm gains) are not decayed."""
    return p.data.ndim < 2


def _check_hyper(name, value, low=0.0, high=None, low_open=False):
    value = float(value)
    bad = value <= low if low_open else value < low
    if bad or (high is not None and value >= high) or value != value:
        bound = f"in ({low}, {high})" if high is not None else (f"> {low}" if low_open else f">= {low}")
        raise ValueError(f"{name} must be {bound}, got {value!r}")
    return value


class Optimizer:
    """Shared bookkeeping: parameter names, per-parameter state, zero_grad, (de)serialisation."""

    state_keys: tuple[str, ...] = ()

    def __init__(self, params, lr, weight_decay=0.0, no_decay=None):
        self.params = list(params)
        if not self.params:
            raise ValueError("optimizer got an empty parameter list")
        self.names = [p.name if getattr(p, "name", None) else f"param{i}" for i, p in enumerate(self.params)]
        dup = {n for n in self.names if self.names.count(n) > 1}
        if dup:
            raise ValueError(f"parameter names must be unique for state_dict, repeated: {sorted(dup)}")
        self.lr = _check_hyper("lr", lr)
        self.weight_decay = _check_hyper("weight_decay", weight_decay)
        self.no_decay = no_decay
        self.state: dict[str, dict] = {}  # name -> {"step": int, buffer name -> array}
        self.step_count = 0  # optimizer steps taken (also counts steps where all grads were None)

    def zero_grad(self):
        for p in self.params:
            p.grad = None

    def nbytes(self) -> int:
        """Bytes of the optimizer state's arrays (the step counters are not arrays)."""
        return sum(st[k].nbytes for st in self.state.values() for k in self.state_keys if k in st)

    def wait(self):
        """Return once the parameters' arrays hold the last step's values.  The update here
        is done when ``step`` returns; an offloaded one finishes in the background
        (optim/offload.py), and the loop's readers of the parameters call this first."""

    def reloaded(self):
        """The parameters' arrays and ``state`` were just overwritten (a checkpoint load).
        Nothing to do here; an offloaded optimizer moves the state to its host copies."""

    def decay_of(self, p) -> float:
        """The weight decay applied to ``p`` (0 where the ``no_decay`` predicate says so)."""
        return 0.0 if self.no_decay is not None and self.no_decay(p) else self.weight_decay

    def _state_for(self, name, p) -> dict:
        st = self.state.get(name)
        if st is None:
            st = {"step": 0, **{k: self._zeros(p.data) for k in self.state_keys}}
            self.state[name] = st
        return st

    def _zeros(self, like):
        """A state array's first value (an offloaded optimizer keeps it in host memory)."""
        return xp.zeros_like(like)

    def step(self):
        present = [(name, p) for name, p in zip(self.names, self.params) if p.grad is not None]
        for name, p in present:  # every shape checked before any count moves
            if p.grad.shape != p.data.shape:
                raise ValueError(f"gradient of {name!r} has shape {p.grad.shape}, parameter {p.data.shape}")
        self.step_count += 1
        items = []
        for name, p in present:
            st = self._state_for(name, p)
            st["step"] += 1
            items.append((p, st))
        self._update_all(items)

    def _update_all(self, items):
        """Update every (parameter, state) pair; one at a time unless a subclass batches them."""
        for p, st in items:
            self._update(p, st)

    def _update(self, p, st):
        self.update(p.data, p.grad, st, st["step"], self.decay_of(p))

    def update(self, data, grad, st, step, decay):  # pragma: no cover - abstract
        """The update rule on arrays: ``data`` (in place) from ``grad`` and the state arrays
        ``st``, at step ``step`` with weight decay ``decay``.  ZeRO applies it to shards."""
        raise NotImplementedError

    # -- checkpoints ---------------------------------------------------------------------
    def state_dict(self) -> dict:
        """``{"step": int, "lr": float, "state": {name: {"step": int, buffer: array}}}`` (copies)."""
        return {
            "step": self.step_count,
            "lr": self.lr,
            "state": {n: {k: (v.copy() if hasattr(v, "copy") else v) for k, v in st.items()}
                      for n, st in self.state.items()},
        }

    def load_state_dict(self, sd: dict):
        """Restore from :meth:`state_dict`; buffers are copied in, shapes and names checked."""
        shapes = {n: p.data.shape for n, p in zip(self.names, self.params)}
        unknown = sorted(set(sd["state"]) - set(shapes))
        if unknown:
            raise ValueError(f"state_dict has state for unknown parameters {unknown}")
        new_state = {}
        for name, st in sd["state"].items():
            missing = [k for k in ("step", *self.state_keys) if k not in st]
            if missing:
                raise ValueError(f"state of {name!r} lacks {missing}")
            entry = {"step": int(st["step"])}
            for k in self.state_keys:
                arr = xp.asarray(st[k])
                if arr.shape != shapes[name]:
                    raise ValueError(f"state {k!r} of {name!r} has shape {arr.shape}, parameter {shapes[name]}")
                entry[k] = arr.astype(self._param(name).data.dtype, copy=True)
            new_state[name] = entry
        self.state = new_state
        self.step_count = int(sd["step"])
        self.lr = float(sd.get("lr", self.lr))

    def _param(self, name):
        return self.params[self.names.index(name)]


class SGD(Optimizer):
    """Stochastic gradient descent with optional (Nesterov) momentum; see :func:`sgd_update`.

    ``weight_decay`` here is the classic L2 penalty added to the gradient (as in
    ``torch.optim.SGD``), not the decoupled form of AdamW.
    """

    def __init__(self, params, lr, momentum=0.0, weight_decay=0.0, nesterov=False, no_decay=None):
        super().__init__(params, lr, weight_decay, no_decay)
        self.momentum = _check_hyper("momentum", momentum, 0.0, 1.0)
        if nesterov and not self.momentum:
            raise ValueError("nesterov=True needs momentum > 0")
        self.nesterov = bool(nesterov)
        self.state_keys = ("momentum_buffer",) if self.momentum else ()

    def update(self, data, grad, st, step, decay):
        sgd_update(data, grad, st.get("momentum_buffer"), self.lr, self.momentum, decay, self.nesterov)


class AdamW(Optimizer):
    """Adam with decoupled weight decay (Kingma & Ba 2015; Loshchilov & Hutter 2019).

    Defaults follow GPT training practice (betas=(0.9, 0.95), weight_decay=0.1) rather than
    PyTorch's (0.9, 0.999) and 0.01.  See :func:`adamw_update` for the formula.
    """

    state_keys = ("exp_avg", "exp_avg_sq")

    def __init__(self, params, lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, no_decay=None):
        super().__init__(params, lr, weight_decay, no_decay)
        if len(betas) != 2:
            raise ValueError(f"betas must be a pair, got {betas!r}")
        self.betas = (_check_hyper("beta1", betas[0], 0.0, 1.0), _check_hyper("beta2", betas[1], 0.0, 1.0))
        self.eps = _check_hyper("eps", eps, 0.0, low_open=True)

    def update(self, data, grad, st, step, decay):
        adamw_update(data, grad, st["exp_avg"], st["exp_avg_sq"], step, self.lr,
                     self.betas[0], self.betas[1], self.eps, decay)

    def _update_all(self, items):
        """On CuPy, every parameter in one multi-tensor launch (ops.cuda.multi_tensor: the
        arithmetic of adamw_update's fused kernel); elsewhere one adamw_update each."""
        arrays = [a for p, st in items for a in (p.data, p.grad, st["exp_avg"], st["exp_avg_sq"])]
        if multi_tensor.why_not(arrays) is not None:
            return super()._update_all(items)
        b1, b2 = self.betas
        hyper = [adamw_hyper(st["step"], self.lr, b1, b2, self.decay_of(p)) for p, st in items]
        multi_tensor.adamw([p.data for p, _ in items], [p.grad for p, _ in items],
                                [st["exp_avg"] for _, st in items], [st["exp_avg_sq"] for _, st in items],
                                hyper, b1, b2, self.eps)
