"""The memory a training step needs on this machine, estimated before anything is allocated.

``validate`` (``flags.py``) refuses a run whose estimate exceeds the memory available, on every
rank before any message (``host.cli_checks.check_memory``); the formulas for one rank's share
are :func:`training_memory_bytes`, its parameters the planner's count
(``plan.model.num_params``), the sharding divisors :func:`minidist.layout.memory.zero_divisors`.
"""

from __future__ import annotations

import os
from dataclasses import replace

from minidist.host.oversubscribed import local_ranks
from minidist.layout.memory import zero_divisors
from minidist.plan.model import num_params
from minidist.train.config import RunConfig


def memory_estimate(cfg: RunConfig) -> dict:
    """The estimated peak bytes of a training step on the ranks that share this machine's
    memory, by part (:func:`training_memory_bytes` for one rank's share; ``ranks``: how
    many ranks it counts, ``per_rank``: one rank's total).

    One rank holds its pipeline stage's layers (embeddings counted on every stage: small,
    and an over-estimate is the safe side), 1/tp of their weights, and of those ZeRO's 1/dp
    (1: optimizer state; 2: and gradients; 3: and weights; HSDP: 1/K); it computes its dp
    rows of the batch and its seq/cp tokens, and a pipeline keeps the activations of its
    microbatches in flight (GPipe: all of them; 1F1B: at most pp, interleaved a few more).
    ZeRO-3 gathers each block's weights again for backward and recomputes the block, so it
    keeps activations as activation checkpointing does."""
    from minidist.state.data import DEFAULT_MAX_BYTES

    m, d, dev, p = cfg.model, cfg.data, cfg.device, cfg.parallel
    # token shards are memory-mapped: the pages the batches touch, not the corpus, are in memory
    data_bytes = (0 if os.path.isdir(d.data) else os.path.getsize(d.data)) if d.data else DEFAULT_MAX_BYTES
    rows = max(1, d.batch_size // p.dp)
    accum = dev.grad_accum
    if p.pp > 1:  # microbatches split the rows; only those in flight keep their activations
        # ZB-H2's longer warm-up; ZB-V's 2P half-stage chunks are P microbatches' worth
        held = {"zb-h2": 2 * p.pp - 1, "zbv": p.pp}.get(p.schedule, p.pp * p.virtual_stages)
        in_flight = p.microbatches if p.schedule == "gpipe" else min(p.microbatches, held)
        accum = max(1, accum * p.microbatches // in_flight)
    layers = -(-m.layers // p.pp)
    est = training_memory_bytes(num_params(replace(m, layers=layers)), layers, m.d_model, m.heads, d.seq_len // p.cp,
                                rows, accum, m.dtype, dev.mixed_precision, dev.checkpoint_activations or p.zero == 3,
                                cfg.optim.optimizer, data_bytes=data_bytes,
                                eval_batches=cfg.report.eval_batches if cfg.report.eval_every else 0,
                                score_values=score_values(cfg), tp=p.tp, sequence_parallel=p.sequence_parallel,
                                vocab_size=m.vocab_size)
    states = 2 if cfg.optim.optimizer == "adamw" else 1
    shard = p.hsdp_shard or p.dp * p.cp  # ZeRO's partition: the data-parallel (dp x cp) group, or HSDP's
    div = zero_divisors(p.zero, shard)
    weights, grads, state = (1 / p.tp / div[part] for part in ("params", "grads", "optimizer"))
    key = "weights, gradients and optimizer state"
    est[key] = int(est[key] * (weights + grads + states * state) / (2 + states))
    ranks = min(p.world_size, local_ranks() or p.world_size)  # the launcher says; else all of them
    per_rank = sum(n for name, n in est.items() if name != "total")
    out = {name: n * ranks for name, n in est.items() if name != "total"}
    out["total"] = per_rank * ranks
    return {**out, "ranks": ranks, "per_rank": per_rank}


def score_values(cfg: RunConfig) -> int:
    """Attention scores one block keeps per sequence on one rank (its heads/tp), for the memory estimate:
    plain attention keeps H x T x T, blockwise one tile per head; ring attention one tile of
    its chunks; Ulysses its H / C heads over the whole sequence."""
    T, p = cfg.data.seq_len, cfg.parallel
    H = cfg.model.heads // p.tp  # tensor parallelism splits the heads
    block = cfg.model.attention_block or 128
    if p.cp > 1 and p.cp_impl == "ring":
        return H * min(block, max(1, T // (2 * p.cp))) ** 2
    heads = H // p.cp if p.cp > 1 else H
    return heads * (min(block, T) ** 2 if cfg.model.attention == "blockwise" else T * T)


def training_memory_bytes(params: int, n_layer: int, d_model: int, n_head: int, seq_len: int,
                          batch_size: int, grad_accum: int = 1, dtype: str = "float32",
                          mixed_precision: str = "none", checkpoint_activations: bool = False,
                          optimizer: str = "adamw", vocab_size: int = 256,
                          data_bytes: int = 0, eval_batches: int = 0, score_values: int | None = None,
                          tp: int = 1, sequence_parallel: bool = False) -> dict:
    """Estimated peak bytes of a training step of a model of ``params`` parameters and
    ``n_layer`` blocks, by part (``total`` sums them).

    Fitted to :mod:`tracemalloc` peaks of real two-step runs (1-8 layers, d_model 32-1024,
    seq 16-1024, 1-8 heads, float32/64, bf16/fp16, checkpointing, accumulation, SGD: from 6 %
    under to 25 % over the measured peak; tiny models, where Python objects weigh, more over).
    Per block the step keeps about 24 arrays of the micro-batch's
    (tokens x d_model) plus one (T x T) score matrix per head; the logits and their softmax
    and gradients about 8 (tokens x vocab) arrays; the update one temporary the size of the
    largest weight.  Checkpointing keeps each block's input and one block's activations;
    mixed precision (float32 arithmetic on low-precision copies) was measured 25 % above
    float32.  ``data_bytes`` of corpus are held twice while loading; ``eval_batches`` fixed
    validation batches are int64 inputs and targets.  ``score_values``: the attention scores a
    block keeps per sequence (default ``n_head * seq_len**2``, plain attention's; blockwise and
    context-parallel attention keep fewer, see ``estimate.score_values``).  Tensor parallelism
    (``tp``) splits 14 of a block's 24 arrays (the heads' and the MLP's hidden ones) and the
    logits' vocabulary; sequence parallelism splits the other 10 too (Korthikanti et al. 2022).
    """
    item = {"float32": 4, "float64": 8}[dtype]
    act_item = item if mixed_precision == "none" else 5  # measured: 1.25 x float32
    states = 2 if optimizer == "adamw" else 1  # AdamW: m, v; SGD: momentum
    micro = -(-batch_size // grad_accum)       # the largest micro-batch
    tokens = micro * seq_len
    scores = n_head * seq_len * seq_len if score_values is None else score_values
    block = (10 / (tp if sequence_parallel else 1) + 14 / tp) * tokens * d_model + micro * scores
    stored = (n_layer * tokens * d_model + block) if checkpoint_activations else n_layer * block
    parts = {
        "weights, gradients and optimizer state": params * item * (2 + states),
        "activations": int((stored + 8 * tokens * vocab_size / tp + max(4 * d_model * d_model, vocab_size * d_model))
                           * act_item),
        "data": 2 * data_bytes + eval_batches * batch_size * 2 * seq_len * 8,
    }
    parts["total"] = sum(parts.values())
    return parts
