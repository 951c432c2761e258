"""DDP with and without overlap: compute time, exposed communication, bytes per rank.

    mpiexec -n 4 python examples/04_data_parallel.py [--gbps 1] [--steps 4] [--quick]

Each rank trains the same GPT on its shard of the global batch; after backward the gradients
(Ψ numbers) are summed over the ranks (minidist.parallel.data.DistributedDataParallel).
A bandwidth-optimal all-reduce sends 2(N-1)/N·Ψ numbers per rank, whatever the bucket size.

Three runs, same model and batch:

* ``no overlap``: every bucket's all-reduce starts after the backward pass; the step pays
  compute + communication;
* ``overlap``: each bucket's all-reduce starts from the gradient hooks as soon as its last
  gradient is final, while backward goes on with the earlier layers; only the tail of the
  communication stays exposed (what the step waits for after backward);
* ``one bucket``: the same overlap machinery with every gradient in one bucket, which can only
  start when the whole backward is done: nothing to overlap.

``--gbps`` simulates a link of that speed (comm.set_link_model; a sleeping wait that frees the
core, as a NIC would).  On shared memory with one core per rank there is little idle CPU to
hide communication in; on the simulated link the hidden share is visible.
"""
import argparse
import time

from minidist.host.blas_env import pin_blas_threads  # noqa: E402  (imports neither NumPy nor MPI)

pin_blas_threads(1)  # one BLAS thread per rank, before NumPy loads: the ranks already share the cores

import numpy as np  # noqa: E402

from minidist import comm  # noqa: E402
from minidist.comm.stats import reset_stats, stats  # noqa: E402
from minidist.layout.model import ModelConfig  # noqa: E402
from minidist.model.nn import GPT  # noqa: E402
from minidist.model.optim import AdamW  # noqa: E402
from minidist.parallel.data import DistributedDataParallel  # noqa: E402
from minidist.parallel.strategy import Strategy  # noqa: E402


def run(mode, args, mesh, batch):
    model = GPT(ModelConfig(block_size=args.seq, layers=args.layers, heads=4, d_model=args.width))
    opt = AdamW(model.parameters(), lr=1e-3)
    bucket_mb = 1e6 if mode == "one bucket" else args.bucket_mb
    # The textbook ring all-reduce: 2(N-1)/N·X bytes per rank for any bucket (the automatic
    # choice would take recursive doubling for small buckets, log2(N)·X bytes but fewer rounds).
    dp = DistributedDataParallel(model, opt, mesh.group("dp"), bucket_mb=bucket_mb, overlap=mode != "no overlap",
                                 algorithm="ring")
    strategy = Strategy(model, dp, mesh)  # for this rank's rows of the global batch
    x, y = batch
    rows = []
    for step in range(args.steps):
        reset_stats()
        t0 = time.perf_counter()
        for xs, ys, share, last in strategy.micro_batches(x, y, 1):
            with dp.micro_step(last):
                (model(xs, ys) * share).backward()
                t_backward = time.perf_counter()
        t_comm_end = time.perf_counter()
        dp.step()
        dp.zero_grad()
        sent = stats()["all_reduce"]["bytes_sent"]
        rows.append((t_backward - t0, dp.comm_wait_s, t_comm_end - t0, sent))
    psi = sum(p.size for p in dp.params)
    compute, exposed, step, sent = np.median(np.array(rows[1:] or rows), axis=0)  # the first step warms up
    return dict(mode=mode, compute=compute, exposed=exposed, step=step, sent=sent, psi=psi,
                buckets=len(dp.buckets), first=dp.reducer.launch_times[0] - dp.reducer.backward_end)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gbps", type=float, default=None, help="simulated link speed (default: shared memory)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--bucket-mb", type=float, default=0.25)
    ap.add_argument("--quick", action="store_true", help="a tiny model (for tests)")
    args = ap.parse_args()
    args.layers, args.width, args.seq, args.rows = (2, 32, 16, 2) if args.quick else (4, 128, 64, 4)
    g = comm.world()
    mesh = comm.Mesh(dp=g.size)
    if args.gbps:
        comm.set_link_model(gbps=args.gbps)
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, (args.rows * g.size, args.seq + 1))
    batch = (data[:, :-1], data[:, 1:])
    results = [run(mode, args, mesh, batch) for mode in ("no overlap", "overlap", "one bucket")]
    if g.rank:
        return
    link = f"simulated {args.gbps} Gbit/s link" if args.gbps else "shared memory"
    r0 = results[0]
    formula = 2 * (g.size - 1) / g.size * r0["psi"] * 4
    print(f"DDP on {g.size} ranks, {link}: GPT {args.layers}x{args.width}, Ψ = {r0['psi']:,} float32 gradients, "
          f"{args.rows} sequences of {args.seq} per rank")
    print(f"bytes per rank per step (ring all-reduce): measured {r0['sent']:,.0f}, 2(N-1)/N·Ψ·4 = {formula:,.0f} "
          f"(equal when N divides each bucket; otherwise ranks differ by a few elements)")
    print(f"{'mode':<11} | {'buckets':>7} | {'fwd+bwd s':>9} | {'exposed comm s':>14} | {'step s':>7} | "
          f"first launch vs backward end")
    for r in results:
        print(f"{r['mode']:<11} | {r['buckets']:>7} | {r['compute']:>9.4f} | {r['exposed']:>14.4f} | "
              f"{r['step']:>7.4f} | {1e3 * r['first']:+.1f} ms")
    saved = results[0]["step"] - results[1]["step"]
    print(f"overlap saved {1e3 * saved:.1f} ms of the {1e3 * results[0]['exposed']:.1f} ms of communication "
          f"exposed without it ({100 * saved / max(results[0]['exposed'], 1e-12):.0f}% hidden)")


if __name__ == "__main__":
    main()
