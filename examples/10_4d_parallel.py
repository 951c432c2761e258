"""4D parallelism: data, pipeline, context and tensor parallelism at once, and who holds what.

    mpiexec -n 16 python examples/10_4d_parallel.py [--dp 2 --pp 2 --cp 2 --tp 2] [--png 4d_grid.png]
    mpiexec -n 16 python examples/10_4d_parallel.py --arch llama --kv-heads 1   # Llama: who holds which K/V head
    python examples/10_4d_parallel.py --grid-only --dp 8 --pp 4       # just the grid, no mpiexec

Llama 3 trained its 405B model on TP8 · CP16 · PP16 · DP8 = 16,384 GPUs (Llama Team 2024,
*The Llama 3 Herd of Models*): Megatron-LM's 3D parallelism (Narayanan et al. 2021, *Efficient
Large-Scale Language Model Training on GPU Clusters Using Megatron-LM*) plus context
parallelism for long sequences.  Every rank holds the intersection of four cuts:

* ``tp`` (Megatron-LM tensor parallelism): H/tp of the attention heads and the matching
  slices of the weights; innermost, so a tp group is consecutive ranks (one node, NVLink),
  because it all-reduces activations in every layer.  With Llama's grouped-query attention
  (``--arch llama --kv-heads K``) a rank holds K/tp key/value heads, or where tp > K the one
  head its query heads read, shared with tp/K ranks (the grid's ``kv`` column);
* ``cp`` (ring attention with the zig-zag layout, or DeepSpeed-Ulysses): a part of every
  sequence, with K/V blocks (or all-to-alls) exchanged in every attention;
* ``pp`` (pipeline): a stage's consecutive blocks, activations passed between neighbours;
* ``dp`` (data parallelism): its rows of the global batch; outermost, since it talks only
  once per step (the gradients) and can cross the slowest links.

The ranks are numbered ``((dp * PP + pp) * CP + cp) * TP + tp``, as in minidist.comm.mesh.

Rank 0 prints the grid (minidist.layout.grid.describe: each rank's coordinates, layers,
heads, tokens and batch rows, then the groups of every axis) and, when matplotlib is
installed, draws it into --png.  Then every rank trains a tiny GPT for a few steps with the
composed mesh as the training command does (minidist.train.loop), and rank 0 prints a table of
the bytes every rank sent on each axis in the last step next to the closed-form formula
(minidist.layout.traffic).  Flags this script does not know are passed on to minidist.train (e.g.
``--schedule gpipe``).  Without mpiexec (one process) only the grid is shown.
"""
import argparse
import math
import sys

from minidist.host.blas_env import pin_blas_threads

pin_blas_threads(1)  # one BLAS thread per rank, before NumPy loads: 16 ranks already share the cores

from minidist.train.flags import world_rank, world_size  # noqa: E402  (reads the launcher's environment, no MPI)
from minidist.layout import grid  # noqa: E402


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for axis in ("dp", "pp", "cp", "tp"):
        ap.add_argument(f"--{axis}", type=int, default=2, help=f"{axis} size (default: 2)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--arch", choices=["gpt2", "llama"], default="gpt2")
    ap.add_argument("--kv-heads", type=int, default=None, help="Llama: key/value heads (default: --heads)")
    ap.add_argument("--d-model", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=16)
    ap.add_argument("--batch-size", type=int, default=8, help="the global batch")
    ap.add_argument("--grad-accum", type=int, default=1)
    ap.add_argument("--virtual-stages", type=int, default=1,
                    help="model chunks per pipeline rank (> 1 uses the interleaved schedule)")
    ap.add_argument("--cp-impl", choices=["ring", "ulysses"], default="ring")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--png", default="4d_grid.png", help="where to draw the grid (default: 4d_grid.png)")
    ap.add_argument("--no-png", action="store_true", help="do not draw the grid")
    ap.add_argument("--grid-only", action="store_true", help="print (and draw) the grid, do not train")
    args, rest = ap.parse_known_args(argv)
    return ap, args, rest


def grid_args(args) -> dict:
    """The arguments of grid.placement / describe / draw for these flags."""
    return dict(dp=args.dp, pp=args.pp, tp=args.tp, cp=args.cp, n_layer=args.layers, n_head=args.heads,
                seq_len=args.seq_len, batch_size=args.batch_size, grad_accum=args.grad_accum,
                virtual_stages=args.virtual_stages, cp_impl=args.cp_impl, kv_heads=args.kv_heads)


def show_grid(args) -> None:
    """Rank 0: the table, and the PNG when matplotlib is there."""
    print(grid.describe(**grid_args(args)), flush=True)
    if args.no_png:
        return
    try:
        grid.draw(**grid_args(args), path=args.png)
    except ImportError:
        print(f"(not drawing {args.png}: matplotlib is not installed; pip install 'minidist[plot]')", flush=True)
        return
    print(f"wrote {args.png}", flush=True)


