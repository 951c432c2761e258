"""Point-to-point messages: every message minidist's collectives send starts here.

The algorithms (:mod:`minidist.comm.algorithms`), the public collectives and the check mode
send and receive only through the functions of this module, so this is the one place that

* turns an array into an MPI buffer without pickling: a contiguous host array viewed as raw
  bytes (``MPI.BYTE``).  That also carries dtypes MPI has no name for (bfloat16, float16);
  all ranks run on the same kind of machine, so byte order agrees.  CuPy arrays are staged
  through host memory (``backend.to_host``/``from_host``);
* counts every byte sent and received (and the time spent) under the current collective's
  name (:mod:`minidist.comm.stats`);
* applies the optional simulated link (:mod:`minidist.comm.links`);
* checks that each received message had exactly the expected size, so that ranks calling a
  collective with different shapes get an error instead of a silently wrong answer, and
  the expected identity (collective, op, dtype, size class: see :func:`identity`), so that
  ranks calling different collectives get a CollectiveMismatchError naming both calls;
* notes every blocking wait (what, peer, bytes) for the watchdog (comm/watchdog.py).

One wing bypasses it, on purpose: the cached plans of :mod:`minidist.comm.fast`.  They call
mpi4py themselves (``Sendrecv``/``Send``/``Recv`` on message descriptors built once, and
``Startall``/``Waitall`` on the persistent requests that :func:`persistent_round` made),
because one more Python call per message is a measurable part of a small collective
(docs/perf-notes.md).  They still check every received size and identity tag (precomputed
per plan), note each call for the watchdog (in fast.run), never run while the simulated
link is on, and charge each call's exact byte counts once, through ``stats.record_call``; the
tests check that ``comm.stats()`` reads the same with the fast path on and off.

Public functions take group-relative ranks and a :class:`~minidist.comm.group.Group`, and
talk on its ``user_comm``; collectives have a communicator of their own (``Group.comm``).
The underscored helpers take an mpi4py communicator and host NumPy arrays; the algorithms
use them.  Two things ride along every message at almost no cost: the collective's identity
in the MPI tag (checked on arrival: :func:`identity`), and the note of what this thread is
blocked on, for the watchdog (comm/watchdog.py).
"""

from __future__ import annotations

import os

import numpy as np
from mpi4py import MPI

from minidist.backend import from_host, to_host, xp
from minidist.comm import links, stats
from minidist.comm.errors import CollectiveMismatchError, CommError

# Tags at and above TAG_RESERVED carry collective traffic; user messages use smaller tags.
# The algorithms name a message's kind with these; on the wire a collective's data and meta
# messages carry its identity instead (see identity below), check-mode signatures TAG_CHECK.
TAG_RESERVED = 30000
TAG_COLLECTIVE = 30001
TAG_CHECK = 30002
TAG_META = 30003

# ------------------------------------------------------------- collective identity tags
# Every message of a collective carries the collective's identity in its MPI tag: name, op,
# dtype and size class (bit length of the input's byte size, where all ranks must pass the
# same size).  Receivers take the next message from the expected source with ANY_TAG and
# compare its tag, so ranks that call different collectives, ops or dtypes raise
# CollectiveMismatchError naming both calls, at no cost beyond one comparison per message.
# ANY_TAG is safe because collective traffic has a communicator of its own (Group.comm);
# users' send/recv go over Group.user_comm.  MINIDIST_COLLECTIVE_TAGS=0 turns it off.
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
    if os.environ.get("MINIDIST_COLLECTIVE_TAGS", "1").strip().lower() in ("0", "false", "no", "off"):
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
BYTE = MPI.BYTE
_tls = stats._tls


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


# ----------------------------------------------------------------------------- buffers
# Messages are described as ``[array, MPI.BYTE]``: the array's raw bytes (it must be
# C-contiguous and on the host), so every dtype travels the same way and nothing is pickled.

def _host_contiguous(x) -> np.ndarray:
    h = to_host(x)
    if not isinstance(h, np.ndarray):
        raise TypeError(f"expected an array, got {type(x).__name__}")
    if h.dtype.hasobject:
        raise TypeError(f"cannot send arrays of dtype {h.dtype} (Python objects) as raw bytes")
    return h if h.flags.c_contiguous else np.ascontiguousarray(h)


