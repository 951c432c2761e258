"""minidist.comm: collectives written by hand on top of MPI point-to-point messages.

    from minidist import comm
    g = comm.world()
    y = comm.all_reduce(x, g, op="sum")          # ring / recursive doubling, see collectives.py
    h = comm.all_reduce(x, g, async_op=True)     # runs on the group's progress thread
    y = h.wait()
    comm.stats()                                 # bytes and time per collective on this rank

Layers: p2p.py (buffers, byte accounting, simulated links) <- tree.py / ring.py (algorithms)
<- collectives.py and rooted.py (public API; launch.py: argument checks, stats scope, async;
fastpath.py, fastgather.py: cached plans for repeated small calls) ; group.py holds communicators and the
progress thread; check.py the debug-mode agreement of signatures; mesh.py the device mesh
(``comm.Mesh(dp=2, tp=2).group("tp")``); functional.py the differentiable collectives.
"""

from minidist.comm.check import check_enabled, set_check
from minidist.comm.collectives import (all_gather, all_reduce, all_to_all, barrier, broadcast, gather,
                                       ppermute, reduce, reduce_scatter, scatter)
from minidist.comm.errors import CollectiveMismatchError, CommError
from minidist.comm.group import Group, world
from minidist.comm.links import link_model, set_link_model
from minidist.comm.mesh import Mesh
from minidist.comm.p2p import Request, irecv, isend, recv, recv_into, send, sendrecv
from minidist.comm.progress import Handle
from minidist.comm.stats import recent_ops, reset_stats, stats
from minidist.comm import functional  # noqa: E402  (differentiable collectives: comm.functional.*)

__all__ = [
    "Group", "world", "Mesh", "functional", "all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce",
    "scatter", "gather", "all_to_all", "ppermute", "barrier", "send", "recv", "recv_into",
    "sendrecv", "isend", "irecv", "Request", "Handle", "stats", "reset_stats", "recent_ops",
    "set_link_model", "link_model", "set_check", "check_enabled", "CommError",
    "CollectiveMismatchError",
]
