"""Simulated network links, to study communication costs on a single machine.

On one machine, ranks talk through shared memory at memcpy speed, so a ring and a tree look
alike.  The alpha-beta (latency-bandwidth) model of a real link, t(n) = alpha + n / beta
(Hockney 1994; used throughout Thakur, Rabenseifner & Gropp 2005), makes the differences
visible: every message sleeps ``latency_us`` microseconds plus ``bytes / (gbps * 1e9 / 8)``
seconds before it is sent.

Off by default.  Turn it on with the environment variables ``MINIDIST_LINK_LATENCY_US`` and
``MINIDIST_LINK_GBPS`` (read once, at import) or from code with :func:`set_link_model`.

Where it applies: ``MINIDIST_LINK_SCOPE=all`` (the default) slows every message;
``MINIDIST_LINK_SCOPE=internode`` only the messages between ranks on different nodes, as on
a cluster where the ranks of a node share memory or NVLink and the nodes a slower network.
With ``MINIDIST_RANKS_PER_NODE=K`` the nodes are pretend ones (every K consecutive ranks), so
one machine shows what a slow inter-node link does to each axis of the mesh.  The node of
every rank comes from :func:`minidist.comm.nodes.node_ids` (collective: every rank calls it
once before the traffic of interest; the training command does at start-up), which hands it
to :func:`set_nodes`.
"""

from __future__ import annotations

import time

from minidist.host import env

SCOPES = ("all", "internode")

_latency_s = 0.0
_bytes_per_s = 0.0  # 0 = infinite bandwidth
_scope = "all"
_nodes: tuple | None = None  # node id of each COMM_WORLD rank (set_nodes)
_keyval = None  # MPI attribute key: each communicator's COMM_WORLD ranks, cached on it
enabled = False


def set_link_model(latency_us: float = 0.0, gbps: float | None = None, scope: str = "all") -> None:
    """Make every message cost ``latency_us`` µs plus its size at ``gbps`` gigabits/s;
    ``scope="internode"``: only messages between ranks on different nodes (:func:`set_nodes`).

    ``set_link_model()`` (no arguments) turns the simulation off again.
    """
    global _latency_s, _bytes_per_s, _scope, enabled
    try:
        latency_us = float(latency_us)
        gbps = None if gbps is None else float(gbps)
    except (TypeError, ValueError):
        raise ValueError(f"set_link_model: latency_us={latency_us!r}, gbps={gbps!r} must be numbers") from None
    if latency_us < 0 or latency_us != latency_us:
        raise ValueError(f"set_link_model: latency_us={latency_us!r} must be >= 0")
    if gbps is not None and not gbps > 0:
        raise ValueError(f"set_link_model: gbps={gbps!r} must be > 0 (or None for unlimited)")
    if scope not in SCOPES:
        raise ValueError(f"set_link_model: scope={scope!r} must be one of {SCOPES}")
    _latency_s = latency_us * 1e-6
    _bytes_per_s = 0.0 if gbps is None else gbps * 1e9 / 8
    _scope = scope
    enabled = _latency_s > 0 or _bytes_per_s > 0


def link_model() -> dict:
    """The current model: ``{"latency_us": ..., "gbps": ... or None}`` (where it applies: :func:`link_scope`)."""
    return {"latency_us": _latency_s * 1e6, "gbps": _bytes_per_s * 8 / 1e9 if _bytes_per_s else None}


def link_scope() -> str:
    """Which messages pay the simulated link: "all" or "internode"."""
    return _scope


def set_nodes(ids) -> None:
    """The node of every COMM_WORLD rank (``ids[r]``), for ``scope="internode"``;
    ``None`` forgets it.  :func:`minidist.comm.nodes.node_ids` calls this."""
    global _nodes
    _nodes = None if ids is None else tuple(int(n) for n in ids)


def _world_rank(comm, peer: int) -> int:
    """COMM_WORLD rank of rank ``peer`` of ``comm`` (the translation cached on ``comm`` as an
    MPI attribute, so it lives exactly as long as the communicator)."""
    from mpi4py import MPI  # here: a single-process run that never sends keeps MPI uninitialised

    global _keyval
    if _keyval is None:
        _keyval = MPI.Comm.Create_keyval()
    ranks = comm.Get_attr(_keyval)
    if ranks is None:
        mine, world = comm.Get_group(), MPI.COMM_WORLD.Get_group()
        try:
            ranks = tuple(int(r) for r in MPI.Group.Translate_ranks(mine, list(range(comm.Get_size())), world))
        finally:
            mine.Free()
            world.Free()
        comm.Set_attr(_keyval, ranks)
    return ranks[peer]


def crosses(comm, peer) -> bool:
    """Does a message to rank ``peer`` of ``comm`` pay the simulated link?  Always with
    scope "all", and when the caller does not say where it goes; with "internode", when the
    two ranks are on different nodes (raises when no node layout was given: :func:`set_nodes`)."""
    if _scope == "all" or comm is None or peer is None:
        return True
    if _nodes is None:
        raise RuntimeError("MINIDIST_LINK_SCOPE=internode needs the node of every rank: call "
                           "minidist.comm.nodes.node_ids() on every rank before the traffic (the training "
                           "command does at start-up)")
    return _nodes[_world_rank(comm, comm.Get_rank())] != _nodes[_world_rank(comm, peer)]


def delay(nbytes: int, comm=None, peer=None) -> None:
    """Sleep as long as sending ``nbytes`` over the simulated link would take (nothing for a
    message that stays inside a node, with scope "internode": :func:`crosses`)."""
    t = _latency_s + (nbytes / _bytes_per_s if _bytes_per_s else 0.0)
    if t > 0 and crosses(comm, peer):
        time.sleep(t)


def _from_environment() -> None:
    """The model of MINIDIST_LINK_LATENCY_US, MINIDIST_LINK_GBPS and MINIDIST_LINK_SCOPE
    (read and checked by minidist.host.env: EnvError naming a bad one)."""
    lat, bw = env.get("MINIDIST_LINK_LATENCY_US"), env.get("MINIDIST_LINK_GBPS")
    scope = env.get("MINIDIST_LINK_SCOPE")
    if lat or bw is not None:
        set_link_model(lat, bw, scope)


_from_environment()
