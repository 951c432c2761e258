"""Running a pipeline schedule on a clock, and drawing it (no MPI, no model).

:func:`simulate` plays a :class:`~.schedules.Schedule` on an idealised machine: each compute
action takes its cost, messages are free and instant, a receive waits for its send.  It checks
the schedule (a :class:`Deadlock` if a rank waits for a message nobody sends; every send
received once; forward before backward) and measures it: each rank's idle share, the bubble,
which for every schedule equals its formula (``schedules.theoretical_bubble``), and the most
microbatches whose activations a rank holds at once.  :func:`chart` prints the time x rank
chart, :func:`measured_chart` draws a real run's timeline the same way, :func:`save_png` with
matplotlib, and the command line prints (or draws) any schedule's chart::

    python -m minidist.layout.simulate --schedule interleaved --pp 4 -m 8 -v 2 [--png FILE]
"""

from __future__ import annotations

from dataclasses import dataclass

from minidist.layout.settings import VIRTUAL

from minidist.layout.schedules import (BACKWARD, COMPUTE, FORWARD, ORDERS, RECV_ACT, RECV_GRAD, SEND_ACT, SEND_GRAD,
                                       SPLIT_COMPUTE, WEIGHT, LOOPING, Action, Schedule, make_schedule, model_stage,
                                       schedule_problem, splits_backward, stage_location, theoretical_bubble)

@dataclass
class Simulation:
    """What :func:`simulate` found: each rank's compute intervals, the step's length and
    each rank's idle share, and how many microbatches' activations each rank held at most."""

    timeline: list           # timeline[rank] = [(start, end, Action)] of F, B (and W) actions
    makespan: float
    bubble: list             # per rank: idle time / makespan
    peak_in_flight: list     # per rank: most (microbatch, chunk) forwards awaiting their backward (their W)

    @property
    def mean_bubble(self) -> float:
        return sum(self.bubble) / len(self.bubble)


class Deadlock(RuntimeError):
    pass


def _message_key(a: Action, rank: int, P: int, placement: str = LOOPING) -> tuple:
    """(kind, microbatch, destination stage) of the message a send/recv action carries."""
    s = model_stage(rank, a.chunk, P, placement)
    if a.op == SEND_ACT:
        return ("act", a.microbatch, s + 1)
    if a.op == RECV_ACT:
        return ("act", a.microbatch, s)
    if a.op == SEND_GRAD:
        return ("grad", a.microbatch, s - 1)
    return ("grad", a.microbatch, s)


class _RankState:
    """One rank during :func:`simulate`: its program counter, clock, compute intervals and
    the (microbatch, chunk) activations it holds."""

    def __init__(self, rank: int, actions, split: bool = False, placement: str = LOOPING):
        self.rank, self.actions, self.split, self.placement = rank, actions, split, placement
        self.pc, self.clock = 0, 0.0
        self.timeline, self.done, self.live, self.peak = [], set(), set(), 0

    def finished(self) -> bool:
        return self.pc == len(self.actions)

    def advance(self, P: int, cost, sent: dict, received: set) -> bool:
        """Run the next action if it can run now; False when it is a receive whose send has
        not happened yet."""
        a, r = self.actions[self.pc], self.rank
        if a.op in (RECV_ACT, RECV_GRAD):
            key = _message_key(a, r, P, self.placement)
            if key not in sent:
                return False
            if key in received:
                raise ValueError(f"rank {r} receives {key} twice")
            if stage_location(key[2] + (-1 if key[0] == "act" else 1), P, self.placement)[0] != a.peer:
                raise ValueError(f"rank {r}'s {a} names the wrong peer")
            received.add(key)
            self.clock = max(self.clock, sent[key])
        elif a.op in (SEND_ACT, SEND_GRAD):
            key = _message_key(a, r, P, self.placement)
            if key in sent:
                raise ValueError(f"rank {r} sends {key} twice")
            sent[key] = self.clock
        else:
            self._compute(a, cost(r, a))
        self.pc += 1
        return True

    def _compute(self, a: Action, seconds: float):
        unit, r = (a.op, a.microbatch, a.chunk), self.rank
        if unit in self.done:
            raise ValueError(f"rank {r} runs {a} twice")
        if a.op == BACKWARD and (FORWARD, a.microbatch, a.chunk) not in self.done:
            raise ValueError(f"rank {r} runs {a} before its forward")
        if a.op == WEIGHT and (not self.split or (BACKWARD, a.microbatch, a.chunk) not in self.done):
            raise ValueError(f"rank {r} runs {a} " + ("before its B" if self.split else "in a schedule without W"))
        self.done.add(unit)
        self.timeline.append((self.clock, self.clock + seconds, a))
        self.clock += seconds
        if a.op == FORWARD:
            self.live.add((a.microbatch, a.chunk))
            self.peak = max(self.peak, len(self.live))
        elif a.op == (WEIGHT if self.split else BACKWARD):  # W still reads the saved activations
            self.live.discard((a.microbatch, a.chunk))


