"""Every collective on small integer arrays: what each rank holds before and after.

Run:  mpiexec -n 4 python examples/01_collectives.py

Each table has one row per rank, like the pictures in lectures on collective communication
(and the MPI standard's figures).  Rank r starts from ``10*r + [0, 1, 2, 3]``, so you can
read off where every number came from: the tens digit is the rank that owned it.

The rows are printed by rank 0 only, after collecting them with minidist's own ``gather``:
``print`` from several processes would interleave in whatever order mpiexec forwards it.
"""

from minidist import comm
from minidist.model.backend import to_host, xp

WIDTH = 96  # each rank's row travels as a fixed-width byte array


def show(arr) -> str:
    """``[0 1 2 3]`` for an array, ``None`` for no result (non-root ranks)."""
    if arr is None:
        return "None"
    return "[" + " ".join(str(int(v)) for v in to_host(arr).reshape(-1)) + "]"


def table(g, title: str, before, after) -> None:
    """Rank 0 prints ``title`` and one ``rank | before | after`` row per rank, in rank order."""
    row = f"{g.rank:>6} | {show(before):<24} | {show(after)}"
    data = xp.frombuffer(row.ljust(WIDTH)[:WIDTH].encode(), dtype=xp.uint8).reshape(1, WIDTH)
    rows = comm.gather(data, g, root=0)  # (size, WIDTH) bytes on rank 0, None elsewhere
    if g.rank == 0:
        print(f"\n{title}")
        print(f"{'rank':>6} | {'before':<24} | after")
        for r in range(g.size):
            print(bytes(to_host(rows[r])).decode().rstrip())


def main():
    g = comm.world()
    n, r = g.size, g.rank
    x = 10 * r + xp.arange(4)  # rank r: [10r, 10r+1, 10r+2, 10r+3]
    if r == 0:
        print(f"{n} ranks; rank r starts with x = 10*r + [0 1 2 3]")

    table(g, "all_reduce(x, op='sum'): every rank gets the element-wise sum",
          x, comm.all_reduce(x, g, op="sum"))
    w = (37 * x) % 50  # scrambled so that the maxima come from different ranks
    table(g, "all_reduce(w, op='max') with w = 37*x mod 50: every rank gets the element-wise maximum",
          w, comm.all_reduce(w, g, op="max"))
    table(g, f"reduce_scatter(x): the sum, cut into {n} parts; rank i keeps part i",
          x, comm.reduce_scatter(x, g, op="sum"))
    table(g, "all_gather(x[:2]): every rank gets every rank's piece, in rank order",
          x[:2], comm.all_gather(x[:2], g))
    table(g, "broadcast(x, root=0): rank 0's x everywhere",
          x, comm.broadcast(x, g, root=0))
    table(g, "reduce(x, root=0): the sum, on rank 0 only",
          x, comm.reduce(x, g, root=0))
    full = xp.arange(2 * n) if r == 0 else xp.zeros(2 * n, dtype=x.dtype)
    table(g, f"scatter(x, root=0): rank 0's {2 * n} numbers, cut into {n} parts, part i to rank i",
          full, comm.scatter(full, g, root=0))
    table(g, "gather(x[:1], root=0): every rank's piece, concatenated on rank 0",
          x[:1], comm.gather(x[:1], g, root=0))
    y = 10 * r + xp.arange(n)  # one number per destination rank
    table(g, f"all_to_all(y): number j of rank i goes to rank j (a transpose of the {n} x {n} grid)",
          y, comm.all_to_all(y, g))
    ring = [(i, (i + 1) % n) for i in range(n)]
    table(g, "ppermute(x, perm=[(i, i+1 mod n)]): a ring shift, rank i receives from rank i-1",
          x, comm.ppermute(x, g, perm=ring))
    to_last = [(0, n - 1)]
    table(g, f"ppermute(x, perm={to_last}): ranks that receive nothing get zeros",
          x, comm.ppermute(x, g, perm=to_last))

    comm.barrier(g)  # no data moves: nobody leaves until everybody has arrived
    if r == 0:
        print(f"\nbarrier(): all {n} ranks arrived; the tables above are rank 0's view of the run")


if __name__ == "__main__":
    main()
