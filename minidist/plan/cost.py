"""The cost of one training step on a mesh, from first principles: time by parts, memory
per device, MFU.

The step is priced the way the seeds draw it (a pipeline of microbatches, each running its
stage's blocks with tensor- and context-parallel communication inside, then the
data-parallel reduction and the optimizer):

* **compute** of a microbatch on one stage: matmul FLOPs at ``gemm_eff`` of peak, attention
  FLOPs at ``attn_eff``, element-wise traffic (each saved activation written and read once
  forward, twice backward) at the memory bandwidth, plus the machine's fixed costs; backward
  = 2 x forward; activation checkpointing adds one forward (and its tp communication);
* **tp** (Megatron-LM, Shoeybi et al. 2019): two all-reduces per block forward and two
  backward of the microbatch's activations (with sequence parallelism the same bytes as an
  all-gather plus a reduce-scatter), on the link that t consecutive ranks share; a ring sends
  2(N-1)/N of the buffer per all-reduce and (N-1)/N per all-gather or reduce-scatter, in
  2(N-1) resp. N-1 latency-bound steps; not overlapped;
* **cp** (Ring Attention, Liu et al. 2023; Llama 3's all-gather of K and V): every rank
  receives the other (C-1)/C of the sequence's keys and values per block forward, and twice
  that backward; with ``cp_impl="ulysses"`` (DeepSpeed-Ulysses, Jacobs et al. 2023) two
  all-to-alls per block forward (Q|K|V to whole sequences of heads / C heads, the output
  back) and two backward; exposed;
* **pp**: the schedule's bubble, minidist.layout.schedules.theoretical_bubble of the
  pipeline's time with this stage's forward and backward times: (P-1)/(V M + P-1) for gpipe
  and 1F1B (V = 1) and interleaved 1F1B (Narayanan et al. 2021: V chunks per rank); the
  zero-bubble schedules (Qi et al. 2023) split the backward into B and W of equal halves:
  zb-h1 / zb-h2 idle (P-1) max(F, W) per rank instead of 1F1B's (P-1)(F+B+W), zbv (two
  half-stage chunks in a V) (P-1) F/2 when F, B and W are equal; activations between stages cross
  the link between neighbouring stages; the messages of the fill and the drain are exposed,
  the steady state's overlap with compute (``overlap``);
* **dp** (ZeRO, Rajbhandari et al. 2020): stage 0 all-reduces the gradients, 1 and 2
  reduce-scatter them and all-gather the updated parameters, 3 gathers the parameters for
  each microbatch's forward and backward and reduce-scatters its gradients; the reduction
  overlaps with one microbatch's backward and the gather with one forward (stage 3: with
  each microbatch's compute);
* **ep** (GShard; plan/moe_cost.py): a mixture's dispatch and combine all-to-alls, forward
  and backward, on the link its ep group spans; the experts' gradients reduce over the
  dp x cp / ep ranks holding the same experts, with the run's ZeRO stage;
* **optimizer**: AdamW reads and writes its state once, memory-bound (sharded by ZeRO >= 1);

and **memory** per device: ZeRO's formulas for parameters, gradients and optimizer state
(mixed precision: 2 + 2 + 12 bytes per parameter; stage 1 divides the 12, stage 2 also the
gradients, stage 3 everything by the data-parallel degree; the experts' by dp x cp / ep,
E / ep of them per rank), the activations the schedule
keeps in flight on each stage (1F1B: P - r microbatches; GPipe: all M; interleaved: P (1 +
(P-1)/(P V)) on the first, Narayanan et al.; zb-h1 P and zb-h2 2P-1 on every stage, W holding
them, and zbv P: schedules.peak_in_flight), each block's input only with checkpointing, and
the logits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from minidist.layout.grid import ring_tiles
from minidist.layout.memory import zero_divisors
from minidist.layout.model import ModelConfig
from minidist.layout.schedules import peak_in_flight, theoretical_bubble
from minidist.layout.traffic import qkv_width
from minidist.plan import moe_cost
from minidist.plan.collectives import all_to_all, message, ring_all_reduce, ring_gather
from minidist.plan.feasible import problems
from minidist.plan.machine import Machine
from minidist.plan.model import (activation_bytes_per_token, attention_flops, block_matmul_flops,
                                 block_params, head_flops, mlp_params, model_flops_per_token,
                                 recompute_flops_per_token, skips_masked_half)
from minidist.plan.settings import CHUNKED, FLOAT32, FLOAT64, MIXED_BF16, PRECISIONS, SCHEDULES, Plan, Precision
from minidist.plan.stages import candidate_stages, stage_blocks, stage_mix, stage_params

# The plan's vocabulary and checks live in settings.py and feasible.py; importers of this
# module's names from before the split keep finding them here.
__all__ = ["CHUNKED", "FLOAT32", "FLOAT64", "MIXED_BF16", "PRECISIONS", "SCHEDULES", "Estimate", "Plan", "Precision",
           "Step", "estimate", "in_flight", "memory_parts", "minidist_block_values", "problems", "stage_blocks"]


@dataclass
class Estimate:
    plan: Plan
    step_s: float
    mfu: float
    hfu: float
    mem_bytes: float
    time: dict = field(default_factory=dict)    # seconds by part: compute, tp, cp, ep, pp, bubble, dp, optimizer, fixed
    memory: dict = field(default_factory=dict)  # bytes by part: params, grads, optimizer, activations, logits
    limit: str = ""                             # the largest term after compute
    fits: bool = True

    def as_dict(self) -> dict:
        p = self.plan
        return {"tp": p.tp, "cp": p.cp, "cp_impl": p.cp_impl if p.cp > 1 else None, "pp": p.pp, "dp": p.dp,
                "ep": p.ep, "zero": p.zero,
                "microbatches": p.microbatches,
                "schedule": p.schedule, "virtual_stages": p.virtual_stages,
                "checkpoint_activations": p.checkpoint_activations,
                "sequence_parallel": p.sequence_parallel, "step_s": self.step_s, "mfu": self.mfu, "hfu": self.hfu,
                "mem_gb": self.mem_bytes / 1e9, "fits": self.fits, "limit": self.limit,
                "time_s": dict(self.time), "memory_gb": {k: v / 1e9 for k, v in self.memory.items()}}


# ------------------------------------------------------------------------- the estimate


@dataclass(frozen=True)
class Step:
    """What every term of a step's price needs: the model, the machine, the plan, the
    precision, and the quantities derived from them once."""

    m: ModelConfig
    mc: Machine
    p: Plan
    pr: Precision
    minidist: bool      # price minidist's NumPy implementation instead of fused GPU kernels
    share: float        # the share of a core each rank gets (1 on a device per rank)
    n: float            # tokens of one microbatch on one rank
    seqs_mb: int        # sequences per microbatch
    blocks: tuple       # blocks of each pipeline stage
    V: int              # model chunks per rank (interleaved, zbv), else 1
    ckpt: bool          # forward recomputed in backward
    sp: bool            # sequence parallelism (fused kernels with tp only)
    expert_load: float = 1.0  # with ep > 1: the busiest ep rank's routed rows over the mean (1: balanced)

    @property
    def Ls(self) -> int:
        return max(self.blocks)

    @property
    def nd(self) -> int:
        """Ranks holding the same parameters: the data-parallel reduction group (dp x cp)."""
        return self.p.dp * self.p.cp

    @property
    def ne(self) -> int:
        """Ranks holding the same experts: the edp group (dp x cp / ep)."""
        return self.nd // self.p.ep

    @staticmethod
    def of(m, mc, p, pr, global_batch_tokens, minidist, expert_load: float = 1.0) -> "Step":
        share = min(1.0, mc.cores / (p.devices + mc.load)) if mc.cores else 1.0
        seqs_mb = global_batch_tokens // m.block_size // p.dp // p.microbatches
        return Step(m, mc, p, pr, minidist, share, seqs_mb * m.block_size / p.cp, seqs_mb, stage_blocks(m.layers, p.pp),
                    p.virtual_stages if p.schedule in CHUNKED and p.pp > 1 else 1,
                    # minidist's ZeRO-3 recomputes every block in backward (parallel/data/fsdp.py)
                    p.checkpoint_activations or (minidist and p.zero == 3),
                    p.sequence_parallel and p.tp > 1 and not minidist, expert_load if p.ep > 1 else 1.0)


def forward_time(s: Step) -> float:
    """Seconds of one microbatch's forward on the busiest stage (the last one adds the head):
    per block, the matmul FLOPs at ``gemm_eff`` of peak, the attention FLOPs at ``attn_eff``,
    each saved activation written and read once at the memory bandwidth, and a third of the
    machine's fixed cost per block and microbatch (backward is the other two thirds)."""
    m, mc, p, n, sh = s.m, s.mc, s.p, s.n, s.share
    peak = mc.peak_for(s.pr.compute) * sh

    ring = ring_priced(s)  # then cp_time prices the attention's whole cost

    def block(moe: bool) -> float:  # a mixture: its router and the rows its experts run
        act = (minidist_block_values(m, m.block_size, moe, p.cp > 1 and not p.ulysses) * s.pr.act if s.minidist
               else activation_bytes_per_token(m, s.pr.act, moe))
        if s.minidist and p.ulysses:  # its regrouped copies, per token of a tp rank
            act += ulysses_values(m, p.tp, p.cp) * p.tp * s.pr.act
        flops = block_matmul_flops(m, moe) + (moe_cost.expert_extra_flops(m, s.minidist) if moe else 0.0)
        # the busiest ep rank's experts run more rows than the mean (fused kernels padded to a capacity do not)
        if moe and s.expert_load != 1.0 and (s.minidist or not m.capacity_factor):
            flops += (s.expert_load - 1) * moe_cost.expert_flops(m, s.minidist)
            if s.minidist:
                act += (s.expert_load - 1) * moe_cost.expert_values(m) * s.pr.act
        attention = 0.0 if ring else attention_flops(m, m.block_size, executed=True)
        return (flops * n / p.tp / (peak * mc.gemm_eff) + attention * n / p.tp / (peak * mc.attn_eff)
                + 2 * act * n / p.tp / (mc.mem_bw * sh) + mc.block_mb_s / 3 / sh)

    head = (head_flops(m) * n / p.tp / (peak * mc.gemm_eff) + 4 * n * m.vocab_size / p.tp * 4 / (mc.mem_bw * sh)
            + mc.mb_overhead_s / 3 / sh)
    dense, mixture = block(False), (block(True) if m.experts else 0.0)
    return max(d * dense + k * mixture + (head if r == p.pp - 1 else 0.0)
               for r, (d, k) in enumerate(stage_mix(m, p.pp)))


