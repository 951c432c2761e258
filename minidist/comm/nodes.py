"""Which ranks share a machine ("node"), and which tp / cp groups cross between machines.

On a cluster, the ranks of one node talk through shared memory or NVLink, and ranks on
different nodes through a network an order of magnitude slower.  The mesh (mesh.py) puts
tensor parallelism innermost so that, with the launcher's usual *block* placement
(ranks 0..K-1 on the first node, K..2K-1 on the next, ...), a tp group lands inside one
node: Megatron-LM keeps tp within a server (Narayanan et al. 2021), and Llama 3 orders its
axes [TP, CP, PP, DP] from the fastest links to the slowest.  This module finds out where
the ranks really are, so a run can say so (the summary's node layout) and warn when a tp or
cp group's per-layer traffic would cross nodes (docs/multinode.md).

* The real node: ``MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)`` groups the ranks that can
  share memory, i.e. one node each.
* A pretend node, to try a multi-node layout on one machine: ``MINIDIST_RANKS_PER_NODE=K``
  makes ranks ``r`` with the same ``r // K`` a node.  The simulated link
  (links.py, ``MINIDIST_LINK_SCOPE=internode``) then slows only the messages between
  pretend nodes.

:func:`node_ids` is collective over COMM_WORLD (every rank calls it, once; the answer is
cached); everything else is arithmetic on its answer.
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from minidist.host import env
from minidist.comm import links
from minidist.comm.collectives import all_gather
from minidist.comm.group import world as world_group
from minidist.layout.mesh import MeshLayout

RANKS_PER_NODE = "MINIDIST_RANKS_PER_NODE"
CHECKED_AXES = ("tp", "cp")
"""The axes whose groups should stay inside a node (their traffic is per layer)."""

_ids: tuple | None = None  # node_ids()'s answer, once computed
_sharing = 0  # how many ranks share this rank's memory (its real node), found by node_ids()


def ranks_per_node() -> int | None:
    """``MINIDIST_RANKS_PER_NODE`` (K: every K consecutive ranks are a pretend node), or None
    when unset (the real nodes); read and checked by minidist.host.env, like every MINIDIST_* variable."""
    return env.get(RANKS_PER_NODE)  # EnvError (a ValueError) when bad


def pretend_node_ids(world_size: int, k: int) -> tuple[int, ...]:
    """Node of each rank when every ``k`` consecutive ranks are a node: ``rank // k``."""
    return tuple(r // k for r in range(world_size))


def node_ids(world=None) -> tuple[int, ...]:
    """The node of every COMM_WORLD rank: ``ids[r]`` is rank r's node, numbered 0, 1, ... in
    the order of each node's lowest rank.  Collective over the world group ``world``
    (default ``comm.world()``): every rank calls it.  Cached after the first call; also
    tells the simulated link (links.py) where the node boundaries are."""
    global _ids, _sharing
    if _ids is not None:
        return _ids
    g = world_group() if world is None else world
    if g.size != MPI.COMM_WORLD.Get_size():
        raise ValueError(f"node_ids: the group {g.name!r} has {g.size} of the {MPI.COMM_WORLD.Get_size()} ranks; "
                         "it needs the whole world")
    k = ranks_per_node()
    # Every rank takes the same steps whatever it read, so a disagreement raises instead of hanging.
    # The real node: the ranks that can share memory; its lowest world rank names it.
    local = g.comm.Split_type(MPI.COMM_TYPE_SHARED, key=g.rank)
    try:
        lowest = int(MPI.Group.Translate_ranks(local.Get_group(), [0], MPI.COMM_WORLD.Get_group())[0])
        _sharing = local.Get_size()
    finally:
        local.Free()
    me = g.world_ranks[g.rank]
    # The exchange below needs a layout when the simulated link applies between nodes only: the
    # pretend one, or one node (these few bytes are not charged) until the real one is known.
    links.set_nodes(pretend_node_ids(g.size, k) if k is not None else (0,) * g.size)
    rows = all_gather(np.array([[me // k if k else lowest, k or 0]], dtype=np.int64), g).tolist()
    if len({row[1] for row in rows}) > 1:
        said = ", ".join(f"rank {r}: {row[1] or 'unset'}" for r, row in zip(g.world_ranks, rows))
        raise ValueError(f"the ranks disagree on {RANKS_PER_NODE} ({said}): set it for every rank")
    keys = [row[0] for row in rows]
    number = {}
    for k_ in keys:  # number the nodes in order of first appearance (lowest rank)
        number.setdefault(k_, len(number))
    by_world = dict(zip(g.world_ranks, (number[k_] for k_ in keys)))
    _ids = tuple(by_world[r] for r in sorted(by_world))
    links.set_nodes(_ids)
    return _ids


def ranks_sharing_this_node() -> int:
    """How many ranks share this rank's machine (its real node, whatever
    ``MINIDIST_RANKS_PER_NODE`` pretends); after :func:`node_ids`, 0 before."""
    return _sharing


def _ranges(ranks) -> str:
    """``[0, 1, 2, 3, 8, 9]`` -> ``"0-3 8-9"``; ``[0, 2, 4]`` -> ``"0 2 4"``."""
    parts, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            parts.append(str(r) if r == start else f"{start}-{r}")
            start = None
    return " ".join(parts)


def members(ids) -> dict[int, list[int]]:
    """``{node: [its world ranks]}``."""
    out: dict[int, list[int]] = {}
    for rank, node in enumerate(ids):
        out.setdefault(node, []).append(rank)
    return dict(sorted(out.items()))


def describe_nodes(ids) -> str:
    """``"node 0: ranks 0-1, node 1: ranks 2-3"``."""
    return ", ".join(f"node {n}: ranks {_ranges(rs)}" for n, rs in members(ids).items())


def consecutive(ids) -> bool:
    """Does every node hold consecutive ranks (block placement)?"""
    return all(rs == list(range(rs[0], rs[0] + len(rs))) for rs in members(ids).values())


def layout_text(ids=None) -> str:
    """The node layout for the run's summary, e.g. ``"nodes: 2 (pretend: MINIDIST_RANKS_PER_NODE=2):
    node 0: ranks 0-1, node 1: ranks 2-3"``, with a note when the launcher did not place
    consecutive ranks together.  Uses :func:`node_ids`'s cached answer (call that on every
    rank first; with ``MINIDIST_RANKS_PER_NODE`` set no call is needed)."""
    if ids is None:
        ids = _ids
    if ids is None:
        k = ranks_per_node()
        if k is None:
            raise RuntimeError("layout_text: call nodes.node_ids() on every rank first (it is collective)")
        ids = pretend_node_ids(MPI.COMM_WORLD.Get_size(), k)
    k = ranks_per_node()
    source = f"pretend: {RANKS_PER_NODE}={k}" if k is not None else "MPI_COMM_TYPE_SHARED"
    text = f"nodes: {len(set(ids))} ({source}): {describe_nodes(ids)}"
    if not consecutive(ids):
        text += ("\n  note: the nodes do not hold consecutive ranks (round-robin placement?), so tp groups"
                 " cross nodes; launch with block placement (docs/multinode.md)")
    return text


def _layout_and_names(mesh):
    """(MeshLayout, COMM_WORLD rank of each mesh rank) of a Mesh, MeshLayout or ParallelConfig."""
    if hasattr(mesh, "mesh_sizes"):  # a ParallelConfig: the mesh over the whole world
        lay = MeshLayout(**mesh.mesh_sizes())
        return lay, list(range(lay.world_size))
    lay = getattr(mesh, "layout", mesh)
    world = getattr(mesh, "world", None)
    return lay, list(world.world_ranks) if world is not None else list(range(lay.world_size))


def _nodes_phrase(nodes) -> str:
    words = [str(n) for n in nodes]
    return ", ".join(words[:-1]) + " and " + words[-1]


def spanning(mesh, ids=None) -> dict[str, list[tuple[tuple[int, ...], list[int]]]]:
    """``{axis: [(group's world ranks, its nodes), ...]}`` for each tp / cp group on more
    than one node (axes without such a group are left out)."""
    ids = node_ids() if ids is None else tuple(ids)
    lay, names = _layout_and_names(mesh)
    if max(names) >= len(ids):
        raise ValueError(f"node ids for {len(ids)} ranks, but the mesh has world rank {max(names)}")
    out = {}
    for axis in CHECKED_AXES:
        if lay.shape[axis] == 1:
            continue
        found = []
        for group in lay.partition(axis):
            ranks = tuple(names[r] for r in group)
            nodes = sorted({ids[r] for r in ranks})
            if len(nodes) > 1:
                found.append((ranks, nodes))
        if found:
            out[axis] = found
    return out


def groups_spanning_nodes(mesh, ids=None) -> list[str]:
    """One line per tp or cp group whose ranks sit on more than one node, e.g.
    ``"tp group [0 1 2 3] spans nodes 0 and 1"``; [] when every such group is in one node.
    ``mesh``: a Mesh, a MeshLayout or a ParallelConfig; ``ids``: every world rank's node
    (default :func:`node_ids`, which is collective)."""
    return [f"{axis} group [{' '.join(map(str, ranks))}] spans nodes {_nodes_phrase(nodes)}"
            for axis, found in spanning(mesh, ids).items() for ranks, nodes in found]


def _advice(axis: str, lay, per: int) -> str:
    if axis == "tp":
        return ("tensor parallelism all-reduces activations in every layer: Megatron-LM keeps a tp group inside "
                f"one server and Llama 3 puts TP innermost. Use a --tp that divides the ranks per node ({per}) and "
                "a launcher that places consecutive ranks together (docs/multinode.md)")
    tp = lay.shape["tp"]
    if tp >= per:
        return (f"tp={tp} fills a node of {per} ranks, so cp has to cross nodes, as in Llama 3 (TP8 inside a node, "
                "CP16 across nodes): ring or Ulysses attention sends its keys and values over the inter-node "
                "link in every layer (docs/multinode.md)")
    return ("context parallelism sends keys and values in every layer; Llama 3 orders its axes [TP, CP, PP, DP] "
            f"so CP stays close: a tp x cp that divides the ranks per node ({per}) keeps each cp group inside "
            "one node (docs/multinode.md)")


def layout_warnings(mesh, ids=None, shown: int = 3) -> list[str]:
    """The start-up warnings of ``mesh``'s layout: one line per axis (tp, cp) whose groups
    cross nodes, naming the first ``shown`` of them; [] when none does.  Collective when
    ``ids`` is None (it calls :func:`node_ids`); rank 0 prints the lines."""
    ids = node_ids() if ids is None else tuple(ids)
    lay, _ = _layout_and_names(mesh)
    per = min(len(rs) for rs in members(ids).values())
    lines = []
    for axis, found in spanning(mesh, ids).items():
        if len(found) == 1:
            (ranks, nodes), = found
            what = f"{axis} group [{' '.join(map(str, ranks))}] spans nodes {_nodes_phrase(nodes)}"
        else:
            named = [f"[{' '.join(map(str, ranks))}] on nodes {_nodes_phrase(nodes)}" for ranks, nodes in found[:shown]]
            more = f", and {len(found) - shown} more" if len(found) > shown else ""
            what = f"{len(found)} {axis} groups span nodes ({', '.join(named)}{more})"
        lines.append(f"warning: {what}: {_advice(axis, lay, per)}")
    return lines
