"""Synchronous vs asynchronous SGD: what stale gradients cost.

    mpiexec -n 4 python examples/06_async_sgd.py [--updates 60] [--quick]

Two ways to use W workers (the seeds' BSP vs ASP):

* **BSP** (bulk synchronous, what minidist's training does): every step, each worker computes
  a gradient at the *same* parameters, the gradients are summed (DDP), every worker applies
  the same update.  Slow workers make everyone wait, but no gradient is ever stale.
* **ASP** (asynchronous, a parameter server as in Dean et al. 2012 "Downpour SGD"): rank 0
  holds the parameters; each worker repeatedly fetches them, computes a gradient on its own
  batch and sends it back; the server applies each gradient the moment it arrives.  Nobody
  waits, but by the time a worker's gradient arrives the server has already applied the
  other workers' gradients: it was computed at parameters W-1 updates old.

Here the server serves the workers in turn (a deterministic stand-in for "whoever is first"),
which gives every gradient exactly W-1 updates of staleness.  A third run applies the same
per-worker batches one at a time with no staleness (plain sequential SGD), so the ASP curve
can be compared with the same number of gradient evaluations and the same batch per update.
All three use the same learning rate; losses are on one fixed held-out batch.  BSP's step
uses W batches, so its curve is printed against the number of batches consumed as well.
"""
import argparse

from minidist.host.blas_env import pin_blas_threads  # noqa: E402  (imports neither NumPy nor MPI)

pin_blas_threads(1)  # one BLAS thread per rank, before NumPy loads: the ranks already share the cores

import numpy as np  # noqa: E402

from minidist import comm  # noqa: E402
from minidist.model.autograd import no_grad  # noqa: E402
from minidist.comm import p2p  # noqa: E402
from minidist.layout.model import ModelConfig  # noqa: E402
from minidist.model.nn import GPT  # noqa: E402
from minidist.model.optim import SGD  # noqa: E402
from minidist.parallel.data import DistributedDataParallel  # noqa: E402


def model_and_opt(args):
    model = GPT(ModelConfig(block_size=args.seq, layers=2, heads=2, d_model=args.width, seed=0))
    return model, SGD(model.parameters(), lr=args.lr, momentum=0.0)


def batch(seed, args):
    data = np.random.default_rng(seed).integers(0, 256, (args.rows, args.seq + 1))
    return data[:, :-1], data[:, 1:]


def corpus_batch(text, seed, args):
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, len(text) - args.seq - 1, args.rows)
    data = np.stack([text[s:s + args.seq + 1] for s in starts])
    return data[:, :-1], data[:, 1:]


def val_loss(model, val):
    with no_grad():
        return model(*val).item()


def flat(model):
    return np.concatenate([p.data.reshape(-1) for p in model.parameters()])


def set_flat(model, vec):
    o = 0
    for p in model.parameters():
        p.data[...] = vec[o:o + p.size].reshape(p.shape)
        o += p.size


def grad_flat(model):
    return np.concatenate([p.grad.reshape(-1) for p in model.parameters()])


def asp(args, text, val, g):
    """Rank 0: the parameter server; ranks 1..W: workers.  Returns the server's loss curve."""
    workers = g.size - 1
    model, opt = model_and_opt(args)
    curve = []
    if g.rank == 0:
        for w in range(1, workers + 1):  # every worker starts from the initial parameters
            p2p.send(flat(model), w, g)
        for t in range(args.updates):
            w = 1 + t % workers
            grad = p2p.recv(flat(model).shape, np.float32, w, g)
            set_grads(model, grad)
            opt.step()
            opt.zero_grad()
            if t + workers < args.updates:  # the worker has another round
                p2p.send(flat(model), w, g)  # the worker's next fetch: the newest parameters
            curve.append(val_loss(model, val))
        return curve
    rounds = len(range(g.rank - 1, args.updates, workers))
    for k in range(rounds):
        set_flat(model, p2p.recv(flat(model).shape, np.float32, 0, g))
        t = (g.rank - 1) + k * workers  # the update this gradient will become
        (model(*corpus_batch(text, 1000 + t, args))).backward()
        p2p.send(grad_flat(model), 0, g)
        model.zero_grad()
    return curve


def set_grads(model, vec):
    o = 0
    for p in model.parameters():
        p.grad = vec[o:o + p.size].reshape(p.shape).copy()
        o += p.size


def sequential(args, text, val):
    """The same batches as ASP, applied one at a time with fresh gradients (no staleness)."""
    model, opt = model_and_opt(args)
    curve = []
    for t in range(args.updates):
        model(*corpus_batch(text, 1000 + t, args)).backward()
        opt.step()
        opt.zero_grad()
        curve.append(val_loss(model, val))
    return curve


def bsp(args, text, val, g):
    """DDP over all ranks: each step consumes one batch per rank at the same parameters."""
    model, opt = model_and_opt(args)
    dp = DistributedDataParallel(model, opt, g)
    curve = []
    for step in range(args.updates // g.size):
        xs, ys = corpus_batch(text, 1000 + step * g.size + g.rank, args)
        with dp.micro_step(True):
            (model(xs, ys) * (1.0 / g.size)).backward()
        dp.step()
        dp.zero_grad()
        curve.append(val_loss(model, val))
    return curve


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--updates", type=int, default=120, help="gradient evaluations in each run")
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--quick", action="store_true", help="a tiny run (for tests)")
    args = ap.parse_args()
    args.width, args.seq, args.rows = (16, 16, 4) if args.quick else (64, 32, 8)
    if args.quick:
        args.updates = 12
    g = comm.world()
    if g.size < 2:
        raise SystemExit("run with mpiexec -n 2 or more: one parameter server and at least one worker")
    # A small repetitive "corpus": learnable in a few dozen steps, so the curves separate.
    text = np.frombuffer((b"the quick brown fox jumps over the lazy dog. " * 200), dtype=np.uint8).astype(np.int64)
    val = corpus_batch(text, 7, args)
    curve_asp = asp(args, text, val, g)
    curve_bsp = bsp(args, text, val, g)
    if g.rank:
        return
    curve_seq = sequential(args, text, val)
    W = g.size - 1
    print(f"held-out loss after k gradient evaluations (batch {args.rows}x{args.seq} each, SGD lr {args.lr}); "
          f"ASP: {W} workers, staleness {W - 1}; BSP: {g.size} ranks, {g.size} evaluations per step")
    print(f"{'k':>5} | {'sequential':>10} | {'ASP stale':>10} | {'BSP (DDP)':>10}")
    every = max(1, args.updates // 10)
    for k in range(every, args.updates + 1, every):
        b = curve_bsp[k // g.size - 1] if k >= g.size else float("nan")
        print(f"{k:>5} | {curve_seq[k - 1]:>10.4f} | {curve_asp[k - 1]:>10.4f} | {b:>10.4f}")
    print(f"final: sequential {curve_seq[-1]:.4f}, ASP {curve_asp[-1]:.4f} "
          f"({curve_asp[-1] - curve_seq[-1]:+.4f} from staleness), BSP {curve_bsp[-1]:.4f} "
          f"after {len(curve_bsp)} synchronous steps")


if __name__ == "__main__":
    main()