def tp_time(s: Step) -> float:
    """Seconds of one microbatch's tensor-parallel communication (Megatron-LM, Shoeybi et al.
    2019): per block two all-reduces of the activations forward and two backward (two more
    with recompute); sequence parallelism's all-gather + reduce-scatter move the same bytes."""
    if s.p.tp == 1:
        return 0.0
    msg = s.n * s.m.d_model * s.pr.act
    each = ring_all_reduce(msg, s.p.tp, s.mc.link_for(s.p.tp), s.mc.link_eff) + s.mc.coll_overhead_s / s.share
    return s.Ls * each * (4 + (2 if s.ckpt else 0))


def ring_priced(s: Step) -> bool:
    """Is the attention of this step minidist's ring attention on a CPU, priced by the
    calibration's ring probe (plan/probes.py) rather than by its FLOPs?"""
    return s.minidist and s.p.cp > 1 and not s.p.ulysses and bool(s.mc.ring_tile_s or s.mc.ring_score_s)


def cp_time(s: Step) -> float:
    """Seconds of one microbatch's context-parallel exchange, exposed (the attention waits for it).

    Ring (Ring Attention, Liu et al. 2023; Llama 3's all-gather): every rank receives the
    other (C-1)/C of the sequence's keys and values per block forward, twice that backward.
    minidist's ring attention on a CPU (:func:`ring_priced`): the whole attention, forward and
    backward, priced per online-softmax tile and per score of the busiest cp rank
    (layout.grid.ring_tiles) at the ring probe's rates, which hold its messages too (measured
    at one head width, 32: the price does not follow it); the recompute of checkpointing adds
    its forward, taken as a third (the probe times forward and backward together).

    Ulysses (DeepSpeed-Ulysses, Jacobs et al. 2023): per block forward one all-to-all of a
    rank's queries, keys and values (to whole sequences of heads / C heads) and one of the
    attention's output (back to the rank's tokens); backward the same two again, and the
    forward's two once more with checkpointing.  Each sends (C-1)/C of its buffer."""
    p, m = s.p, s.m
    if p.cp == 1:
        return 0.0
    if p.ulysses:
        qkv, out = ulysses_widths(m, p.tp, p.cp)
        link = s.mc.link_for(p.tp * p.cp)
        calls = sum(all_to_all(s.n * w * s.pr.act, p.cp, link, s.mc.link_eff) for w in (qkv, out))
        return s.Ls * (2 + (1 if s.ckpt else 0)) * (calls + 2 * s.mc.coll_overhead_s / s.share)
    if ring_priced(s):
        tiles, scores = max(ring_tiles(p.cp, m.block_size, True, m.attention_block))
        per_block = (tiles * s.mc.ring_tile_s + s.seqs_mb * m.heads / p.tp * scores * s.mc.ring_score_s) / s.share
        return s.Ls * per_block * (4 / 3 if s.ckpt else 1.0)
    kv = s.seqs_mb * s.m.block_size * 2 * s.m.d_kv / p.tp * s.pr.act
    step = ring_gather(kv, p.cp, s.mc.link_for(p.tp * p.cp), s.mc.link_eff) + (p.cp - 1) * s.mc.coll_overhead_s / s.share
    return s.Ls * 3 * step


