"""A mixture of experts over 8 ranks: which token went to which expert on which rank, then training.

    mpiexec -n 8 python examples/11_experts.py [--experts 8 --ep 4 --top-k 2] [--steps 12]

GShard (Lepikhin et al. 2020) and Switch Transformer (Fedus et al. 2021) replace a block's
feed-forward by E experts and a router: each token goes to its k most probable experts, and
the experts live on different devices (expert parallelism).  Here every rank is a
data-parallel rank with its own rows of the batch, and the ``--ep`` ranks of an ep group
split the experts of every mixture: the r-th rank of a group holds experts ``r·E/ep .. (r+1)·E/ep - 1``
(with 8 ranks and ep 4, ranks 0-3 and 4-7 are two ep groups, and ranks 0 and 4 hold the same
experts: their gradients are summed over that "edp" group, as data parallelism sums).  In
each mixture's forward a rank sends every kept (token, choice) to the rank holding that
expert (dispatch, an ``all_to_all_v``) and gets the experts' outputs back (combine).

Rank 0 prints, for the first batch and the untrained model's first mixture:

* a table of the first tokens of every rank's first sequence, each with the experts it
  chose and the rank holding them (``*`` marks a choice dropped over the expert's capacity);
* the dispatch matrix: how many rows each rank sent to each rank of its ep group.

Then every rank trains the model a few steps as ``python -m minidist.train`` does, whose
progress lines show the loss falling and the routers' statistics (max/mean tokens per expert,
the share dropped, the load-balancing loss).  Flags this script does not know are passed on to
minidist.train (e.g. ``--aux-loss-coef 0.1`` for a stronger pull towards balance).
"""
import argparse
import sys

from minidist.host.blas_env import pin_blas_threads

pin_blas_threads(1)  # one BLAS thread per rank, before NumPy loads: 8 ranks already share the cores

from minidist.train.flags import world_rank, world_size  # noqa: E402  (reads the launcher's environment, no MPI)

SHOWN = 6  # tokens of each rank's first sequence in the routing table


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--ep", type=int, default=4, help="ranks that split the experts (default: 4: two ep groups)")
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--capacity-factor", type=float, default=1.25)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--d-model", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=16)
    ap.add_argument("--batch-size", type=int, default=16, help="the global batch (rows split over the ranks)")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--lr", type=float, default=3e-3)
    args, rest = ap.parse_known_args(argv)
    return args, rest


def train_argv(args, rest) -> list:
    """The training command: every rank data-parallel, the experts split over --ep of them."""
    argv = ["--dp", world_size(), "--ep", args.ep, "--zero", 1, "--experts", args.experts, "--top-k", args.top_k,
            "--capacity-factor", args.capacity_factor, "--layers", args.layers, "--d-model", args.d_model,
            "--heads", 2, "--seq-len", args.seq_len, "--batch-size", args.batch_size, "--steps", args.steps,
            "--lr", args.lr, "--warmup", 0, "--dtype", "float64", "--eval-every", 0, "--log-every", 1]
    return [str(a) for a in argv] + rest


def first_routing(cfg):
    """Every rank routes its rows of the first batch through the untrained model; rank 0 gets
    each rank's first tokens with their choices, and each rank's rows sent to each ep rank."""
    import numpy as np

    from minidist import comm
    from minidist.model.autograd import no_grad
    from minidist.model.moe import MoE
    from minidist.parallel.compose import build, build_mesh
    from minidist.train.loop import load_data

    model, strategy = build(cfg, build_mesh(cfg.parallel))
    sampler, _ = load_data(cfg)
    x, y = sampler.batch(0)
    mixture = next(b.mlp for b in model.h if isinstance(b.mlp, MoE))
    seen = {}
    mixture.observe = lambda logits, probs, choice, keep, f, T: seen.setdefault("route", (choice, keep))
    xs, ys, _, _ = next(strategy.micro_batches(x, y, 1))  # this rank's rows
    with no_grad():
        model(xs, ys)  # collective: each mixture dispatches over the ep group
    choice, keep = seen["route"]
    E, k, ep = cfg.model.experts, choice.shape[1], cfg.parallel.ep
    sent = np.bincount(choice[keep] // (E // ep), minlength=ep)  # kept rows to each ep rank (experts by rank)
    row = np.concatenate([np.asarray(xs)[0, :SHOWN], choice[:SHOWN].ravel(), keep[:SHOWN].ravel(), sent])
    rows = comm.gather(row[None].astype(np.float64), comm.world(), root=0)
    return None if rows is None else (rows.astype(np.int64), k, E, ep)


def show_routing(rows, k, E, ep) -> None:
    per = E // ep
    print(f"\nthe untrained first mixture: the first {SHOWN} tokens of each rank's first sequence, each with its "
          f"{k} experts as expert@rank (the rank of its ep group holding it; * dropped over capacity)")
    print("rank | " + " | ".join(f"token {i:<{5 * k + 2}}" for i in range(SHOWN)))
    for r, row in enumerate(rows):
        tokens = row[:SHOWN]
        choice = row[SHOWN:SHOWN + SHOWN * k].reshape(SHOWN, k)
        keep = row[SHOWN + SHOWN * k:SHOWN + 2 * SHOWN * k].reshape(SHOWN, k)
        cells, base = [], r // ep * ep  # the first rank of r's ep group
        for t in range(SHOWN):
            ch = chr(tokens[t]) if 32 <= tokens[t] < 127 else "?"
            picks = " ".join(f"{e}@{base + e // per}{'' if kept else '*'}" for e, kept in zip(choice[t], keep[t]))
            cells.append(f"{ch!r:<5} {picks:<{5 * k + 1}}")
        print(f"{r:>4} | " + " | ".join(cells))
    sent = rows[:, SHOWN + 2 * SHOWN * k:]
    n = len(rows)
    print("\nrows each rank dispatched to each rank (all its tokens, first mixture, first batch; "
          "only within its ep group)")
    print("from \\ to " + "".join(f"{j:>6}" for j in range(n)) + "   off-rank")
    for r, counts in enumerate(sent):
        full = [0] * n
        full[r // ep * ep:r // ep * ep + ep] = counts
        off = counts.sum() - counts[r % ep]
        print(f"{r:>9} " + "".join(f"{c:>6}" for c in full) + f"   {off:>8}")
    print("(a row is one (token, choice): the token's d_model activations; the off-rank ones travel)", flush=True)


def main(argv=None) -> int:
    args, rest = parse(argv)
    from minidist.train import loop as train

    parser = train.build_parser()
    cfg = train.validate(parser.parse_args(train_argv(args, rest)), parser)  # bad sizes: one line, exit 2
    if world_rank() == 0:
        print(f"{world_size()} ranks, {args.experts} experts per mixture split over ep groups of {args.ep}: "
              f"python -m minidist.train {' '.join(train_argv(args, rest))}", flush=True)
    routing = first_routing(cfg)
    if routing is not None:
        show_routing(*routing)
        print("\ntraining:", flush=True)
    metrics = train.train(cfg, log=lambda line: print(line, flush=True))
    if world_rank() == 0:
        first, last = metrics[0], metrics[-1]
        print(f"\nloss {first['loss']:.4f} -> {last['loss']:.4f} over {len(metrics)} steps "
              f"({'fell' if last['loss'] < first['loss'] else 'did not fall'}); last step: tokens per expert "
              f"min {last['router']['min']} / mean {last['router']['mean']:.1f} / max {last['router']['max']}, "
              f"dropped {100 * last['router']['dropped']:.1f}%", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
