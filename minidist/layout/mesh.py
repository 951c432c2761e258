"""The mesh's axes and rank arithmetic: ranks arranged on a named ``dp x pp x cp x tp`` grid.

Large models combine several kinds of parallelism at once ("3D parallelism", Narayanan et
al. 2021, *Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM*;
"4D" once context parallelism joins).  Each rank gets a coordinate on every axis:

* ``dp`` data parallel (replicas of the model, each on its own slice of the batch),
* ``pp`` pipeline parallel (consecutive groups of layers, "stages"),
* ``cp`` context parallel (the sequence is split; ring attention / Ulysses),
* ``tp`` tensor parallel (each weight matrix is split; Megatron-LM, Shoeybi et al. 2019).

Layout: ``tp`` is the innermost (fastest-varying) axis, then ``cp``, then ``pp``; ``dp`` is the
outermost::

    world_rank = ((dp * PP + pp) * CP + cp) * TP + tp

Why this order: tensor parallelism exchanges activations in every layer, so its ranks should
be *consecutive* world ranks, which in a real cluster sit on the same node with the fastest
links (NVLink).  Data parallelism only all-reduces gradients once per step and can afford to
cross the slower inter-node network, so it goes outermost.

:data:`AXES` is the one axis order of minidist; :class:`MeshLayout` the coordinate
arithmetic.  :class:`minidist.comm.mesh.Mesh` adds the communicators.
"""

from __future__ import annotations

from itertools import combinations

AXES = ("dp", "pp", "cp", "tp")
"""Axis names from outermost (slowest-varying rank index) to innermost (fastest)."""


def _check_sizes(sizes: dict) -> None:
    for axis, n in sizes.items():
        if isinstance(n, bool) or not isinstance(n, int):
            raise ValueError(f"mesh axis {axis}={n!r} must be a positive int, got {type(n).__name__}")
        if n < 1:
            raise ValueError(f"mesh axis {axis}={n} must be a positive int")


def canonical_axes(axes) -> tuple[str, ...]:
    """``"tp"`` or ``("dp", "cp")`` as a tuple of distinct known axes in layout order.

    The order the caller lists the axes in does not matter: ``("cp", "dp")`` names the same
    group as ``("dp", "cp")``, and its ranks are ordered by the mesh layout (dp outer).
    """
    names = (axes,) if isinstance(axes, str) else tuple(axes)
    unknown = [a for a in names if a not in AXES]
    if unknown or not names:
        raise ValueError(f"unknown mesh axes {unknown or names!r}; choose from {AXES}")
    if len(set(names)) != len(names):
        raise ValueError(f"mesh axes {names!r} repeat an axis")
    return tuple(a for a in AXES if a in names)


class MeshLayout:
    """Pure rank <-> coordinate arithmetic of a ``dp × pp × cp × tp`` grid (no MPI)."""

    def __init__(self, dp: int = 1, pp: int = 1, tp: int = 1, cp: int = 1):
        self.shape = {"dp": dp, "pp": pp, "cp": cp, "tp": tp}
        _check_sizes(self.shape)
        self.world_size = dp * pp * cp * tp

    def __repr__(self):
        return "MeshLayout(" + ", ".join(f"{a}={self.shape[a]}" for a in AXES) + ")"

    def size(self, axes) -> int:
        """Number of ranks in a group along ``axes`` (the product of their sizes)."""
        n = 1
        for a in canonical_axes(axes):
            n *= self.shape[a]
        return n

    def coords(self, rank: int) -> dict[str, int]:
        """``{"dp": .., "pp": .., "cp": .., "tp": ..}`` of ``rank`` (mixed-radix digits)."""
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank!r} is outside the mesh of {self.world_size} ranks")
        out = {}
        for a in reversed(AXES):  # peel off the innermost digit first
            rank, out[a] = divmod(rank, self.shape[a])
        return {a: out[a] for a in AXES}

    def rank_of(self, **coords: int) -> int:
        """The rank at the given coordinates; every axis must be given."""
        unknown = sorted(set(coords) - set(AXES))
        missing = [a for a in AXES if a not in coords]
        if unknown or missing:
            raise ValueError(f"rank_of needs exactly the axes {AXES}: unknown {unknown}, missing {missing}")
        rank = 0
        for a in AXES:
            c = coords[a]
            if isinstance(c, bool) or not isinstance(c, int) or not 0 <= c < self.shape[a]:
                raise ValueError(f"coordinate {a}={c!r} is outside 0..{self.shape[a] - 1}")
            rank = rank * self.shape[a] + c
        return rank

    def members(self, axes, rank: int) -> tuple[int, ...]:
        """Ranks of ``rank``'s group along ``axes``, in group-rank order.

        Members share ``rank``'s coordinates on every *other* axis; they are listed with
        the mesh layout's order (the last listed axis varies fastest).
        """
        axes = canonical_axes(axes)
        fixed = self.coords(rank)
        out = [fixed]
        for a in axes:  # outer axis first, so the innermost varies fastest
            out = [{**c, a: i} for c in out for i in range(self.shape[a])]
        return tuple(self.rank_of(**c) for c in out)

    def color(self, axes, rank: int) -> int:
        """An id of ``rank``'s group along ``axes``: equal for exactly the members (for Split)."""
        axes = canonical_axes(axes)
        c = self.coords(rank)
        return self.rank_of(**{a: (0 if a in axes else c[a]) for a in AXES})

    def partition(self, axes) -> list[tuple[int, ...]]:
        """All groups along ``axes``: they partition the ranks (sorted by first member)."""
        groups = {self.members(axes, r) for r in range(self.world_size)}
        return sorted(groups)

    def describe(self, names=None) -> str:
        """A table of every rank's coordinates and the groups of each axis.

        ``names[r]`` is printed for rank r (e.g. its COMM_WORLD rank when the mesh spans a
        sub-group); by default the rank itself.
        """
        names = list(range(self.world_size)) if names is None else list(names)
        lines = [f"Mesh {' x '.join(f'{a}={self.shape[a]}' for a in AXES)} = {self.world_size} ranks"
                 "  (tp innermost: consecutive ranks; dp outermost)",
                 "rank  " + " ".join(f"{a:>3}" for a in AXES)]
        for r in range(self.world_size):
            c = self.coords(r)
            lines.append(f"{names[r]:>4}  " + " ".join(f"{c[a]:>3}" for a in AXES))
        for a in reversed(AXES):
            groups = " ".join("[" + " ".join(str(names[r]) for r in g) + "]" for g in self.partition(a))
            note = "  (size 1: every rank alone)" if self.shape[a] == 1 else ""
            lines.append(f"{a} groups: {groups}{note}")
        return "\n".join(lines)


def all_axis_sets() -> list[tuple[str, ...]]:
    """Every non-empty set of axes, in one fixed order (every rank creates groups in it)."""
    return [combo for k in range(1, len(AXES) + 1) for combo in combinations(AXES, k)]