def _size_error(comm, src, tag, expected, got, what=None) -> CommError:
    me = comm.Get_rank()
    what = what or stats.current() or "p2p"
    return CommError(
        f"rank {me} expected a {expected}-byte message from rank {src} (tag {tag}) during "
        f"{what}, but {got} bytes arrived. The ranks probably called collectives with "
        f"different shapes/dtypes or in a different order; rerun with "
        f"MINIDIST_CHECK_COLLECTIVES=1 to see what each rank called.\n"
        f"Recent operations on this rank:\n{stats.format_recent()}")


def _check_status(comm, status, src, tag, expected, wire=None):
    """A received message's size, and its identity tag when it was received with ANY_TAG
    (``wire``: this rank's tag for it)."""
    if wire is not None and status.Get_tag() != wire:
        raise mismatch_error(comm, status.Get_source() if src == MPI.ANY_SOURCE else src, wire, status.Get_tag(),
                             status.Get_count(MPI.BYTE), expected)
    got = status.Get_count(MPI.BYTE)
    if got != expected:
        raise _size_error(comm, status.Get_source() if src == MPI.ANY_SOURCE else src, tag, expected, got)


def _truncated(comm, src, tag, expected, err, what=None, status=None, wire=None) -> CommError:
    """The error of a receive that failed: a message of another collective (its tag, which a
    truncated receive still reports, is not ``wire``), one too long, or another MPI error."""
    if wire is not None and status is not None and err.Get_error_class() == MPI.ERR_TRUNCATE \
            and status.Get_tag() != wire:
        return mismatch_error(comm, src, wire, status.Get_tag(), f"more than {expected}", expected)
    if err.Get_error_class() == MPI.ERR_TRUNCATE:
        return _size_error(comm, src, tag, expected, f"more than {expected}", what)
    return CommError(f"MPI error while receiving from rank {src} (tag {tag}): {err}")


def _charge(state, sent: int, received: int) -> None:
    """stats.count_bytes on a thread state already at hand."""
    counters, name = state.counters, state.label or "p2p"
    rec = counters.get(name)
    if rec is None:
        rec = counters[name] = [0, 0, 0, 0.0]
    rec[1] += sent
    rec[2] += received


# ------------------------------------------------- fast helpers on host arrays (internal)
# Each blocking MPI call is bracketed by ``state.wait = (what, comm, peer, bytes)`` and
# ``state.wait = None``: what the watchdog (comm/watchdog.py) reports if the call makes no
# progress for the timeout.  Two attribute stores on the thread state fetched anyway for
# the byte accounting.
def _send(comm, a: np.ndarray, dst: int, tag: int) -> None:
    nbytes = a.nbytes
    if links.enabled:
        links.delay(nbytes)
    state = _tls.state
    state.wait = ("send", comm, dst, nbytes)
    try:
        comm.Send([a, BYTE], dst, _wire(state, tag)[0])  # [buffer, BYTE]: raw bytes, whatever the dtype
    finally:
        state.wait = None
    _charge(state, nbytes, 0)


def _recv(comm, out: np.ndarray, src: int, tag: int) -> np.ndarray:
    state = _tls.state
    wire, rtag = _wire(state, tag)
    status = MPI.Status()
    state.wait = ("recv", comm, src, out.nbytes)
    try:
        comm.Recv([out, BYTE], src, rtag, status)
    except MPI.Exception as err:
        raise _truncated(comm, src, tag, out.nbytes, err, None, status, wire) from None
    finally:
        state.wait = None
    _check_status(comm, status, src, tag, out.nbytes, wire if rtag == ANY_TAG else None)
    _charge(state, 0, out.nbytes)
    return out


