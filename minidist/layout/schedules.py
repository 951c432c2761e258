"""Pipeline schedules as pure data: who computes what, in which order, and who talks to whom.

Pipeline parallelism cuts the model's layers into consecutive *stages*, one group of layers
per rank, and splits each batch into ``M`` *microbatches* so that several stages can work at
once on different microbatches.  What distinguishes the classic schemes is only the ORDER in
which each rank runs the forward (F) and backward (B) passes of its microbatches.  So here a
schedule is nothing but that order, written down as data::

    make_schedule("1f1b", num_stages=4, num_microbatches=8)  ->  Schedule
    schedule.actions[rank]  ->  [Action("recv_act", 0, 0, peer=0), Action("F", 0, 0), ...]

No MPI and no model here: the runtime (``parallel/pipeline/runtime.py``) executes any schedule,
``simulate.py`` runs one on a clock to check it (no deadlock, every send received once,
forward before backward, the bubble equals its formula) and draws it (``python -m
minidist.layout.simulate --schedule 1f1b --pp 4 -m 8`` prints that chart).

The schedules (``P`` ranks, ``M`` microbatches, ``V`` model chunks per rank):

* ``naive``: one microbatch at a time through all stages and back (plain model parallelism).
  Only one rank works at a time: bubble ``(P-1)/P``.
* ``gpipe``: all forwards, then all backwards (Huang et al. 2019, *GPipe*).  Bubble
  ``(P-1)/(M+P-1)``; holds the activations of all ``M`` microbatches.
* ``1f1b``: PipeDream-flush (Narayanan et al. 2021, *Memory-Efficient Pipeline-Parallel DNN
  Training*): after a warm-up of ``P-r-1`` forwards, rank ``r`` alternates one forward and one
  backward.  Same bubble as GPipe, but at most ``P`` microbatches' activations in flight.
* ``interleaved``: interleaved 1F1B (Narayanan et al. 2021, *Efficient Large-Scale Language
  Model Training on GPU Clusters Using Megatron-LM*): each rank holds ``V`` chunks of layers
  (model stage ``s`` lives on rank ``s % P``), so a microbatch loops ``V`` times around the
  ranks.  Bubble ``(P-1)/(V*M+P-1)``; needs ``M`` a multiple of ``P``.
* ``looping``: breadth-first pipeline (Lamy-Poirier 2023, *Breadth-First Pipeline
  Parallelism*): the same looping placement, but every microbatch goes through chunk 0 before
  any goes through chunk 1 (GPipe order on the looped pipeline).  Same bubble as interleaved
  when ``M >= P``, GPipe's memory (all ``V*M`` chunk activations).
* ``zb-h1`` and ``zb-h2``: zero-bubble pipelines (Qi et al. 2023, *Zero Bubble Pipeline
  Parallelism*): the backward split in two, ``B`` (the gradient of the stage's input, which
  the previous stage waits for) and ``W`` (the weights' gradients, which nothing waits for),
  so that W's fill the bubbles.  ZB-H1 keeps 1F1B's peak memory (``P`` microbatches) with a
  bubble of ``(P-1)(F+B-W)`` instead of 1F1B's ``(P-1)(F+B+W)``; ZB-H2 warms up with more
  forwards (``2P-1`` microbatches at most) and approaches the floor ``(P-1)F`` that a
  synchronous step keeps (the last stage cannot start before the first forward reaches it).
  Both need ``M >= P``.
* ``zbv``: ZB-V (Qi et al. 2024, same paper, section 6): the split backward on two chunks per
  rank placed in a V (chunk 0 of rank r is stage r, chunk 1 stage 2P-1-r; see
  :func:`placement_of`), so the first and last stages share rank 0.  1F1B's peak memory,
  bubble ``(P-1)/(6M+P-1)`` for equal F, B, W (half ZB-H1's); needs ``V = 2`` and
  ``M >= 2P-1``.

Communication is derived from the compute order, identically for every schedule
(:func:`with_communication`): a forward of stage ``s > 0`` first receives its input
activation from stage ``s-1``, and sends its output to stage ``s+1``; a backward receives
the gradient of its output from stage ``s+1`` and sends its input's gradient to stage
``s-1``.  Sends never block (the runtime uses nonblocking sends), receives do.
"""

from __future__ import annotations

