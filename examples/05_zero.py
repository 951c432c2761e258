"""ZeRO stages 0-3: per-rank memory of parameters, gradients and optimizer state, and step time.

    mpiexec -n 4 python examples/05_zero.py [--quick]

Rajbhandari et al. 2020.  DDP (stage 0) keeps everything on every rank; stage 1 shards the
optimizer state, stage 2 also the gradients, stage 3 (FSDP) also the parameters.  The bytes
below are counted from the arrays each rank holds after a step (before the gradients are
dropped), next to the formula for minidist's layout (float32 weights, gradients and AdamW's m
and v: 4 + 4 + 8 bytes per parameter) and the paper's mixed-precision layout (fp16 weights
and gradients, fp32 master weights and Adam state: 2 + 2 + 12 bytes), for the same Ψ and N.
Ψ_r is this rank's share of the sharded units (Ψ/N up to rounding).
"""
import argparse
import time

from minidist.host.blas_env import pin_blas_threads  # noqa: E402  (imports neither NumPy nor MPI)

pin_blas_threads(1)  # one BLAS thread per rank, before NumPy loads: the ranks already share the cores

import numpy as np  # noqa: E402

from minidist import comm  # noqa: E402
from minidist.train.config import RunConfig  # noqa: E402
from minidist.parallel.compose import build  # noqa: E402
from minidist.layout.memory import memory_formula  # noqa: E402

PAPER = {0: lambda P, N: 16 * P, 1: lambda P, N: 4 * P + 12 * P / N,
         2: lambda P, N: 2 * P + 14 * P / N, 3: lambda P, N: 16 * P / N}


def run(stage, args, mesh, batch):
    cfg = RunConfig().replace(model=dict(layers=args.layers, d_model=args.width, heads=4),
                              data=dict(seq_len=args.seq), optim=dict(lr=1e-3),
                              parallel=dict(dp=mesh.size("dp"), zero=stage)).resolved()
    model, strategy = build(cfg, mesh)  # AdamW; DDP, ZeRO-1/2 or FSDP: strategy.data
    psi = sum(int(np.prod(p.global_shape)) for p in model.parameters())  # FSDP has freed the full arrays
    x, y = batch
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        strategy.forward_backward(x, y)  # this rank's rows of the global batch
        strategy.step()
        held = strategy.memory_bytes()
        strategy.zero_grad()
        times.append(time.perf_counter() - t0)
    mine, live = psi, None
    if stage:
        mine = strategy.data.shard_numel
        live = strategy.data.max_live_blocks if stage == 3 else None
    return psi, mine, held, memory_formula(stage, psi, mine, 4, 2), float(np.median(times[1:] or times)), live


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--quick", action="store_true", help="a tiny model (for tests)")
    args = ap.parse_args()
    args.layers, args.width, args.seq, args.rows = (2, 32, 16, 2) if args.quick else (4, 128, 64, 4)
    mesh = comm.Mesh(dp=comm.world().size)
    n = mesh.size("dp")
    data = np.random.default_rng(0).integers(0, 256, (args.rows * n, args.seq + 1))
    batch = (data[:, :-1], data[:, 1:])
    rows = [(stage,) + run(stage, args, mesh, batch) for stage in range(4)]
    if mesh.rank:
        return
    psi = rows[0][1]
    base = rows[0][5]  # DDP step time
    print(f"ZeRO on {n} ranks: GPT {args.layers}x{args.width}, Ψ = {psi:,} parameters; rank 0's bytes after a step")
    print(f"{'stage':<6} | {'params':>10} | {'grads':>10} | {'optimizer':>10} | {'total':>10} | {'formula':>10} | "
          f"{'Ψ-bytes':>13} | {'paper 2+2+12':>12} | step vs DDP")
    names = {0: "0 DDP", 1: "1", 2: "2", 3: "3 FSDP"}
    for stage, psi, mine, held, want, step_s, live in rows:
        total, formula = sum(held.values()), sum(want.values())
        symbolic = {0: "16Ψ", 1: "8Ψ+8Ψ/N", 2: "4Ψ+12Ψ/N", 3: "16Ψ/N"}[stage]
        print(f"{names[stage]:<6} | {held['params']:>10,} | {held['grads']:>10,} | {held['optimizer']:>10,} | "
              f"{total:>10,} | {formula:>10,} | {symbolic:>13} | {PAPER[stage](psi, n):>12,.0f} | {step_s / base:.2f}x")
        assert held == want, (stage, held, want)
    print(f"stage 3 held at most {rows[3][6]} blocks' full parameters at once (the current one and the prefetched next)")


if __name__ == "__main__":
    main()