def simulate(schedule: Schedule, t_forward: float = 1.0, t_backward: float = 2.0, cost=None) -> Simulation:
    """Run every rank's program on a clock: F of one chunk takes ``t_forward / V``, B
    ``t_backward / V`` (split schedules: B and W half of that each), or ``cost(rank, action)``
    seconds when given (e.g. measured ones); messages are free and sends never block; a
    receive waits for its send.

    Raises :class:`Deadlock` when no rank can move, and ValueError for a send without its
    one receive (or the reverse), a backward before its forward, a W before its B (or in a
    schedule without W's), a missing or repeated action.
    """
    P, V = schedule.num_stages, schedule.virtual_stages
    split = splits_backward(schedule.name)
    if cost is None:
        b = t_backward / V / (2 if split else 1)
        duration = {FORWARD: t_forward / V, BACKWARD: b, WEIGHT: b}

        def cost(rank, a):
            return duration[a.op]
    ranks = [_RankState(r, schedule.actions[r], split, schedule.placement) for r in range(P)]
    sent, received = {}, set()  # message key -> time sent; keys received
    while not all(st.finished() for st in ranks):
        moved = False
        for st in ranks:  # each rank runs until it finishes or waits for a message
            while not st.finished() and st.advance(P, cost, sent, received):
                moved = True
        if not moved:
            stuck = {st.rank: str(st.actions[st.pc]) for st in ranks if not st.finished()}
            raise Deadlock(f"schedule {schedule.name!r} deadlocks: ranks wait at {stuck}")
    unmatched = set(sent) ^ received
    if unmatched:
        raise ValueError(f"messages without exactly one send and one receive: {sorted(unmatched)}")
    expected = {(op, m, c) for op in (SPLIT_COMPUTE if split else COMPUTE)
                for m in range(schedule.num_microbatches) for c in range(V)}
    for st in ranks:
        if st.done != expected:
            raise ValueError(f"rank {st.rank} misses {sorted(expected - st.done)}")
    makespan = max(st.clock for st in ranks)
    bubble = [1 - sum(end - start for start, end, _ in st.timeline) / makespan for st in ranks]
    return Simulation([st.timeline for st in ranks], makespan, bubble, [st.peak for st in ranks])


# -------------------------------------------------------------------------------- charts
def chart(schedule: Schedule, sim: Simulation | None = None) -> str:
    """A time x rank chart in text: one row per rank, one column per forward-chunk time unit.

    A forward occupies one column, a backward two (the usual 1:2 cost), labelled ``F3`` /
    ``B3`` (microbatch 3), with the chunk as a letter when V > 1 (``F3a``, ``F3b``); ``.`` is
    idle time (the bubble).  Zero-bubble schedules: B (the input's gradient) and W (the
    weights') one column each."""
    V = schedule.virtual_stages
    sim = sim or simulate(schedule, t_forward=V, t_backward=2 * V)  # one column per chunk forward
    letters = "abcdefghijklmnopqrstuvwxyz"
    labels = [[(int(round(s)), int(round(e)), f"{a.op}{a.microbatch}" + (letters[a.chunk % 26] if V > 1 else ""))
               for s, e, a in row] for row in sim.timeline]
    width = max(len(text) for row in labels for _, _, text in row) + 1
    columns = int(round(sim.makespan))
    lines = [f"{schedule.name}: P={schedule.num_stages} ranks, M={schedule.num_microbatches} microbatches"
             + (f", V={V} chunks per rank" if V > 1 else "")
             + ("  (F forward, B input gradient, W weight gradients, . idle)" if splits_backward(schedule.name)
                else "  (F forward, B backward, . idle)")]
    for r, row in enumerate(labels):
        cells = [".".ljust(width)] * columns
        for start, end, text in row:
            for t in range(start, end):
                cells[t] = text.ljust(width)
        lines.append(f"rank {r} | " + "".join(cells).rstrip())
    lines.append(bubble_line(schedule, sim))
    return "\n".join(lines)


