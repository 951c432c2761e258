"""Context parallelism: one long sequence split over the ranks, ring attention vs Ulysses.

    mpiexec -n 4 python examples/08_context_parallel.py [--seq 1024] [--quick]

Each of the N ranks holds T/N tokens of the sequence.  Everything but attention works token by
token; attention needs every earlier key, and gets it one of two ways
(minidist/parallel/context/):

* ring attention: the key/value blocks travel around the ring of ranks (ppermute), folded into
  an online softmax as they arrive; no rank ever holds the whole sequence;
* Ulysses: an all-to-all hands every rank the whole sequence for H/N of the heads, attention
  runs as usual, a second all-to-all brings the output back to the sequence split.

The script trains one step of a small GPT on one sequence of --seq bytes with ring attention
(zig-zag and contiguous layouts), Ulysses, and on rank 0 alone, and prints per rank: the
step time, the peak memory traced during the step, the bytes sent, and (for ring attention)
the attention scores computed, to show why the zig-zag layout (rank r holds chunks r and
2N-1-r of 2N) balances causal attention while contiguous slices leave the last rank with
N times the first one's work.  All runs give the same loss.
"""
import argparse
import time

from minidist.host.blas_env import pin_blas_threads  # noqa: E402  (imports neither NumPy nor MPI)

pin_blas_threads(1)  # one BLAS thread per rank, before NumPy loads: the ranks already share the cores

import numpy as np  # noqa: E402

from minidist import comm  # noqa: E402
from minidist.train.config import RunConfig  # noqa: E402
from minidist.layout.model import ModelConfig  # noqa: E402
from minidist.model.nn import GPT  # noqa: E402
from minidist.parallel.context import ContextParallel  # noqa: E402
from minidist.parallel.context import problems as context_problems  # noqa: E402
from minidist.parallel.data import allreduce_gradients  # noqa: E402
from minidist.observe.profile import PeakMemory  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--seq", type=int, default=1024, help="sequence length (divisible by 2 x ranks)")
parser.add_argument("--d-model", type=int, default=64)
parser.add_argument("--heads", type=int, default=4, help="attention heads (divisible by the ranks, for Ulysses)")
parser.add_argument("--layers", type=int, default=2)
parser.add_argument("--block", type=int, default=64, help="tile of the online softmax")
parser.add_argument("--quick", action="store_true", help="a short sequence, for tests")
args = parser.parse_args()
if args.quick:
    args.seq, args.block = 64, 8

world = comm.world()
rank, n = world.rank, world.size
for impl in ("ring", "ulysses"):  # the training command's checks of --cp: one line naming the flag
    given = RunConfig().replace(model=dict(heads=args.heads, d_model=args.d_model, layers=args.layers),
                                data=dict(seq_len=args.seq), parallel=dict(cp=n, cp_impl=impl))
    problems = context_problems(given, given.resolved(n))
    if problems:  # every rank stops; rank 0 says why (--cp here is the number of ranks)
        parser.exit(2, f"{parser.prog}: error: {n} ranks, {impl}: {problems[0]}\n" if rank == 0 else None)

cfg = ModelConfig(block_size=args.seq, layers=args.layers, heads=args.heads, d_model=args.d_model, seed=0)
tokens = np.random.default_rng(0).integers(0, 256, size=(1, args.seq + 1))
x, y = tokens[:, :-1], tokens[:, 1:]


def step(model, cp):
    """Forward + backward (+ the gradients summed over the ranks); returns the loss."""
    if cp is not None:
        local = cp.loss(model, x, y)
        local.backward()
        allreduce_gradients(model.parameters(), world)
        return float(comm.all_reduce(np.array([local.item()]), world)[0])
    if rank == 0:  # one rank holds the whole sequence; the others wait
        loss = model(x, y)
        loss.backward()
        return loss.item()
    return None


def run(impl=None, zigzag=True):
    """A warm-up step, then one measured step: per-rank time, traced peak memory, bytes sent
    for attention (ppermute, all-to-all) and for the gradients (all-reduce), attention scores."""
    model = GPT(cfg)
    cp = None
    if impl is not None:
        cp = ContextParallel(world, impl, attention="blockwise", block=args.block, zigzag=zigzag)
        cp.install(model)
    step(model, cp)
    model.zero_grad()
    if cp is not None:
        cp.work.clear()
    memory = PeakMemory()
    comm.barrier(world)
    comm.reset_stats()
    t0 = time.perf_counter()
    with memory.measure():
        loss = step(model, cp)
    seconds = time.perf_counter() - t0
    counters = comm.stats()
    attention = sum(counters.get(op, {}).get("bytes_sent", 0) for op in ("ppermute", "all_to_all"))
    gradients = counters.get("all_reduce", {}).get("bytes_sent", 0)
    row = [seconds, memory.last_bytes, attention, gradients, cp.work.get("scores", 0) if cp else 0]
    rows = comm.all_gather(np.array([row], dtype=np.float64), world)  # (ranks, 5) on every rank
    return loss, rows


runs = {
    "ring, zig-zag": run("ring", zigzag=True),
    "ring, contiguous": run("ring", zigzag=False),
    "ulysses": run("ulysses"),
    "one rank (plain attention)": run(None),
}

if rank == 0:
    print(f"GPT {args.layers}x{args.d_model}, {args.heads} heads, one sequence of {args.seq} tokens "
          f"over {n} ranks (blockwise tiles of {args.block})")
    for name, (loss, rows) in runs.items():
        print(f"\n{name}: loss {loss:.10f}")
        print(f"{'rank':>4} | {'step':>8} | {'peak memory':>11} | {'sent: attention':>15} | {'gradients':>10} | "
              f"{'attention scores':>16}")
        for r, (sec, peak, attention, gradients, scores) in enumerate(rows):
            print(f"{r:>4} | {sec * 1e3:>6.0f}ms | {peak / 2**20:>7.1f} MiB | {attention / 2**10:>11.0f} KiB | "
                  f"{gradients / 2**10:>6.0f} KiB | {int(scores):>16,}")
    zz, contiguous = runs["ring, zig-zag"][1][:, 4], runs["ring, contiguous"][1][:, 4]
    print("\nper-rank attention work (scores per sequence, head and layer); busiest / least busy rank:")
    print(f"  contiguous: {[int(s) for s in contiguous / args.layers]}, "
          f"{contiguous.max() / contiguous.min():.2f}x")
    print(f"  zig-zag:    {[int(s) for s in zz / args.layers]}, {zz.max() / zz.min():.2f}x")
    losses = [loss for loss, _ in runs.values()]
    print(f"same loss everywhere: {max(losses) - min(losses) < 1e-4 * abs(losses[0])}")