from dataclasses import dataclass

from minidist.layout.settings import VIRTUAL

FORWARD, BACKWARD, WEIGHT = "F", "B", "W"
SEND_ACT, RECV_ACT, SEND_GRAD, RECV_GRAD = "send_act", "recv_act", "send_grad", "recv_grad"
COMPUTE = (FORWARD, BACKWARD)
SPLIT_COMPUTE = (FORWARD, BACKWARD, WEIGHT)  # the zero-bubble schedules: B is the input's gradient only


@dataclass(frozen=True)
class Action:
    """One step of a rank's program: compute ``op`` in (F, B, W) on ``microbatch`` with model
    ``chunk`` (0..V-1 on this rank), or send/receive the activation or gradient that
    belongs to it (``peer``: the other rank)."""

    op: str
    microbatch: int
    chunk: int = 0
    peer: int | None = None

    def __str__(self):
        text = f"{self.op}{self.microbatch}" + (f".{self.chunk}" if self.chunk else "")
        return text if self.peer is None else f"{text}@{self.peer}"


@dataclass(frozen=True)
class Schedule:
    """A schedule's parameters and every rank's list of actions (``actions[rank]``)."""

    name: str
    num_stages: int          # P: pipeline ranks
    num_microbatches: int    # M
    virtual_stages: int      # V: model chunks per rank
    actions: tuple

    @property
    def num_model_stages(self) -> int:
        return self.num_stages * self.virtual_stages

    @property
    def placement(self) -> str:
        """Where its model stages live (:func:`placement_of`)."""
        return placement_of(self.name)


# ------------------------------------------------------------------------- placement
LOOPING, V_SHAPE = "looping", "v"
"""Where the model stages live.  Looping (Megatron-LM's interleaved placement): chunk c of
rank r holds stage ``c*P + r``, so a microbatch goes round the ranks V times.  V shape (ZB-V,
Qi et al. 2024): even chunks go down the ranks and odd chunks come back up, chunk 0 of rank r
holding stage r and chunk 1 stage ``2P-1-r``: the first and the last stage share rank 0, and
stages P-1 and P (the turn of the V) share rank P-1."""


def placement_of(name: str) -> str:
    """The placement schedule ``name`` runs on: the V shape for ZB-V, looping for the others."""
    return V_SHAPE if name in V_SCHEDULES else LOOPING


def model_stage(rank: int, chunk: int, num_stages: int, placement: str = LOOPING) -> int:
    """The model stage (0..P*V-1, in layer order) that ``chunk`` of ``rank`` holds: ``c*P + r``
    (looping; with V=1 simply ``r``), or with the V shape ``c*P + P-1-r`` for odd chunks."""
    if placement == V_SHAPE and chunk % 2:
        return chunk * num_stages + num_stages - 1 - rank
    return chunk * num_stages + rank


def rank_stages(rank: int, num_stages: int, virtual_stages: int = 1, placement: str = LOOPING) -> list[int]:
    """The model stages ``rank`` holds, one per chunk, in chunk order (:func:`model_stage`)."""
    return [model_stage(rank, c, num_stages, placement) for c in range(virtual_stages)]


def stage_location(stage: int, num_stages: int, placement: str = LOOPING) -> tuple[int, int]:
    """(rank, chunk) holding model ``stage``: the inverse of :func:`model_stage`."""
    chunk, rank = divmod(stage, num_stages)
    if placement == V_SHAPE and chunk % 2:
        rank = num_stages - 1 - rank
    return rank, chunk


def layer_range(stage: int, num_layers: int, num_model_stages: int) -> range:
    """The blocks of model ``stage`` when ``num_layers`` are cut into equal consecutive parts."""
    per = num_layers // num_model_stages
    return range(stage * per, (stage + 1) * per)


# -------------------------------------------------- compute orders, one function each
def naive_order(P: int, M: int, rank: int, V: int = 1) -> list[Action]:
    """Naive model parallelism: F then B of one microbatch at a time.  Rank r's program is
    F0 B0 F1 B1 ...; B0 needs the gradient back from the last stage, so microbatch 1 enters
    only when microbatch 0 has finished: one rank busy at a time."""
    return [Action(op, m) for m in range(M) for op in COMPUTE]


