"""``python -m minidist.observe.plot TRACE -o timeline.png``: draw a merged trace (minidist/observe/trace.py).

Given the metrics file of an ``--experts`` run instead (``--metrics-jsonl``), it draws the
expert load over the steps (minidist/observe/expert_load.py).

One row per rank and thread track, time running right, spans coloured by kind, in the
manner of the lecture's figures: a *compute* row (forward light, backward dark, the
optimizer, idle time hatched) above the *communication* rows of the same rank (the main
thread's collectives and waits, the progress thread's messages), so that overlap between
computation and communication reads off vertically.  Nested spans (a block inside its
microbatch's forward, a message inside its collective) are drawn thinner on top of their
parent.

For a pipeline run a second panel shows each stage's forward and backward of the step
(microbatch numbers in the boxes) and, below it, the schedule's simulated chart
(``layout/simulate.py``) with the measured mean forward and backward
times, on the same time axis: the real bubble next to the one the schedule predicts.

``--step N`` draws step N (default: the last step; ``--step all``: the whole run).
matplotlib is an optional dependency: ``pip install minidist[plot]``.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys

COLOURS = {  # kind -> colour (forward light, backward dark: the lecture's pipeline figures)
    "forward": "#9ecae1", "backward": "#2171b5", "weight": "#6a51a3", "compute": "#6baed6", "optimizer": "#41ab5d",
    "bubble": "#f0f0f0", "collective": "#fd8d3c", "wait": "#d94801", "p2p": "#9e9ac8",
    "message": "#dadaeb", "staging": "#8c6d31", "sync": "#e7298a", "step": "#ffffff", "eval": "#bdbdbd",
}
LEGEND = [("forward", "forward"), ("backward", "backward"), ("weight", "weight gradients (W)"), ("optimizer", "optimizer"),
          ("bubble", "idle (waits for input)"), ("collective", "collective"), ("wait", "wait on async collective"),
          ("p2p", "p2p message"), ("staging", "host<->device copy"), ("sync", "host read (waits for the GPU)"),
          ("eval", "validation")]


def kind(e: dict) -> str:
    """The colour key of span ``e``."""
    op = (e.get("args") or {}).get("op")
    if e["cat"] == "compute" and op in ("forward", "backward", "weight"):
        return op
    return e["cat"] if e["cat"] in COLOURS else "compute"


def load(path: str) -> dict:
    with open(path) as f:
        doc = json.load(f)
    if not isinstance(doc, dict) or "traceEvents" not in doc:
        raise ValueError(f"{path} is not a Chrome trace (no traceEvents)")
    return doc


def is_trace(path: str) -> bool:
    """Is ``path`` one JSON document (a trace) rather than a metrics file (a JSON object per line)?"""
    with open(path) as f:
        text = f.read()
    try:
        doc = json.loads(text)
    except json.JSONDecodeError:
        return False  # several lines of JSON: a metrics file (or neither, which reading it says)
    return not (isinstance(doc, dict) and "step" in doc)  # a one-step metrics file is one record


def window(doc: dict, step: str) -> tuple[float, float]:
    """(start, end) in µs of ``step`` on rank 0 ("last", "all" or a number)."""
    spans = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    if not spans:
        raise ValueError("the trace holds no spans")
    if step == "all":
        return min(e["ts"] for e in spans), max(e["ts"] + e["dur"] for e in spans)
    steps = {int(e["args"]["step"]): e for e in spans if e["cat"] == "step" and e["name"].startswith("step ")
             and e["pid"] == 0}
    if not steps:
        return window(doc, "all")
    n = max(steps) if step == "last" else int(step)
    if n not in steps:
        raise ValueError(f"--step {step}: the trace holds steps {min(steps)}..{max(steps)}")
    s = steps[n]
    # every rank's spans of that step: from the earliest start to the latest end among the ranks' step spans
    others = [e for e in spans if e["cat"] == "step" and e["name"] == s["name"]]
    return min(e["ts"] for e in others), max(e["ts"] + e["dur"] for e in others)


def rows(doc: dict) -> list:
    """[(label, pid, tid)] of every track holding spans, rank by rank, compute first."""
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "thread_name"}
    procs = {e["pid"]: e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "process_name"}
    used = {(e["pid"], e["tid"]) for e in doc["traceEvents"] if e["ph"] == "X"}
    return [(f"{procs.get(pid, pid)}\n{names.get((pid, tid), tid)}", pid, tid) for pid, tid in sorted(used)]


def depths(spans: list) -> dict:
    """Nesting depth of each span of one track (spans of a thread nest), the step's
    containers left out."""
    out, stack = {}, []
    for e in sorted(spans, key=lambda e: (e["ts"], -e["dur"])):
        while stack and stack[-1] <= e["ts"] + 1e-3:
            stack.pop()
        out[id(e)] = len(stack)
        if e["cat"] != "step":  # the step's containers are the row itself: they add no depth
            stack.append(e["ts"] + e["dur"])
    return out


def draw_timeline(ax, doc: dict, t0: float, t1: float) -> None:
    """The rows of every rank's tracks between t0 and t1 (µs), time in ms from t0."""
    tracks = rows(doc)
    by_track = collections.defaultdict(list)
    for e in doc["traceEvents"]:
        if e["ph"] == "X" and e["ts"] < t1 and e["ts"] + e["dur"] > t0:
            by_track[e["pid"], e["tid"]].append(e)
    for y, (_, pid, tid) in enumerate(tracks):
        spans = by_track[pid, tid]
        depth = depths(spans)
        for e in sorted(spans, key=lambda e: depth[id(e)]):
            if e["cat"] == "step":
                continue  # containers: the row itself
            k, d = kind(e), depth[id(e)]
            h = 0.8 * 0.7 ** max(d - 1, 0) if d else 0.8
            start, width = (e["ts"] - t0) / 1e3, e["dur"] / 1e3
            ax.broken_barh([(start, width)], (y - h / 2, h), facecolor=COLOURS[k], edgecolor="grey",
                           linewidth=0.3, hatch="//" if k == "bubble" else None)
            if k in ("forward", "backward", "weight") and "microbatch" in e["args"] and d <= 1:
                ax.text(start + width / 2, y, str(e["args"]["microbatch"]), ha="center", va="center", fontsize=6)
    ax.set_yticks(range(len(tracks)))
    ax.set_yticklabels([label for label, _, _ in tracks], fontsize=7)
    ax.set_ylim(len(tracks) - 0.5, -0.5)
    ax.set_xlim(0, (t1 - t0) / 1e3)
    ax.set_xlabel("time (ms)")


