"""A mixture of experts: the feed-forward of every ``moe_every``-th block, as in GShard,
Switch Transformer and Mixtral (Lepikhin et al. 2020; Fedus et al. 2021; Jiang et al. 2024).

A **router** (a bias-free linear map d -> E, then a softmax) scores the E experts for every
token; each token goes to its ``top_k`` best, and the experts' outputs are summed with the
router's weights.  The experts are the architecture's own feed-forward (GPT-2's GELU MLP,
Llama's SwiGLU), named ``h.i.mlp.experts.e.<...>``; the router is ``h.i.mlp.router.weight``.

The rules, each chosen so that a data-parallel or expert-parallel run equals one process:

* **Weights.**  With ``top_k >= 2`` the k chosen probabilities are renormalised to sum to one
  (Mixtral).  With ``top_k = 1`` the weight is the chosen probability itself (Switch): a
  renormalised single weight would be 1, and the router would learn from the auxiliary loss
  alone.  Ties between equal probabilities go to the lower expert index.
* **Groups.**  Capacity and the load-balancing loss are computed per *group* of tokens, as in
  GShard, and a group is one sequence (a row of the batch).  Data parallelism and gradient
  accumulation split a batch by rows, so every rank sees whole groups.
* **Capacity.**  With ``capacity_factor`` c > 0 an expert takes at most
  ``C = ceil(c * T * top_k / E)`` tokens of a sequence of T tokens; the ones beyond, in token
  order (the earlier tokens of the sequence win, whatever their choice rank), are dropped
  for that expert: it adds nothing to the token, and a token all of whose experts dropped it
  passes through the block on the residual alone.  ``capacity_factor = 0`` drops nothing.
* **Load-balancing loss** (Switch, eq. 4; GShard's ``l_aux``): per sequence
  ``E * sum_e f_e * P_e``, where ``f_e`` is the share of the sequence's T * top_k choices
  that picked expert e (before dropping; a constant) and ``P_e`` the mean router probability
  of e over its tokens; 1 when balanced.  The mean over sequences, times ``aux_loss_coef``.
* **Router z-loss** (ST-MoE, Zoph et al. 2022, eq. 5): the mean over tokens of
  ``logsumexp(router logits)^2``, times ``z_loss_coef``; it keeps the logits small.

Both losses of the last forward stay on the layer (``aux_loss``, a Tensor in the graph), and
``GPT.loss`` adds every layer's *value* to the cross-entropy (:func:`add_aux_losses`).  Their
gradient does not flow back from the loss: the mixture's output carries it
(:func:`carry_aux_grad`, as Megatron Core's ``MoEAuxLossAutoScaler`` does), so a block that is
run without its graph and recomputed in backward (activation checkpointing, ZeRO-3) or a
pipeline stage without the loss still backpropagates its auxiliary losses, exactly once: the
backward of the output hands the auxiliary losses the loss's gradient with respect to them
(``MoE.aux_grad``), set as the backward starts -- by the loss's node, or by a pipeline stage
for its own mixtures (:func:`feed_aux_grad`).

The tokens travel in one buffer sorted by expert (:func:`gather_rows`: its backward scatter-adds),
each expert runs on its rows, and the weighted outputs go back to their tokens with
:func:`combine_rows` (one op, written by hand: a scatter-add forward, a gather backward).  The
step in the middle is the **dispatcher** (``MoE.dispatch``): here every expert is local;
expert parallelism (minidist/parallel/expert/) swaps in one that moves the rows to the ranks
holding their experts and back with ``comm.functional.all_to_all_v``.
"""

from __future__ import annotations

import math

from minidist.model import ops
from minidist.model.autograd import Tensor, is_grad_enabled, make_tensor
from minidist.model.backend import from_host, host, host_read, xp  # host: the routing's index bookkeeping
from minidist.model.module import Module, _param
from minidist.model.ops.basic import check_index, check_range, scatter_add_rows
from minidist.model.ops.precision import compute_dtype


def capacity(cfg, tokens: int) -> int | None:
    """How many of a sequence's ``tokens`` one expert takes (None: all, dropless)."""
    if not cfg.capacity_factor:
        return None
    return math.ceil(cfg.capacity_factor * tokens * cfg.top_k / cfg.experts)