def gpipe_order(P: int, M: int, rank: int, V: int = 1) -> list[Action]:
    """GPipe (Huang et al. 2019): every forward, then every backward (same microbatch order;
    the gradients are accumulated, so the order of the backwards does not matter)."""
    return [Action(FORWARD, m) for m in range(M)] + [Action(BACKWARD, m) for m in range(M)]


def one_f_one_b_order(P: int, M: int, rank: int, V: int = 1) -> list[Action]:
    """1F1B / PipeDream-flush (Narayanan et al. 2021): warm up with P-rank-1 forwards, then
    alternate one forward and one backward, then drain the remaining backwards.  Rank r never
    holds more than P-r microbatches' activations."""
    warmup = min(P - rank - 1, M)
    order = [Action(FORWARD, m) for m in range(warmup)]
    for i in range(M - warmup):
        order += [Action(FORWARD, warmup + i), Action(BACKWARD, i)]
    order += [Action(BACKWARD, m) for m in range(M - warmup, M)]
    return order


def _interleaved_unit(k: int, P: int, V: int, forward: bool) -> tuple[int, int]:
    """(microbatch, chunk) of the k-th forward (or backward) unit of the interleaved schedule:
    units go in groups of P microbatches, each group through chunk 0, 1, ..., V-1 (backwards:
    V-1, ..., 0) before the next group of P microbatches starts."""
    group, within = divmod(k, P * V)
    chunk = within // P
    return group * P + within % P, (chunk if forward else V - 1 - chunk)


def interleaved_order(P: int, M: int, rank: int, V: int = 2) -> list[Action]:
    """Interleaved 1F1B (Narayanan et al. 2021, Megatron-LM): 1F1B over the M*V chunk units
    of this rank, with a longer warm-up, 2(P-rank-1) + (V-1)P units, so that the first
    backward's gradient can come all the way round the V loops."""
    total = M * V
    warmup = min((P - rank - 1) * 2 + (V - 1) * P, total)
    units = [Action(FORWARD, *_interleaved_unit(k, P, V, True)) for k in range(warmup)]
    for i in range(total - warmup):
        units.append(Action(FORWARD, *_interleaved_unit(warmup + i, P, V, True)))
        units.append(Action(BACKWARD, *_interleaved_unit(i, P, V, False)))
    units += [Action(BACKWARD, *_interleaved_unit(k, P, V, False)) for k in range(total - warmup, total)]
    return units


def looping_order(P: int, M: int, rank: int, V: int = 2) -> list[Action]:
    """Breadth-first looping pipeline (Lamy-Poirier 2023): all M forwards through chunk 0,
    then all through chunk 1, ...; backwards chunk by chunk in reverse.  GPipe on the
    looped pipeline: every rank stays busy between loops when M >= P."""
    forwards = [Action(FORWARD, m, c) for c in range(V) for m in range(M)]
    backwards = [Action(BACKWARD, m, c) for c in reversed(range(V)) for m in range(M)]
    return forwards + backwards


def _split_order(P: int, M: int, warmup: int, lag: int) -> list[Action]:
    """1F1B's order with the backward split: ``warmup`` forwards, then pairs (F, B) where the
    W of microbatch ``i - lag`` follows the i-th pair, then the remaining B's, each followed by
    one W, then the W's left.  Delaying W's keeps the B's, which the previous stage waits for,
    early; the delayed W's fill the waits of the drain."""
    warmup = min(warmup, M)
    order, w = [Action(FORWARD, m) for m in range(warmup)], 0
    for i in range(M - warmup):
        order += [Action(FORWARD, warmup + i), Action(BACKWARD, i)]
        if i >= lag:
            order.append(Action(WEIGHT, w))
            w += 1
    for m in range(M - warmup, M):
        order.append(Action(BACKWARD, m))
        if w < M:
            order.append(Action(WEIGHT, w))
            w += 1
    return order + [Action(WEIGHT, m) for m in range(w, M)]


def zb_h1_order(P: int, M: int, rank: int, V: int = 1) -> list[Action]:
    """ZB-H1 (Qi et al. 2023, Zero Bubble Pipeline Parallelism): 1F1B's warm-up of P-rank-1
    forwards, and rank r delays each W by r microbatches, so every rank holds at most P
    microbatches (1F1B's peak, its first stage's).  Bubble (P-1)(F+B-W) of a step
    M(F+B+W) + (P-1)(F+B-W): (P-1)/(3M+P-1) for equal F, B, W, a third of 1F1B's idle time."""
    return _split_order(P, M, warmup=P - rank - 1, lag=rank)


