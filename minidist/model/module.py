"""The module registry every layer of the model builds on (nn.py's layers, moe.py's mixture).

``Module`` finds its parameters and sub-modules by walking its attributes in order (a list
of modules too; a ``None`` in it, a layer another rank holds, keeps the others' indices and
names); ``init_parameters`` draws every parameter from (seed, dotted name) in its global
shape, so that every mesh starts identical.  nn.py re-exports these names.
"""

from __future__ import annotations

from minidist.model.autograd import Parameter
from minidist.model.backend import seeded_normal, xp


# --------------------------------------------------------------------------------------------
# Module: a registry of parameters and sub-modules, found by walking attributes in order.
# --------------------------------------------------------------------------------------------
class Module:
    def named_children(self):
        for key, value in vars(self).items():
            if isinstance(value, Module):
                yield key, value
            elif isinstance(value, (list, tuple)):
                for i, item in enumerate(value):
                    if isinstance(item, Module):
                        yield f"{key}.{i}", item

    def named_parameters(self, prefix: str = ""):
        """(dotted name, Parameter) pairs in a stable order; a shared Parameter appears once."""
        seen = set()
        for name, p in self._walk(prefix):
            if id(p) not in seen:
                seen.add(id(p))
                yield name, p

    def _walk(self, prefix):
        for key, value in vars(self).items():
            if isinstance(value, Parameter):
                yield prefix + key, value
        for key, child in self.named_children():
            yield from child._walk(f"{prefix}{key}.")

    def parameters(self):
        return [p for _, p in self.named_parameters()]

    def zero_grad(self):
        for p in self.parameters():
            p.grad = None

    def state_dict(self) -> dict:
        """Parameter arrays by stable dotted name (GPT-2 naming: ``h.0.attn.c_attn.weight``)."""
        return {name: p.data for name, p in self.named_parameters()}

    def load_state_dict(self, state: dict, strict: bool = True):
        params = dict(self.named_parameters())
        missing = sorted(set(params) - set(state))
        unexpected = sorted(set(state) - set(params))
        if strict and (missing or unexpected):
            raise KeyError(f"state_dict mismatch: missing {missing}, unexpected {unexpected}")
        for name, p in params.items():
            if name not in state:
                continue
            value = xp.asarray(state[name])
            if tuple(value.shape) != tuple(p.shape):
                raise ValueError(f"{name}: shape {tuple(value.shape)} != parameter shape {tuple(p.shape)}")
            p.data = value.astype(p.dtype, copy=True)

    def num_parameters(self) -> int:
        return sum(int(p.size) for p in self.parameters())

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)


def _param(shape, dtype, init: tuple, sharding=None) -> Parameter:
    """A parameter whose values are filled later by ``init_parameters`` (see GPT.__init__).

    ``shape`` is the global shape; a ``sharding`` (e.g. parallel.tensor.Shard) says which
    slice of it this rank keeps: ``sharding.local_shape(shape)`` and ``sharding.take(full)``.
    """
    local = shape if sharding is None else sharding.local_shape(shape)
    p = Parameter(xp.zeros(local, dtype=dtype), global_shape=shape, sharding=sharding)
    p.init = init  # ("normal", std) | ("ones",) | ("zeros",)
    return p


def init_parameters(module: Module, seed: int):
    """Name every parameter and draw its values from (seed, name) in its global shape;
    a sharded parameter keeps its slice of that draw, so every mesh starts identical."""
    for name, p in module.named_parameters():
        p.name = name
        kind = p.init[0]
        if kind == "normal":
            full = seeded_normal(seed, name, p.global_shape, p.init[1], p.dtype)
        elif kind == "ones":
            full = xp.ones(p.global_shape, dtype=p.dtype)
        elif kind == "zeros":
            full = xp.zeros(p.global_shape, dtype=p.dtype)
        else:
            raise ValueError(f"unknown init {p.init!r} for {name}")
        p.data = full if p.sharding is None else xp.ascontiguousarray(p.sharding.take(full))