def ulysses_widths(m: ModelConfig, tp: int, cp: int) -> tuple[float, float]:
    """Values per token of a tp rank's two Ulysses all-to-alls: its queries, keys and values
    (layout.traffic.qkv_width: the key/value heads repeated for their query heads where cp
    cannot split them, as parallel/context/ulysses.py does), and the attention's output."""
    return qkv_width(m.d_model, m.heads, cp, tp, {"kv_heads": m.kv}), m.d_model / tp


def ulysses_values(m: ModelConfig, tp: int, cp: int) -> float:
    """Values per token a tp rank's Ulysses attention keeps beyond plain attention's (each a new
    array the graph holds for the backward): the keys and values regrouped by destination
    (the q|k|v width less the queries'), the all-to-all's input and output (that width
    twice), the output's way back (the queries' width): three q|k|v widths in all.  Where
    the key/value heads are repeated first, that copy replaces the one plain attention makes
    (already counted by :func:`minidist_block_values`)."""
    return 3 * ulysses_widths(m, tp, cp)[0]


def pp_message_time(s: Step) -> float:
    """Seconds of one activation (or gradient) message between neighbouring stages."""
    if s.p.pp == 1:
        return 0.0
    nbytes = s.n * s.m.d_model * s.pr.act / (s.p.tp if s.sp else 1)
    return message(nbytes, s.mc.link_for(s.p.tp * s.p.cp * 2), s.mc.link_eff) + s.mc.coll_overhead_s / s.share