def zb_h2_order(P: int, M: int, rank: int, V: int = 1) -> list[Action]:
    """ZB-H2 (Qi et al. 2023): twice 1F1B's warm-up, 2(P-rank-1) forwards, and W's delayed by
    2r microbatches on rank r: at most 2P-1 microbatches held.  The B's then never wait in the
    steady state; the bubble approaches the floor (P-1)F of a synchronous step when B costs
    more than W (the same as ZB-H1 for equal F, B, W: (P-1)/(3M+P-1))."""
    return _split_order(P, M, warmup=2 * (P - rank - 1), lag=2 * rank)


def zbv_order(P: int, M: int, rank: int, V: int = 2) -> list[Action]:
    """ZB-V (Qi et al. 2024, Zero Bubble Pipeline Parallelism, section 6): two chunks per rank
    in a V (chunk 0 of rank r is stage r, chunk 1 stage 2P-1-r), backward split into B and W.
    Warm-up: 2(P-r)-1 forwards of chunk 0, r pairs (F chunk 1, F chunk 0), P-r triples (F, B,
    W) of chunk 1; steady state: F B W of chunk 0, then of chunk 1; drain: r pairs of B's, P-r
    pairs (B, W) of chunk 0, the W's left.  Needs M >= 2P-1 (rank 0's warm-up).  With a
    chunk's F, B, W costing f, b, w (half a stage's), each rank holds at most 2P chunks (1F1B's
    P microbatches) and idles (P-1)f for f = b = w: bubble (P-1)/(6M+P-1), half ZB-H1's, as the
    last rank waits for P-1 half-stage forwards only.  For b = w != f the idle time is (P-1)b
    when b >= f, else (P-2)(2f-b) + max(f, 2(f-b)) (checked by simulation)."""
    order, done = [], {op: [0, 0] for op in SPLIT_COMPUTE}

    def run(op, chunk):
        order.append(Action(op, done[op][chunk], chunk))
        done[op][chunk] += 1

    for _ in range(2 * (P - rank) - 1):
        run(FORWARD, 0)
    for _ in range(rank):
        run(FORWARD, 1), run(FORWARD, 0)
    for _ in range(P - rank):
        run(FORWARD, 1), run(BACKWARD, 1), run(WEIGHT, 1)
    while done[FORWARD][1] < M:
        if done[FORWARD][0] < M:
            run(FORWARD, 0)
        run(BACKWARD, 0), run(WEIGHT, 0)
        run(FORWARD, 1), run(BACKWARD, 1), run(WEIGHT, 1)
    for _ in range(rank):
        run(BACKWARD, 0), run(BACKWARD, 1)
    for _ in range(P - rank):
        run(BACKWARD, 0), run(WEIGHT, 0)
    while done[WEIGHT][1] < M:
        run(WEIGHT, 1)
    while done[WEIGHT][0] < M:
        run(WEIGHT, 0)
    return order


ORDERS = {"naive": naive_order, "gpipe": gpipe_order, "1f1b": one_f_one_b_order,
          "interleaved": interleaved_order, "looping": looping_order,
          "zb-h1": zb_h1_order, "zb-h2": zb_h2_order, "zbv": zbv_order}
"""Schedule name -> compute-order function ``(P, M, rank, V) -> [Action]``."""
ZERO_BUBBLE = ("zb-h1", "zb-h2", "zbv")  # the schedules with W actions (backward in two parts)
V_SCHEDULES = ("zbv",)  # the schedules on the V-shape placement


def splits_backward(name: str) -> bool:
    """Whether schedule ``name`` runs B (the input's gradient) and W (the weights') apart."""
    return name in ZERO_BUBBLE


