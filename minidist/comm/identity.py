"""Collective identity tags: every message of a collective says which call it belongs to.

Each message of a collective carries the collective's identity in its MPI tag: name, op,
dtype, size class (bit length of the input's byte size, where all ranks must pass the same
size), the algorithm that runs (it fixes the message pattern: a ring and recursive doubling
move the same bytes in different messages) and, for broadcast, reduce, scatter and gather,
the root (for ppermute, in the same bits, a hash of its (src, dst) pairs).  Receivers take
the next message from the expected source with ANY_TAG and compare its tag, so ranks that
call different collectives, or one with different ops, dtypes, sizes, algorithms or roots,
raise CollectiveMismatchError naming both calls, at no cost beyond one comparison per
message (p2p.py does the comparing; the fast/ plans precompute their tags).  ANY_TAG is safe
because collective traffic has a communicator of its own (Group.comm); users' send/recv go
over Group.user_comm.  MINIDIST_COLLECTIVE_TAGS=0 turns it off.

The tag, from the low bits up: 1 bit data/header message, then the code

    name 4 | op 3 | dtype 5 | size class 6 | algorithm 3 | root (ROOT_BITS)

added to IDENT_BASE.  MPI promises only tags up to 32767 (MPI_TAG_UB says how far this one
goes: 2^29 - 1 for MPICH, 2^23 - 1 for Open MPI over UCX), so the code takes what fits: the
first 18 bits are needed (with less room, identity tags are off), the algorithm's 3 come
next, and the root gets the bits left, up to 16: 6 under MPICH, so it travels as root mod
64.  Two roots equal mod 2^ROOT_BITS look alike, which only a group of more than 2^ROOT_BITS
ranks can meet; with no bits left (a tag bound under 2^22 + 2^16) roots are not compared.

Roots need one more thing.  In every rooted algorithm the root only sends (broadcast,
scatter) or only receives (reduce, gather), and ranks that disagree on the root each act as
a root: when every rank passes its own rank, no message is ever received (a small broadcast
returns each rank's own data; a large one, or a reduce, waits forever).  So a rooted call
first exchanges one empty message around the ring (rank r sends to r+1 and receives from
r-1; check.handshake), carrying the call's identity: a pattern that does not depend on the
root, so it cannot hang, and makes every rank whose left neighbour passed another root (or
made another call) raise before any data moves.  It costs one message latency per rooted
call and no bytes (comm.stats() and the traffic formulas are unchanged), which is also why
the root is not sent as data: the tag has to hold it.  A rank whose left neighbour agrees
with it, while a rank further on does not, goes on into the algorithm; there the raising
ranks' errors end the job (the abort hook of comm.world()), or the watchdog does.  With
the check mode on (MINIDIST_CHECK_COLLECTIVES=1) every rank compares every rank's call
first instead, root included.

Not in the tag: the group.  Ranks that call a collective on different groups talk on
different communicators, where no message of one can reach the other: each waits for
messages that never come, and the watchdog reports the group each rank waits on.
"""

from __future__ import annotations

from mpi4py import MPI

from minidist.host import env
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
          "all_to_all", "ppermute", "barrier", "all_to_all_v")  # 4 bits
_OPS = ("", "sum", "avg", "max", "min")  # 3 bits
_DTYPES = ("", "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float16",
           "bfloat16", "float32", "float64", "complex64", "complex128")  # 5 bits; 31 = another dtype
# The algorithm (3 bits; 0: none named): what the general path's choice is called, per collective.
# all_gather's "pair_even" sends the one-shot round's messages, so it shares "direct"'s code.
ALGORITHMS = {
    "all_reduce": ("recursive_doubling", "pairwise", "ring", "rabenseifner"),
    "reduce_scatter": ("direct", "halving", "pipelined_ring", "pairwise", "ring"),
    "all_gather": ("direct", "doubling", "even_ring", "pair", "ring_rows", "bruck"),
    "broadcast": ("binomial", "chain"),
    "reduce": ("binomial", "chain"),
}
ROOTED = ("broadcast", "reduce", "scatter", "gather")
_ALIASES = {("all_gather", "pair_even"): "direct"}
_NEEDED_BITS = 4 + 3 + 5 + 6  # name, op, dtype, size class
_ALGORITHM_SHIFT, _ROOT_SHIFT = _NEEDED_BITS, _NEEDED_BITS + 3
_NAME_CODE = {n: i for i, n in enumerate(_NAMES)}
_OP_CODE = {o: i for i, o in enumerate(_OPS)}
_ALGORITHM_CODE = {(name, a): i for name, algos in ALGORITHMS.items() for i, a in enumerate(algos, 1)}
_ALGORITHM_CODE.update({key: _ALGORITHM_CODE[key[0], alias] for key, alias in _ALIASES.items()})
_DTYPE_CODE: dict = {}  # dtype object -> code, filled as dtypes come


def _code_bits(tag_ub: int) -> int:
    """Bits of code whose tags (IDENT_BASE + 2 * code + 1 at most) stay within ``tag_ub``:
    the 18 needed ones, the algorithm's 3 if they fit, and the root's up to 16; 0 when even
    the needed ones do not fit."""
    room = (tag_ub - IDENT_BASE + 1).bit_length() - 2 if tag_ub > IDENT_BASE else -1
    if room < _NEEDED_BITS:
        return 0
    return _NEEDED_BITS if room < _ROOT_SHIFT else min(room, _ROOT_SHIFT + 16)