def _sendrecv(comm, a: np.ndarray, dst: int, out: np.ndarray, src: int, tag: int) -> np.ndarray:
    """Send ``a`` to ``dst`` while receiving ``out`` from ``src`` (deadlock-free exchange)."""
    if links.enabled:
        links.delay(a.nbytes)
    state = _tls.state
    wire, rtag = _wire(state, tag)
    status = MPI.Status()
    state.wait = ("sendrecv", comm, src, out.nbytes)
    try:
        comm.Sendrecv([a, BYTE], dst, wire, [out, BYTE], src, rtag, status)
    except MPI.Exception as err:
        raise _truncated(comm, src, tag, out.nbytes, err, None, status, wire) from None
    finally:
        state.wait = None
    if status.Get_count(BYTE) != out.nbytes or (rtag == ANY_TAG and status.Get_tag() != wire):
        _check_status(comm, status, src, tag, out.nbytes, wire if rtag == ANY_TAG else None)
    _charge(state, a.nbytes, out.nbytes)
    return out


def _isend(comm, a: np.ndarray, dst: int, tag: int):
    if links.enabled:
        links.delay(a.nbytes)
    state = _tls.state
    _charge(state, a.nbytes, 0)
    return comm.Isend([a, BYTE], dst, _wire(state, tag)[0])


def _irecv(comm, out: np.ndarray, src: int, tag: int):
    state = _tls.state
    _charge(state, 0, out.nbytes)
    return comm.Irecv([out, BYTE], src, _wire(state, tag)[1])


def _wait_recv(comm, req, src: int, tag: int, nbytes: int) -> None:
    """Complete a receive posted by :func:`_irecv`, checking the message's size and identity."""
    state = _tls.state
    wire, rtag = _wire(state, tag)
    status = MPI.Status()
    state.wait = ("recv", comm, src, nbytes)
    try:
        req.Wait(status)
    except MPI.Exception as err:
        raise _truncated(comm, src, tag, nbytes, err, None, status, wire) from None
    finally:
        state.wait = None
    _check_status(comm, status, src, tag, nbytes, wire if rtag == ANY_TAG else None)


def _exchange(comm, a: np.ndarray, dst: int, out: np.ndarray, src: int, tag: int, status=None):
    """Send ``a`` to ``dst`` while receiving into ``out`` from ``src``, for callers that learn
    something from the size that arrives (a row count, a wrong block): returns the bytes
    received, or the text "more than K" when the message did not fit ``out``'s K bytes.
    A message of another collective is reported like one of the wrong size, and its
    CollectiveMismatchError kept on the thread state (``state.mismatch``): the caller goes
    on (so that every rank gets to raise, see evengather.py), and launch raises it at the end."""
    if links.enabled:
        links.delay(a.nbytes)
    state = _tls.state
    wire, rtag = _wire(state, tag)
    status = MPI.Status() if status is None else status
    state.wait = ("sendrecv", comm, src, out.nbytes)
    try:
        comm.Sendrecv([a, BYTE], dst, wire, [out, BYTE], src, rtag, status)
    except MPI.Exception as err:
        if err.Get_error_class() != MPI.ERR_TRUNCATE:
            raise CommError(f"MPI error while receiving from rank {src} (tag {tag}): {err}") from None
        if rtag == ANY_TAG and status.Get_tag() != wire and state.mismatch is None:
            state.mismatch = mismatch_error(comm, src, wire, status.Get_tag(), f"more than {out.nbytes}", out.nbytes)
        _charge(state, a.nbytes, 0)
        return f"more than {out.nbytes}"
    finally:
        state.wait = None
    got = status.Get_count(BYTE)
    if rtag == ANY_TAG and status.Get_tag() != wire:
        if state.mismatch is None:
            state.mismatch = mismatch_error(comm, src, wire, status.Get_tag(), got, out.nbytes)
        _charge(state, a.nbytes, got)
        return f"{got} bytes of another call"  # a text: never the expected count
    _charge(state, a.nbytes, got)
    return got


def _waitall(requests) -> None:
    """Complete sends (or receives whose size the caller does not check)."""
    state = _tls.state
    state.wait = ("waitall", None, None, None)
    try:
        MPI.Request.Waitall(requests)
    finally:
        state.wait = None


# ------------------------------------------------------ one round of many messages at once
class _Round(list):
    """The requests of a round (receives first), and what :func:`_wait_round` checks."""

    __slots__ = ("comm", "sources", "wire")