# -------------------------------------------------------------------------- checks
def schedule_problem(name: str, P: int, M: int, V: int = 1, num_layers: int | None = None) -> str | None:
    """Why (name, P, M, V, layers) is not a valid pipeline, as one line; None if it is.

    Pure arithmetic on the arguments: every rank reaches the same verdict before any message.
    """
    if name not in ORDERS:
        return f"unknown pipeline schedule {name!r}; choose from {', '.join(ORDERS)}"
    for label, value in (("pipeline stages", P), ("microbatches", M), ("virtual stages", V)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            return f"{label} must be a positive integer, got {value!r}"
    if V > 1 and name not in VIRTUAL:
        return f"schedule {name!r} has no virtual stages (got {V}); use {', '.join(VIRTUAL)}"
    if name == "interleaved" and M % P:
        return f"the interleaved schedule needs the microbatches ({M}) to be a multiple of the pipeline stages ({P})"
    if name == "looping" and M < P:
        return f"the looping schedule needs at least as many microbatches ({M}) as pipeline stages ({P})"
    if name in V_SCHEDULES and V != 2:
        return f"the {name} schedule runs exactly 2 virtual stages per rank (a V), got {V}"
    if name in V_SCHEDULES and M < 2 * P - 1:
        return f"the {name} schedule needs at least 2P-1 = {2 * P - 1} microbatches for {P} pipeline stages, got {M}"
    if name in ZERO_BUBBLE and M < P:
        return f"the {name} schedule needs at least as many microbatches ({M}) as pipeline stages ({P})"
    if num_layers is not None and num_layers % (P * V):
        return (f"{num_layers} layers cannot be cut into {P} pipeline stages x {V} virtual stages "
                f"(needs a multiple of {P * V})")
    if 2 * P * V * M > TAG_LIMIT:
        return f"too many microbatches x stages ({M} x {P * V}) for the message tags (at most {TAG_LIMIT // 2})"
    return None


def problems(given, cfg) -> list[str]:
    """Why the pipeline settings cannot run (one line each; [] if they can).

    ``given``: the run configuration as the user gave it (None = not given), ``cfg`` resolved.
    Each pipeline pass splits a data-parallel rank's share of an accumulation step into M
    microbatches of at least one row."""
    p, g = cfg.parallel, given.parallel
    flags = [f for f, v in (("--microbatches", g.microbatches), ("--schedule", g.schedule),
                            ("--virtual-stages", g.virtual_stages)) if v is not None]
    if p.pp == 1:
        if not flags:
            return []
        verb = "needs" if len(flags) == 1 else "need"
        return [f"{' and '.join(flags)} {verb} pipeline parallelism: add --pp 2 or more"]
    P, M, V, L = p.pp, p.microbatches, p.virtual_stages, cfg.model.layers
    if g.virtual_stages is not None and p.schedule not in VIRTUAL:
        return [f"--virtual-stages {V}: the {p.schedule} schedule has no virtual stages "
                f"(only {', '.join(VIRTUAL)} have)"]
    if p.schedule in V_SCHEDULES and V != 2:
        return [f"--virtual-stages {V}: the {p.schedule} schedule runs exactly --virtual-stages 2 (a V)"]
    if L % (P * V):
        return [f"--layers {L} cannot be cut into --pp {P} x --virtual-stages {V} = {P * V} equal stages"]
    problem = schedule_problem(p.schedule, P, M, V, L)
    if problem:
        return [f"--schedule {p.schedule} --pp {P} --microbatches {M}: {problem}"]
    accum = cfg.device.grad_accum
    rows = cfg.data.batch_size // p.dp // accum  # the fewest rows a rank gets per accumulation step
    if rows < M:
        return [f"--microbatches {M} exceeds the {rows} sequence(s) of a pipeline pass (--batch-size "
                f"{cfg.data.batch_size} / --dp {p.dp} / --grad-accum {accum}): every microbatch needs at least one"]
    return []


TAG_LIMIT = 29000  # the schedule's message tags; the runtime uses a few more up to comm's reserved 30000


def message_tag(kind: str, microbatch: int, dst_stage: int, num_model_stages: int, num_microbatches: int) -> int:
    """A distinct MPI tag for each message of a step: (activation | gradient, destination stage,
    microbatch).  Receives match exactly one send, whatever order the messages arrive in."""
    k = 0 if kind == "act" else 1
    return (k * num_model_stages + dst_stage) * num_microbatches + microbatch


# ------------------------------------------------------------- communication insertion
def with_communication(order: list[Action], rank: int, P: int, V: int, placement: str = LOOPING) -> list[Action]:
    """Insert the sends and receives that a compute order implies on ``rank``.

    Stage s = :func:`model_stage` of (rank, chunk).  F(m) of stage s > 0 is preceded by a
    receive of its input from stage s-1's rank, and F(m) of stage s < S-1 followed by a send of
    its output to stage s+1's rank; B(m) mirrors it with gradients.  A neighbour on the same
    rank (P = 1; the turn of the V) is no message: the runtime hands the tensor over locally.
    """
    S = P * V
    out = []

    def holder(stage):
        return stage_location(stage, P, placement)[0]

    for a in order:
        s = model_stage(rank, a.chunk, P, placement)
        if a.op == WEIGHT:  # the weights' gradients: nobody waits for them
            out.append(a)
        elif a.op == FORWARD:
            if s > 0 and holder(s - 1) != rank:
                out.append(Action(RECV_ACT, a.microbatch, a.chunk, holder(s - 1)))
            out.append(a)
            if s < S - 1 and holder(s + 1) != rank:
                out.append(Action(SEND_ACT, a.microbatch, a.chunk, holder(s + 1)))
        else:
            if s < S - 1 and holder(s + 1) != rank:
                out.append(Action(RECV_GRAD, a.microbatch, a.chunk, holder(s + 1)))
            out.append(a)
            if s > 0 and holder(s - 1) != rank:
                out.append(Action(SEND_GRAD, a.microbatch, a.chunk, holder(s - 1)))
    return out


def make_schedule(name: str, num_stages: int, num_microbatches: int, virtual_stages: int = 1) -> Schedule:
    """The named schedule for P ranks, M microbatches and V chunks per rank (raises ValueError
    with :func:`schedule_problem`'s message on bad input)."""
    problem = schedule_problem(name, num_stages, num_microbatches, virtual_stages)
    if problem:
        raise ValueError(problem)
    P, M, V = num_stages, num_microbatches, virtual_stages
    placement = placement_of(name)
    actions = tuple(tuple(with_communication(ORDERS[name](P, M, r, V), r, P, V, placement)) for r in range(P))
    return Schedule(name, P, M, V, actions)


def peak_in_flight(name: str, P: int, M: int, rank: int, V: int = 1) -> int:
    """The most (microbatch, chunk) activations ``rank`` holds at once (a chunk is 1/V of its
    stage's blocks), in closed form: what :func:`simulate.simulate` finds (a test checks every
    valid schedule).  Naive 1; GPipe M; looping V*M; 1F1B P-rank; interleaved its warm-up plus
    one, 2(P-rank-1) + (V-1)P + 1; ZB-H1 P and ZB-H2 2P-1 on every rank (W holds the
    activations); ZB-V 2P half-stage chunks on every rank, 1F1B's first stage's P microbatches."""
    count = {"naive": 1, "gpipe": M, "looping": V * M, "1f1b": P - rank,
             "interleaved": 2 * (P - rank - 1) + (V - 1) * P + 1, "zb-h1": P, "zb-h2": 2 * P - 1, "zbv": 2 * P}[name]
    return min(count, V * M)


def theoretical_bubble(name: str, P: int, M: int, V: int = 1, t_forward: float = 1.0, t_backward: float = 2.0) -> float:
    """The idle share of a step with equal stages and free communication:
    (P-1)/P for naive, (P-1)/(M+P-1) for GPipe and 1F1B, (P-1)/(V*M+P-1) for the looped
    pipelines (interleaved, and looping with M >= P), (P-1)/(3M+P-1) for ZB-H1 and ZB-H2 with
    B and W each half of the backward and the forward as long as each: (P-1)(F+B-W) idle in
    M(F+B+W) + (P-1)(F+B-W); (P-1)/(6M+P-1) for ZB-V (see :func:`zbv_order` for other costs)."""
    if name == "naive":
        return (P - 1) / P
    if name in V_SCHEDULES:
        f, b = t_forward / 2, t_backward / 4  # one chunk's F, and its B = W
        idle = 0.0 if P == 1 else (P - 1) * b if b >= f else (P - 2) * (2 * f - b) + max(f, 2 * (f - b))
        return idle / (2 * M * (f + 2 * b) + idle)
    if name in ZERO_BUBBLE:
        idle = (P - 1) * max(t_forward, t_backward / 2)
        return idle / (M * (t_forward + t_backward) + idle)
    return (P - 1) / (V * M + P - 1)
