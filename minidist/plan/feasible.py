"""Why a plan cannot run a model, one line per reason, before anything is priced: the mesh
against the devices, the heads, the sequence, the layers and the batch; the schedule's own
conditions; and expert parallelism's (ep divides the experts and the data-parallel ranks,
as minidist's ``--ep`` requires; with ``minidist`` the combinations its mixture refuses)."""

from __future__ import annotations

import math

from minidist.layout.schedules import schedule_problem
from minidist.layout.model import ModelConfig
from minidist.layout.settings import CP_IMPLEMENTATIONS, cp_unsplit
from minidist.plan.settings import SCHEDULES, Plan
from minidist.plan.stages import stage_blocks


def problems(model: ModelConfig, plan: Plan, devices: int, global_batch_tokens: int,
             minidist: bool = False) -> list[str]:
    """Why ``plan`` cannot run ``model`` (one line each; [] when it can), before any cost.
    ``minidist``: also what minidist's own implementation refuses."""
    out = []
    p, seq = plan, model.block_size
    if p.devices != devices:
        out.append(f"mesh {p.mesh()} has {p.devices} devices, not --gpus {devices}")
    if model.heads % p.tp or model.kv % p.tp:
        out.append(f"tp={p.tp} does not divide the {model.heads} heads and {model.kv} key/value heads")
    problem = cp_problem(model, p.tp, p.cp, p.cp_impl)
    if problem:
        out.append(problem)
    if p.pp > model.layers:
        out.append(f"pp={p.pp} exceeds the {model.layers} layers")
    if global_batch_tokens % seq:
        out.append(f"the global batch of {global_batch_tokens} tokens is not a whole number of {seq}-token sequences")
    else:
        seqs = global_batch_tokens // seq
        if seqs % p.dp:
            out.append(f"dp={p.dp} does not divide the {seqs} sequences of the global batch")
        elif (seqs // p.dp) % p.microbatches:
            out.append(f"{p.microbatches} microbatches do not split the {seqs // p.dp} sequences of a replica")
    if p.schedule not in SCHEDULES:
        out.append(f"schedule {p.schedule!r} is not one of {', '.join(SCHEDULES)}")
    if p.schedule == "interleaved" and p.pp > 1:
        if p.virtual_stages < 2:
            out.append("the interleaved schedule needs at least 2 virtual stages")
        elif p.virtual_stages > math.ceil(model.layers / p.pp):
            out.append(f"{p.virtual_stages} virtual stages exceed the {math.ceil(model.layers / p.pp)} blocks "
                       f"of a stage "
                       f"(pp={p.pp}, {model.layers} layers)")
        elif p.microbatches % p.pp:
            out.append(f"the interleaved schedule needs the microbatches ({p.microbatches}) a multiple of pp={p.pp}")
    if p.schedule in ("zb-h1", "zb-h2", "zbv") and p.pp > 1:
        problem = schedule_problem(p.schedule, p.pp, p.microbatches, p.virtual_stages)
        if problem:
            out.append(problem)
        elif p.schedule == "zbv" and min(stage_blocks(model.layers, p.pp)) < 2:
            out.append(f"the zbv schedule needs 2 blocks per stage at least (pp={p.pp}, {model.layers} layers)")
    if p.zero not in (0, 1, 2, 3):
        out.append(f"ZeRO stage {p.zero} is not 0, 1, 2 or 3")
    return out + expert_problems(model, p, minidist)


def cp_problem(model: ModelConfig, tp: int, cp: int, cp_impl: str = "ring") -> str | None:
    """Why ``cp`` ranks cannot share the attention the way ``cp_impl`` does (None when they
    can): layout.settings.cp_unsplit's rule, the run's, in the planner's words."""
    seq = model.block_size
    if cp_impl not in CP_IMPLEMENTATIONS:
        return f"context-parallel implementation {cp_impl!r} is not one of {', '.join(CP_IMPLEMENTATIONS)}"
    if not cp_unsplit(cp, cp_impl, seq, model.heads // tp):
        return None
    if cp_impl == "ring":
        return f"cp={cp}: the sequence of {seq} tokens does not split into 2 x {cp} equal chunks"
    return (f"cp={cp} (Ulysses): the {model.heads // tp} heads of a tp={tp} rank and the sequence of {seq} "
            f"tokens must split into {cp} equal parts")


def expert_problems(model: ModelConfig, p: Plan, minidist: bool = False) -> list[str]:
    """Expert parallelism's conditions: ep splits every mixture's experts evenly over ep ranks
    of the data-parallel group (parallel/expert/checks.py).  Priced as minidist, a mixture
    with tp, pp, cp, ZeRO-3 or checkpointing is refused: minidist runs them (docs/moe.md), but
    the cost model prices the experts as fused implementations run them (split over tp,
    Megatron Core), not minidist's (replicated over tp, whole sequences gathered under
    sequence parallelism), and these combinations were never checked against measured steps."""
    out = []
    if p.ep > 1 and not model.experts:
        return [f"ep={p.ep} splits the experts of a mixture over ranks: the model has no experts"]
    if model.experts and model.experts % p.ep:
        out.append(f"ep={p.ep} does not divide the {model.experts} experts of a mixture")
    if p.dp % p.ep:
        out.append(f"ep={p.ep} does not divide dp={p.dp}: the experts split over ranks of the data-parallel group")
    if minidist and model.experts:
        refused = [name for name, on in (("tp", p.tp > 1), ("pp", p.pp > 1), ("cp", p.cp > 1),
                                         ("ZeRO-3", p.zero == 3), ("checkpointing", p.checkpoint_activations)) if on]
        if refused:
            out.append(f"the planner does not price minidist's mixture of experts with {', '.join(refused)} "
                       "(minidist runs it; the cost model prices fused experts: use --impl fused)")
    return out
