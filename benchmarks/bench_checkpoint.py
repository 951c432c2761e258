"""Checkpoints at dp2·tp2 (4 ranks): sharded against gathered, and what --save-async hides.

    python benchmarks/bench_checkpoint.py [--out DIR] [--quick] [--reps 3]

For the benchmark GPT (bench_model.SHAPE, AdamW, float32) on a dp2·tp2 mesh with ZeRO-1 (each rank
owns its optimizer-state shard), all in one run:

* **sharded save** (minidist/state/checkpoint.py): every rank writes what it owns; time of the
  collective save and bytes written per rank;
* **gathered save**: the same arrays gathered to rank 0 (minidist's gather) and written there
  as one file -- what a checkpoint without sharding does;
* **load**: each rank reads the pieces it needs, against every rank reading the whole file;
* **--save-async**: training steps with a checkpoint after each, synchronous and asynchronous,
  interleaved; the share of the save time hidden is 1 - (time the asynchronous save held the
  loop) / (time of the synchronous save).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))


def worker(out_path: str, quick: bool, reps: int) -> None:
    import numpy as np

    from minidist.state import checkpoint
    from minidist import comm
    from minidist.train.config import RunConfig
    from minidist.state.data import Sampler
    from minidist.parallel.compose import build, build_mesh
    from minidist.train.loop import update

    sys.path.insert(0, HERE)
    from bench_model import SHAPE

    shape = dict(n_layer=2, d_model=64, n_head=4, seq_len=32, batch=8) if quick else SHAPE
    cfg = RunConfig().replace(
        model=dict(layers=shape["n_layer"], d_model=shape["d_model"], heads=shape["n_head"]),
        data=dict(seq_len=shape["seq_len"], batch_size=shape["batch"]),
        optim=dict(steps=1000, warmup=1), parallel=dict(dp=2, tp=2, zero=1)).resolved(4)
    model, strategy = build(cfg, build_mesh(cfg.parallel))
    world = comm.world()
    corpus = np.random.default_rng(0).integers(0, 256, 100_000).astype(np.uint8)
    sampler = Sampler(corpus, cfg.data.seq_len, cfg.data.batch_size, 0)

    def step(k):
        x, y = sampler.batch(k)
        strategy.forward_backward(x, y)
        update(strategy, None, 1.0)

    step(0)  # the optimizer state exists from here on
    root = tempfile.mkdtemp(prefix="minidist-bench-ckpt-") if world.rank == 0 else None
    root = _share_path(root, world)
    rows = {"sharded_save_s": [], "gathered_save_s": [], "sharded_load_s": [], "whole_load_s": [],
            "train_step_s": [], "sync_save_s": [], "async_blocking_s": []}
    mcfg = cfg.model
    for rep in range(reps):
        t0 = time.perf_counter()
        path = checkpoint.save(root, 1 + rep, strategy, mcfg)
        rows["sharded_save_s"].append(_max_over(time.perf_counter() - t0, world))
        written = os.path.getsize(os.path.join(path, f"rank-{world.rank:05d}.bin"))
        t0 = time.perf_counter()
        whole = _gathered_save(strategy, world, os.path.join(root, f"whole-{rep}.bin"))
        rows["gathered_save_s"].append(_max_over(time.perf_counter() - t0, world))
        t0 = time.perf_counter()
        checkpoint.load(path, strategy)
        rows["sharded_load_s"].append(_max_over(time.perf_counter() - t0, world))
        t0 = time.perf_counter()
        with open(os.path.join(root, f"whole-{rep}.bin"), "rb") as f:
            f.read()
        rows["whole_load_s"].append(_max_over(time.perf_counter() - t0, world))
    # training steps with a checkpoint after each: synchronous, then asynchronous, rep by rep
    saver = checkpoint.AsyncSaver()
    for rep in range(reps):
        t0 = time.perf_counter()
        step(100 + rep)
        rows["train_step_s"].append(_max_over(time.perf_counter() - t0, world))
        t0 = time.perf_counter()
        checkpoint.save(root, 200 + rep, strategy, mcfg)
        rows["sync_save_s"].append(_max_over(time.perf_counter() - t0, world))
        step(300 + rep)
        before = saver.blocking_s
        saver.save(root, 400 + rep, strategy, mcfg)  # written while the next step trains
        step(500 + rep)
        saver.wait(final=False)  # as the next save does: rank 0 renames it in the background
        rows["async_blocking_s"].append(_max_over(saver.blocking_s - before, world))
    saver.wait()
    written_all = comm.gather(np.asarray([written], dtype=np.int64), world, root=0)
    if world.rank == 0:
        med = {k: statistics.median(v) for k, v in rows.items()}
        result = {"shape": shape, "mesh": "dp2·tp2", "bytes_written_per_rank": [int(b) for b in written_all],
                  "whole_bytes": whole, **med,
                  "hidden_share": 1 - med["async_blocking_s"] / med["sync_save_s"], "samples": rows}
        with open(out_path, "w") as f:
            json.dump(result, f)
        shutil.rmtree(root, ignore_errors=True)


def _share_path(path, world):
    """Rank 0's temporary directory, told to every rank (a broadcast of its bytes)."""
    import numpy as np

    from minidist import comm

    data = np.zeros(256, dtype=np.uint8)
    if world.rank == 0:
        raw = path.encode()
        data[:len(raw)] = np.frombuffer(raw, dtype=np.uint8)
    data = comm.broadcast(data, world, root=0)
    return bytes(data).rstrip(b"\0").decode()


