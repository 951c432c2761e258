"""Every mesh for a model on a number of devices, priced, the feasible ones ranked.

A mesh is (tp, cp, pp, dp) with tp x cp x pp x dp = the device count, tp dividing the
attention heads and the key/value heads, cp splitting the sequence into 2 x cp chunks (the
zig-zag layout's balance), pp at most the layers, dp dividing the global batch's sequences.
For each mesh the planner tries the step's settings -- ZeRO stage 0-3, the microbatch size
(1, 2, 4, 8 sequences), the 1F1B schedule or the interleaved one with V = 2, 4, ... up to
the blocks of a stage, activation checkpointing off and on -- and keeps the fastest that fits
in memory.  GPipe is not tried: it has 1F1B's bubble and holds all M microbatches' activations.

A model with experts is searched over expert parallelism too (GShard): every ep that divides
the experts and the data-parallel ranks (ep | dp, as minidist's ``--ep`` requires) is its own
mesh (tp, cp, pp, dp, ep), priced with its all-to-alls and its experts' memory, so ep > 1
wins where its memory or its smaller expert reduction pays for the all-to-alls.
"""

from __future__ import annotations

from minidist.plan.cost import MIXED_BF16, Estimate, Plan, estimate, problems, stage_blocks
from minidist.plan.feasible import cp_problem


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def meshes(model, devices: int, global_batch_tokens: int, cp_impl: str = "ring"):
    """Every (tp, cp, pp, dp) whose product is ``devices`` and that the model allows (cp
    sharing the attention the way ``cp_impl`` does)."""
    seqs = global_batch_tokens // model.block_size
    for tp in divisors(devices):
        if model.heads % tp or model.kv % tp:
            continue
        for cp in divisors(devices // tp):
            if cp_problem(model, tp, cp, cp_impl):
                continue
            for pp in divisors(devices // (tp * cp)):
                dp = devices // (tp * cp * pp)
                if pp <= model.layers and seqs % dp == 0:
                    yield tp, cp, pp, dp


def expert_degrees(model, dp: int) -> list[int]:
    """The ep sizes a mesh with ``dp`` data-parallel ranks can use: 1, and with experts every
    divisor of dp that divides them."""
    return [ep for ep in divisors(dp) if model.experts and model.experts % ep == 0] or [1]


def settings(model, tp, cp, pp, dp, global_batch_tokens: int, zeros=(0, 1, 2, 3), checkpoint=(False, True),
             zero_bubble: bool = False, ep: int = 1, cp_impl: str = "ring"):
    """The step settings tried for one mesh: 1F1B and interleaved (what the published meshes
    it is compared with ran), and with ``zero_bubble`` zb-h1, zb-h2 and zbv too (priced, but
    not searched by default: their bubble assumes W as long as B, and the paper's zero
    bubble also needs its optimizer post-validation)."""
    per_replica = global_batch_tokens // model.block_size // dp
    sizes = [b for b in (1, 2, 4, 8) if per_replica % b == 0]
    schedules = [("1f1b", 1)]
    if pp > 1:
        most = max(stage_blocks(model.layers, pp))
        v = 2
        while v <= most:
            schedules.append(("interleaved", v))
            v *= 2
        if zero_bubble:  # problems() drops the M and blocks they refuse
            schedules += [("zb-h1", 1), ("zb-h2", 1), ("zbv", 2)]
    for b in sizes:
        M = per_replica // b
        for sched, v in schedules:
            if sched == "interleaved" and M % pp:
                continue
            for z in zeros:
                for ck in checkpoint:
                    yield Plan(tp=tp, cp=cp, pp=pp, dp=dp, zero=z, microbatches=M, schedule=sched, virtual_stages=v,
                               checkpoint_activations=ck, sequence_parallel=True, ep=ep, cp_impl=cp_impl)


def best_for_mesh(model, machine, mesh, global_batch_tokens: int, precision=MIXED_BF16,
                  minidist: bool = False, ep: int = 1, cp_impl: str = "ring") -> tuple[Estimate | None, Estimate | None]:
    """(the fastest setting that fits, the one that needs the least memory) of a mesh."""
    fastest = leanest = None
    fitted = set()  # settings that fit without checkpointing: recomputing would only be slower
    for plan in settings(model, *mesh, global_batch_tokens, ep=ep, cp_impl=cp_impl):
        key = (plan.zero, plan.microbatches, plan.schedule, plan.virtual_stages)
        if plan.checkpoint_activations and key in fitted:
            continue
        if problems(model, plan, plan.devices, global_batch_tokens, minidist):
            continue
        e = estimate(model, machine, plan, global_batch_tokens, precision, minidist)
        if e.fits and not plan.checkpoint_activations:
            fitted.add(key)
        if e.fits and (fastest is None or e.step_s < fastest.step_s):
            fastest = e
        if leanest is None or e.mem_bytes < leanest.mem_bytes:
            leanest = e
    return fastest, leanest


def search(model, machine, devices: int, global_batch_tokens: int, precision=MIXED_BF16, minidist: bool = False,
           cp_impl: str = "ring"):
    """(ranked feasible estimates, one per mesh (and ep), fastest first; the meshes that fit
    nowhere, each with its leanest setting); context parallelism as ``cp_impl``."""
    ranked, infeasible = [], []
    for mesh in meshes(model, devices, global_batch_tokens, cp_impl):
        for ep in expert_degrees(model, mesh[3]):
            fastest, leanest = best_for_mesh(model, machine, mesh, global_batch_tokens, precision, minidist, ep,
                                             cp_impl)
            if fastest is not None:
                ranked.append(fastest)
            elif leanest is not None:
                infeasible.append(leanest)
    ranked.sort(key=lambda e: e.step_s)
    return ranked, infeasible


def rank_of(ranked, tp, cp, pp, dp, ep: int | None = None) -> int | None:
    """1-based rank of a mesh in a ranking (None when absent; any ep unless given)."""
    for i, e in enumerate(ranked, 1):
        p = e.plan
        if (p.tp, p.cp, p.pp, p.dp) == (tp, cp, pp, dp) and ep in (None, p.ep):
            return i
    return None


