"""What the mixture-of-experts routers did in a training step, over the whole global batch.

A :class:`RouterStats` sits on every mixture's ``observe`` seam (model/moe.py) and adds up,
over the step's forwards (every micro-batch), per mixture:

* the **tokens per expert**: the (token, choice) pairs each expert kept (a token counts once
  at each of its k experts), and how many were routed to it before capacity dropped any;
* the **load-balancing loss** of Switch Transformer (Fedus et al. 2021, eq. 4; GShard's
  ``l_aux``), ``E · sum_e f_e P_e`` per sequence, without its coefficient: 1 when balanced;
* the **router z-loss** of ST-MoE (Zoph et al. 2022, eq. 5), the mean over tokens of
  ``logsumexp(logits)^2``, without its coefficient.

At the step's end (:meth:`RouterStats.step`) one all-reduce of these sums over the data-,
pipeline- and context-parallel ranks (``comm.all_reduce``: data-parallel ranks see other
sequences, with expert parallelism the ep ranks among them; context-parallel ranks other
tokens of them; pipeline stages hold other mixtures) makes them the whole model's over the
global batch, so every mesh reports what one process would.  Tensor-parallel ranks are not
summed over: they route the same tokens (parallel/expert/tokens.py).  The sums have one row
per mixture of the *whole model* (its blocks with a mixture, in block order, from the model's
configuration), so every rank lays out the same buffer whatever its stage holds: a stage
fills its own mixtures' rows and leaves the others zero, and a stage without a mixture still
takes part, with zeros.

A forward run without recording gradients is not counted: evaluation, and a recomputed
block's first pass (activation checkpointing), whose recording pass is counted instead.

The record (``router`` in each metrics line, docs/moe.md): ``tokens`` [mixture][expert]
(kept), ``min`` / ``mean`` / ``max`` of those over every expert of every mixture (per
mixture, not summed over mixtures: an imbalance of one layer is not hidden by another's),
``dropped`` (choices over capacity / choices routed, all mixtures), ``aux_loss`` and
``z_loss`` (each the mean over mixtures).  With ``--ep``, ``ep_bytes``: this rank's bytes on
its ep group by the closed form of layout/expert_traffic.py, from the step's routing.
"""

from __future__ import annotations

import functools

from minidist import comm
from minidist.layout.expert_traffic import ep_step_bytes
from minidist.model.autograd import is_grad_enabled
from minidist.model.backend import host, host_read, xp


def mixture_layout(model) -> tuple[list[int], int]:
    """``(blocks, E)``: the indices of the blocks of the whole model that hold a mixture (a
    pipeline stage keeps ``model.h``'s length, None for the blocks it does not hold) and the
    experts per mixture, from the model's configuration: the same on every rank, so every
    stage lays out the same buffer."""
    cfg = model.config
    return [i for i in range(len(model.h)) if cfg.is_moe(i)], cfg.experts