def _post_round(comm, recvs, sends, tag: int) -> list:
    """Post a round: an Irecv per (buffer, source), then an Isend per (buffer, dest).
    Complete it with :func:`_wait_round`."""
    state = _tls.state
    wire, rtag = _wire(state, tag)
    reqs = _Round(comm.Irecv([buf, BYTE], src, rtag) for buf, src in recvs)
    reqs.comm, reqs.sources, reqs.wire = comm, [src for _, src in recvs], wire if rtag == ANY_TAG else None
    sent = 0
    for buf, dest in sends:
        if links.enabled:
            links.delay(buf.nbytes)
        reqs.append(comm.Isend([buf, BYTE], dest, wire))
        sent += buf.nbytes
    _charge(state, sent, 0)
    return reqs


def _wait_round(reqs, nrecv: int) -> list:
    """Wait for a whole round; the byte count of each of the first ``nrecv`` requests (the
    receives), or the text "more than K" for one that got more than its K-byte buffer.
    A message of another collective raises CollectiveMismatchError (once all are done)."""
    statuses = [MPI.Status() for _ in reqs]
    state = _tls.state
    state.wait = ("round", getattr(reqs, "comm", None), getattr(reqs, "sources", None), None)
    try:
        MPI.Request.Waitall(reqs, statuses)
        counts = [statuses[i].Get_count(MPI.BYTE) for i in range(nrecv)]
        tags = [statuses[i].Get_tag() for i in range(nrecv)]
    except MPI.Exception as err:
        tags = []
        counts = _settle(err, reqs, statuses, nrecv, tags)
    finally:
        state.wait = None
    wire = getattr(reqs, "wire", None)
    if wire is not None:
        for i, tag in enumerate(tags):
            if tag != wire:
                raise mismatch_error(reqs.comm, reqs.sources[i], wire, tag, counts[i])
    _charge(state, 0, sum(c for c in counts if type(c) is int))
    return counts


def _settle(err, reqs, statuses, nrecv, tags=None) -> list:
    """After a Waitall that failed: a truncated receive makes it stop and leave the later
    requests pending (MPI_ERR_IN_STATUS).  Complete those one by one (each may be
    truncated too), so that nothing of the round stays in flight, then give the counts
    (and append the receives' tags to ``tags``)."""
    if err.Get_error_class() not in (MPI.ERR_IN_STATUS, MPI.ERR_TRUNCATE):
        raise CommError(f"MPI error in a round of messages: {err}") from None
    counts = []
    for i, req in enumerate(reqs):
        status, code = statuses[i], statuses[i].Get_error()
        kind = MPI.SUCCESS if code == MPI.SUCCESS else MPI.Get_error_class(code)
        if kind == MPI.ERR_PENDING or err.Get_error_class() == MPI.ERR_TRUNCATE:
            status = MPI.Status()
            try:
                req.Wait(status)
                kind = MPI.SUCCESS
            except MPI.Exception as again:
                kind = again.Get_error_class()
        if i < nrecv:
            if tags is not None:
                tags.append(status.Get_tag())
            got = status.Get_count(BYTE)
            counts.append(f"more than {got}" if kind == MPI.ERR_TRUNCATE else got)
    return counts


def _persistent_round(comm, recvs, sends, tag: int, rtag: int | None = None) -> list:
    """The same round as persistent requests (``Recv_init``/``Send_init``, MPI 1.1): made
    once, then started and completed as often as needed (see fast/exchange.py).  ``tag``
    is sent; receives match ``rtag`` (default: ``tag``)."""
    rtag = tag if rtag is None else rtag
    reqs = [comm.Recv_init([buf, BYTE], src, rtag) for buf, src in recvs]
    return reqs + [comm.Send_init([buf, BYTE], dest, tag) for buf, dest in sends]


# ----------------------------------------------------------- public, group-relative API
def _check_peer(peer, group, what: str) -> int:
    if isinstance(peer, bool) or not isinstance(peer, (int, np.integer)) or not 0 <= peer < group.size:
        raise ValueError(f"{what}={peer!r} is not a rank of group {group.name!r} (size {group.size})")
    return int(peer)