def dp_calls(s: Step) -> int:
    """Collective calls of the data-parallel reduction per step: ZeRO-3 three per block and
    microbatch (gather, gather again, reduce-scatter), else one or two per block's bucket."""
    if s.p.zero == 3:
        return 3 * s.p.microbatches * s.Ls + 3
    return (1 if s.p.zero == 0 else 2) * (s.Ls + 1)


def dp_time(s: Step, psi: float, nd: int, per_block: float) -> float:
    """Seconds of the data-parallel reduction of ``psi`` parameters per rank over ``nd`` ranks
    (dp x cp; the experts': the edp group) (ZeRO, Rajbhandari et al. 2020), before any
    overlap: stage 0 all-reduces the gradients (ring: 2(N-1)/N of them), 1 and 2
    reduce-scatter them and all-gather the parameters ((N-1)/N each), 3 gathers each block
    (``per_block`` parameters per rank) twice per microbatch and reduce-scatters its gradients."""
    p, pr, mc = s.p, s.pr, s.mc
    if nd == 1 or not psi:
        return 0.0
    link = mc.link_for(p.devices)
    if p.zero == 0:
        t = ring_all_reduce(psi * pr.grad, nd, link, mc.link_eff)
    elif p.zero in (1, 2):
        t = ring_gather(psi * pr.grad, nd, link, mc.link_eff) + ring_gather(psi * pr.param, nd, link, mc.link_eff)
    else:  # one collective per block (FSDP's unit), each paying the ring's latency
        t = p.microbatches * s.Ls * (2 * ring_gather(per_block * pr.param, nd, link, mc.link_eff)
                                     + ring_gather(per_block * pr.grad, nd, link, mc.link_eff))
    t += dp_calls(s) * mc.coll_overhead_s
    return t / s.share if mc.cores else t  # on a CPU the messages take the rank's share of a core too