def pipeline_timelines(doc: dict, t0: float, t1: float):
    """Each pipeline stage's measured (start_ms, end_ms, op, microbatch, chunk) of the
    window, for the ranks at dp0 cp0 tp0; None without a pipeline."""
    run = doc.get("otherData", {}).get("run", {})
    mesh = run.get("mesh", {})
    if mesh.get("pp", 1) < 2:
        return None
    from minidist.layout.mesh import MeshLayout

    layout = MeshLayout(**mesh)
    ranks = [layout.rank_of(dp=0, pp=s, cp=0, tp=0) for s in range(mesh["pp"])]
    out = []
    for r in ranks:
        out.append([((e["ts"] - t0) / 1e3, (e["ts"] + e["dur"] - t0) / 1e3, e["args"]["op"], e["args"]["microbatch"],
                     e["args"].get("chunk", 0))
                    for e in doc["traceEvents"] if e["ph"] == "X" and e["pid"] == r and e["cat"] == "compute"
                    and "stage" in (e.get("args") or {}) and t0 <= e["ts"] < t1])
    return out


def draw_pipeline(ax, timelines, title: str) -> None:
    """One row per stage: forward light, backward dark, one colour per chunk, microbatch numbers."""
    import matplotlib.pyplot as plt

    shades = plt.get_cmap("tab10").colors
    for r, row in enumerate(timelines):
        for start, end, op, m, chunk in row:
            ax.broken_barh([(start, end - start)], (r - 0.4, 0.8), facecolor=shades[chunk % len(shades)],
                           alpha={"forward": 0.45, "weight": 0.7}.get(op, 0.95), edgecolor="black", linewidth=0.5)
            ax.text((start + end) / 2, r, str(m), ha="center", va="center", fontsize=7)
    ax.set_yticks(range(len(timelines)))
    ax.set_yticklabels([f"stage {r}" for r in range(len(timelines))], fontsize=8)
    ax.set_ylim(len(timelines) - 0.5, -0.5)
    ax.set_title(title, fontsize=9)


OPS = {"F": "forward", "B": "backward", "W": "weight"}  # schedule action -> the trace's op