def bubble_line(schedule: Schedule, sim: Simulation) -> str:
    P, M, V = schedule.num_stages, schedule.num_microbatches, schedule.virtual_stages
    formula = {"naive": "(P-1)/P", "zb-h1": "(P-1)/(3M+P-1)", "zb-h2": "(P-1)/(3M+P-1)", "zbv": "(P-1)/(6M+P-1)"}.get(
        schedule.name, "(P-1)/(V*M+P-1)" if V > 1 else "(P-1)/(M+P-1)")
    return (f"bubble: simulated {100 * sim.mean_bubble:.1f}%, formula {formula} = "
            f"{100 * theoretical_bubble(schedule.name, P, M, V):.1f}%; "
            f"peak activations in flight per rank: {sim.peak_in_flight}")


def measured_chart(timelines, span: float, width: int = 72) -> str:
    """Measured F/B intervals of every rank (``timelines[rank] = [(start, end, Action)]``,
    seconds from the step's start) as one text row per rank of ``width`` columns: each column
    shows what ran at its middle instant: ``F``/``B`` (lower case for odd chunks), ``.`` idle."""
    lines = []
    for r, row in enumerate(timelines):
        cells = []
        for k in range(width):
            t = (k + 0.5) * span / width
            a = next((a for start, end, a in row if start <= t < end), None)
            cells.append("." if a is None else (a.op if a.chunk % 2 == 0 else a.op.lower()))
        lines.append(f"rank {r} | " + "".join(cells))
    return "\n".join(lines)


def save_png(schedule: Schedule, path: str, sim: Simulation | None = None) -> None:
    """Draw the chart with matplotlib (``pip install minidist[plot]``): one colour per
    chunk, forwards light and backwards dark, microbatch numbers in the boxes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    V = schedule.virtual_stages
    sim = sim or simulate(schedule, t_forward=V, t_backward=2 * V)
    colours = plt.get_cmap("tab10").colors
    fig, ax = plt.subplots(figsize=(max(6.0, 0.3 * sim.makespan), 0.6 * schedule.num_stages + 1.2))
    for r, row in enumerate(sim.timeline):
        for start, end, a in row:
            colour = colours[a.chunk % len(colours)]
            ax.broken_barh([(start, end - start)], (r - 0.4, 0.8), facecolor=colour,
                           alpha={FORWARD: 0.45, WEIGHT: 0.7}.get(a.op, 0.95), edgecolor="black", linewidth=0.5)
            ax.text((start + end) / 2, r, str(a.microbatch), ha="center", va="center", fontsize=7)
    ax.set_yticks(range(schedule.num_stages))
    ax.set_yticklabels([f"rank {r}" for r in range(schedule.num_stages)])
    ax.invert_yaxis()
    ax.set_xlabel("time (one unit = one chunk's forward; backward = 2 units)")
    ax.set_title(f"{schedule.name}  P={schedule.num_stages} M={schedule.num_microbatches}"
                 + (f" V={V}" if V > 1 else "") + f"   bubble {100 * sim.mean_bubble:.1f}%")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    import argparse
    import sys

    p = argparse.ArgumentParser(prog="python -m minidist.layout.simulate",
                                description="Print (or draw) a pipeline schedule as a time x rank chart.")
    p.add_argument("--schedule", default="1f1b", help=f"one of {', '.join(ORDERS)} (default: 1f1b)")
    p.add_argument("--pp", type=int, default=4, help="pipeline ranks P (default: 4)")
    p.add_argument("-m", "--microbatches", type=int, default=8, help="microbatches M (default: 8)")
    p.add_argument("-v", "--virtual-stages", type=int, default=None,
                   help="model chunks per rank V (interleaved, looping and zbv; default: 2 for them, else 1)")
    p.add_argument("--png", default=None, metavar="FILE", help="also draw the chart into FILE with matplotlib")
    args = p.parse_args(argv)

    V = args.virtual_stages if args.virtual_stages is not None else (2 if args.schedule in VIRTUAL else 1)
    problem = schedule_problem(args.schedule, args.pp, args.microbatches, V)
    if problem:
        p.exit(2, f"{p.prog}: error: {problem}\n")
    schedule = make_schedule(args.schedule, args.pp, args.microbatches, V)
    print(chart(schedule))
    if args.png:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("--png needs matplotlib, which is not installed: pip install 'minidist[plot]' "
                  "(or pip install matplotlib); the text chart above is complete", file=sys.stderr)
            return 1
        save_png(schedule, args.png)
        print(f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
