"""Pipeline parallelism: every schedule on the same model, side by side.

    mpiexec -n 4 python examples/09_pipeline.py [--microbatches 8] [--steps 3] [--quick]

An 8-layer GPT is cut into one stage per rank (two chunks per rank for the looped
schedules) and trained for a few steps with each schedule of
``minidist.layout.schedules``: naive model parallelism, GPipe, 1F1B, interleaved
1F1B and the breadth-first looping pipeline.  For each one the script prints

* the schedule's chart as simulated (equal stages, free messages: the textbook picture),
* the chart as measured on this machine (what each rank really ran, and when),
* the measured bubble (idle share of a step, mean over ranks) beside the formula,
* each rank's peak activation memory (bytes held for pending backwards) and how many
  microbatches that was: GPipe holds all M, 1F1B at most P,
* the step time, and the loss after the last step: the same for every schedule, because
  every schedule computes the same gradient (the single-process one).

With more ranks than cores the ranks take turns on the cores, and a rank waiting for a
message spins instead of yielding: the measured bubble then reads higher than the formula.
BLAS runs with one thread per rank.
"""
import argparse
import time

from minidist.host.blas_env import pin_blas_threads  # noqa: E402  (imports neither NumPy nor MPI)

pin_blas_threads(1)  # one BLAS thread per rank, before NumPy loads: the ranks already share the cores

import numpy as np  # noqa: E402  (after the thread settings)

from minidist import comm  # noqa: E402
from minidist.layout.model import ModelConfig  # noqa: E402
from minidist.model.nn import GPT  # noqa: E402
from minidist.model.optim import AdamW  # noqa: E402
from minidist.layout import schedules as S  # noqa: E402
from minidist.layout.simulate import chart, measured_chart, simulate  # noqa: E402
from minidist.parallel.pipeline.runtime import PipelineRuntime  # noqa: E402

SCHEDULES = [("naive", 1), ("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("looping", 2)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--quick", action="store_true", help="a smaller model and 2 steps (for the tests)")
    args = ap.parse_args()
    if args.quick:
        args.d_model, args.steps = 32, 2
    g = comm.world()
    P, M = g.size, args.microbatches
    seq, batch = 32, 2 * M
    rng = np.random.default_rng(0)
    data = [(rng.integers(0, 256, (batch, seq)), rng.integers(0, 256, (batch, seq))) for _ in range(args.steps)]
    say = print if g.rank == 0 else (lambda *a, **k: None)
    say(f"{args.layers}-layer GPT (d_model {args.d_model}), batch {batch}x{seq}, "
        f"{P} pipeline ranks, {M} microbatches, {args.steps} steps per schedule\n")
    rows = []
    for name, V in SCHEDULES:
        problem = S.schedule_problem(name, P, M, V, args.layers)
        if problem:
            say(f"== {name}: skipped ({problem})\n")
            continue
        model = GPT(ModelConfig(block_size=seq, layers=args.layers, heads=4, d_model=args.d_model, seed=0))
        pipe = PipelineRuntime(model, g, name, M, V)
        opt = AdamW(model.parameters(), lr=1e-3)
        for x, y in data:
            t0 = time.perf_counter()
            loss = pipe.forward_backward(x, y)
            pipe.reduce_tied_gradients()
            opt.step()
            opt.zero_grad()
            step_s = time.perf_counter() - t0
        stats = pipe.gather_stats()  # of the last step
        timelines = pipe.gather_timelines()
        if g.rank != 0:
            continue
        sched = S.make_schedule(name, P, M, V)
        sim = simulate(sched)
        measured = float(np.mean([s["bubble"] for s in stats]))
        theory = S.theoretical_bubble(name, P, M, V)
        print(f"== {name}" + (f" (V={V} chunks per rank)" if V > 1 else ""))
        print("simulated:")
        print("\n".join(chart(sched, simulate(sched, t_forward=V, t_backward=2 * V)).splitlines()[1:-1]))
        print("measured (F/B: forward/backward, lower case: second chunk, '.': idle):")
        print(measured_chart(timelines, stats[0]["span_s"]))
        peaks = [int(s["peak_activation_bytes"]) for s in stats]
        flights = [int(s["peak_in_flight"]) for s in stats]
        print(f"bubble: measured {100 * measured:.1f}%  theory {100 * theory:.1f}%  (simulated "
              f"{100 * sim.mean_bubble:.1f}%)")
        print(f"peak activations per rank: {', '.join(f'{b / 1024:.0f} KiB' for b in peaks)} "
              f"({', '.join(map(str, flights))} chunk-microbatches in flight)")
        print(f"step time {1000 * step_s:.1f} ms, loss after the last step {loss:.6f}\n")
        rows.append((name + (f" V={V}" if V > 1 else ""), measured, theory, max(peaks), max(flights), step_s, loss))
    if g.rank == 0:
        print(f"{'schedule':<16} {'bubble meas.':>12} {'theory':>7} {'peak act.':>10} {'in flight':>9} "
              f"{'step ms':>8} {'loss':>10}")
        for name, meas, theory, peak, flight, step_s, loss in rows:
            print(f"{name:<16} {100 * meas:>11.1f}% {100 * theory:>6.1f}% {peak / 1024:>6.0f} KiB {flight:>9} "
                  f"{1000 * step_s:>8.1f} {loss:>10.6f}")
        same = max(r[-1] for r in rows) - min(r[-1] for r in rows)
        print(f"every schedule ends at the same loss (spread {same:.1e}): they compute the same gradient")


if __name__ == "__main__":
    main()
