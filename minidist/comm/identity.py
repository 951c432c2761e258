"""Collective identity tags: every message of a collective says which call it belongs to.

Each message of a collective carries the collective's identity in its MPI tag: name, op,
dtype and size class (bit length of the input's byte size, where all ranks must pass the
same size).  Receivers take the next message from the expected source with ANY_TAG and
compare its tag, so ranks that call different collectives, ops or dtypes raise
CollectiveMismatchError naming both calls, at no cost beyond one comparison per message
(p2p.py does the comparing; the fast/ plans precompute their tags).  ANY_TAG is safe because
collective traffic has a communicator of its own (Group.comm); users' send/recv go over
Group.user_comm.  MINIDIST_COLLECTIVE_TAGS=0 turns it off.
"""

from __future__ import annotations

from mpi4py import MPI

from minidist import env
from minidist.comm import stats
from minidist.comm.errors import CollectiveMismatchError

# The kinds of message the algorithms name (p2p re-exports them).  Tags at and above
# TAG_RESERVED carry collective traffic; user messages use smaller tags.  On the wire a
# collective's data and meta messages carry its identity instead, check-mode signatures TAG_CHECK.
TAG_RESERVED = 30000
TAG_COLLECTIVE = 30001
TAG_CHECK = 30002
TAG_META = 30003

IDENT_BASE = 1 << 16  # identity tags: IDENT_BASE + 2 * code (data) or + 1 (meta)
_NAMES = ("?", "all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce", "scatter", "gather",
          "all_to_all", "ppermute", "barrier")  # 4 bits
_OPS = ("", "sum", "avg", "max", "min")  # 3 bits
_DTYPES = ("", "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float16",
           "bfloat16", "float32", "float64", "complex64", "complex128")  # 5 bits; 31 = another dtype
_CODE_BITS = 4 + 3 + 5 + 6
_NAME_CODE = {n: i for i, n in enumerate(_NAMES)}
_OP_CODE = {o: i for i, o in enumerate(_OPS)}
_DTYPE_CODE: dict = {}  # dtype object -> code, filled as dtypes come


def _tags_wanted() -> bool:
    if not env.get("MINIDIST_COLLECTIVE_TAGS"):
        return False
    # MPI only promises tags up to 32767; identity tags need IDENT_BASE + 2^19.
    return (MPI.COMM_WORLD.Get_attr(MPI.TAG_UB) or 0) >= IDENT_BASE + (2 << _CODE_BITS)


tags_enabled = _tags_wanted()


def _dtype_code(dtype) -> int:
    if dtype is None:
        return 0
    code = _DTYPE_CODE.get(dtype)
    if code is None:
        from minidist.backend import dtype_name

        name = dtype_name(dtype)
        code = _DTYPE_CODE[dtype] = _DTYPES.index(name) if name in _DTYPES else 31
    return code


def identity(name: str, op: str = "", dtype=None, nbytes: int | None = None) -> int | None:
    """The tag of the data messages of collective ``name`` (``op``, ``dtype``, and ``nbytes``
    where every rank must pass the same size), or None with identity tags off."""
    if not tags_enabled:
        return None
    size = 0 if nbytes is None else min(int(nbytes).bit_length() + 1, 63)
    code = _NAME_CODE.get(name, 0) | _OP_CODE.get(op, 0) << 4 | _dtype_code(dtype) << 7 | size << 12
    return IDENT_BASE + (code << 1)


def describe_tag(tag: int) -> str:
    """A message's tag in words: the call it belongs to, e.g. 'all_reduce(op=sum, float32, [2 KiB, 4 KiB))'."""
    if tag == TAG_CHECK:
        return "a check-mode signature (MINIDIST_CHECK_COLLECTIVES is on there)"
    if not IDENT_BASE <= tag < IDENT_BASE + (2 << _CODE_BITS):
        return f"a message with tag {tag} (collective identity tags off there?)"
    code, meta = divmod(tag - IDENT_BASE, 2)
    name, op, dt, size = code & 15, code >> 4 & 7, code >> 7 & 31, code >> 12
    parts = [f"op={_OPS[op]}"] if 0 < op < len(_OPS) else []
    if dt:
        parts.append(_DTYPES[dt] if dt < len(_DTYPES) else "another dtype")
    if size:  # the bit length of the input's byte size: [2^(size-2), 2^(size-1)) bytes
        parts.append("0 bytes" if size == 1 else f"[{_bytes(1 << (size - 2))}, {_bytes(1 << (size - 1))})")
    call = f"{_NAMES[name] if name < len(_NAMES) else '?'}({', '.join(parts)})"
    return call + (" (its header)" if meta else "")


def _bytes(n: int) -> str:
    """A power of two in bytes, e.g. 512 B, 4 KiB, 2 MiB."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n} {unit}"
        n //= 1024
    return str(n)


def _wire(state, tag: int):
    """(tag to send with, tag to receive with) for a message of kind ``tag`` on this thread:
    the running collective's identity and ANY_TAG (compared on arrival) for its data and
    meta messages; ``tag`` itself for user messages and check-mode signatures."""
    ident = state.ident
    if ident is None or tag < TAG_RESERVED or tag == TAG_CHECK:
        return tag, tag
    return ident + (tag == TAG_META), ANY_TAG


ANY_TAG = MPI.ANY_TAG


def mismatch_error(comm, src, mine: int, got: int, nbytes=None, expected=None) -> CollectiveMismatchError:
    """The error of a message whose identity tag is not this rank's call's (``nbytes``: its
    size, where ``expected`` bytes were expected)."""
    me = comm.Get_rank()
    sizes = "" if nbytes is None else f" ({nbytes} bytes{'' if expected in (None, nbytes) else f' where {expected} were expected'})"
    return CollectiveMismatchError(
        f"rank {me}{_where(comm)} called {describe_tag(mine)} but rank {src} sent {describe_tag(got)}{sizes}: "
        f"the ranks called different collectives, ops or dtypes (or sizes), or collectives in a different "
        f"order.  MINIDIST_CHECK_COLLECTIVES=1 also compares shapes before any data moves.\n"
        f"Recent operations on this rank:\n{stats.format_recent()}")


_comm_names: dict = {}  # MPI handle of a collective communicator -> its group's name


def name_comm(comm, name: str) -> None:
    """Name ``comm`` (a Group's) in error messages."""
    _comm_names[comm.py2f()] = name


def _where(comm) -> str:
    name = _comm_names.get(comm.py2f())
    return f" of group {name!r} (world rank {MPI.COMM_WORLD.Get_rank()})" if name else ""