class Router(Module):
    """Scores of the experts for each token: ``x @ weight``, weight (d, E), no bias.

    Under mixed precision in the master weight's dtype, float32: Switch Transformer's
    "selective precision" (Fedus et al. 2021, sec. 2.4).  The choices compare probabilities,
    and rounded to bfloat16 (8 bits) near-equal ones tie or swap; the product is tiny (E
    columns)."""

    def __init__(self, d_model: int, n_experts: int, dtype):
        self.weight = _param((d_model, n_experts), dtype, ("normal", 0.02))

    def forward(self, x):
        if ops.get_autocast_dtype() is None:
            return ops.linear(x, self.weight)
        with ops.autocast(None):
            return ops.linear(ops.cast(x, self.weight.dtype), self.weight)


def _add_rows(idx, rows, n: int):
    """``rows`` added into ``n`` zero rows at ``idx`` (repeats add up).  Low-precision rows
    (mixed precision) add up in float32 and are rounded once to their dtype: minidist does no
    arithmetic in float16/bfloat16, and CuPy's scatter-add has no bfloat16."""
    dt = compute_dtype(rows.dtype)
    return scatter_add_rows(idx, rows.astype(dt, copy=False), n, dt).astype(rows.dtype, copy=False)


def combine_rows(rows: Tensor, idx, n: int) -> Tensor:
    """``out[idx[m]] += rows[m]`` into ``n`` zero rows (repeated indices add up); backward:
    the gradient of each row is that of the token it went to, ``grad[idx]``."""
    return make_tensor(_add_rows(idx, rows.data, n), (rows,), lambda g: (g[idx],))


def gather_rows(x: Tensor, idx) -> Tensor:
    """``x[idx]`` along axis 0 (``idx`` an int array, checked on the host when it lies there),
    as ``ops.index_rows``; backward scatter-adds the rows' gradients as :func:`combine_rows`
    does (in float32 for low-precision rows)."""
    idx = check_index(idx, x.shape[0], "gather_rows idx")
    return make_tensor(x.data[idx], (x,), lambda g: (_add_rows(idx, g, x.shape[0]),))


def permute_rows(x: Tensor, perm) -> Tensor:
    """``x[perm]`` for a permutation ``perm`` of x's rows (a host int array); backward puts
    each row's gradient back where the row came from, ``g[inverse]``.  Every row is taken
    once, so no gradients add up: :func:`gather_rows`' scatter-add (a sort and a segment sum
    per call) would give the same rows, slower.  ``check_range``'s errors for an index that is
    not ints in range; ValueError for one that is not a permutation."""
    n = x.shape[0]
    perm = host.asarray(check_range(perm, n, "permute_rows perm"))
    if perm.shape != (n,) or not (host.bincount(perm, minlength=n) == 1).all():
        raise ValueError(f"permute_rows: the index is not a permutation of {n} rows (shape {perm.shape})")
    inverse = host.empty_like(perm)
    inverse[perm] = host.arange(n)
    forward_idx, back_idx = from_host(perm), from_host(inverse)
    return make_tensor(x.data[forward_idx], (x,), lambda g: (g[back_idx],))


def run_local_experts(experts, xs: Tensor, counts) -> Tensor:
    """The rows of ``xs`` sorted by expert, ``counts[e]`` for expert e: each expert on its own.
    An expert no token chose runs on zero rows: its gradient is zeros rather than missing, as
    data parallelism counts a missing gradient, so one process and N ranks take the same step
    (AdamW's moments and weight decay move for it too) and the gradient hooks fire alike."""
    parts = ops.split(xs, [int(c) for c in counts], axis=0)
    return ops.concat([experts[e](p) for e, p in enumerate(parts)], axis=0)


class Route:
    """Which expert each (token, choice) goes to, and which are kept (host arrays)."""

    def __init__(self, choice, keep, n_experts: int):
        n, k = choice.shape
        token, slot = host.nonzero(keep)  # kept (token, choice) pairs, by token
        expert = choice[token, slot]
        order = host.argsort(expert * n + token, kind="stable")  # by expert, then by token
        self.token, self.slot, self.expert = token[order], slot[order], expert[order]
        self.counts = host.bincount(self.expert, minlength=n_experts)


def top_k(cfg, probs: host.ndarray):
    """The top-k choices (N, k) of every token, by its router probabilities (N, E); ties go
    to the lower expert."""
    return host.argsort(-probs, axis=1, kind="stable")[:, :cfg.top_k]


