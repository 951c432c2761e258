"""Long sequences: blockwise vs plain attention on one rank; ring vs Ulysses (cp=2) vs one rank.

Model: the width of the benchmark model (bench_model.py: d_model 256, 4 layers, 4 heads) at
sequence 2048, batch 1, float32, one BLAS thread per process.  A step is forward, backward
and an AdamW update.  The compared sides alternate rep by rep (same machine load) and the
medians are reported, as ratios first: the machine may be shared.

1. One process, plain vs blockwise attention (``--attention-block``): step time, the traced
   peak memory of a whole step, and that of the attention alone (one attention forward +
   backward on a (1, T, 3C) input); the time ratio also from CPU time (``time.process_time``),
   which time spent descheduled on a busy machine does not inflate.  Target: blockwise attention's peak memory <= 0.25x
   plain's at <= 1.3x the step time.
2. ``mpiexec -n 2``: ring attention (cp=2, zig-zag), Ulysses (cp=2, blockwise on its heads)
   and one rank holding the whole sequence (each of the two ranks runs its own copy at the
   same time, so every side keeps both cores busy): tokens/s of the job, peak memory per
   rank, and the bytes each rank sends per step for attention (ppermute, all-to-all) and for
   the gradients (all-reduce over the cp group).

    python benchmarks/bench_context.py [--seq 2048] [--reps 5] [--block 128] [--quick] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from minidist.host.blas_env import pin_blas_threads  # noqa: E402  (imports neither NumPy nor MPI)

pin_blas_threads(1)  # one BLAS thread per rank, before NumPy loads: the ranks already share the cores

WIDTH = dict(n_layer=4, n_head=4, d_model=256)


def _forward_backward(model, x, y):
    """One process's forward and backward of the whole batch (the training loop's call)."""
    from minidist.parallel.data import OneReplica
    from minidist.parallel.strategy import Strategy

    return Strategy(model, OneReplica(model, None)).forward_backward(x, y)


def _model(seq, attention="plain", block=128):
    from minidist.layout.model import ModelConfig
    from minidist.model.nn import GPT
    from minidist.model.optim import AdamW

    model = GPT(ModelConfig(block_size=seq, layers=WIDTH["n_layer"], heads=WIDTH["n_head"], d_model=WIDTH["d_model"],
                            dtype="float32", attention=attention, attention_block=block))
    return model, AdamW(model.parameters(), lr=1e-4)


def _batch(seq):
    import numpy as np

    tokens = np.random.default_rng(0).integers(0, 256, size=(1, seq + 1))
    return tokens[:, :-1], tokens[:, 1:]


def _peak(fn):
    from minidist.observe.profile import PeakMemory

    memory = PeakMemory()
    with memory.measure():
        fn()
    return memory.last_bytes


def _attention_peak(fn, seq):
    """Traced peak bytes of one attention forward + backward on a (1, seq, 3C) input."""
    import numpy as np

    from minidist.model.autograd import Tensor

    C, H = WIDTH["d_model"], WIDTH["n_head"]
    rng = np.random.default_rng(1)
    qkv = rng.standard_normal((1, seq, 3 * C)).astype(np.float32)
    g = rng.standard_normal((1, seq, C)).astype(np.float32)
    return _peak(lambda: fn(Tensor(qkv, requires_grad=True), H).backward(g))


def one_rank(seq, reps, block) -> dict:
    import numpy as np

    from minidist.model.nn import attention_function

    x, y = _batch(seq)
    sides = {"plain": _model(seq, "plain"), "blockwise": _model(seq, "blockwise", block)}

    def step(model, opt):
        _forward_backward(model, x, y)
        opt.step()
        opt.zero_grad()

    times = {name: [] for name in sides}
    cpu = {name: [] for name in sides}
    for rep in range(reps + 1):  # one warm-up rep
        for name, (model, opt) in sides.items():
            c0, t0 = time.process_time(), time.perf_counter()
            step(model, opt)
            if rep:
                times[name].append(time.perf_counter() - t0)
                cpu[name].append(time.process_time() - c0)
    out = {"seq": seq, "block": block}
    for name, (model, opt) in sides.items():
        out[name] = {"step_s": float(np.median(times[name])), "cpu_s": float(np.median(cpu[name])),
                     "peak_step_bytes": _peak(lambda: step(model, opt)),
                     "peak_attention_bytes": _attention_peak(attention_function(name, block), seq)}
    p, b = out["plain"], out["blockwise"]
    out["time_ratio"] = b["step_s"] / p["step_s"]
    out["cpu_time_ratio"] = b["cpu_s"] / p["cpu_s"]  # robust on a shared machine: descheduled time does not count
    out["step_memory_ratio"] = b["peak_step_bytes"] / p["peak_step_bytes"]
    out["attention_memory_ratio"] = b["peak_attention_bytes"] / p["peak_attention_bytes"]
    return out


def cp_child(seq, reps, block):
    """Runs on every rank of ``mpiexec -n 2``; rank 0 prints one JSON line."""
    import numpy as np

    from minidist import comm
    from minidist.parallel.context import ContextParallel
    from minidist.parallel.data import allreduce_gradients

    world = comm.world()
    x, y = _batch(seq)
    sides = {}
    for impl in ("ring", "ulysses"):
        model, opt = _model(seq)
        cp = ContextParallel(world, impl=impl, attention="blockwise", block=block)
        cp.install(model)
        sides[f"{impl} cp=2"] = (model, opt, cp)
    sides["one rank (plain)"] = (*_model(seq, "plain"), None)
    sides["one rank (blockwise)"] = (*_model(seq, "blockwise", block), None)

    def step(model, opt, cp):
        if cp is None:
            _forward_backward(model, x, y)
        else:
            cp.loss(model, x, y).backward()
            allreduce_gradients(model.parameters(), world)
        opt.step()
        opt.zero_grad()

    times = {name: [] for name in sides}
    for rep in range(reps + 1):
        for name, side in sides.items():
            comm.barrier(world)
            t0 = time.perf_counter()
            step(*side)
            comm.barrier(world)  # the job's step ends when its slowest rank is done
            if rep:
                times[name].append(time.perf_counter() - t0)
    result = {"seq": seq, "block": block, "ranks": world.size}
    for name, side in sides.items():
        comm.reset_stats()
        peak = _peak(lambda: step(*side))
        counters = comm.stats()
        attention_sent = sum(counters.get(op, {}).get("bytes_sent", 0) for op in ("ppermute", "all_to_all"))
        gradient_sent = counters.get("all_reduce", {}).get("bytes_sent", 0)
        peaks = [int(v) for v in comm.all_gather(np.array([peak]), world)]
        step_s = float(np.median(times[name]))
        # the cp sides train one sequence per step on 2 ranks; each single rank trains its own
        tokens = seq * (1 if side[2] is not None else world.size)
        result[name] = {"step_s": step_s, "tokens_per_s": tokens / step_s, "peak_bytes_per_rank": peaks,
                        "attention_bytes_sent": attention_sent, "gradient_bytes_sent": gradient_sent}
    if world.rank == 0:
        print(json.dumps(result), flush=True)


def _mb(b):
    return f"{b / 2**20:,.0f} MiB"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--block", type=int, default=128, help="blockwise attention's block")
    ap.add_argument("--quick", action="store_true", help="seq 256, one rep: seconds, for tests")
    ap.add_argument("--out", default=None, help="directory for context.json")
    ap.add_argument("--cp-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.quick:
        args.seq, args.reps, args.block = 256, 1, 64
    if args.cp_child:
        cp_child(args.seq, args.reps, args.block)
        return
    load = [os.getloadavg()[0]]
    single = one_rank(args.seq, args.reps, args.block)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from minidist.host.launcher import mpiexec_command

    child = subprocess.run(mpiexec_command(2) + [sys.executable, os.path.abspath(__file__), "--cp-child",
                                                 "--seq", str(args.seq), "--reps", str(args.reps),
                                                 "--block", str(args.block)], capture_output=True, text=True)
    if child.returncode:
        sys.stderr.write(child.stdout[-3000:] + child.stderr[-3000:])
        sys.exit(f"bench_context.py: the cp=2 measurement failed with exit status {child.returncode}")
    cp = json.loads(child.stdout.strip().splitlines()[-1])
    load.append(os.getloadavg()[0])

    p, b = single["plain"], single["blockwise"]
    print(f"long sequences: GPT {WIDTH} at seq {args.seq}, batch 1, float32, 1 BLAS thread per process, "
          f"median of {args.reps} interleaved reps, load avg {load[0]:.1f}-{load[1]:.1f}")
    print(f"one rank, blockwise (block {args.block}) / plain: step time {single['time_ratio']:.2f}x "
          f"(CPU time {single['cpu_time_ratio']:.2f}x; target <= 1.3x), peak memory of the attention {single['attention_memory_ratio']:.3f}x "
          f"(target <= 0.25x), of the whole step {single['step_memory_ratio']:.2f}x")
    print(f"{'':>22} {'step':>8} {'CPU':>8} {'step peak':>11} {'attention peak':>15}")
    for name, r in (("plain", p), ("blockwise", b)):
        print(f"{name:>22} {r['step_s']:>7.2f}s {r['cpu_s']:>7.2f}s {_mb(r['peak_step_bytes']):>11} "
              f"{_mb(r['peak_attention_bytes']):>15}")
    print(f"cp=2 on mpiexec -n 2 (ring and Ulysses run blockwise tiles of {args.block}):")
    print(f"{'':>22} {'tokens/s':>9} {'peak per rank':>17} {'sent by attention':>18} {'by gradients':>13}")
    for name, r in cp.items():
        if isinstance(r, dict):
            peaks = "/".join(f"{v / 2**20:.0f}" for v in r["peak_bytes_per_rank"]) + " MiB"
            print(f"{name:>22} {r['tokens_per_s']:>9,.0f} {peaks:>17} {_mb(r['attention_bytes_sent']):>18} "
                  f"{_mb(r['gradient_bytes_sent']):>13}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "context.json"), "w") as f:
            json.dump({"width": WIDTH, "one_rank": single, "cp2": cp, "load_avg": load}, f, indent=2)


if __name__ == "__main__":
    main()