def sync_wait(s: Step) -> float:
    """On ranks sharing cores: each sync point (a collective, a pipeline message) finds its
    partner descheduled with probability 1 - share and waits a scheduler slice for it."""
    p = s.p
    if not s.mc.cores or p.devices == 1:
        return 0.0
    M = p.microbatches
    # per block: Ulysses' all-to-alls, each C-1 pairwise steps, or the ring's steps
    cp_steps = (4 + (2 if s.ckpt else 0)) * (p.cp - 1) if p.ulysses else 3 * (p.cp - 1)
    syncs = (M * s.Ls * ((4 + (2 if s.ckpt else 0)) * (p.tp > 1) + cp_steps)
             + (2 * s.V * M if p.pp > 1 else 0) + (dp_calls(s) if s.nd > 1 else 0) + 3
             + moe_cost.ep_syncs(s) + (dp_calls(s) if s.m.experts and s.ne > 1 else 0))
    return syncs * (1 - s.share) * s.mc.sync_slice_s


def estimate(model: ModelConfig, machine: Machine, plan: Plan, global_batch_tokens: int,
             precision: Precision = MIXED_BF16, minidist: bool = False, expert_load: float = 1.0) -> Estimate:
    """Time by parts, memory per device and MFU of one step (``problems`` must be empty).

    ``minidist``: price minidist's own implementation (tracemalloc-counted arrays, no
    sequence parallelism, plain attention, or with cp ring attention's tiles where the machine
    has their rates) instead of a fused GPU implementation.
    ``expert_load``: with ep > 1, the busiest ep rank's routed rows over the mean (1:
    balanced routing; moe_cost)."""
    s = Step.of(model, machine, plan, precision, global_batch_tokens, minidist, expert_load)
    m, p, mc, M = model, plan, machine, plan.microbatches
    t_f = forward_time(s)
    work = t_f * (3 + (1 if s.ckpt else 0))                      # backward = 2 x forward, + recompute
    t_mb = work + tp_time(s) + cp_time(s) + moe_cost.ep_time(s)   # one microbatch on the busiest stage
    msg = pp_message_time(s)
    # the fill and drain's messages are exposed; the steady state's where the machine cannot overlap
    pp_exposed = 2 * (p.pp - 1) * msg + (1 - mc.overlap) * 2 * s.V * M * msg
    # the schedule's idle share b of the pipeline, with this stage's forward and backward: b/(1-b) x the work
    share = theoretical_bubble(p.schedule, p.pp, M, s.V, t_forward=t_f, t_backward=work - t_f) if p.pp > 1 else 0.0
    bubble = share / (1 - share) * M * t_mb                        # 1F1B: (P-1) t_mb; interleaved: (P-1)/V t_mb
    psi, psi_e = stage_params(m, p)                                # dense, experts (over ep)
    window = M * work if p.zero == 3 else t_f * 3                  # what the reduction hides behind
    dense, moe = stage_mix(m, p.pp)[s.blocks.index(s.Ls)]           # ZeRO-3's unit: one block of each set
    experts = moe * m.experts * mlp_params(m)
    per_block = ((dense * block_params(m) + moe * block_params(m, True) - experts) / s.Ls / p.tp,
                 experts / p.ep / s.Ls / p.tp)
    reduce = dp_time(s, psi, s.nd, per_block[0]) + dp_time(s, psi_e, s.ne, per_block[1])
    dp_exposed = max(0.0, reduce - mc.overlap * window)
    # AdamW reads the gradient and the state and writes both, on its ZeRO shard of each set
    upd = psi / (s.nd if p.zero >= 1 else 1) + psi_e / (s.ne if p.zero >= 1 else 1)
    optimizer = upd * (precision.grad + 2 * precision.optim + precision.param) / (mc.mem_bw * s.share)
    fixed = (s.Ls * mc.block_step_s + mc.step_overhead) / s.share
    scalars = 3 * 2 * math.ceil(math.log2(p.devices)) * mc.link_for(p.devices).latency if p.devices > 1 else 0.0
    time = {"compute": M * work, "tp": M * tp_time(s), "cp": M * cp_time(s), "pp": pp_exposed, "bubble": bubble,
            "dp": dp_exposed, "optimizer": optimizer, "fixed": fixed + scalars, "sync": sync_wait(s)}
    if m.experts:  # the all-to-alls, exposed (an expert waits for its rows)
        time["ep"] = M * moe_cost.ep_time(s)
    step = sum(time.values())

    mflops = model_flops_per_token(m, m.block_size) * global_batch_tokens
    hflops = mflops + (recompute_flops_per_token(m, m.block_size) * global_batch_tokens if s.ckpt else 0.0)
    total_peak = mc.peak_for(precision.compute) * (min(p.devices, mc.cores) if mc.cores else p.devices)
    memory = memory_parts(m, p, precision, global_batch_tokens, minidist=minidist)
    mem = sum(memory.values())
    others = {k: v for k, v in time.items() if k != "compute"}
    return Estimate(p, step, mflops / (step * total_peak), hflops / (step * total_peak), mem, time, memory,
                    max(others, key=others.get), fits=mem <= mc.mem_bytes * mc.mem_usable)