def kept(cfg, choice, T: int):
    """The mask (N, k) of the choices kept under capacity; ``choice``: the choices of whole
    sequences of T tokens, in token order (the earlier tokens take an expert's places first)."""
    n, k, E = choice.shape[0], cfg.top_k, cfg.experts
    C = capacity(cfg, T)
    if C is None:
        return host.ones((n, k), bool)
    picked = host.zeros((n // T, T, E), host.int64)  # picked[b, t, e]: token t of sequence b chose e
    host.put_along_axis(picked.reshape(n, E), choice, 1, axis=1)
    place = host.cumsum(picked, axis=1) - 1  # the token's place in its expert's queue, by token order
    return host.take_along_axis(place.reshape(n, E), choice, axis=1) < C


def shares(choice, B: int, E: int):
    """``f`` (B, E): the share of each sequence's T·k choices (whole sequences) that picked each expert."""
    n, k = choice.shape
    f = host.zeros((n, E))
    host.put_along_axis(f, choice, 1.0 / (n // B * k), axis=1)
    return f.reshape(B, n // B, E).sum(axis=1)


def ignore_routing(logits, probs, choice, keep, f, T) -> None:
    """The default observer of a mixture's routing: nothing (observe/router.py records it)."""


class MoE(Module):
    """The mixture of ``cfg.experts`` experts ``make_expert()`` with a router; ``cfg``: a
    ModelConfig with experts, top_k, capacity_factor, aux_loss_coef and z_loss_coef.
    ``experts_here``: the experts this rank holds (the others are None; all by default).

    Three seams: ``dispatch`` runs the experts on their rows (expert parallelism swaps in one
    that moves them over ranks); where a rank holds part of each sequence -- capacity and the
    load-balancing loss are per sequence (parallel/expert/tokens.py) -- either ``sequence``,
    None or ``(gather, scatter)``: the mixture runs on the whole sequences ``gather(x)`` and
    returns ``scatter(y)``, this rank's part of the output (sequence parallelism); or
    ``whole_choices``, None or ``(choice, B) -> (the whole sequences' choices, this rank's
    token positions in them)``: the mixture runs on this rank's tokens and decides capacity
    and the balancing loss's shares from every rank's choices (context parallelism)."""

    def __init__(self, cfg, dtype, make_expert, experts_here=None):
        E = cfg.experts
        here = range(E) if experts_here is None else experts_here
        self.router = Router(cfg.d_model, E, dtype)
        self.experts = [make_expert() if e in here else None for e in range(E)]
        self.cfg = cfg
        self.aux_loss = None  # the last forward's auxiliary losses (a scalar Tensor)
        self.last_counts = None  # the last forward's kept tokens per expert (host int64, E)
        self.dispatch = run_local_experts  # (experts, rows by expert, counts) -> outputs (the seam)
        self.observe = ignore_routing  # sees each forward's routing: the router statistics' seam (observe/router.py)
        self.sequence = None  # (gather, scatter): whole sequences from this rank's parts, and back (the seam)
        self.whole_choices = None  # (choice, B) -> (every rank's choices in sequence order, this rank's positions)
        self.aux_grad = None  # d loss / d aux_loss for the backward under way (carry_aux_grad)

    def forward(self, x):
        if self.sequence is None:
            return self.mix(x)
        gather, scatter = self.sequence
        return scatter(self.mix(gather(x)))

    def mix(self, x):
        """The mixture's output for ``x`` (B, t, d): whole sequences, or with ``whole_choices``
        this rank's t tokens of each."""
        cfg = self.cfg
        B, t, d = x.shape
        flat = ops.reshape(x, (B * t, d))
        logits = self.router(flat)                                   # (N, E)
        probs = ops.softmax(logits, axis=-1)
        # The routing is decided on the host: one counted read of the probabilities per
        # mixture and pass (on a GPU a synchronisation, like the loss's).
        ph = host_read(probs.data, "routing").astype(host.float64)
        choice = top_k(cfg, ph)
        whole, mine = (choice, None) if self.whole_choices is None else self.whole_choices(choice, B)
        T = whole.shape[0] // B
        keep = kept(cfg, whole, T)
        if mine is not None:  # this rank's tokens' part of the whole sequences' decisions
            keep = keep.reshape(B, T, -1)[:, mine].reshape(B * t, -1)
        f = shares(whole, B, cfg.experts)
        self.observe(logits.data, ph, choice, keep, f, T)
        tokens = host.arange(B * t)[:, None]
        # The gates in float32 under mixed precision: the gather's backward scatter-adds, and
        # minidist does no arithmetic in low precision (nor has CuPy's scatter-add bfloat16).
        p32 = ops.cast(probs, compute_dtype(probs.dtype))
        gates = ops.getitem(p32, (xp.asarray(tokens), xp.asarray(choice)))  # (N, k)
        if cfg.top_k > 1:  # Mixtral: the chosen weights renormalised
            gates = ops.div(gates, ops.sum(gates, axis=1, keepdims=True))
        r = Route(choice, keep, cfg.experts)
        self.last_counts = r.counts
        token, slot = xp.asarray(r.token), xp.asarray(r.slot)
        ys = self.dispatch(self.experts, gather_rows(flat, r.token), r.counts)   # (M, d), by expert
        weighted = ops.mul(ys, ops.cast(ops.reshape(ops.getitem(gates, (token, slot)), (-1, 1)), ys.dtype))
        # The auxiliary losses in float32 too: their gradient is the loss scale times their
        # weight, and fp16's first scale (2**16) alone is above float16's largest number.
        self.aux_loss = self.losses(ops.cast(logits, p32.dtype), p32, f, B, t)
        return carry_aux_grad(ops.reshape(combine_rows(weighted, token, B * t), (B, t, d)), self)

    def losses(self, logits, probs, f, B, t):
        """aux_loss_coef * the load-balancing loss + z_loss_coef * the router z-loss (module
        docstring), or None when both coefficients are 0; ``f`` (B, E): the whole sequences'
        shares (:func:`shares`).  Both are means over the t tokens here: on a context-parallel
        rank the means over its part of each sequence, which the strategy weights by 1/cp, so
        their sum over the cp ranks is the whole sequences' (the loss is linear in them, f a
        constant)."""
        cfg, E = self.cfg, self.cfg.experts
        total = None
        if cfg.aux_loss_coef:
            P = ops.mean(ops.reshape(probs, (B, t, E)), axis=1)                        # (B, E)
            f = xp.asarray(f.astype(probs.dtype))
            total = ops.mul(ops.sum(ops.mul(P, f)), cfg.aux_loss_coef * E / B)
        if cfg.z_loss_coef:
            m = xp.max(logits.data, axis=-1, keepdims=True)  # a constant shift: the gradient is exact
            lse = ops.add(ops.log(ops.sum(ops.exp(ops.sub(logits, m)), axis=-1)), m[:, 0])
            z = ops.mul(ops.mean(ops.mul(lse, lse)), cfg.z_loss_coef)
            total = z if total is None else ops.add(total, z)
        return total


def carry_aux_grad(y: Tensor, layer: MoE) -> Tensor:
    """``y`` unchanged; its backward also hands ``layer.aux_loss`` the gradient ``layer.aux_grad``
    (and clears it: one backward per forward).  The auxiliary losses thus backpropagate with
    the output they came with -- in the recomputed forward when the first one ran without a
    graph -- and the loss adds only their values (:func:`add_aux_losses`).  Without a pending
    gradient (a loss that left them out) they get none this way."""
    aux = layer.aux_loss
    if aux is None:
        return y

    def backward(g):
        scale, layer.aux_grad = layer.aux_grad, None
        return g, None if scale is None else xp.asarray(scale, dtype=aux.dtype).reshape(aux.shape)

    return make_tensor(y.data, (y, aux), backward)


def mixtures(blocks) -> list:
    """The mixtures of ``blocks`` (a pipeline stage's: None for the blocks it does not hold)."""
    return [b.mlp for b in blocks if isinstance(getattr(b, "mlp", None), MoE)]


def aux_loss_value(blocks):
    """The sum of the last forward's auxiliary losses of ``blocks``' mixtures (an array of shape
    (), float64), or None when they have none."""
    values = [m.aux_loss.data.astype(xp.float64) for m in mixtures(blocks) if m.aux_loss is not None]
    return None if not values else sum(values[1:], values[0])


def feed_aux_grad(blocks, grad) -> None:
    """The gradient of the loss being backpropagated with respect to the auxiliary losses of
    ``blocks``' mixtures (a pipeline stage without the loss: its microbatch's loss weight)."""
    for m in mixtures(blocks):
        m.aux_grad = grad


def add_aux_losses(model, loss, blocks=None):
    """``loss`` plus the values of the auxiliary losses of the mixtures of ``blocks`` (default:
    the model's) of their last forward, as one node without graph parents: its backward feeds
    its gradient to the mixtures (:func:`feed_aux_grad`), whose outputs carry it on
    (:func:`carry_aux_grad`).  Added to the graph directly, a recomputed block's auxiliary
    losses would get no gradient, the first forward's having no graph."""
    blocks = model.h if blocks is None else blocks
    value = aux_loss_value(blocks)
    if value is None:
        return loss
    total = Tensor(value.astype(loss.dtype))
    if is_grad_enabled():
        total.requires_grad = True
        total._ctx = ((), lambda g: feed_aux_grad(blocks, g) or ())
    return ops.add(loss, total)
