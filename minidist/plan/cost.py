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
  that backward; hidden behind the attention's own compute where the machine overlaps;
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
* **optimizer**: AdamW reads and writes its state once, memory-bound (sharded by ZeRO >= 1);

and **memory** per device: ZeRO's formulas for parameters, gradients and optimizer state
(mixed precision: 2 + 2 + 12 bytes per parameter; stage 1 divides the 12, stage 2 also the
gradients, stage 3 everything by the data-parallel degree), the activations the schedule
keeps in flight on each stage (1F1B: P - r microbatches; GPipe: all M; interleaved: P (1 +
(P-1)/(P V)) on the first, Narayanan et al.; zb-h1 P and zb-h2 2P-1 on every stage, W holding
them, and zbv P: schedules.peak_in_flight), each block's input only with checkpointing, and
the logits.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

from minidist.layout.memory import zero_divisors
from minidist.layout.schedules import peak_in_flight, schedule_problem, theoretical_bubble
from minidist.plan.machine import Machine
from minidist.plan.model import (ModelSpec, activation_bytes_per_token, attention_flops, block_matmul_flops,
                                 block_params, embedding_params, head_flops, model_flops_per_token,
                                 recompute_flops_per_token)

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "zbv")
CHUNKED = ("interleaved", "zbv")  # several model chunks per rank (Plan.virtual_stages)