REPLICATED_ARRAYS = 12  # of minidist's 24 d-wide arrays per token, those every tp rank holds whole


def minidist_block_values(m: ModelConfig, seq: int, moe: bool = False, ring: bool = False) -> float:
    """Values minidist's NumPy block keeps live per token (counted with tracemalloc, see
    train/estimate.training_memory_bytes): about 24 arrays of width d for GPT-2, and plain
    attention's H x T scores per query token.  A Llama block (nn.GroupedQueryAttention,
    nn.SwiGLU) differs by what its ops keep: SwiGLU's 2 f + f in place of GELU's 4 d + 4 d,
    a q|k|v of d + 2 d_kv in place of 3 d, the rotated copy of it (rotary), and with fewer
    key/value heads than query heads the 3 d the repeated heads take (repeat_kv).  A mixture
    (``moe``): moe_cost.minidist_moe_values.  ``ring`` (context parallelism): ring attention's
    online softmax keeps no scores."""
    d, scores = m.d_model, (0 if ring or skips_masked_half(m) else m.heads * seq)
    if not m.gated:
        values = 24 * d + scores
    else:
        qkv = d + 2 * m.d_kv
        values = 24 * d + (3 * m.ffn - 8 * d) + (qkv - 3 * d) + qkv + (3 * d if m.kv < m.heads else 0) + scores
    return moe_cost.minidist_moe_values(m, values) if moe else values


