"""minidist.comm: collectives written by hand on top of MPI point-to-point messages.

    from minidist import comm
    g = comm.world()
    y = comm.all_reduce(x, g, op="sum")          # doubling when small, pairwise + gather when large
    y = comm.all_reduce(x, g, algorithm="ring")  # the textbook ring (algorithms/ring.py)
    h = comm.all_reduce(x, g, async_op=True)     # runs on the group's progress thread
    y = h.wait()
    y, got = comm.all_to_all_v(x, [2, 0, 1], g)   # 2 rows to rank 0, none to 1, 1 to 2; got: rows from each
    comm.stats()                                 # bytes and time per collective on this rank
    comm.set_fast_path(False)                    # only the textbook algorithms from now on
    comm.set_timeout(60)                         # a wait without progress for 60 s aborts the job

Start reading at ``algorithms/ring.py``.  The modules, from the wire up:

  p2p/              every message the algorithms send: raw bytes, size and identity-tag checks
                    (a collective's name, op, dtype, size class, algorithm and root ride in its
                    MPI tags), byte accounting, the watchdog's note of each wait; rounds.py:
                    many messages posted and awaited at once
  links.py          optional simulated latency/bandwidth per message
  stats.py          per-collective counters and the recent-ops log
  errors.py         CommError, CollectiveMismatchError
  sentinel.py       a small process per rank names the rank if it dies without a word (kill -9)
  abort.py          one rank's uncaught exception aborts the whole job (comm.world() installs it)
  identity.py       each collective message's tag names its call: mismatched calls raise, naming both
  watchdog.py       a wait without progress for MINIDIST_TIMEOUT_S (set_timeout) aborts the job, with a report
  progress.py       async collectives: one FIFO worker thread per group
  group.py          Group: a communicator, its async twin, scratch buffers, the plan cache
  algorithms/       the textbook algorithms, one short function each, with their step schedules:
    blocks.py       the all-gather rows rule (the blocks: layout/split.py, as np.array_split)
    ring.py         ring reduce-scatter, all-gather, all-reduce (start here)
    doubling.py     recursive doubling / halving, Rabenseifner
    pairwise.py     pairwise reduce-scatter, all-to-all and all-to-all-v, the 2-rank all-gather swap
    oneshot.py      one-shot all-gather / reduce-scatter (every message in one round)
    bruck.py        Bruck all-gather (fixed records, and rows with their counts)
    evengather.py   all-gather of equal blocks straight into out=
    trees.py        binomial broadcast / reduce, dissemination barrier
    pipelined.py    chunked ring reduce-scatter, chain broadcast / reduce
  fast/             the speed-up wing (switch: MINIDIST_FAST_PATH=0, set_fast_path(False)):
    __init__.py     run() and remember(): the one plan lookup and the one plan table
    common.py       what every plan shares
    exchange.py     a round on MPI persistent requests (one Startall, one Waitall)
    allreduce.py    recursive-doubling and pairwise all-reduce plans
    scatter.py      one-shot, ring, halving and pairwise reduce-scatter plans
    gather.py       pair, Bruck and even all-gather plans
    directgather.py the one-shot all-gather plan on the caller's own arrays
    alltoallv.py    the all-to-all-v plan: the rows sent with their counts, in one round
  reduction.py      sum/avg/max/min; float16/bfloat16 accumulated in float32
  check.py          argument checks; MINIDIST_CHECK_COLLECTIVES signature agreement
  launch.py         argument coercion; run a collective here or on the progress thread
  reducing.py       all_reduce, reduce_scatter, reduce (algorithm choice; thresholds: layout/thresholds.py)
  rooted.py         scatter, gather
  collectives.py    all_gather, broadcast, all_to_all, ppermute, barrier (and re-exports)
  mesh.py           Mesh(dp, pp, tp, cp): a Group per set of axes
  nodes.py          which ranks share a node (real, or MINIDIST_RANKS_PER_NODE); tp/cp groups across nodes
  functional.py     differentiable collectives (Megatron's f/g, all-gather <-> reduce-scatter)

The path of ``comm.all_reduce(x, g)`` to the wire: reducing.all_reduce asks fast.run once
(a cached plan runs the call, unless the fast path is off); otherwise it checks the
arguments, picks the algorithm (reducing.all_reduce_algorithm), and launch.launch runs
reducing._all_reduce in the collective's stats scope, which calls e.g.
algorithms.doubling.recursive_doubling_all_reduce, whose messages go through
p2p._sendrecv to MPI's Sendrecv; afterwards fast.remember caches the plan for next time.

Every MINIDIST_* variable is checked first (minidist/host/env.py): a bad value raises its one-line
EnvError (a ValueError) here, before anything else loads.  Imports host, layout and
model (the backend's arrays); never the parallel axes or anything above them.
"""

from minidist.host import env as _env
from minidist.host.oversubscribed import prepare as _prepare

if _env.problem() is not None:
    raise _env.problem()  # raised here, not deep inside an import: the traceback stays a few lines
_prepare()  # more ranks than cores: MPI's waits yield; before the imports below start MPI

from minidist.comm.check import check_enabled, set_check
from minidist.comm.collectives import (all_gather, all_reduce, all_to_all, all_to_all_v, barrier, broadcast,
                                       gather, ppermute, reduce, reduce_scatter, scatter)
from minidist.comm.errors import CollectiveMismatchError, CommError
from minidist.comm.fast import fast_path_enabled, set_fast_path
from minidist.comm.group import Group, world
from minidist.comm.links import link_model, set_link_model
from minidist.comm.mesh import Mesh
from minidist.comm.p2p import Request, irecv, isend, recv, recv_into, send, sendrecv
from minidist.comm.progress import Handle
from minidist.comm.stats import recent_ops, reset_stats, stats
from minidist.comm.watchdog import set_timeout, timeout
from minidist.comm import functional  # differentiable collectives: comm.functional.*

__all__ = [
    "Group", "world", "Mesh", "functional", "all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce",
    "scatter", "gather", "all_to_all", "all_to_all_v", "ppermute", "barrier", "send", "recv", "recv_into",
    "sendrecv", "isend", "irecv", "Request", "Handle", "stats", "reset_stats", "recent_ops",
    "set_link_model", "link_model", "set_check", "check_enabled", "set_fast_path", "fast_path_enabled",
    "set_timeout", "timeout",
    "CommError", "CollectiveMismatchError",
]
