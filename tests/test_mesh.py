"""Device mesh: coordinate arithmetic (no MPI) and the real sub-groups under mpiexec."""
import os

import pytest

from minidist.layout.mesh import AXES, MeshLayout, all_axis_sets, canonical_axes
from minidist.train.testing import run_mpi

BODIES = os.path.join(os.path.dirname(__file__), "mpi", "mesh_bodies.py")

SHAPES = [(2, 2, 2, 1), (2, 1, 2, 2), (1, 2, 2, 2), (8, 1, 1, 1), (1, 1, 1, 8), (3, 1, 2, 1), (1, 1, 1, 1)]


def _layout(dp, pp, tp, cp):
    return MeshLayout(dp=dp, pp=pp, tp=tp, cp=cp)


@pytest.mark.parametrize("dp,pp,tp,cp", SHAPES)
def test_coords_roundtrip_and_tp_innermost(dp, pp, tp, cp):
    lay = _layout(dp, pp, tp, cp)
    assert lay.world_size == dp * pp * tp * cp
    seen = set()
    for r in range(lay.world_size):
        c = lay.coords(r)
        assert lay.rank_of(**c) == r
        # the documented formula, written out independently
        assert r == ((c["dp"] * pp + c["pp"]) * cp + c["cp"]) * tp + c["tp"]
        seen.add(tuple(c[a] for a in AXES))
    assert len(seen) == lay.world_size  # a bijection onto the grid


def test_known_8_rank_layout():
    lay = _layout(2, 2, 2, 1)
    assert lay.partition("tp") == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert lay.partition("pp") == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert lay.partition("dp") == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert lay.partition("cp") == [(r,) for r in range(8)]
    assert lay.partition(("pp", "tp")) == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert lay.coords(6) == {"dp": 1, "pp": 1, "cp": 0, "tp": 0}
    lay = _layout(2, 1, 2, 2)  # tp then cp then dp
    assert lay.partition("cp") == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert lay.partition(("dp", "cp")) == [(0, 2, 4, 6), (1, 3, 5, 7)]


@pytest.mark.parametrize("dp,pp,tp,cp", SHAPES)
def test_groups_partition_and_share_other_coords(dp, pp, tp, cp):
    lay = _layout(dp, pp, tp, cp)
    for axes in all_axis_sets():
        parts = lay.partition(axes)
        flat = sorted(r for g in parts for r in g)
        assert flat == list(range(lay.world_size))  # every rank in exactly one group
        for g in parts:
            assert len(g) == lay.size(axes)
            assert lay.color(axes, g[0]) == lay.color(axes, g[-1])
            for r in g:
                assert lay.members(axes, r) == g  # every member sees the same ordered group
                others = {a: lay.coords(r)[a] for a in AXES if a not in axes}
                assert others == {a: lay.coords(g[0])[a] for a in AXES if a not in axes}
        colors = {lay.color(axes, g[0]) for g in parts}
        assert len(colors) == len(parts)  # distinct groups get distinct Split colors
    for axis in AXES:  # on a single axis, position in the group == coordinate
        for r in range(lay.world_size):
            assert lay.members(axis, r).index(r) == lay.coords(r)[axis]


def test_axis_order_is_canonical():
    assert canonical_axes(("cp", "dp")) == ("dp", "cp")
    assert canonical_axes("tp") == ("tp",)
    lay = _layout(2, 1, 1, 4)
    assert lay.members(("cp", "dp"), 0) == lay.members(("dp", "cp"), 0) == (0, 1, 2, 3, 4, 5, 6, 7)
    assert len(all_axis_sets()) == 15 and len(set(all_axis_sets())) == 15


@pytest.mark.parametrize("kwargs,words", [
    (dict(dp=0), ["dp=0"]),
    (dict(tp=-2), ["tp=-2"]),
    (dict(pp=2.0), ["pp=2.0", "float"]),
    (dict(cp="2"), ["cp='2'"]),
    (dict(dp=True), ["dp=True"]),
])
def test_bad_sizes(kwargs, words):
    with pytest.raises(ValueError) as err:
        MeshLayout(**kwargs)
    for w in words:
        assert w in str(err.value)


def test_bad_axes_and_coordinates():
    lay = _layout(2, 2, 2, 1)
    with pytest.raises(ValueError, match="'ep'"):
        canonical_axes("ep")
    with pytest.raises(ValueError, match="'zz'"):
        lay.partition(("dp", "zz"))
    with pytest.raises(ValueError, match="repeat"):
        canonical_axes(("tp", "tp"))
    with pytest.raises(ValueError, match=r"tp=2 is outside 0..1"):
        lay.rank_of(dp=0, pp=0, cp=0, tp=2)
    with pytest.raises(ValueError, match=r"missing \['pp'\]"):
        lay.rank_of(dp=0, cp=0, tp=0)
    with pytest.raises(ValueError, match="rank 8"):
        lay.coords(8)


def test_describe_lists_groups():
    text = _layout(2, 2, 2, 1).describe()
    assert "tp groups: [0 1] [2 3] [4 5] [6 7]" in text
    assert "dp groups: [0 4] [1 5] [2 6] [3 7]" in text
    assert "cp groups:" in text and "size 1" in text
    assert "   6    1   1   0   0" in text


# ---------------------------------------------------------------- under mpiexec


@pytest.mark.mpi
def test_mesh_groups_on_8_ranks():
    """One launch, every shape: members, coordinates, and all_reduce vs MPI's Allreduce."""
    shapes = ";".join(",".join(map(str, s)) for s in SHAPES if s[0] * s[1] * s[2] * s[3] == 8)
    out = run_mpi(8, f"{BODIES}::check_mesh_shapes", shapes, timeout=150).stdout
    assert out.count("mesh ok") == 8 * len(shapes.split(";")), out
    assert "pp groups: [0 2] [1 3] [4 6] [5 7]" in out  # rank 0 printed the (2,2,2,1) grid


@pytest.mark.mpi
def test_mesh_bad_size_raises_on_every_rank():
    out = run_mpi(4, f"{BODIES}::check_bad_mesh", timeout=60).stdout
    assert out.count("bad mesh rejected") == 4, out
    assert "needs 8 ranks (the product), but the world group has 4" in out



def test_describe_with_world_rank_names():
    text = _layout(2, 1, 2, 1).describe(names=[4, 5, 6, 7])
    assert "tp groups: [4 5] [6 7]" in text and "dp groups: [4 6] [5 7]" in text


def test_mesh_and_functional_are_part_of_the_comm_api():
    from minidist import comm
    from minidist.comm import functional, mesh

    assert comm.Mesh is mesh.Mesh
    assert comm.functional is functional
