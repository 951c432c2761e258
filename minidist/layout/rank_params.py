"""What a rank holds of the model's parameters: each one's elements on a tensor-parallel rank
of some pipeline stages, in ``model.parameters()`` order, and what reduces it.

The tensors are the model's own list (``layout.model.parameter_shapes``, in global shapes);
here each is cut as Megatron-LM's layers cut it (Shoeybi et al. 2019): column-parallel
weights and biases (q|k|v, the MLP's first matrix) divided by tp on their output axis,
row-parallel weights (attention's output, the MLP's second matrix) on their input axis,
their biases and the norms replicated; the vocabulary-parallel embedding and head hold
ceil(V/tp) rows (padded: parallel/tensor/vocab_parallel.py); a mixture's router and experts
replicated over tp (parallel/expert/tokens.py).  The data-parallel traffic (traffic.py)
cuts DDP's buckets from this list and sums ZeRO's shards over it; tests/test_axis_bytes.py
checks it against real models' parameters.
"""

from __future__ import annotations

import math

from minidist.layout.model import ModelConfig, parameter_shapes
from minidist.layout.schedules import layer_range

COLUMN = {"attn.c_attn.weight", "attn.c_attn.bias", "mlp.c_fc.weight", "mlp.c_fc.bias", "attn.q_proj.weight",
          "mlp.gate_up_proj.weight"}                       # split on the output (last) axis
ROW = {"attn.c_proj.weight", "mlp.c_proj.weight", "attn.o_proj.weight", "mlp.down_proj.weight"}  # the input axis
KEY_VALUE = {"attn.k_proj.weight", "attn.v_proj.weight"}   # Llama's k and v: whole key/value heads


def kv_heads_here(kv_heads: int, tp: int) -> int:
    """Key/value heads a tensor-parallel rank holds: K/tp, or the one it shares with tp/K ranks."""
    return max(kv_heads // tp, 1)


def tp_numel(m: ModelConfig, key: str, shape: tuple, tp: int) -> int:
    """Elements a tensor-parallel rank holds of the parameter ``key`` (its name inside a block,
    or a top-level name) of global ``shape``."""
    if key in ("wte.weight", "lm_head.weight"):
        return -(-m.vocab_size // tp) * m.d_model
    if key in COLUMN or key in ROW:
        return math.prod(shape) // tp
    if key in KEY_VALUE:
        return m.d_model * kv_heads_here(m.kv, tp) * m.head_dim
    return math.prod(shape)  # norms, row-parallel biases, position table, router, experts


def rank_params(m: ModelConfig, tp: int = 1, stages=None, num_stages: int = 1, ep: int = 1,
                ep_rank: int = 0) -> list[tuple[int, tuple]]:
    """``(elements, unit)`` of each parameter a rank holds, in ``model.parameters()`` order
    (the order DDP's buckets are cut from, reversed); ``unit`` says what reduces it: ``("root",)``
    (embeddings, final norm, head), ``("block", i)``, or ``("experts", i)`` for block i's
    experts under expert parallelism (``ep`` > 1: this rank, ``ep_rank`` of its ep group,
    holds experts ``ep_rank·E/ep ..``; they are reduced over the edp group, parallel/data/experts.py).

    On a pipeline (``stages``: this rank's model stages of ``num_stages``) the first stage
    keeps the embeddings, the last the final norm and the head, and with tied embeddings the
    last stage keeps its own copy of the token embedding (pipeline/runtime.py)."""
    stages = list(range(num_stages)) if stages is None else list(stages)
    first, last = 0 in stages, num_stages - 1 in stages
    held = {i for s in stages for i in layer_range(s, m.layers, num_stages)}
    mine = range(ep_rank * m.experts // ep, (ep_rank + 1) * m.experts // ep)
    out = []
    for name, shape in parameter_shapes(m).items():
        if name.startswith("h."):
            _, i, key = name.split(".", 2)
            i = int(i)
            expert = key.startswith("mlp.experts.")
            if i not in held or (expert and ep > 1 and int(key.split(".")[2]) not in mine):
                continue
            unit = ("experts", i) if expert and ep > 1 else ("block", i)
        else:
            key, unit = name, ("root",)
            keeps = {"wte.weight": first or (last and not m.untied), "wpe.weight": first}.get(key, last)
            if not keeps:
                continue
        out.append((tp_numel(m, key, shape, tp), unit))
    return out


def param_numels(m: ModelConfig, tp: int = 1, stages=None, num_stages: int = 1, ep: int = 1,
                 ep_rank: int = 0) -> list[int]:
    """Elements of each parameter a rank holds, in ``model.parameters()`` order (:func:`rank_params`)."""
    return [n for n, _ in rank_params(m, tp, stages, num_stages, ep, ep_rank)]
