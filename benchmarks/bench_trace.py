"""What tracing costs: a traced training step against an untraced one, interleaved rep by rep.

    python benchmarks/bench_trace.py [--out DIR] [--quick] [--reps 20]

On 2 ranks, for each mesh (dp2, pp2 with 4 microbatches, tp2; --quick: tp2 only, the one
with the most collectives per step), a GPT (4 layers of width 128, batch 16x64; --quick:
2x64, 8x32) is built once and its steps alternate, A B B A ..., so that neither arm always
runs first and both see the same load of a shared machine: an untraced step (no hook
installed: minidist/observe/trace.py's hooks are swapped in only while a tracer runs) and a traced
one (every span of ``--trace``: microbatches, blocks, pipeline actions and idle waits, each
collective and message, and the step's breakdown computed from them, as minidist.train.loop
does).  The step time is the slowest rank's (the step ends when its last rank does); the
result is the ratio of the medians, against the target of at most 10% slower
(docs/tracing.md), plus the one-off cost of merging the trace on rank 0.
Writes tracing.json under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

MESHES = {"dp2": dict(dp=2), "pp2": dict(pp=2, microbatches=4), "tp2": dict(tp=2)}
TARGET = 0.10  # a traced step at most 10% slower


def worker(out_path: str, quick: bool, reps: int, meshes: list) -> None:
    import numpy as np

    from minidist import comm
    from minidist.observe import trace
    from minidist.observe.breakdown import breakdown
    from minidist.train.config import RunConfig
    from minidist.state.data import Sampler
    from minidist.parallel.compose import build, build_mesh
    from minidist.train.loop import update

    shape = dict(n_layer=2, d_model=64, n_head=4, seq_len=32, batch=8) if quick else \
        dict(n_layer=4, d_model=128, n_head=4, seq_len=64, batch=16)
    world = comm.world()
    corpus = np.random.default_rng(0).integers(0, 256, 100_000).astype(np.uint8)
    results = {}
    for name in meshes:
        cfg = RunConfig().replace(
            model=dict(layers=shape["n_layer"], d_model=shape["d_model"], heads=shape["n_head"]),
            data=dict(seq_len=shape["seq_len"], batch_size=shape["batch"]),
            optim=dict(steps=1000, warmup=1), parallel=MESHES[name]).resolved(world.size)
        model, strategy = build(cfg, build_mesh(cfg.parallel))
        sampler = Sampler(corpus, cfg.data.seq_len, cfg.data.batch_size, 0)
        tracer = trace.Tracer(world.rank, trace.rank_label(cfg.parallel.mesh_sizes(), world.rank))
        tracer.offset = trace.clock_offset(world, tracer.clock)
        tracer.wrap(strategy)

        def step(k, traced):
            if traced:
                trace.install(tracer)
            clock = tracer.clock if traced else time.perf_counter
            first = len(tracer.events)
            t0 = clock()
            x, y = sampler.batch(k)
            t1 = clock()
            strategy.forward_backward(x, y)
            t2 = clock()
            update(strategy, None, 1.0)
            t3 = clock()
            if traced:  # what train/loop.py adds to a traced step
                tracer.add("compute", "forward_backward", "step", t1, t2, {"step": k})
                tracer.add("compute", "optimizer", "optimizer", t2, t3, {"step": k})
                tracer.add("compute", f"step {k}", "step", t0, t3, {"step": k})
                breakdown(tracer.events, t0, t3, first)
                t3 = clock()
                trace.stop()
            return _max_over(t3 - t0, world)

        for k in range(3):  # warm-up: plans cached, buffers allocated
            step(k, False)
            step(k, True)
        rows = {"untraced_s": [], "traced_s": []}
        for rep in range(reps):  # A B B A ...: neither arm always runs first
            for traced in ((False, True) if rep % 2 == 0 else (True, False)):
                rows["traced_s" if traced else "untraced_s"].append(step(10 + 2 * rep + traced, traced))
        path = os.path.join(tempfile.gettempdir(), f"minidist-bench-trace-{os.getpid()}.json") if world.rank == 0 else None
        t0 = time.perf_counter()
        tracer.save(path, world)
        save_s = _max_over(time.perf_counter() - t0, world)
        if path:
            os.unlink(path)
        spans = int(comm.all_reduce(np.asarray([len(tracer.events)], dtype=np.int64), world)[0])
        med = {k: statistics.median(v) for k, v in rows.items()}
        results[name] = {**med, "overhead": med["traced_s"] / med["untraced_s"] - 1,
                         "spans_per_traced_step": spans / (reps + 3), "merge_and_write_s": save_s, "samples": rows}
    if world.rank == 0:
        with open(out_path, "w") as f:
            json.dump({"shape": shape, "ranks": world.size, "reps": reps, "target": TARGET, "meshes": results}, f)


def _max_over(seconds, world) -> float:
    """The slowest rank's time (minidist's all-reduce, untraced: called between steps)."""
    import numpy as np

    from minidist import comm

    return float(comm.all_reduce(np.asarray([seconds]), world, op="max")[0])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a tiny model, tp2 only, 3 reps")
    ap.add_argument("--out", default=None, help="directory for tracing.json")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--meshes", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    reps = 3 if args.quick else args.reps
    meshes = args.meshes.split(",") if args.meshes else (["tp2"] if args.quick else list(MESHES))
    if args.worker:
        worker(args.worker, args.quick, reps, meshes)
        return
    from minidist.host.blas_env import blas_threads
    from minidist.host.launcher import mpiexec_command

    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    cmd = mpiexec_command(2) + [sys.executable, os.path.abspath(__file__), "--worker", path, "--reps", str(reps),
                                "--meshes", ",".join(meshes)] + (["--quick"] if args.quick else [])
    subprocess.run(cmd, check=True, timeout=1200, env=dict(os.environ, **blas_threads(1)))
    with open(path) as f:
        r = json.load(f)
    os.unlink(path)
    s = r["shape"]
    print(f"tracing overhead: GPT {s['n_layer']}x{s['d_model']}, batch {s['batch']}x{s['seq_len']}, 2 ranks, "
          f"median of {reps} interleaved rep(s)")
    print(f"{'mesh':<6} {'untraced':>10} {'traced':>10} {'overhead':>9} {'target':>7} {'spans/step, 2 ranks':>19} {'merge':>8}")
    for name, m in r["meshes"].items():
        ok = "ok" if m["overhead"] <= TARGET else "MISSED"
        print(f"{name:<6} {1e3 * m['untraced_s']:>8.2f}ms {1e3 * m['traced_s']:>8.2f}ms {100 * m['overhead']:>8.1f}% "
              f"{ok:>7} {m['spans_per_traced_step']:>19.0f} {1e3 * m['merge_and_write_s']:>6.1f}ms")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "tracing.json"), "w") as f:
            json.dump(r, f, indent=2)


if __name__ == "__main__":
    main()
