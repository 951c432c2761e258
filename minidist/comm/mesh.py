"""The device mesh: one process group per set of axes of the ``dp x pp x cp x tp`` grid.

Large models combine several kinds of parallelism at once (Narayanan et al. 2021, *Efficient
Large-Scale Language Model Training on GPU Clusters Using Megatron-LM*).  The ranks that
differ only in their ``tp`` coordinate form a *tp group*, and so on for the other axes; every
strategy only talks to the group of its own axis.

The axes, their order (tp innermost, dp outermost) and the rank <-> coordinate arithmetic
are :mod:`minidist.layout.mesh` (no MPI); :class:`Mesh` adds the communicators, built with
``Split`` on the parent communicator.
"""

from __future__ import annotations

from minidist.comm import sentinel
from minidist.comm.group import Group, world as world_group
from minidist.layout.mesh import AXES, MeshLayout, all_axis_sets, canonical_axes


class Mesh:
    """A ``dp × pp × cp × tp`` grid over a group of ranks, with a Group per set of axes.

    ``Mesh(dp=2, pp=2, tp=2)`` on 8 ranks; ``mesh.group("tp")`` is this rank's tensor-parallel
    group, ``mesh.group(("dp", "cp"))`` the group spanning both axes (e.g. the ranks that
    share gradients when context parallelism also splits the batch's sequences).

    All groups are created in the constructor, in the same order on every rank, because
    ``Split`` is collective over the parent communicator: creating them lazily would deadlock
    as soon as two ranks asked for different groups first.  Axis sets that contain the same
    ranks (because the other axes have size 1) share one Group.
    """

    def __init__(self, dp: int = 1, pp: int = 1, tp: int = 1, cp: int = 1, world=None):
        # Validate everything before any communication: every rank sees the same
        # arguments, so every rank raises the same error and nobody is left waiting.
        self.layout = MeshLayout(dp=dp, pp=pp, tp=tp, cp=cp)
        if world is None:
            world = world_group()
        if world.size != self.layout.world_size:
            sizes = ", ".join(f"{a}={self.layout.shape[a]}" for a in AXES)
            raise ValueError(f"mesh {sizes} needs {self.layout.world_size} ranks "
                             f"(the product), but the world group has {world.size}")
        self.world = world
        self.rank = world.rank
        self._groups = self._build_groups()
        if world.size == world_group().size:  # the job's mesh: its sentinel names a killed rank by it
            sentinel.describe(" ".join(f"{a}{c}" for a, c in self.coords.items() if self.layout.shape[a] > 1))

    def _build_groups(self) -> dict:
        groups, by_ranks = {}, {}
        for axes in all_axis_sets():
            # The axes of size > 1 decide who is in the group; reuse identical groups.
            key = tuple(a for a in axes if self.layout.shape[a] > 1)
            if key not in by_ranks:
                if self.layout.size(axes) == self.world.size:
                    # Spans everyone: the world's ranks, under the axes' name, so that traffic
                    # is counted per axis (comm.stats.bytes_by_group).
                    by_ranks[key] = Group(self.world.user_comm.Dup(), name="+".join(key) if key else "self")
                else:
                    color = self.layout.color(axes, self.rank)
                    position = self.layout.members(axes, self.rank).index(self.rank)
                    sub = self.world.comm.Split(color, position)
                    by_ranks[key] = Group(sub, name="+".join(key) if key else "self")
            groups[axes] = by_ranks[key]
        return groups

    def group(self, axes):
        """This rank's Group along one axis (``"tp"``) or several (``("dp", "cp")``)."""
        return self._groups[canonical_axes(axes)]

    def size(self, axes) -> int:
        """Number of ranks along ``axes`` (e.g. ``mesh.size("tp")``)."""
        return self.layout.size(axes)

    @property
    def shape(self) -> dict[str, int]:
        return dict(self.layout.shape)

    @property
    def coords(self) -> dict[str, int]:
        """This rank's coordinates, e.g. ``{"dp": 1, "pp": 0, "cp": 0, "tp": 1}``."""
        return self.layout.coords(self.rank)

    def coord(self, axis: str) -> int:
        """This rank's coordinate on one axis (equals its rank inside ``group(axis)``)."""
        if not isinstance(axis, str):
            raise ValueError(f"coord() takes one axis name, got {axis!r}")
        (axis,) = canonical_axes(axis)
        return self.coords[axis]

    def rank_of(self, **coords: int) -> int:
        """Rank (in the mesh's world group) at ``coords``; omitted axes keep this rank's value.

        ``mesh.rank_of(pp=mesh.coord("pp") + 1)`` is the next pipeline stage's rank with the
        same dp/cp/tp coordinates.
        """
        unknown = sorted(set(coords) - set(AXES))
        if unknown:
            raise ValueError(f"unknown mesh axes {unknown} in rank_of; choose from {AXES}")
        return self.layout.rank_of(**{**self.coords, **coords})

    def describe(self) -> str:
        """The grid: each rank's coordinates and who forms each group (COMM_WORLD ranks)."""
        return self.layout.describe(names=self.world.world_ranks)

    __str__ = describe

    def __repr__(self):
        return f"Mesh({', '.join(f'{a}={self.layout.shape[a]}' for a in AXES)}) rank {self.rank}"