def _tags_wanted() -> bool:
    return bool(env.get("MINIDIST_COLLECTIVE_TAGS")) and CODE_BITS > 0


CODE_BITS = _code_bits(MPI.COMM_WORLD.Get_attr(MPI.TAG_UB) or 0)
ROOT_BITS = max(0, CODE_BITS - _ROOT_SHIFT)  # the root travels as root mod 2^ROOT_BITS
_ALGORITHM_MASK = 7 if CODE_BITS > _NEEDED_BITS else 0
_ROOT_MASK = (1 << ROOT_BITS) - 1
tags_enabled = _tags_wanted()


def _dtype_code(dtype) -> int:
    if dtype is None:
        return 0
    code = _DTYPE_CODE.get(dtype)
    if code is None:
        from minidist.model.backend import dtype_name

        name = dtype_name(dtype)
        code = _DTYPE_CODE[dtype] = _DTYPES.index(name) if name in _DTYPES else 31
    return code


def identity(name: str, op: str = "", dtype=None, nbytes: int | None = None, algorithm: str | None = None,
             root: int | None = None) -> int | None:
    """The tag of the data messages of collective ``name`` (``op``, ``dtype``, ``nbytes``
    where every rank must pass the same size, the ``algorithm`` that runs and the ``root``
    of a rooted collective), or None with identity tags off."""
    if not tags_enabled:
        return None
    size = 0 if nbytes is None else min(int(nbytes).bit_length() + 1, 63)
    code = _NAME_CODE.get(name, 0) | _OP_CODE.get(op, 0) << 4 | _dtype_code(dtype) << 7 | size << 12
    if algorithm is not None:
        code |= (_ALGORITHM_CODE.get((name, algorithm), 0) & _ALGORITHM_MASK) << _ALGORITHM_SHIFT
    if root is not None:
        code |= (int(root) & _ROOT_MASK) << _ROOT_SHIFT
    return IDENT_BASE + (code << 1)


def describe_tag(tag: int, group_size: int | None = None) -> str:
    """A message's tag in words: the call it belongs to, e.g. 'all_reduce(op=sum, float32,
    [2 KiB, 4 KiB)) by recursive_doubling' or 'broadcast(int64, [32 B, 64 B), root=1) by
    binomial' (a root is exact on groups of up to 2^ROOT_BITS ranks, ``group_size``; on
    larger or unknown ones, taken mod 2^ROOT_BITS)."""
    if tag == TAG_CHECK:
        return "a check-mode signature (MINIDIST_CHECK_COLLECTIVES is on there)"
    if not IDENT_BASE <= tag < IDENT_BASE + (2 << CODE_BITS):
        return f"a message with tag {tag} (collective identity tags off there?)"
    code, meta = divmod(tag - IDENT_BASE, 2)
    name, op, dt, size = code & 15, code >> 4 & 7, code >> 7 & 31, code >> 12 & 63
    algorithm, root = code >> _ALGORITHM_SHIFT & 7, code >> _ROOT_SHIFT
    called = _NAMES[name] if name < len(_NAMES) else "?"
    parts = [f"op={_OPS[op]}"] if 0 < op < len(_OPS) else []
    if dt:
        parts.append(_DTYPES[dt] if dt < len(_DTYPES) else "another dtype")
    if size:  # the bit length of the input's byte size: [2^(size-2), 2^(size-1)) bytes
        parts.append("0 bytes" if size == 1 else f"[{_bytes(1 << (size - 2))}, {_bytes(1 << (size - 1))})")
    if called in ROOTED and ROOT_BITS:
        exact = group_size is not None and group_size <= 1 << ROOT_BITS
        parts.append(f"root={root}" if exact else f"root={root} (mod {1 << ROOT_BITS})")
    elif called == "ppermute" and ROOT_BITS:
        parts.append(f"pairs #{root}")  # a hash of the (src, dst) pairs
    call = f"{called}({', '.join(parts)})"
    algos = ALGORITHMS.get(called, ())
    if 0 < algorithm <= len(algos):
        call += f" by {algos[algorithm - 1]}"
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
    me, n = comm.Get_rank(), comm.Get_size()
    sizes = "" if nbytes is None or nbytes == expected == 0 else \
        f" ({nbytes} bytes{'' if expected in (None, nbytes) else f' where {expected} were expected'})"
    ours, theirs = describe_tag(mine, n), describe_tag(got, n)
    hint = ""
    if ours.startswith("all_gather(") and theirs.startswith("all_gather(") and " by " in ours + theirs:
        hint = "  (out= picks the all-gather's algorithm: pass it on every rank or on none, of one shape.)"
    return CollectiveMismatchError(
        f"rank {me}{_where(comm)} called {ours} but rank {src} sent {theirs}{sizes}: the ranks called "
        f"different collectives, or one with different ops, dtypes, sizes, roots or algorithms, or "
        f"collectives in a different order.{hint}  MINIDIST_CHECK_COLLECTIVES=1 also compares shapes "
        f"before any data moves.\n"
        f"Recent operations on this rank:\n{stats.format_recent()}")


_comm_names: dict = {}  # MPI handle of a collective communicator -> its group's name


def name_comm(comm, name: str) -> None:
    """Name ``comm`` (a Group's) in error messages."""
    _comm_names[comm.py2f()] = name


def _where(comm) -> str:
    name = _comm_names.get(comm.py2f())
    return f" of group {name!r} (world rank {MPI.COMM_WORLD.Get_rank()})" if name else ""
