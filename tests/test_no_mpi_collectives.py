"""minidist's library code must build every collective from point-to-point messages."""
import pathlib
import re

PATTERN = re.compile(
    r"\.(Allreduce|allreduce|Allgatherv?|allgather|Reduce_scatter(_block)?|Bcast|bcast|Alltoallv?|alltoall"
    r"|I(allreduce|reduce_scatter|allgather|bcast|alltoall|barrier)|Reduce|Gatherv?|Scatterv?|Scan|Exscan"
    r"|Barrier|barrier)\(")
ROOT = pathlib.Path(__file__).resolve().parent.parent / "minidist"


def mpi_collective_calls(text: str) -> list[str]:
    """Lines of ``text`` calling an MPI collective (comment lines and comments ignored).

    One name is shared: ``comm.barrier(g)`` is minidist's own hand-written barrier when the
    file imports minidist's comm module as ``comm``; any other receiver (``g.comm``,
    ``MPI.COMM_WORLD``, ``self.comm``) is an MPI communicator.
    """
    uses_minidist_comm = re.search(r"^\s*from minidist import .*\bcomm\b", text, re.M) is not None
    hits = []
    for number, line in enumerate(text.splitlines(), 1):
        code = line.split("#", 1)[0]
        for m in PATTERN.finditer(code):
            own_barrier = (m.group(1) == "barrier" and uses_minidist_comm
                           and re.search(r"(?<![\w.])comm$", code[:m.start()]))
            if not own_barrier:
                hits.append(f"{number}: {line.strip()}")
    return hits


def test_pattern_catches_mpi_collectives():
    bad = ["MPI.COMM_WORLD.Allreduce(a, b)", "g.comm.Bcast(x, root=0)", "self.comm.barrier()",
           "comm.Reduce_scatter_block(a, b)", "c.Ialltoall(a, b)", "MPI.COMM_WORLD.allgather(3)",
           "w.Gatherv(a, b)", "mpi_comm.Barrier()", "comm.barrier()", "x = world.Scan(a, b)"]
    for line in bad:
        assert mpi_collective_calls(line), line
    header = "from minidist import comm\n"
    assert mpi_collective_calls(header + "g.comm.barrier()")
    ok = ["# MPI.COMM_WORLD.Allreduce(a, b) in a comment", "comm.all_reduce(x, g)",
          "comm.gather(x, g, root=0)", "g.comm.Sendrecv(a, 1, 0, b, 1, 0)", "MPI.Request.Waitall(r)"]
    for line in ok + [header + "comm.barrier(g)"]:
        assert not mpi_collective_calls(line), line


def test_library_never_calls_mpi_collectives():
    offenders = {}
    for path in sorted(ROOT.rglob("*.py")):
        hits = mpi_collective_calls(path.read_text())
        if hits:
            offenders[str(path.relative_to(ROOT.parent))] = hits
    assert not offenders, f"MPI collectives called in library code: {offenders}"