def simulated(doc: dict, measured) -> tuple:
    """The schedule's simulated timelines with the measured mean F, B (and W) times (ms), and
    its bubble."""
    from minidist.layout.schedules import make_schedule
    from minidist.layout.simulate import simulate

    run = doc["otherData"]["run"]
    sched = make_schedule(run["schedule"], run["mesh"]["pp"], run["microbatches"], run["virtual_stages"])
    mean = {}
    for action, op in OPS.items():
        times = [e - s for row in measured for s, e, o, *_ in row if o == op]
        mean[action] = sum(times) / len(times) if times else 0.0
    sim = simulate(sched, cost=lambda rank, a: mean[a.op])  # each action its kind's measured mean
    rows_ = [[(s, e, OPS[a.op], a.microbatch, a.chunk) for s, e, a in row] for row in sim.timeline]
    return sched, rows_, sim


def plot(doc: dict, out: str, step: str = "last") -> str:
    """Draw ``doc`` into ``out`` (PNG, SVG or PDF by its extension); returns a one-line summary."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    t0, t1 = window(doc, step)
    measured = pipeline_timelines(doc, t0, t1)
    n = len(rows(doc))
    heights = [max(2.0, 0.45 * n)]
    if measured:
        heights += [0.5 * len(measured) + 0.6] * 2
    fig, axes = plt.subplots(len(heights), 1, figsize=(12, sum(heights) + 1.2), squeeze=False,
                             gridspec_kw={"height_ratios": heights})
    ax = axes[0][0]
    draw_timeline(ax, doc, t0, t1)
    what = "whole run" if step == "all" else f"step {step}" if step != "last" else "last step"
    ax.set_title(f"per-rank timeline ({what}, {(t1 - t0) / 1e3:.1f} ms)", fontsize=10)
    ax.legend(handles=[Patch(facecolor=COLOURS[k], edgecolor="grey", hatch="//" if k == "bubble" else None, label=t)
                       for k, t in LEGEND], fontsize=7, ncol=len(LEGEND), loc="upper center",
              bbox_to_anchor=(0.5, -0.12 if not measured else -0.25), frameon=False)
    summary = f"{n} tracks over {(t1 - t0) / 1e3:.1f} ms"
    if measured:
        sched, sim_rows, sim = simulated(doc, measured)
        end = max([e for row in measured for _, e, *_ in row] + [sim.makespan])
        busy = [sum(e - s for s, e, *_ in row) for row in measured]
        span = max(e for row in measured for _, e, *_ in row) - min(s for row in measured for s, *_ in row)
        real_bubble = 1 - sum(busy) / len(busy) / span if span > 0 else 0.0
        draw_pipeline(axes[1][0], measured, f"measured: {sched.name}, P={sched.num_stages} M={sched.num_microbatches}"
                      f"{f' V={sched.virtual_stages}' if sched.virtual_stages > 1 else ''}, "
                      f"bubble {100 * real_bubble:.0f}% of the stages' span")
        draw_pipeline(axes[2][0], sim_rows, f"simulated with the measured mean forward / backward (/ W) times: "
                      f"bubble {100 * sim.mean_bubble:.0f}%")
        for a in (axes[1][0], axes[2][0]):
            a.set_xlim(0, end)
            a.set_xlabel("time (ms)")
        summary += f"; pipeline bubble {100 * real_bubble:.0f}% measured, {100 * sim.mean_bubble:.0f}% simulated"
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return summary


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minidist.observe.plot", description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", help="a trace written by --trace (Chrome-trace JSON), or the metrics file of an "
                                      "--experts run (--metrics-jsonl): its expert load over the steps")
    parser.add_argument("-o", "--output", default=None, help="image to write (default timeline.png, or "
                                                              "expert_load.png for a metrics file)")
    parser.add_argument("--step", default="last", help="the step to draw: a number, 'last' (default) or 'all'")
    args = parser.parse_args(argv)
    if args.step not in ("last", "all") and not args.step.isdigit():
        parser.error(f"--step {args.step!r}: give a step number, 'last' or 'all'")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        parser.error("drawing needs matplotlib: pip install 'minidist[plot]'")
    try:
        if is_trace(args.trace):
            args.output = args.output or "timeline.png"
            summary = plot(load(args.trace), args.output, args.step)
        else:  # a metrics file: the routers' load per expert over the steps (observe/expert_load.py)
            from minidist.observe import expert_load

            args.output = args.output or "expert_load.png"
            with open(args.trace) as f:
                summary = expert_load.draw(expert_load.read_metrics(f.read(), args.trace), args.output)
    except (OSError, ValueError, KeyError) as exc:
        parser.error(f"{args.trace}: {exc}")
    print(f"wrote {args.output}: {summary}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
