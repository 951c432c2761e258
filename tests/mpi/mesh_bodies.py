"""Bodies run on every rank by tests/test_mesh.py (MPI built-ins appear here only as oracles)."""
import numpy as np
from mpi4py import MPI

from minidist import comm
from minidist.comm.mesh import Mesh
from minidist.layout.mesh import AXES, all_axis_sets


def _member_world_ranks(mpi_comm):
    """World ranks of a communicator's members, straight from MPI (independent of Group)."""
    return tuple(mpi_comm.Get_group().Translate_ranks(list(range(mpi_comm.size)), MPI.COMM_WORLD.Get_group()))


def _check_groups(mesh, parent_world_ranks):
    lay, me = mesh.layout, mesh.rank
    for axes in all_axis_sets():
        g = mesh.group(axes)
        expect = tuple(parent_world_ranks[r] for r in lay.members(axes, me))
        assert g.size == len(expect) == mesh.size(axes), (axes, g.size, expect)
        assert tuple(g.world_ranks) == expect, (axes, g.world_ranks, expect)
        assert _member_world_ranks(g.comm) == expect, (axes, _member_world_ranks(g.comm), expect)
        assert g.rank == lay.members(axes, me).index(me), (axes, g.rank)
    for axis in AXES:
        assert mesh.coord(axis) == mesh.group(axis).rank
    assert mesh.rank_of(**mesh.coords) == me
    assert mesh.group(("cp", "dp")) is mesh.group(("dp", "cp"))


def _check_all_reduce(mesh):
    """all_reduce over each axis group sums exactly that group's members' arrays."""
    world_rank = MPI.COMM_WORLD.rank
    x = np.arange(5, dtype=np.int64) + 100 * world_rank
    for axes in [("tp",), ("cp",), ("pp",), ("dp",), ("dp", "cp"), ("pp", "tp")]:
        g = mesh.group(axes)
        got = comm.all_reduce(x, g)
        oracle = np.empty_like(x)
        g.comm.Allreduce(x, oracle, op=MPI.SUM)
        members = g.world_ranks
        by_hand = sum(np.arange(5, dtype=np.int64) + 100 * r for r in members)
        assert np.array_equal(got, oracle), (axes, got, oracle)
        assert np.array_equal(got, by_hand), (axes, got, by_hand)


def check_mesh_shapes(shapes):
    world = comm.world()
    for spec in shapes.split(";"):
        dp, pp, tp, cp = map(int, spec.split(","))
        mesh = Mesh(dp=dp, pp=pp, tp=tp, cp=cp)
        _check_groups(mesh, tuple(range(world.size)))
        _check_all_reduce(mesh)
        if world.rank == 0 and spec == "2,2,2,1":
            print(mesh.describe())
        print(f"mesh ok {spec} rank {world.rank} coords {mesh.coords}", flush=True)
    # A mesh over a sub-group: each half of the world gets its own 2x2 (dp x tp) mesh.
    half = comm.Group(MPI.COMM_WORLD.Split(world.rank // 4, world.rank), name="half")
    mesh = Mesh(dp=2, tp=2, world=half)
    _check_groups(mesh, tuple(half.world_ranks))
    first = 4 * (world.rank // 4)
    assert f"tp groups: [{first} {first + 1}] [{first + 2} {first + 3}]" in mesh.describe(), mesh.describe()
    assert mesh.group("cp").name == "self" and mesh.group("cp").size == 1
    assert tuple(mesh.group("tp").world_ranks) == tuple(half.world_ranks[2 * (half.rank // 2) + i] for i in range(2))


def check_bad_mesh():
    world = comm.world()
    msgs = []
    for kwargs in [dict(dp=2, pp=2, tp=2), dict(tp=0, dp=4), dict(dp=1.5)]:
        try:
            Mesh(**kwargs)
        except ValueError as e:
            msgs.append(str(e))
        else:
            raise AssertionError(f"Mesh({kwargs}) on {world.size} ranks did not raise")
    mesh = Mesh(dp=2, tp=2)
    try:
        mesh.group("ep")
    except ValueError as e:
        msgs.append(str(e))
    else:
        raise AssertionError("mesh.group('ep') did not raise")
    # Every rank got here without hanging; the world is still usable afterwards.
    total = comm.all_reduce(np.ones(1), world)
    assert total[0] == world.size
    assert "tp=0" in msgs[1] and "dp=1.5" in msgs[2] and "'ep'" in msgs[3], msgs
    print(f"bad mesh rejected on rank {world.rank}: {msgs[0]}", flush=True)