def _check_tag(tag) -> int:
    if isinstance(tag, bool) or not isinstance(tag, (int, np.integer)) or not 0 <= tag < TAG_RESERVED:
        raise ValueError(f"tag={tag!r} must be an int in [0, {TAG_RESERVED}) "
                         f"(larger tags are reserved for collectives)")
    return int(tag)


def send(x, dst: int, group, tag: int = 0) -> None:
    """Blocking send of array ``x`` to group rank ``dst``."""
    dst, tag = _check_peer(dst, group, "dst"), _check_tag(tag)
    with stats.scope("send"):
        _send(group.user_comm, _host_contiguous(x), dst, tag)


def recv_into(out, src: int, group, tag: int = 0):
    """Blocking receive into the preallocated array ``out`` (its size must match exactly)."""
    src, tag = _check_peer(src, group, "src"), _check_tag(tag)
    host = to_host(out)
    direct = isinstance(host, np.ndarray) and host is out and out.flags.c_contiguous
    buf = out if direct else np.empty(out.shape, out.dtype)
    with stats.scope("recv"):
        _recv(group.user_comm, buf, src, tag)
    if not direct:
        out[...] = from_host(buf)
    return out


def recv(shape, dtype, src: int, group, tag: int = 0):
    """Blocking receive of a new array of ``shape``/``dtype`` from group rank ``src``."""
    return recv_into(xp.empty(shape, dtype), src, group, tag)


def sendrecv(x, dst: int, src: int, group, out=None, tag: int = 0):
    """Send ``x`` to ``dst`` and receive an array like ``x`` (or into ``out``) from ``src``."""
    dst, src = _check_peer(dst, group, "dst"), _check_peer(src, group, "src")
    tag = _check_tag(tag)
    sendbuf = _host_contiguous(x)
    target = out if out is not None else xp.empty(x.shape, x.dtype)
    host = to_host(target)
    direct = host is target and target.flags.c_contiguous
    buf = target if direct else np.empty(target.shape, target.dtype)
    with stats.scope("sendrecv"):
        _sendrecv(group.user_comm, sendbuf, dst, buf, src, tag)
    if not direct:
        target[...] = from_host(buf)
    return target


class Request:
    """Handle of a nonblocking send or receive: ``wait()`` completes it (a receive returns
    its array), ``is_completed()`` polls without blocking."""

    def __init__(self, comm, req, keep, out=None, staged=None, src=None, tag=None):
        self._comm, self._req, self._keep = comm, req, keep
        self._out, self._staged, self._src, self._tag = out, staged, src, tag
        self._done = False

    def is_completed(self) -> bool:
        if not self._done and self._req.Test():
            self.wait()
        return self._done

    def wait(self):
        if not self._done:
            with stats.scope("wait"):
                if self._out is None:
                    _waitall([self._req])
                else:
                    buf = self._staged if self._staged is not None else self._out
                    _wait_recv(self._comm, self._req, self._src, self._tag, buf.nbytes)
            if self._staged is not None:
                self._out[...] = from_host(self._staged)
            self._done, self._keep = True, None
        return self._out


def isend(x, dst: int, group, tag: int = 0) -> Request:
    """Start sending ``x`` to ``dst``; don't modify ``x`` before ``wait()``."""
    dst, tag = _check_peer(dst, group, "dst"), _check_tag(tag)
    buf = _host_contiguous(x)
    with stats.scope("isend"):
        req = _isend(group.user_comm, buf, dst, tag)
    return Request(group.user_comm, req, keep=buf)


def irecv(out, src: int, group, tag: int = 0) -> Request:
    """Start receiving into ``out`` from ``src``; ``wait()`` returns ``out``."""
    src, tag = _check_peer(src, group, "src"), _check_tag(tag)
    direct = to_host(out) is out and out.flags.c_contiguous
    staged = None if direct else np.empty(out.shape, out.dtype)
    with stats.scope("irecv"):
        req = _irecv(group.user_comm, out if direct else staged, src, tag)
    return Request(group.user_comm, req, keep=None, out=out, staged=staged, src=src, tag=tag)