def train_argv(args, rest) -> list:
    """The training command for the same grid: a tiny model, exact float64, a few steps."""
    argv = ["--dp", args.dp, "--pp", args.pp, "--tp", args.tp, "--cp", args.cp, "--layers", args.layers,
            "--d-model", args.d_model, "--heads", args.heads, "--seq-len", args.seq_len,
            "--batch-size", args.batch_size, "--grad-accum", args.grad_accum, "--steps", args.steps,
            "--dtype", "float64", "--eval-every", 0, "--log-every", 1, "--warmup", 0]
    if args.cp > 1:
        argv += ["--cp-impl", args.cp_impl]
    if args.arch != "gpt2":
        argv += ["--arch", args.arch] + (["--kv-heads", args.kv_heads] if args.kv_heads else [])
    if args.virtual_stages > 1:  # only the looped schedules have several chunks per rank
        argv += ["--virtual-stages", args.virtual_stages] + ([] if "--schedule" in rest else ["--schedule", "interleaved"])
    return [str(a) for a in argv] + rest


def main(argv=None) -> int:
    ap, args, rest = parse(argv)
    try:
        grid.placement(**grid_args(args))  # every rank checks, so every rank stops on bad sizes
    except ValueError as exc:
        ap.error(str(exc))
    if world_rank() == 0:
        show_grid(args)  # before any training: the picture comes first even if training refuses
    need = math.prod((args.dp, args.pp, args.cp, args.tp))
    if args.grid_only or (world_size() == 1 and need > 1):
        if not args.grid_only:
            print(f"\nto train on this grid: mpiexec -n {need} python {' '.join(sys.argv)}", flush=True)
        return 0
    from minidist.train import loop as train

    if world_rank() == 0:
        print(f"\ntraining on the {need}-rank grid: python -m minidist.train {' '.join(train_argv(args, rest))}",
              flush=True)
    parser = train.build_parser()
    cfg = train.validate(parser.parse_args(train_argv(args, rest)), parser)
    metrics = train.train(cfg, log=lambda line: print(line, flush=True))
    show_axis_bytes(cfg, metrics[-1]["bytes_sent"])
    return 0


def show_axis_bytes(cfg, sent: dict) -> None:
    """Every rank's bytes sent in the last step on each axis's group, next to the closed-form
    formula for that rank (minidist.layout.traffic): dp the gradient reduction (ring or
    doubling all-reduce, 2(N-1)/N of the stage's gradients for a ring), pp the activations
    and gradients at each microbatch boundary, tp Megatron's two all-reduces per block and
    direction, cp the K/V blocks of every ring step; "world" the step's agreed scalars."""
    import numpy as np

    from minidist import comm
    from minidist.layout.traffic import expected_step_bytes, group_names

    world = comm.world()
    p = cfg.parallel
    names = {axis: name for axis, name in group_names(p.dp, p.pp, p.tp, p.cp).items() if name != "self"}
    columns = list(dict.fromkeys(names.values()))  # dp=1 with cp: the reduction group is cp's
    try:
        want = expected_step_bytes(cfg, rank=world.rank)
    except ValueError as exc:  # no formula (collective matmuls, HSDP): measured only
        want, why = {}, str(exc)
    if cfg.model.arch == "llama" and p.tp > 1:  # the shared K/V heads' gradient sums: one column
        columns.append("tp-kv")
        sent, want = kv_groups_joined(sent), want and kv_groups_joined(want)
    row = [sent.get(g, 0) for g in columns] + [want.get(g, -1) for g in columns]
    rows = comm.gather(np.asarray([row], dtype=np.float64), world, root=0)
    if rows is None:
        return
    n = len(columns)
    print("\nbytes each rank sent in the last step, per axis: measured (formula)")
    print("rank  " + "".join(f"{g:>24}" for g in columns))
    for r, values in enumerate(rows):
        cells = [f"{int(m):,} ({int(f):,})" if f >= 0 else f"{int(m):,}" for m, f in zip(values[:n], values[n:])]
        print(f"{r:>4}  " + "".join(f"{c:>24}" for c in cells))
    if not want:
        print(f"measured only: {why}", flush=True)
        return
    exact = all(values[i] == values[n + i] for values in rows for i in range(n) if values[n + i] >= 0)
    print("every rank's bytes equal the formulas" if exact else "some ranks differ from the formulas", flush=True)


def kv_groups_joined(by_group: dict) -> dict:
    """``by_group`` with the tp-kv<i> groups (the ranks sharing key/value head i) summed as
    "tp-kv": each rank is in one of them at most."""
    out = {g: b for g, b in by_group.items() if not g.startswith("tp-kv")}
    out["tp-kv"] = sum(b for g, b in by_group.items() if g.startswith("tp-kv"))
    return out


if __name__ == "__main__":
    sys.exit(main())