def in_flight(p: Plan, stage: int = 0) -> float:
    """Microbatches (of the whole stage) whose activations ``stage`` holds at its peak: GPipe
    all M; 1F1B P - r (Narayanan et al. 2021); interleaved a share (P-1)/(P V) more for the
    chunks in warm-up (Narayanan et al.: exact on the first stage; the simulator finds later
    stages holding more, up to ((V-1)P+1)/V on the last, which the search's calibration
    against the published meshes has not absorbed yet); the zero-bubble schedules their
    simulated peak over their V chunks (schedules.peak_in_flight): zb-h1 P and zb-h2 2P-1 on
    every stage (W keeps the activations), zbv P."""
    if p.pp == 1:
        return 1.0
    if p.schedule in ("zb-h1", "zb-h2", "zbv"):
        V = p.virtual_stages if p.schedule in CHUNKED else 1
        return peak_in_flight(p.schedule, p.pp, p.microbatches, stage, V) / V
    if p.schedule == "gpipe":
        return float(p.microbatches)
    k = min(p.microbatches, p.pp - stage)
    return k * (1 + (p.pp - 1) / (p.pp * p.virtual_stages)) if p.schedule == "interleaved" else float(k)


def memory_parts(m: ModelConfig, p: Plan, pr: Precision, global_batch_tokens: int, minidist: bool = False) -> dict:
    """Bytes one device of the fullest stage holds at its peak, by part (ZeRO's formulas for
    the state; the activations its schedule keeps in flight; the logits on the last stage)."""
    seq = m.block_size
    n = global_batch_tokens // seq // p.dp // p.microbatches * seq / p.cp
    sp = p.sequence_parallel and p.tp > 1 and not minidist

    def block(moe: bool) -> float:  # one block's activations on one rank
        if minidist:  # half of its 24 arrays lie outside the tp-split layers (norms, residual, gathered outputs)
            split = (minidist_block_values(m, seq, moe, p.cp > 1 and not p.ulysses) - REPLICATED_ARRAYS * m.d_model
                     + (ulysses_values(m, p.tp, p.cp) * p.tp if p.ulysses else 0.0)) * pr.act
            ep = moe_cost.minidist_ep_values(m, p.ep) * pr.act * n if moe else 0.0
            return split * n / p.tp + REPLICATED_ARRAYS * m.d_model * pr.act * n + ep
        # without sequence parallelism the norms' inputs and outputs (4 d per token) are on every tp rank
        per_tok = activation_bytes_per_token(m, pr.act, moe)
        return per_tok * n / p.tp + (0 if sp else 4 * m.d_model * pr.act * n * (1 - 1 / p.tp))

    dense_block, moe_block = block(False), (block(True) if m.experts else 0.0)
    ckpt = p.checkpoint_activations or (minidist and p.zero == 3)
    block_input = m.d_model * pr.act * n / (p.tp if sp else 1)
    nd = p.dp * p.cp
    best = None
    # The fullest stage is the first (most microbatches in flight), the first with the most
    # blocks (the in-flight count falls with the stage), or the last (the head and the logits).
    for r in candidate_stages(m, p.pp):
        dense, moe = stage_mix(m, p.pp)[r]
        psi, psi_e = stage_params(m, p, r)  # the experts' state: ZeRO over the dp x cp / ep holding them
        div, div_e = zero_divisors(p.zero, nd), zero_divisors(p.zero, nd // p.ep)
        parts = {k: (psi / div[k] + psi_e / div_e[k]) * size
                 for k, size in (("params", pr.param), ("grads", pr.grad), ("optimizer", pr.optim))}
        if ckpt:
            parts["activations"] = (dense + moe) * block_input * in_flight(p, r) + max(dense_block, moe_block)
        else:
            parts["activations"] = (dense * dense_block + moe * moe_block) * in_flight(p, r)
        # float32 logits and their gradient (minidist keeps about 8 such arrays: softmax, its gradient, copies)
        parts["logits"] = (8 if minidist else 2) * n * m.vocab_size / p.tp * 4 if r == p.pp - 1 else 0.0
        if p.zero == 3:
            big = block_params(m, True, m.experts // p.ep) if moe else block_params(m)
            parts["gathered"] = 2 * big / p.tp * pr.param  # the block in use and the next one
        if best is None or sum(parts.values()) > sum(best.values()):
            best = parts
    return best
