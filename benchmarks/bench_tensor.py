"""Tensor parallelism on 2 ranks: collective matmuls vs one-shot collectives, and tp=2 vs 1 rank.

    python benchmarks/bench_tensor.py [--out DIR] [--quick] [--reps 11] [--gbps 1]

Launches itself under ``mpiexec -n 2``.  Two measurements, each side alternating with the
others rep by rep (the machine is shared: ratios, medians, never absolute targets):

1. **MLP on a simulated link** (``--gbps``, as MINIDIST_LINK_GBPS): the sequence-parallel
   Megatron MLP (d -> 4d -> d, float32, forward + backward) with its all-gather and
   reduce-scatter as single collectives ("sync"), as ring collective matmuls ("ring") and
   bidirectional ones.  For each: the step time, the speed-up over sync, and the share of
   the ideal overlap achieved::

       hidden = t_sync - t_mode
       ideal  = min(exposed communication of sync, (N-1)/N * chunk matmul time)

   (a ring of N ranks can hide each of its N-1 steps behind one chunk's matmul; the last
   chunk's matmul has nothing left to hide).  Target: >= 0.7 of ideal.
2. **GPT training step on shared memory** (no simulated link): the benchmark GPT of
   bench_model.py, tp=2 (Megatron all-reduce, and sequence parallel) against the plain model
   on one rank (the other rank idles without spinning), tokens/s ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
MLP_SHAPE = dict(batch=8, seq_len=128, d_model=512)
MLP_QUICK = dict(batch=2, seq_len=32, d_model=64)


# ----------------------------------------------------------------- inside mpiexec
def _forward_backward(model, x, y):
    """One process's forward and backward of the whole batch (the training loop's call)."""
    from minidist.parallel.data import OneReplica
    from minidist.parallel.strategy import Strategy

    return Strategy(model, OneReplica(model, None)).forward_backward(x, y)


def _one(g, fn):
    """Run fn once on every rank after a barrier: (slowest rank's seconds, its exposed comm,
    chunk matmul seconds) -- exposed = blocking collectives + waits for ring steps."""
    import numpy as np

    from minidist import comm
    from minidist.parallel.tensor import collective_matmul

    comm.barrier(g)
    comm.reset_stats()
    with collective_matmul.record_timeline() as events:
        t0 = time.perf_counter()
        fn()
        wall = time.perf_counter() - t0
    exposed = (sum(b - a for kind, a, b in events if kind == "wait")
               + sum(v["time_s"] for name, v in comm.stats().items() if name != "ppermute"))
    chunks = sum(b - a for kind, a, b in events if kind == "matmul")
    return [float(v) for v in comm.all_reduce(np.array([wall, exposed, chunks]), g, op="max")]


def mlp_bench(g, shape, reps, gbps):
    import numpy as np

    from minidist import comm
    from minidist.layout.model import ModelConfig
    from minidist.model import nn
    from minidist.model.autograd import Tensor
    from minidist.parallel import tensor as tpm

    B, T, d = shape["batch"], shape["seq_len"], shape["d_model"]
    cfg = ModelConfig(vocab_size=256, block_size=T, layers=1, heads=g.size, d_model=d, dtype="float32")
    x = np.random.default_rng(0).standard_normal((B, T // g.size, d)).astype(np.float32)
    runs = {}
    for mode in ("sync", "ring", "bidirectional"):
        layers = tpm.TensorParallelLayers(g, sequence_parallel=True, overlap="none" if mode == "sync" else mode)
        mlp = nn.MLP(cfg, np.float32, layers)
        nn.init_parameters(mlp, 0)

        def step(mlp=mlp):
            xt = Tensor(x, requires_grad=True)
            y = mlp(xt)
            y.backward(np.ones(y.shape, np.float32))

        runs[mode] = step
    comm.set_link_model(gbps=gbps)
    samples = {mode: [] for mode in runs}
    for rep in range(reps + 1):  # the first rep warms up
        for mode, step in runs.items():
            sample = _one(g, step)
            if rep:
                samples[mode].append(sample)
    comm.set_link_model()
    med = {mode: [statistics.median(s[i] for s in samples[mode]) for i in range(3)] for mode in samples}
    t_sync, comm_sync = med["sync"][0], med["sync"][1]
    out = {"shape": shape, "gbps": gbps, "ranks": g.size, "modes": {}}
    for mode, (wall, exposed, chunks) in med.items():
        row = {"step_s": wall, "exposed_comm_s": exposed, "speedup_vs_sync": t_sync / wall}
        if mode != "sync":
            ideal = min(comm_sync, (g.size - 1) / g.size * chunks)
            row.update(chunk_matmul_s=chunks, hidden_s=t_sync - wall, ideal_hidden_s=ideal,
                       share_of_ideal=(t_sync - wall) / ideal if ideal > 0 else float("nan"))
        out["modes"][mode] = row
    return out


def gpt_bench(g, shape, reps):
    """tokens/s of a training step: tp=2 (two modes) vs the plain model on rank 0 alone."""
    import numpy as np

    from minidist import comm
    from minidist.layout.model import ModelConfig
    from minidist.model import nn
    from minidist.model.optim import AdamW
    from minidist.parallel import tensor as tpm

    cfg = ModelConfig(vocab_size=256, block_size=shape["seq_len"], layers=shape["n_layer"], heads=shape["n_head"],
                      d_model=shape["d_model"], dtype="float32")
    rng = np.random.default_rng(0)
    seq = rng.integers(0, 256, size=(shape["batch"], shape["seq_len"] + 1))
    x, y = seq[:, :-1], seq[:, 1:]
    models = {"1 rank": nn.GPT(cfg) if g.rank == 0 else None,
              "tp=2": nn.GPT(cfg, tpm.TensorParallelLayers(g)),
              "tp=2 sequence parallel": nn.GPT(cfg, tpm.TensorParallelLayers(g, sequence_parallel=True))}
    opts = {name: AdamW(m.parameters(), lr=1e-4) for name, m in models.items() if m is not None}

    def step(name):
        comm.barrier(g)
        t0 = time.perf_counter()
        if models[name] is not None:
            _forward_backward(models[name], x, y)
            opts[name].step()
            opts[name].zero_grad()
        if name == "1 rank":  # rank 1 waits without spinning on a core
            done = np.zeros(1)
            if g.rank == 0:
                comm.send(done, 1, g)
            else:
                request = comm.irecv(done, 0, g)
                while not request.is_completed():  # completes the receive once it is there
                    time.sleep(0.0005)
        return float(comm.all_reduce(np.array([time.perf_counter() - t0]), g, op="max")[0])

    times = {name: [] for name in models}
    for rep in range(reps + 1):
        for name in models:
            t = step(name)
            if rep:
                times[name].append(t)
    tokens = shape["batch"] * shape["seq_len"]
    base = tokens / statistics.median(times["1 rank"])
    return {"shape": shape, "tokens_per_s": {n: tokens / statistics.median(t) for n, t in times.items()},
            "ratio_vs_1_rank": {n: tokens / statistics.median(t) / base for n, t in times.items()}}


def worker(path, quick, reps, gbps):
    from minidist.host.blas_env import pin_blas_threads

    pin_blas_threads(1)
    sys.path.insert(0, HERE)
    from bench_model import SHAPE

    from minidist import comm

    g = comm.world()
    mlp = mlp_bench(g, MLP_QUICK if quick else MLP_SHAPE, reps, gbps)
    shape = dict(SHAPE, n_layer=1, d_model=64, seq_len=32, batch=2) if quick else dict(SHAPE)
    gpt = gpt_bench(g, shape, reps)
    if g.rank == 0:
        with open(path, "w") as f:
            json.dump({"mlp": mlp, "gpt": gpt, "load_avg": os.getloadavg()[0]}, f, indent=1)


# ----------------------------------------------------------------- the driver
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="directory for tensor_parallel.json")
    ap.add_argument("--quick", action="store_true", help="small sizes, two reps (smoke run)")
    ap.add_argument("--reps", type=int, default=11)
    ap.add_argument("--gbps", type=float, default=1.0, help="simulated link for the MLP part, Gbit/s")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    reps = 2 if args.quick else args.reps
    if args.worker:
        worker(args.worker, args.quick, reps, args.gbps)
        return
    sys.path.insert(0, os.path.dirname(HERE))
    from minidist.host.launcher import mpiexec_command

    out_dir = args.out or "."
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "tensor_parallel.json")
    load = os.getloadavg()[0]
    cmd = mpiexec_command(2) + [sys.executable, os.path.abspath(__file__), "--worker", path, "--gbps", str(args.gbps),
                                "--reps", str(reps)] + (["--quick"] if args.quick else [])
    from minidist.host.blas_env import blas_threads
    subprocess.run(cmd, check=True, timeout=1200, env=dict(os.environ, **blas_threads(1)))
    with open(path) as f:
        r = json.load(f)
    m = r["mlp"]
    print(f"tensor-parallel MLP {m['shape']}, 2 ranks, simulated {m['gbps']:g} Gbit/s link, float32, "
          f"median of {reps} interleaved reps (load average {load:.1f} -> {r['load_avg']:.1f})")
    print(f"  {'mode':<14} {'step ms':>8} {'exposed ms':>10} {'vs sync':>8} {'hidden ms':>9} {'ideal ms':>8} "
          f"{'share of ideal':>14}")
    for mode, row in m["modes"].items():
        extra = (f"{row['hidden_s'] * 1e3:>9.1f} {row['ideal_hidden_s'] * 1e3:>8.1f} {row['share_of_ideal']:>14.2f}"
                 if "hidden_s" in row else "")
        print(f"  {mode:<14} {row['step_s'] * 1e3:>8.1f} {row['exposed_comm_s'] * 1e3:>10.1f} "
              f"{row['speedup_vs_sync']:>7.2f}x {extra}")
    print("  (on 2 ranks both directions of the bidirectional ring go to the one neighbour, and the simulated\n"
          "   link gives each direction's thread its own bandwidth: docs/perf-notes.md)")
    gpt = r["gpt"]
    print(f"GPT training step {gpt['shape']}, float32, shared memory: tokens/s relative to 1 rank")
    for name, tps in gpt["tokens_per_s"].items():
        print(f"  {name:<24} {tps:>10,.0f} tok/s {gpt['ratio_vs_1_rank'][name]:>6.2f}x")


if __name__ == "__main__":
    main()
