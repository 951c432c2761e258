"""Pipeline schedules on real ranks: measured bubble beside the formula, and throughput.

    python benchmarks/bench_pipeline.py [--out DIR] [--quick] [--pp 2 4] [--reps 10]

For each pipeline size P (one mpiexec launch each) an 8-layer GPT (d_model 128, seq 64,
batch 64, float32) trains with M = 8 microbatches of 8 sequences under GPipe, 1F1B, interleaved 1F1B (V=2)
and the looping pipeline (V=2), and, as the reference, the same step on one rank (rank 0
runs the single-process step while the others sleep: an MPI rank waiting in a barrier spins
and would take a core from it).  The sides alternate rep by rep (a
shared machine's speed drifts over minutes), the first two reps are warm-up, and medians
are reported:

* the measured bubble (idle share of the step's schedule, mean over ranks; see
  parallel/pipeline/runtime.py), median and best rep (load from other processes only ever
  adds idle time), beside (P-1)/(M+P-1), resp. (P-1)/(V*M+P-1), and beside the bubble
  "replayed": the schedule simulated on the compute times measured in the same step with free
  messages (unequal or noisy compute times alone already raise the bubble above the formula;
  measured minus replayed is what messages and the runtime itself cost);
* tokens/s of each schedule relative to the one-rank run of the same model.

With P ranks on fewer cores (P=4 on a 2-core machine) the ranks take turns and a waiting
rank spins: the bubble reads high and the speed-up is below 1; those rows are reported for
completeness, marked "oversubscribed".  BLAS runs with one thread per rank.

Zero-bubble table (full mode, at P = 4, M = 8, in the same launch as P = 4's rows): 1F1B,
interleaved (V=2), zb-h1, zb-h2 and zbv (V=2), each with its formula (theoretical_bubble,
equal F, B, W), its bubble simulated with the measured F, B and W times of every action of
the same step (free messages), and the measured bubble (idle share between the pipeline
group's barriers, median over reps), beside the mean measured F, B and W of one chunk.  On
fewer cores than ranks the measured column includes the time a rank waits for a core (the
runtime's clock keeps running while the operating system runs another rank); the simulated
column is only the order's cost, on compute times that themselves were stretched by sharing.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

SHAPE = dict(n_layer=8, n_head=4, d_model=128, seq_len=64, batch=64, microbatches=8)
QUICK_SHAPE = dict(n_layer=8, n_head=2, d_model=32, seq_len=16, batch=8, microbatches=8)
SIDES = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("looping", 2)]
ZERO_BUBBLE_SIDES = [("zb-h1", 1), ("zb-h2", 1), ("zbv", 2)]  # full mode, P = 4 only
ZERO_BUBBLE_TABLE = ["1f1b", "interleaved", "zb-h1", "zb-h2", "zbv"]
ZERO_BUBBLE_P = 4


# ----------------------------------------------------------------- inside mpiexec
def _forward_backward(model, x, y):
    """One process's forward and backward of the whole batch (the training loop's call)."""
    from minidist.parallel.data import OneReplica
    from minidist.parallel.strategy import Strategy

    return Strategy(model, OneReplica(model, None)).forward_backward(x, y)


def worker(out_path: str, reps: int, shape: dict, zero_bubble: bool = False) -> None:
    import time

    import numpy as np

    from minidist import comm
    from minidist.layout.model import ModelConfig
    from minidist.model.nn import GPT
    from minidist.model.optim import AdamW
    from minidist.parallel.pipeline.runtime import PipelineRuntime
    from minidist.layout.schedules import theoretical_bubble

    g = comm.world()
    P, M = g.size, shape["microbatches"]
    sides = SIDES + (ZERO_BUBBLE_SIDES if zero_bubble else [])

    def model():
        return GPT(ModelConfig(block_size=shape["seq_len"], layers=shape["n_layer"], heads=shape["n_head"],
                               d_model=shape["d_model"], seed=0))

    serial = model()
    serial_opt = AdamW(serial.parameters(), lr=1e-4)
    pipes = {}
    for name, V in sides:
        m = model()
        pipes[name] = (PipelineRuntime(m, g, name, M, V), AdamW(m.parameters(), lr=1e-4))
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (shape["batch"], shape["seq_len"]))
    y = rng.integers(0, 256, (shape["batch"], shape["seq_len"]))
    times = {k: [] for k in ["serial"] + [n for n, _ in sides]}
    bubbles = {n: [] for n, _ in sides}
    replayed = {n: [] for n, _ in sides}
    op_seconds = {n: [] for n, _ in sides}  # per rep: mean seconds of one chunk's F, B (and W)
    last_serial = np.array([0.5])
    for rep in range(reps + 2):
        # The one-rank reference runs on rank 0 while the other ranks SLEEP (a rank waiting in
        # MPI spins and would take a core from it): as long as rank 0's last step, plus a margin.
        last_serial = comm.broadcast(last_serial, g, root=0)
        comm.barrier(g)
        if g.rank == 0:
            t0 = time.perf_counter()
            _forward_backward(serial, x, y)
            serial_opt.step()
            serial_opt.zero_grad()
            t = time.perf_counter() - t0
            last_serial = np.array([t])
        else:
            time.sleep(1.5 * float(last_serial[0]) + 0.005)
        comm.barrier(g)
        if rep >= 2 and g.rank == 0:
            times["serial"].append(t)
        for name, _ in sides:
            pipe, opt = pipes[name]
            comm.barrier(g)
            t0 = time.perf_counter()
            pipe.forward_backward(x, y)
            pipe.reduce_tied_gradients()
            opt.step()
            opt.zero_grad()
            t = time.perf_counter() - t0
            stats, timelines = pipe.gather_stats(), pipe.gather_timelines()
            if rep >= 2 and g.rank == 0:
                times[name].append(t)
                bubbles[name].append(float(np.mean([s["bubble"] for s in stats])))
                replayed[name].append(replay(pipe.schedule, timelines))
                op_seconds[name].append(mean_op_seconds(timelines))
    if g.rank == 0:
        tokens = shape["batch"] * shape["seq_len"]
        serial_s = float(np.median(times["serial"]))
        rows = []
        for name, V in sides:
            step_s = float(np.median(times[name]))
            ops = {op: float(np.median([s[op] for s in op_seconds[name]])) for op in op_seconds[name][0]}
            rows.append({"schedule": name, "V": V, "P": P, "M": M, "step_s": step_s, "op_seconds": ops,
                         "tokens_per_s": tokens / step_s, "speedup_vs_1_rank": serial_s / step_s,
                         "bubble_measured": float(np.median(bubbles[name])),
                         "bubble_best": float(np.min(bubbles[name])),
                         "bubble_replayed": float(np.median(replayed[name])),
                         "bubble_theory": theoretical_bubble(name, P, M, V)})
        result = {"P": P, "serial_step_s": serial_s, "serial_tokens_per_s": tokens / serial_s,
                  "load_avg": os.getloadavg()[0], "rows": rows}
        with open(out_path, "w") as f:
            json.dump(result, f)


def mean_op_seconds(timelines) -> dict:
    """Mean measured seconds of one chunk's F, B (and W) over every rank's actions of a step."""
    by_op = {}
    for row in timelines:
        for start, end, a in row:
            by_op.setdefault(a.op, []).append(end - start)
    return {op: sum(v) / len(v) for op, v in by_op.items()}


def replay(schedule, timelines) -> float:
    """The bubble the schedule would have with the compute times measured in this step and
    free, instant messages (simulate.simulate with measured costs), mean over ranks: what
    the measured bubble would be without any communication or runtime overhead."""
    from minidist.layout.simulate import simulate

    seconds = {(r, a.op, a.microbatch, a.chunk): end - start
               for r, row in enumerate(timelines) for start, end, a in row}
    sim = simulate(schedule, cost=lambda r, a: seconds[(r, a.op, a.microbatch, a.chunk)])
    return sim.mean_bubble


# ----------------------------------------------------------------- the driver
def launch(P: int, reps: int, quick: bool, zero_bubble: bool = False) -> dict:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from minidist.host.launcher import mpiexec_command

    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    from minidist.host.blas_env import blas_threads
    env = dict(os.environ, **blas_threads(1))
    cmd = mpiexec_command(P) + [sys.executable, os.path.abspath(__file__), "--worker", path, "--reps", str(reps)]
    if quick:
        cmd.append("--quick")
    if zero_bubble:
        cmd.append("--zero-bubble")
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if r.returncode:
        sys.stderr.write(r.stdout[-3000:] + r.stderr[-3000:])
        sys.exit(f"bench_pipeline.py: the {P}-rank launch failed with exit status {r.returncode}")
    with open(path) as f:
        result = json.load(f)
    os.unlink(path)
    return result


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--quick", action="store_true", help="a tiny model, 2 reps, P=2 only")
    ap.add_argument("--out", default=None, help="directory for pipeline.json")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--zero-bubble", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    shape = QUICK_SHAPE if args.quick else SHAPE
    if args.worker:
        worker(args.worker, args.reps, shape, args.zero_bubble)
        return
    if args.quick:
        args.pp, args.reps = [2], 2
    cores = os.cpu_count() or 1
    # the zero-bubble table: full mode, in the P = 4 launch (M = 8: SHAPE's microbatches)
    results = [launch(P, args.reps, args.quick, not args.quick and P == ZERO_BUBBLE_P) for P in args.pp]
    print(f"pipeline step, {shape}, float32, median of {args.reps} interleaved reps; "
          f"speed-up: tokens/s over the 1-rank run of the same model")
    print("bubble: measured (median, best rep), replayed (the schedule on the measured compute times with free "
          "messages), formula")
    print(f"{'P':>2} {'schedule':<14} {'bubble meas.':>12} {'best':>6} {'replayed':>8} {'formula':>8} {'diff':>6} "
          f"{'tokens/s':>10} {'speed-up':>8} {'load':>5}")
    for res in results:
        note = "  oversubscribed" if res["P"] > cores else ""
        for row in res["rows"]:
            name = row["schedule"] + (f" V={row['V']}" if row["V"] > 1 else "")
            diff = 100 * (row["bubble_measured"] - row["bubble_theory"])
            print(f"{res['P']:>2} {name:<14} {100 * row['bubble_measured']:>11.1f}% {100 * row['bubble_best']:>5.1f}% "
                  f"{100 * row['bubble_replayed']:>7.1f}% {100 * row['bubble_theory']:>7.1f}% "
                  f"{diff:>+5.1f} {row['tokens_per_s']:>10,.0f} {row['speedup_vs_1_rank']:>8.2f} "
                  f"{res['load_avg']:>5.1f}{note}")
    for res in results:
        zero_bubble_table(res, cores)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "pipeline.json"), "w") as f:
            json.dump({"shape": shape, "cores": cores, "results": results}, f, indent=2)


def zero_bubble_table(res: dict, cores: int) -> None:
    """Print the zero-bubble table of one launch's result if it has the zero-bubble rows."""
    rows = {r["schedule"]: r for r in res["rows"]}
    if not all(name in rows for name in ZERO_BUBBLE_TABLE):
        return
    P, M = res["P"], rows["zbv"]["M"]
    shared = (f"{P} ranks on {cores} cores: the ranks take turns on the cores, so the measured bubble also counts "
              f"a rank's wait for a core" if P > cores else f"{P} ranks on {cores} cores")
    print(f"\nzero-bubble schedules, P={P}, M={M}: bubble by formula (equal F, B, W), simulated with this step's "
          f"measured F/B/W times (free messages), measured (median over reps); {shared}")
    print(f"{'schedule':<16} {'formula':>8} {'simulated':>9} {'measured':>8} {'best':>6} "
          f"{'F ms':>6} {'B ms':>6} {'W ms':>6}  (one chunk, mean)")
    for name in ZERO_BUBBLE_TABLE:
        r = rows[name]
        ops = r["op_seconds"]
        label = name + (f" V={r['V']}" if r["V"] > 1 else "")
        w = f"{1e3 * ops['W']:>6.2f}" if "W" in ops else f"{'-':>6}"
        print(f"{label:<16} {100 * r['bubble_theory']:>7.1f}% {100 * r['bubble_replayed']:>8.1f}% "
              f"{100 * r['bubble_measured']:>7.1f}% {100 * r['bubble_best']:>5.1f}% "
              f"{1e3 * ops['F']:>6.2f} {1e3 * ops['B']:>6.2f} {w}")


if __name__ == "__main__":
    main()