def _max_over(seconds, world) -> float:
    """The slowest rank's time: a collective operation ends when its last rank does."""
    import numpy as np

    from minidist import comm

    return float(comm.all_reduce(np.asarray([seconds]), world, op="max")[0])


def _gathered_save(strategy, world, path) -> int:
    """Everything each rank owns, gathered to rank 0 and written there as one file; its bytes."""
    import numpy as np

    from minidist import comm

    mine = np.concatenate([np.ascontiguousarray(a).reshape(-1).view(np.uint8)
                           for _, _, _, a in strategy.owned_state()] or [np.zeros(0, np.uint8)])
    size = int(comm.all_reduce(np.asarray([mine.size], dtype=np.int64), world, op="max")[0])
    padded = np.zeros(size, dtype=np.uint8)
    padded[:mine.size] = mine
    gathered = comm.gather(padded, world, root=0)  # equal blocks: minidist's gather takes them
    sizes = comm.gather(np.asarray([mine.size], dtype=np.int64), world, root=0)
    if world.rank == 0:
        with open(path, "wb") as f:
            for r, n in enumerate(sizes):
                f.write(gathered[r * size:r * size + int(n)].tobytes())
            f.flush()
            os.fsync(f.fileno())
        return int(sum(sizes))
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a tiny model, one rep")
    ap.add_argument("--out", default=None, help="directory for checkpoint.json")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    reps = 1 if args.quick else args.reps
    if args.worker:
        worker(args.worker, args.quick, reps)
        return
    from minidist.host.blas_env import blas_threads
    from minidist.host.launcher import mpiexec_command

    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    cmd = mpiexec_command(4) + [sys.executable, os.path.abspath(__file__), "--worker", path] + (
        ["--quick"] if args.quick else []) + ["--reps", str(reps)]
    subprocess.run(cmd, check=True, timeout=1200, env=dict(os.environ, **blas_threads(1)))
    with open(path) as f:
        r = json.load(f)
    os.unlink(path)
    mb = 2**20
    print(f"checkpoints of the {r['shape']} GPT at dp2·tp2 ZeRO-1 (4 ranks, float32, AdamW), median of {reps} rep(s)")
    print(f"bytes written per rank (sharded): {', '.join(f'{b / mb:.2f} MiB' for b in r['bytes_written_per_rank'])}; "
          f"gathered to rank 0: {r['whole_bytes'] / mb:.2f} MiB")
    print(f"save: sharded {r['sharded_save_s']:.3f}s, gathered {r['gathered_save_s']:.3f}s "
          f"(sharded / gathered {r['sharded_save_s'] / r['gathered_save_s']:.2f})")
    print(f"load: sharded {r['sharded_load_s']:.3f}s, every rank reading the whole file {r['whole_load_s']:.3f}s")
    print(f"--save-async: synchronous save {r['sync_save_s']:.3f}s, asynchronous held the loop "
          f"{r['async_blocking_s']:.3f}s: {100 * r['hidden_share']:.0f}% hidden (a step takes {r['train_step_s']:.3f}s)")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "checkpoint.json"), "w") as f:
            json.dump(r, f, indent=2)


if __name__ == "__main__":
    main()
