"""4D composition on 4 ranks: tokens/s of dp4, dp2·tp2, pp2·tp2 and tp2·cp2, each relative to
one rank, all measured in one run; and the bytes each rank sent per step on each axis next
to the closed-form formulas (minidist/layout/traffic.py).

    python benchmarks/bench_compose.py [--out DIR] [--quick] [--rounds 3] [--steps 6]

Every configuration trains the same model on the same global batch (float32).  The meshes
are launched one after the other inside each round, and the rounds repeat the whole list, so
a change in the machine's load or in the bandwidth between processes (which flips between
two levels over minutes on the shared development VMs) hits every mesh alike; each figure is
the median over the rounds.  On a 2-core machine 4 ranks oversubscribe the cores 2 to 1, so
the ratios mostly show what each axis's communication and extra work cost, not a speed-up:
on a machine with a core per rank they are the point (say which machine).
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

MESHES = {"1 rank": {}, "dp4": dict(dp=4), "dp2·tp2": dict(dp=2, tp=2), "pp2·tp2": dict(pp=2, tp=2, microbatches=4),
          "tp2·cp2": dict(tp=2, cp=2)}
SHAPE = dict(layers=4, d_model=128, heads=4, seq_len=128, batch_size=16)
QUICK_SHAPE = dict(layers=2, d_model=32, heads=4, seq_len=16, batch_size=8)


def config(shape: dict, mesh: dict, steps: int):
    from minidist.train.config import RunConfig

    p = dict(mesh)
    if p.get("pp", 1) > 1 and shape["batch_size"] < 8:
        p["microbatches"] = 2
    return RunConfig().replace(
        model=dict(layers=shape["layers"], d_model=shape["d_model"], heads=shape["heads"], dtype="float32"),
        data=dict(seq_len=shape["seq_len"], batch_size=shape["batch_size"]),
        optim=dict(steps=steps, warmup=1), report=dict(eval_every=0), parallel=p)


def worker(out_path: str, mesh: dict, shape: dict, steps: int) -> None:
    """Train ``steps`` steps on this mesh; rank 0 writes tokens/s (median over the steps after
    the first) and the bytes this rank sent on each axis in the last step, with the formula's."""
    import numpy as np

    from minidist.state.data import Sampler
    from minidist.train.flags import world_size
    from minidist.parallel.compose import build, build_mesh
    from minidist.train.loop import update

    cfg = config(shape, mesh, steps).resolved(world_size())
    model, strategy = build(cfg, build_mesh(cfg.parallel))
    corpus = np.random.default_rng(0).integers(0, 256, 200_000).astype(np.uint8)
    sampler = Sampler(corpus, cfg.data.seq_len, cfg.data.batch_size, 0)
    times, sent = [], {}
    for step in range(steps):
        x, y = sampler.batch(step)
        before = _bytes_by_group() if step == steps - 1 else None
        t0 = time.perf_counter()
        strategy.forward_backward(x, y)
        update(strategy, None, cfg.optim.clip_grad)
        times.append(time.perf_counter() - t0)
        if before is not None:
            after = _bytes_by_group()
            sent = {k: after.get(k, 0) - before.get(k, 0) for k in after if after.get(k, 0) != before.get(k, 0)}
    if world_size() == 1 or strategy.mesh.world.rank == 0:
        step_s = statistics.median(times[1:] or times)
        with open(out_path, "w") as f:
            json.dump({"step_s": step_s, "tokens_per_s": cfg.data.batch_size * cfg.data.seq_len / step_s,
                       "bytes_sent_last_step": sent, "expected_bytes": _expected(cfg)}, f)


def _bytes_by_group() -> dict:
    try:
        from minidist.comm.stats import bytes_by_group
    except ImportError:
        return {}
    return dict(bytes_by_group())


def _expected(cfg) -> dict:
    """The formulas' bytes per step for rank 0 (layout/traffic.py), where they exist."""
    try:
        from minidist.layout.traffic import expected_step_bytes
    except ImportError:
        return {}
    return expected_step_bytes(cfg, rank=0)


def launch(name: str, mesh: dict, shape: dict, steps: int) -> dict:
    ranks = 1
    for axis in ("dp", "pp", "tp", "cp"):
        ranks *= mesh.get(axis, 1)
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(mesh), "--result", path,
           "--shape", json.dumps(shape), "--steps", str(steps)]
    if ranks > 1:
        from minidist.host.launcher import mpiexec_command
        cmd = mpiexec_command(ranks) + cmd
    from minidist.host.blas_env import blas_threads
    env = dict(os.environ, **blas_threads(1))
    subprocess.run(cmd, check=True, timeout=900, env=env, stdout=subprocess.DEVNULL)
    with open(path) as f:
        result = json.load(f)
    os.unlink(path)
    return result


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a tiny model, one round, 3 steps")
    ap.add_argument("--out", default=None, help="directory for compose.json")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--result", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--shape", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker is not None:
        worker(args.result, json.loads(args.worker), json.loads(args.shape), args.steps)
        return
    shape = QUICK_SHAPE if args.quick else SHAPE
    rounds, steps = (1, 3) if args.quick else (args.rounds, args.steps)
    runs = {name: [] for name in MESHES}
    for _ in range(rounds):  # every mesh in every round: load changes hit them alike
        for name, mesh in MESHES.items():
            runs[name].append(launch(name, mesh, shape, steps))
    base = statistics.median(r["tokens_per_s"] for r in runs["1 rank"])
    rows = []
    for name, results in runs.items():
        tps = statistics.median(r["tokens_per_s"] for r in results)
        rows.append({"mesh": name, "tokens_per_s": tps, "vs_one_rank": tps / base,
                     "rounds": [r["tokens_per_s"] for r in results],
                     "bytes_sent_last_step": results[-1]["bytes_sent_last_step"],
                     "expected_bytes": results[-1]["expected_bytes"]})
    print(f"4D composition, {shape['layers']}x{shape['d_model']} GPT, batch {shape['batch_size']}x{shape['seq_len']}, "
          f"float32, {os.cpu_count()} cores, median of {rounds} round(s)")
    print(f"{'mesh':<10} {'tokens/s':>10} {'vs 1 rank':>10}   bytes sent by rank 0 in a step, per group (formula)")
    for r in rows:
        sent = ", ".join(f"{g} {b:,}" + (f" ({r['expected_bytes'][g]:,})" if g in r["expected_bytes"] else "")
                         for g, b in sorted(r["bytes_sent_last_step"].items()))
        print(f"{r['mesh']:<10} {r['tokens_per_s']:>10,.0f} {r['vs_one_rank']:>10.2f}   {sent}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "compose.json"), "w") as f:
            json.dump({"shape": shape, "cores": os.cpu_count(), "rounds": rounds, "results": rows}, f, indent=2)


if __name__ == "__main__":
    main()
