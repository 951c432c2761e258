"""What a rank holds of the model's parameters: each one's elements on a tensor-parallel rank
of some pipeline stages, in ``model.parameters()`` order, and what reduces it.

The data-parallel traffic (traffic.py) cuts DDP's buckets from this list and sums ZeRO's
shards over it; tests/test_axis_bytes.py checks it against real models' parameters.  Megatron-LM's
split (Shoeybi et al. 2019): column-parallel weights and biases divided by tp, row-parallel
weights too, their biases and the norms replicated; a mixture's router and experts
replicated over tp (parallel/expert/tokens.py).
"""

from __future__ import annotations

from minidist.layout.schedules import layer_range


def mlp_numels(d: int, tp: int = 1, llama: dict | None = None) -> list[int]:
    """The feed-forward on a tensor-parallel rank: GPT-2's MLP, c_fc (column: weight, bias) and
    c_proj (row; its bias replicated); or with ``llama`` ({"heads", "kv_heads", "ffn"}) the
    SwiGLU of width ffn: gate|up (one fused column weight, each half split) and down (row)."""
    if llama:
        f = llama["ffn"] // tp
        return [d * 2 * f, f * d]
    return [d * 4 * d // tp, 4 * d // tp, 4 * d // tp * d, d]


def kv_heads_here(kv_heads: int, tp: int) -> int:
    """Key/value heads a tensor-parallel rank holds: K/tp, or the one it shares with tp/K ranks."""
    return max(kv_heads // tp, 1)


def attention_numels(d: int, tp: int, llama: dict | None = None) -> list[int]:
    """A block's first part on a tensor-parallel rank: GPT-2's ln_1 (2), c_attn (column, fused
    q|k|v), c_proj (row; its bias replicated), ln_2 (2); Llama's ln_1, q, k, v (its key/value
    heads), o, ln_2 (RMSNorm weights, no biases)."""
    if llama:
        D, kv = d // llama["heads"], kv_heads_here(llama["kv_heads"], tp)
        return [d, d * d // tp, d * kv * D, d * kv * D, d // tp * d, d]
    return [d, d, d * 3 * d // tp, 3 * d // tp, d // tp * d, d, d, d]


def block_numels(d: int, tp: int, experts: int = 0, llama: dict | None = None) -> list[int]:
    """One block's parameters on a tensor-parallel rank, in ``model.parameters()`` order:
    :func:`attention_numels`, then the feed-forward (Megatron-LM's split, Shoeybi et al. 2019),
    or with ``experts`` E the mixture (model/moe.py): the router (d x E) and E whole
    feed-forwards, replicated over tp."""
    if not experts:
        return attention_numels(d, tp, llama) + mlp_numels(d, tp, llama)
    return attention_numels(d, tp, llama) + [d * experts] + experts * mlp_numels(d, 1, llama)


def is_mixture(layer: int, experts: int, moe_every: int) -> bool:
    """Block ``layer`` (from 0) holds a mixture: every ``moe_every``-th (ModelConfig.is_moe)."""
    return experts > 0 and (layer + 1) % moe_every == 0


def rank_params(n_layer: int, d_model: int, vocab: int = 256, block_size: int = 128, tied: bool = True,
                tp: int = 1, stages=None, num_stages: int = 1, experts: int = 0, moe_every: int = 1,
                ep: int = 1, ep_rank: int = 0, llama: dict | None = None) -> list[tuple[int, tuple]]:
    """``(elements, unit)`` of each parameter a rank holds, in ``model.parameters()`` order
    (the order DDP's buckets are cut from, reversed); ``unit`` says what reduces it: ``("root",)``
    (embeddings, final LayerNorm, head), ``("block", i)``, or ``("experts", i)`` for block i's
    experts under expert parallelism (``ep`` > 1: this rank, ``ep_rank`` of its ep group,
    holds experts ``ep_rank·E/ep ..``; they are reduced over the edp group, parallel/data/experts.py).

    The vocabulary-parallel embedding holds ceil(V/tp) rows (padded where tp does not divide
    V: parallel/tensor/vocab_parallel.py), as does an untied head's columns.  On a pipeline
    (``stages``: this rank's model stages of ``num_stages``) the first stage keeps the
    embeddings, the last the final LayerNorm and the head, and with tied embeddings the last
    stage keeps its own copy of the token embedding (pipeline/runtime.py).  ``llama``
    ({"heads", "kv_heads", "ffn"}): the Llama family's blocks, no position table, one
    RMSNorm weight at the end."""
    stages = list(range(num_stages)) if stages is None else list(stages)
    first, last = 0 in stages, num_stages - 1 in stages
    d, rows = d_model, -(-vocab // tp)
    root = ("root",)
    out = []
    if first or (last and tied):
        out.append((rows * d, root))
    if first and not llama:
        out.append((block_size * d, root))
    for layer in range(n_layer):
        if not any(layer in layer_range(s, n_layer, num_stages) for s in stages):
            continue
        if not is_mixture(layer, experts, moe_every):
            out += [(n, ("block", layer)) for n in block_numels(d, tp, 0, llama)]
        elif ep == 1:
            out += [(n, ("block", layer)) for n in block_numels(d, tp, experts, llama)]
        else:  # the dense part (attention, router), then this rank's E/ep experts
            out += [(n, ("block", layer)) for n in attention_numels(d, tp, llama) + [d * experts]]
            out += [(n, ("experts", layer)) for n in experts // ep * mlp_numels(d, 1, llama)]
    if last:
        out += [(d, root)] * (1 if llama else 2) + ([] if tied else [(d * rows, root)])
    return out


def param_numels(n_layer: int, d_model: int, vocab: int = 256, block_size: int = 128, tied: bool = True,
                 tp: int = 1, stages=None, num_stages: int = 1, **moe) -> list[int]:
    """Elements of each parameter a rank holds, in ``model.parameters()`` order
    (:func:`rank_params`; ``moe``: its experts, moe_every, ep, ep_rank)."""
    return [n for n, _ in rank_params(n_layer, d_model, vocab, block_size, tied, tp, stages, num_stages, **moe)]