@dataclass(frozen=True)
class Plan:
    """A mesh (tp innermost, then cp, pp, dp) and the step's settings, in the run's words: the
    fields, names and defaults of a resolved ``layout.settings.ParallelConfig`` (the training
    command's ``--zero``, ``--virtual-stages``, ...) and ``checkpoint_activations`` (the run's
    ``--checkpoint-activations``), so that a plan reads as the flags that run it."""

    tp: int = 1
    cp: int = 1
    pp: int = 1
    dp: int = 1
    zero: int = 0
    microbatches: int = 1
    schedule: str = "1f1b"
    virtual_stages: int = 1             # interleaved, zbv: model chunks per rank
    checkpoint_activations: bool = False  # full activation checkpointing (recompute each block)
    sequence_parallel: bool = False

    @property
    def devices(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    def mesh(self) -> str:
        return f"tp={self.tp},cp={self.cp},pp={self.pp},dp={self.dp}"

    def label(self) -> str:
        s = f"TP{self.tp} CP{self.cp} PP{self.pp} DP{self.dp} ZeRO-{self.zero} M={self.microbatches}"
        if self.pp > 1:
            s += f" {self.schedule}" + (f" V={self.virtual_stages}" if self.schedule in CHUNKED else "")
        return s + (" ckpt" if self.checkpoint_activations else "")


@dataclass(frozen=True)
class Precision:
    """Bytes of what a step holds and moves: the activations and parameters as computed, the
    gradients as reduced, the optimizer state per parameter (mixed precision AdamW: fp32
    master weights, m and v: 12 bytes)."""

    name: str
    act: int
    param: int
    grad: int
    optim: int
    compute: str            # the Machine.peak key of the matmuls


MIXED_BF16 = Precision("bf16", act=2, param=2, grad=2, optim=12, compute="bf16")
FLOAT32 = Precision("float32", act=4, param=4, grad=4, optim=8, compute="float32")
FLOAT64 = Precision("float64", act=8, param=8, grad=8, optim=16, compute="float64")
PRECISIONS = {p.name: p for p in (MIXED_BF16, FLOAT32, FLOAT64)}


@dataclass
class Estimate:
    plan: Plan
    step_s: float
    mfu: float
    hfu: float
    mem_bytes: float
    time: dict = field(default_factory=dict)    # seconds by part: compute, tp, cp, pp, bubble, dp, optimizer, fixed
    memory: dict = field(default_factory=dict)  # bytes by part: params, grads, optimizer, activations, logits
    limit: str = ""                             # the largest term after compute
    fits: bool = True

    def as_dict(self) -> dict:
        p = self.plan
        return {"tp": p.tp, "cp": p.cp, "pp": p.pp, "dp": p.dp, "zero": p.zero, "microbatches": p.microbatches,
                "schedule": p.schedule, "virtual_stages": p.virtual_stages,
                "checkpoint_activations": p.checkpoint_activations,
                "sequence_parallel": p.sequence_parallel, "step_s": self.step_s, "mfu": self.mfu, "hfu": self.hfu,
                "mem_gb": self.mem_bytes / 1e9, "fits": self.fits, "limit": self.limit,
                "time_s": dict(self.time), "memory_gb": {k: v / 1e9 for k, v in self.memory.items()}}


# ------------------------------------------------------------------------- the collectives


def ring_all_reduce(nbytes: float, n: int, link, eff: float) -> float:
    """Ring all-reduce (Patarasuk & Yuan 2009): 2(N-1)/N x bytes per rank in 2(N-1) steps."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) / n * nbytes / (link.bw * eff) + 2 * (n - 1) * link.latency


def ring_gather(nbytes: float, n: int, link, eff: float) -> float:
    """Ring all-gather or reduce-scatter of a ``nbytes`` whole: (N-1)/N x bytes in N-1 steps."""
    if n <= 1:
        return 0.0
    return (n - 1) / n * nbytes / (link.bw * eff) + (n - 1) * link.latency


def message(nbytes: float, link, eff: float) -> float:
    return nbytes / (link.bw * eff) + link.latency


# ------------------------------------------------------------------------- the feasibility


def problems(model: ModelSpec, plan: Plan, devices: int, global_batch_tokens: int) -> list[str]:
    """Why ``plan`` cannot run ``model`` (one line each; [] when it can), before any cost."""
    out = []
    p, seq = plan, model.seq_len
    if p.devices != devices:
        out.append(f"mesh {p.mesh()} has {p.devices} devices, not --gpus {devices}")
    if model.heads % p.tp or model.kv % p.tp:
        out.append(f"tp={p.tp} does not divide the {model.heads} heads and {model.kv} key/value heads")
    if seq % (2 * p.cp if p.cp > 1 else 1):
        out.append(f"cp={p.cp}: the sequence of {seq} tokens does not split into 2 x {p.cp} equal chunks")
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
    return out


# ------------------------------------------------------------------------- the estimate


@functools.lru_cache(maxsize=4096)
def stage_blocks(layers: int, pp: int) -> tuple:
    """Blocks of each stage, cut at whole blocks: when they do not divide evenly the first and
    the last stage take one block fewer first (they also hold the embedding and the head;
    Llama 3 cut its 126 blocks over 16 stages this way)."""
    base, extra = divmod(layers, pp)
    if not extra:
        return (base,) * pp
    short = pp - extra                     # stages with ``base`` blocks; the others ``base + 1``
    order = [0, pp - 1] + list(range(1, pp - 1)) if pp > 1 else [0]
    fewer = set(order[:short])
    return tuple(base if r in fewer else base + 1 for r in range(pp))


@dataclass(frozen=True)
class Step:
    """What every term of a step's price needs: the model, the machine, the plan, the
    precision, and the quantities derived from them once."""

    m: ModelSpec
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

    @property
    def Ls(self) -> int:
        return max(self.blocks)

    @property
    def nd(self) -> int:
        """Ranks holding the same parameters: the data-parallel reduction group (dp x cp)."""
        return self.p.dp * self.p.cp

    @staticmethod
    def of(m, mc, p, pr, global_batch_tokens, minidist) -> "Step":
        share = min(1.0, mc.cores / (p.devices + mc.load)) if mc.cores else 1.0
        seqs_mb = global_batch_tokens // m.seq_len // p.dp // p.microbatches
        return Step(m, mc, p, pr, minidist, share, seqs_mb * m.seq_len / p.cp, seqs_mb, stage_blocks(m.layers, p.pp),
                    p.virtual_stages if p.schedule in CHUNKED and p.pp > 1 else 1,
                    # minidist's ZeRO-3 recomputes every block in backward (parallel/data/fsdp.py)
                    p.checkpoint_activations or (minidist and p.zero == 3),
                    p.sequence_parallel and p.tp > 1 and not minidist)


def forward_time(s: Step) -> float:
    """Seconds of one microbatch's forward on the busiest stage (the last one adds the head):
    per block, the matmul FLOPs at ``gemm_eff`` of peak, the attention FLOPs at ``attn_eff``,
    each saved activation written and read once at the memory bandwidth, and a third of the
    machine's fixed cost per block and microbatch (backward is the other two thirds)."""
    m, mc, p, n, sh = s.m, s.mc, s.p, s.n, s.share
    peak = mc.peak[s.pr.compute] * sh
    act = minidist_block_values(m, m.seq_len) * s.pr.act if s.minidist else activation_bytes_per_token(m, s.pr.act)
    block = (block_matmul_flops(m) * n / p.tp / (peak * mc.gemm_eff)
             + attention_flops(m, m.seq_len, executed=True) * n / p.tp / (peak * mc.attn_eff)
             + 2 * act * n / p.tp / (mc.mem_bw * sh) + mc.block_mb_s / 3 / sh)
    head = (head_flops(m) * n / p.tp / (peak * mc.gemm_eff) + 4 * n * m.vocab / p.tp * 4 / (mc.mem_bw * sh)
            + mc.mb_overhead_s / 3 / sh)
    return max(b * block + (head if r == p.pp - 1 else 0.0) for r, b in enumerate(s.blocks))


def tp_time(s: Step) -> float:
    """Seconds of one microbatch's tensor-parallel communication (Megatron-LM, Shoeybi et al.
    2019): per block two all-reduces of the activations forward and two backward (two more
    with recompute); sequence parallelism's all-gather + reduce-scatter move the same bytes."""
    if s.p.tp == 1:
        return 0.0
    msg = s.n * s.m.d_model * s.pr.act
    each = ring_all_reduce(msg, s.p.tp, s.mc.link_for(s.p.tp), s.mc.link_eff) + s.mc.coll_overhead_s / s.share
    return s.Ls * each * (4 + (2 if s.ckpt else 0))


def cp_time(s: Step) -> float:
    """Seconds of one microbatch's context-parallel exchange (Ring Attention, Liu et al. 2023;
    Llama 3's all-gather): every rank receives the other (C-1)/C of the sequence's keys and
    values per block forward, twice that backward; exposed (gathered before the attention)."""
    p = s.p
    if p.cp == 1:
        return 0.0
    kv = s.seqs_mb * s.m.seq_len * 2 * s.m.d_kv / p.tp * s.pr.act
    step = ring_gather(kv, p.cp, s.mc.link_for(p.tp * p.cp), s.mc.link_eff) + (p.cp - 1) * s.mc.coll_overhead_s / s.share
    return s.Ls * 3 * step


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


def dp_time(s: Step, psi: float) -> float:
    """Seconds of the data-parallel reduction of ``psi`` parameters per rank (ZeRO,
    Rajbhandari et al. 2020), before any overlap: stage 0 all-reduces the gradients (ring:
    2(N-1)/N of them), 1 and 2 reduce-scatter them and all-gather the parameters ((N-1)/N
    each), 3 gathers each block twice per microbatch and reduce-scatters its gradients."""
    p, pr, mc, nd = s.p, s.pr, s.mc, s.nd
    if nd == 1:
        return 0.0
    link = mc.link_for(p.devices)
    if p.zero == 0:
        t = ring_all_reduce(psi * pr.grad, nd, link, mc.link_eff)
    elif p.zero in (1, 2):
        t = ring_gather(psi * pr.grad, nd, link, mc.link_eff) + ring_gather(psi * pr.param, nd, link, mc.link_eff)
    else:  # one collective per block (FSDP's unit), each paying the ring's latency
        per_block = block_params(s.m) / p.tp
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
    syncs = (M * s.Ls * ((4 + (2 if s.ckpt else 0)) * (p.tp > 1) + 3 * (p.cp - 1))
             + (2 * s.V * M if p.pp > 1 else 0) + (dp_calls(s) if s.nd > 1 else 0) + 3)
    return syncs * (1 - s.share) * s.mc.sync_slice_s


def estimate(model: ModelSpec, machine: Machine, plan: Plan, global_batch_tokens: int,
             precision: Precision = MIXED_BF16, minidist: bool = False) -> Estimate:
    """Time by parts, memory per device and MFU of one step (``problems`` must be empty).

    ``minidist``: price minidist's own implementation (tracemalloc-counted arrays, no
    sequence parallelism, plain attention) instead of a fused GPU implementation."""
    s = Step.of(model, machine, plan, precision, global_batch_tokens, minidist)
    m, p, mc, M = model, plan, machine, plan.microbatches
    t_f = forward_time(s)
    work = t_f * (3 + (1 if s.ckpt else 0))                      # backward = 2 x forward, + recompute
    t_mb = work + tp_time(s) + cp_time(s)                          # one microbatch on the busiest stage
    msg = pp_message_time(s)
    # the fill and drain's messages are exposed; the steady state's where the machine cannot overlap
    pp_exposed = 2 * (p.pp - 1) * msg + (1 - mc.overlap) * 2 * s.V * M * msg
    # the schedule's idle share b of the pipeline, with this stage's forward and backward: b/(1-b) x the work
    share = theoretical_bubble(p.schedule, p.pp, M, s.V, t_forward=t_f, t_backward=work - t_f) if p.pp > 1 else 0.0
    bubble = share / (1 - share) * M * t_mb                        # 1F1B: (P-1) t_mb; interleaved: (P-1)/V t_mb
    psi = _stage_params(m, p)
    window = M * work if p.zero == 3 else t_f * 3                  # what the reduction hides behind
    dp_exposed = max(0.0, dp_time(s, psi) - mc.overlap * window)
    upd = psi / (s.nd if p.zero >= 1 else 1)                       # AdamW: read gradient and state, write both
    optimizer = upd * (precision.grad + 2 * precision.optim + precision.param) / (mc.mem_bw * s.share)
    fixed = (s.Ls * mc.block_step_s + mc.step_overhead) / s.share
    scalars = 3 * 2 * math.ceil(math.log2(p.devices)) * mc.link_for(p.devices).latency if p.devices > 1 else 0.0
    time = {"compute": M * work, "tp": M * tp_time(s), "cp": M * cp_time(s), "pp": pp_exposed, "bubble": bubble,
            "dp": dp_exposed, "optimizer": optimizer, "fixed": fixed + scalars, "sync": sync_wait(s)}
    step = sum(time.values())

    mflops = model_flops_per_token(m, m.seq_len) * global_batch_tokens
    hflops = mflops + (recompute_flops_per_token(m, m.seq_len) * global_batch_tokens if s.ckpt else 0.0)
    total_peak = mc.peak[precision.compute] * (min(p.devices, mc.cores) if mc.cores else p.devices)
    memory = memory_parts(m, p, precision, global_batch_tokens, minidist=minidist)
    mem = sum(memory.values())
    others = {k: v for k, v in time.items() if k != "compute"}
    return Estimate(p, step, mflops / (step * total_peak), hflops / (step * total_peak), mem, time, memory,
                    max(others, key=others.get), fits=mem <= mc.mem_bytes * mc.mem_usable)


def _stage_params(m: ModelSpec, p: Plan, stage: int | None = None) -> float:
    """Parameters one rank of ``stage`` holds (default: the largest): its blocks, and the
    embedding on the first stage, the head (or the tied table again) and final norm on the last."""
    blocks = stage_blocks(m.layers, p.pp)
    stages = sorted({0, blocks.index(max(blocks)), p.pp - 1}) if stage is None else [stage]  # the candidates
    table = m.vocab * m.d_model
    rest = embedding_params(m) - table - (0 if m.tied else table)   # positions, final norm
    out = []
    for r in stages:
        emb = 0.0
        if r == 0:
            emb += table + rest
        if r == p.pp - 1 and (p.pp > 1 or not m.tied):  # the head (untied), or the tied table's copy
            emb += table
        out.append((blocks[r] * block_params(m) + emb) / p.tp)
    return max(out)


REPLICATED_ARRAYS = 12  # of minidist's 24 d-wide arrays per token, those every tp rank holds whole


def minidist_block_values(m: ModelSpec, seq: int) -> float:
    """Values minidist's NumPy block keeps live per token (counted with tracemalloc, see
    cli_checks.training_memory_bytes): about 24 arrays of width d for GPT-2, and plain
    attention's H x T scores per query token.  A Llama block (nn.GroupedQueryAttention,
    nn.SwiGLU) differs by what its ops keep: SwiGLU's 2 f + f in place of GELU's 4 d + 4 d,
    a q|k|v of d + 2 d_kv in place of 3 d, the rotated copy of it (rotary), and with fewer
    key/value heads than query heads the 3 d the repeated heads take (repeat_kv)."""
    d, scores = m.d_model, (0 if m.causal_skip else m.heads * seq)
    if m.gpt2:
        return 24 * d + scores
    qkv = d + 2 * m.d_kv
    return 24 * d + (3 * m.f - 8 * d) + (qkv - 3 * d) + qkv + (3 * d if m.kv < m.heads else 0) + scores


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


def memory_parts(m: ModelSpec, p: Plan, pr: Precision, global_batch_tokens: int, minidist: bool = False) -> dict:
    """Bytes one device of the fullest stage holds at its peak, by part (ZeRO's formulas for
    the state; the activations its schedule keeps in flight; the logits on the last stage)."""
    seq = m.seq_len
    n = global_batch_tokens // seq // p.dp // p.microbatches * seq / p.cp
    blocks = stage_blocks(m.layers, p.pp)
    sp = p.sequence_parallel and p.tp > 1 and not minidist
    if minidist:  # half of its 24 arrays lie outside the tp-split layers (norms, residual, gathered outputs)
        split = (minidist_block_values(m, seq) - REPLICATED_ARRAYS * m.d_model) * pr.act
        block = split * n / p.tp + REPLICATED_ARRAYS * m.d_model * pr.act * n
    else:  # without sequence parallelism the norms' inputs and outputs (4 d per token) are on every tp rank
        per_tok = activation_bytes_per_token(m, pr.act)
        block = per_tok * n / p.tp + (0 if sp else 4 * m.d_model * pr.act * n * (1 - 1 / p.tp))
    ckpt = p.checkpoint_activations or (minidist and p.zero == 3)
    block_input = m.d_model * pr.act * n / (p.tp if sp else 1)
    nd = p.dp * p.cp
    best = None
    # The fullest stage is the first (most microbatches in flight), the first with the most
    # blocks (the in-flight count falls with the stage), or the last (the head and the logits).
    for r in sorted({0, blocks.index(max(blocks)), p.pp - 1}):
        psi = _stage_params(m, p, r)
        div = zero_divisors(p.zero, nd)
        parts = {"params": psi * pr.param / div["params"], "grads": psi * pr.grad / div["grads"],
                 "optimizer": psi * pr.optim / div["optimizer"]}
        if ckpt:
            parts["activations"] = blocks[r] * block_input * in_flight(p, r) + block
        else:
            parts["activations"] = blocks[r] * block * in_flight(p, r)
        # float32 logits and their gradient (minidist keeps about 8 such arrays: softmax, its gradient, copies)
        parts["logits"] = (8 if minidist else 2) * n * m.vocab / p.tp * 4 if r == p.pp - 1 else 0.0
        if p.zero == 3:
            parts["gathered"] = 2 * block_params(m) / p.tp * pr.param  # the block in use and the next one
        if best is None or sum(parts.values()) > sum(best.values()):
            best = parts
    return best
