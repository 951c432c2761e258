"""Bodies run on every rank by tests/test_nodes.py (MPI built-ins appear here only as oracles)."""
import time

import numpy as np
from mpi4py import MPI

from minidist import comm
from minidist.comm import links, nodes
from minidist.comm.mesh import Mesh


def layout(expect_layout):
    """Node ids (collective), the layout line, and the tp / cp groups across nodes of three
    4-rank meshes, printed by rank 0; every rank checks them against the expected layout."""
    g = comm.world()
    ids = nodes.node_ids()
    assert nodes.node_ids() is ids  # cached
    assert nodes.describe_nodes(ids) == expect_layout, (nodes.describe_nodes(ids), expect_layout)
    # The oracle of the real node: MPI's own Split_type (+ its Allgather) on a fresh communicator.
    if nodes.ranks_per_node() is None:
        local = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED)
        lowest = MPI.COMM_WORLD.allgather(min(local.allgather(MPI.COMM_WORLD.rank)))
        local.Free()
        assert [sorted(set(lowest)).index(x) for x in lowest] == list(ids), (lowest, ids)
    assert links.link_scope() == "all" or links._nodes == ids
    found = {}
    for name, shape in [("tp4", dict(tp=4)), ("dp2tp2", dict(dp=2, tp=2)), ("tp2cp2", dict(tp=2, cp=2))]:
        mesh = Mesh(**shape)
        found[name] = nodes.groups_spanning_nodes(mesh)
        warnings = nodes.layout_warnings(mesh)
        assert len(warnings) == len({line.split()[0] for line in found[name]}), (warnings, found[name])
        if g.rank == 0:
            for line in found[name]:
                print(f"{name}: {line}")
            for line in warnings:
                print(f"{name} {line}")
    if g.rank == 0:
        print(nodes.layout_text())
    print(f"rank {g.rank}: nodes ok", flush=True)


def internode_link():
    """With MINIDIST_LINK_SCOPE=internode, MINIDIST_LINK_LATENCY_US=20000 and pretend nodes
    of 2 ranks: a message to the other rank of one's node is free, one to another node
    pays the 20 ms latency."""
    g = comm.world()
    assert links.link_scope() == "internode" and links.enabled
    ids = nodes.node_ids()
    partner_in, partner_out = g.rank ^ 1, (g.rank + 2) % g.size
    assert ids[partner_in] == ids[g.rank] and ids[partner_out] != ids[g.rank]
    assert not links.crosses(g.comm, partner_in) and links.crosses(g.comm, partner_out)
    t0 = time.perf_counter()
    links.delay(8, g.comm, partner_in)
    inside = time.perf_counter() - t0
    t0 = time.perf_counter()
    links.delay(8, g.comm, partner_out)
    across = time.perf_counter() - t0
    assert inside < 5e-3 and across >= 20e-3, (inside, across)
    # On a sub-communicator (the peer is a rank of it, not of the world): ranks {r, r+2}.
    sub = MPI.COMM_WORLD.Split(g.rank % 2, g.rank)
    assert links.crosses(sub, 1 - sub.rank)
    pair = MPI.COMM_WORLD.Split(g.rank // 2, g.rank)
    assert not links.crosses(pair, 1 - pair.rank)
    sub.Free()
    pair.Free()
    # Every message still arrives: a ring of sends over both kinds of hop.
    x = np.full(4, g.rank, dtype=np.int64)
    got = comm.sendrecv(x, (g.rank + 1) % g.size, (g.rank - 1) % g.size, g)
    assert (got == (g.rank - 1) % g.size).all()
    print(f"rank {g.rank}: internode link ok inside {inside * 1e3:.2f} ms across {across * 1e3:.1f} ms", flush=True)


def internode_link_through_p2p():
    """The same settings as internode_link, through minidist's own messages (p2p.py passes
    each message's communicator and destination to links.delay): an exchange with the other
    rank of one's node is free, one with a rank of the other node pays 20 ms."""
    g = comm.world()
    nodes.node_ids()
    x = np.ones(8)
    timings = {}
    for name, partner in [("inside", g.rank ^ 1), ("across", (g.rank + 2) % g.size)]:
        # the fastest of 5: on a loaded machine one exchange may wait for its partner's turn on
        # a core, but every message across pays the link's 20 ms and none inside does
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            comm.sendrecv(x, partner, partner, g)
            times.append(time.perf_counter() - t0)
        timings[name] = min(times)
    assert timings["inside"] < 10e-3 <= 20e-3 <= timings["across"], timings
    print(f"rank {g.rank}: p2p link ok {timings}", flush=True)