class RouterStats:
    """Router statistics of the whole model's mixtures, summed over ``group`` (None: one
    process); this rank counts the ones it holds.  ``L``: the model's mixtures, every stage's.

    Attaching sets every held mixture's ``observe``; :meth:`detach` restores the default."""

    def __init__(self, model, group=None, recomputed: bool = False):
        blocks, self.E = mixture_layout(model)
        self.recomputed = recomputed  # blocks run once without a graph before their recorded pass (ep_bytes)
        self.L, self.group = len(blocks), group
        held = [(i, model.h[b].mlp) for i, b in enumerate(blocks) if model.h[b] is not None]  # row i: mixture i
        for i, layer in held:
            layer.observe = functools.partial(self.add, i)
        self.layers = [layer for _, layer in held]  # the mixtures this rank holds
        d = self.layers[0].dispatch if self.layers else None
        self.ep_group = getattr(d, "group", None)  # ExpertParallelDispatch's group (None: experts local)
        self.reset()

    def reset(self) -> None:
        L, E = self.L, self.E
        self.kept, self.routed = host.zeros((L, E)), host.zeros((L, E))
        self.balance, self.sequences, self.tokens = host.zeros(L), host.zeros(L), host.zeros(L)
        self.z = [xp.zeros((), dtype=xp.float64) for _ in range(L)]  # on the device until the step's end
        self.forwards = []  # this rank's kept rows per expert, one (E,) per forward (for ep_bytes)

    def add(self, i, logits, probs, choice, keep, f, T) -> None:
        """Mixture ``i``'s routing of one forward (the MoE's observe seam): this rank's tokens'
        (all of B sequences of T tokens, or a context-parallel rank's part of them), ``f``
        (B, E) the sequences' shares of choices per expert.  Switch's ``E · sum_e f_e P_e`` is
        linear in ``P_e``, the mean probability over the sequence, so a rank adds its tokens'
        part, ``E · sum_e f_e · (its tokens' sum of p_e) / T``, and its share of the sequences."""
        if not is_grad_enabled():
            return
        E, (n, B) = self.E, (probs.shape[0], f.shape[0])
        kept = host.bincount(choice[keep], minlength=E)
        self.kept[i] += kept
        self.routed[i] += host.bincount(choice.reshape(-1), minlength=E)
        self.balance[i] += E * (f * probs.reshape(B, n // B, E).sum(axis=1)).sum() / T
        self.sequences[i] += n / T
        self.tokens[i] += n
        x = logits.astype(xp.float64)
        m = xp.max(x, axis=-1, keepdims=True)
        lse = xp.log(xp.sum(xp.exp(x - m), axis=-1)) + m[:, 0]
        self.z[i] = self.z[i] + xp.sum(lse * lse)
        self.forwards.append([int(c) for c in kept])

    def step(self, d_model: int | None = None, itemsize: int | None = None) -> dict:
        """The step's record (module docstring), summed over the group; resets the sums.
        Collective over the group (and the ep group with ``d_model``): every rank calls it."""
        L, E = self.L, self.E
        z = host.asarray(host_read(xp.stack(self.z), "router statistics"), dtype=host.float64) if L else host.zeros(0)
        flat = host.concatenate([self.kept.ravel(), self.routed.ravel(), self.balance, self.sequences, z, self.tokens])
        if self.group is not None and self.group.size > 1:
            flat = host.asarray(comm.all_reduce(flat, self.group, op="sum"), dtype=host.float64)
        kept = flat[:L * E].reshape(L, E)
        routed = flat[L * E:2 * L * E].reshape(L, E)
        balance, sequences, z, tokens = flat[2 * L * E:].reshape(4, L)
        n = routed.sum()
        out = {"tokens": [[int(c) for c in row] for row in kept],
               "min": int(kept.min()), "mean": float(kept.mean()), "max": int(kept.max()),
               "dropped": float((n - kept.sum()) / n) if n else 0.0,
               "aux_loss": float((balance / host.maximum(sequences, 1)).mean()),
               "z_loss": float((z / host.maximum(tokens, 1)).mean())}
        if self.ep_group is not None and d_model is not None:
            out["ep_bytes"] = {self.ep_group.name: self.ep_bytes(d_model, itemsize)}
        self.reset()
        return out

    def ep_bytes(self, d_model: int, itemsize: int) -> int:
        """This rank's bytes on its ep group in the step, by the closed form, from every ep
        rank's routing (one all-gather of the forwards' row counts over the ep group).  With
        ``recomputed`` blocks (activation checkpointing, ZeRO-3) each recorded forward followed
        a first one without a graph that routed the same tokens alike and exchanged them too
        (a forward's bytes without the backward's)."""
        g, F, E = self.ep_group, len(self.forwards), self.E
        mine = host.asarray(self.forwards, dtype=host.int64).reshape(F, E)
        every = host.asarray(comm.all_gather(mine, g)).reshape(g.size, F, E)
        forwards = [[[int(c) for c in every[s, f]] for s in range(g.size)] for f in range(F)]
        first = ep_step_bytes(forwards, g.rank, d_model, itemsize, backward=False) if self.recomputed else 0
        return first + ep_step_bytes(forwards, g.rank, d_model, itemsize)

    def detach(self) -> None:
        from minidist.model.moe import ignore_routing

        for layer in self.layers:
            layer.observe = ignore_routing


def progress_text(r: dict) -> str:
    """`` | experts max/mean 1.25 drop 3.1% aux 1.02``: the progress line's router part."""
    s = r.get("router")
    if not s:
        return ""
    imbalance = s["max"] / s["mean"] if s["mean"] else 0.0
    return f" | experts max/mean {imbalance:.2f} drop {100 * s['dropped']:.1f}% aux {s['aux_loss']:.3f}"


def summary_row(metrics: list) -> list:
    """The summary's router row: the last step's figures and the mean drop over the run."""
    rows = [r["router"] for r in metrics if "router" in r]
    if not rows:
        return []
    s = rows[-1]
    mean_drop = sum(r["dropped"] for r in rows) / len(rows)
    return [("router (last step)", f"tokens per expert min {s['min']} / mean {s['mean']:.1f} / max {s['max']}, "
                                   f"dropped {100 * s['dropped']:.1f}% (run mean {100 * mean_drop:.1f}%), "
                                   f"aux loss {s['aux_loss']:.4f}, z-loss {s['z_loss']:.4f}")]
