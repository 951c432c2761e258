"""Point-to-point messages: every message minidist's collectives send starts here.

The algorithms (:mod:`minidist.comm.algorithms`), the public collectives and the check mode
send and receive only through the functions of this module, so this is the one place that

* turns an array into an MPI buffer without pickling: a contiguous host array viewed as raw
  bytes (``MPI.BYTE``).  That also carries dtypes MPI has no name for (bfloat16, float16);
  all ranks run on the same kind of machine, so byte order agrees.  CuPy arrays are staged
  through host memory (``backend.to_host``/``from_host``);
* counts every byte sent and received (and the time spent) under the current collective's
  name, and every byte sent under the name of the group it travels on
  (:mod:`minidist.comm.stats`);
* applies the optional simulated link (:mod:`minidist.comm.links`);
* checks that each received message had exactly the expected size, so that ranks calling a
  collective with different shapes get an error instead of a silently wrong answer, and
  the expected identity (collective, op, dtype, size class, algorithm, root: see
  identity.py), so that ranks calling different collectives, or one with different
  arguments, get a CollectiveMismatchError naming both calls;
* notes every blocking wait (what, peer, bytes) for the watchdog (comm/watchdog.py).

One wing bypasses it, on purpose: the cached plans of :mod:`minidist.comm.fast`.  They call
mpi4py themselves (``Sendrecv``/``Send``/``Recv`` on message descriptors built once, and
``Startall``/``Waitall`` on the persistent requests that ``rounds.persistent_round`` made;
the all-to-all-v plan also ``Isend``/``Irecv`` of each call's rows),
because one more Python call per message is a measurable part of a small collective
(docs/perf-notes.md).  They still check every received size and identity tag (precomputed
per plan), note each call for the watchdog (in fast.run, fast.all_to_all_v), never run while the simulated
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

import numpy as np
from mpi4py import MPI

from minidist.host import env
from minidist.model.backend import BACKEND, from_host, on_device, synchronize, to_host, xp
from minidist.comm import links, stats
from minidist.comm.errors import CommError
# The kinds of message (TAG_*) are re-exported: the algorithms name their messages by them.
from minidist.comm.identity import TAG_CHECK, TAG_COLLECTIVE, TAG_META, TAG_RESERVED, _wire, mismatch_error

__all__ = ["TAG_CHECK", "TAG_COLLECTIVE", "TAG_META", "TAG_RESERVED"]  # and the functions below


ANY_TAG = MPI.ANY_TAG
BYTE = MPI.BYTE
_tls = stats._tls
trace = None
"""The running tracer (minidist/observe/trace.py), or None: every helper below times its message
for the timeline only when it is set (one module-level None check before and after)."""


# ----------------------------------------------------------------------------- buffers
# Messages are described as ``[array, MPI.BYTE]``: the array's raw bytes (it must be
# C-contiguous and on the host), so every dtype travels the same way and nothing is pickled.

# With a CUDA-aware MPI (MINIDIST_CUDA_AWARE_MPI=1) the user-facing send/recv calls below hand
# CuPy arrays to MPI as they are (mpi4py passes their device address), after the stream's
# queued work is done (_send_buffer, _receive_buffer); the collectives' algorithms still stage
# through host memory.
CUDA_AWARE = BACKEND == "cupy" and env.get("MINIDIST_CUDA_AWARE_MPI")


def _direct(a) -> bool:
    """``a`` can be an MPI buffer as it is: contiguous, and on the host or CUDA-aware."""
    return a.flags.c_contiguous and (CUDA_AWARE or not on_device(a))


def _receive_buffer(out):
    """Where MPI writes a message for ``out``: ``out`` itself where it can (:func:`_direct`),
    else a host buffer to stage it in.  A device ``out`` waits for the stream's queued work
    first: MPI writes outside the stream's order, and the memory pool may have given ``out``
    memory that queued kernels still read."""
    if not _direct(out):
        return np.empty(out.shape, out.dtype)
    if on_device(out):
        synchronize()
    return out


def _send_buffer(x):
    """What MPI reads to send ``x``: its bytes, contiguous, on the host (staged there from
    the device) or, with a CUDA-aware MPI, on the device."""
    if CUDA_AWARE and on_device(x):
        x = xp.ascontiguousarray(x)  # a copy kernel where x is a strided view
        synchronize()  # the kernels that wrote x, and that copy, must finish before MPI reads it
        return x
    h = to_host(x)  # a device array's copy is a staging span on the timeline (backend.to_host)
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
        raise mismatch_error(comm, src, wire, status.Get_tag(), status.Get_count(MPI.BYTE), expected)
    got = status.Get_count(MPI.BYTE)
    if got != expected:
        raise _size_error(comm, src, tag, expected, got)


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
    """Charge ``sent``/``received`` bytes to the collective running on this thread (its
    counters in ``state``); ``sent`` also counts on the group the running scope names
    (``state.grec``, its record: no lookup)."""
    counters, name = state.counters, state.label or "p2p"
    rec = counters.get(name)
    if rec is None:
        rec = counters[name] = [0, 0, 0, 0.0]
    rec[1] += sent
    rec[2] += received
    state.grec[0] += sent


# ------------------------------------------------- fast helpers on host arrays (internal)
# Each blocking MPI call is bracketed by ``state.wait = (what, comm, peer, bytes)`` and
# ``state.wait = None``: what the watchdog (comm/watchdog.py) reports if the call makes no
# progress for the timeout.  Two attribute stores on the thread state fetched anyway for
# the byte accounting.
def _send(comm, a: np.ndarray, dst: int, tag: int) -> None:
    nbytes = a.nbytes
    tr = trace  # read once: trace.stop() on another thread may clear it meanwhile
    t0 = tr.clock() if tr is not None else 0.0
    if links.enabled:
        links.delay(nbytes, comm, dst)
    state = _tls.state
    state.wait = ("send", comm, dst, nbytes)
    try:
        comm.Send([a, BYTE], dst, _wire(state, tag)[0])  # [buffer, BYTE]: raw bytes, whatever the dtype
    finally:
        state.wait = None
    _charge(state, nbytes, 0)
    if t0 and tr is not None:
        tr.message("send", dst, nbytes, 0, t0)


def _recv(comm, out: np.ndarray, src: int, tag: int) -> np.ndarray:
    tr = trace  # read once: trace.stop() on another thread may clear it meanwhile
    t0 = tr.clock() if tr is not None else 0.0
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
    if t0 and tr is not None:
        tr.message("recv", src, 0, out.nbytes, t0)
    return out


def _isend(comm, a: np.ndarray, dst: int, tag: int):
    tr = trace  # read once: trace.stop() on another thread may clear it meanwhile
    t0 = tr.clock() if tr is not None else 0.0
    if links.enabled:
        links.delay(a.nbytes, comm, dst)
    state = _tls.state
    _charge(state, a.nbytes, 0)
    req = comm.Isend([a, BYTE], dst, _wire(state, tag)[0])
    if t0 and tr is not None:  # its bytes count when posted, as in the counters
        tr.message("isend", dst, a.nbytes, 0, t0)
    return req


def _irecv(comm, out: np.ndarray, src: int, tag: int):
    tr = trace  # read once: trace.stop() on another thread may clear it meanwhile
    t0 = tr.clock() if tr is not None else 0.0
    state = _tls.state
    _charge(state, 0, out.nbytes)
    req = comm.Irecv([out, BYTE], src, _wire(state, tag)[1])
    if t0 and tr is not None:
        tr.message("irecv", src, 0, out.nbytes, t0)
    return req


def _wait_recv(comm, req, src: int, tag: int, nbytes: int) -> None:
    """Complete a receive posted by :func:`_irecv`, checking the message's size and identity."""
    tr = trace  # read once: trace.stop() on another thread may clear it meanwhile
    t0 = tr.clock() if tr is not None else 0.0
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
    if t0 and tr is not None:
        tr.message("wait recv", src, 0, 0, t0)


def _exchange(comm, a: np.ndarray, dst: int, out: np.ndarray, src: int, tag: int, status=None):
    """Send ``a`` to ``dst`` while receiving into ``out`` from ``src``, for callers that learn
    something from the size that arrives (a row count, a wrong block): returns the bytes
    received, or the text "more than K" when the message did not fit ``out``'s K bytes.
    A message of another collective is reported like one of the wrong size, and its
    CollectiveMismatchError kept on the thread state (``state.mismatch``): the caller goes
    on (so that every rank gets to raise, see evengather.py), and launch raises it at the end."""
    tr = trace  # read once: trace.stop() on another thread may clear it meanwhile
    t0 = tr.clock() if tr is not None else 0.0
    if links.enabled:
        links.delay(a.nbytes, comm, dst)
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
    if t0 and tr is not None:
        tr.message("sendrecv", (dst, src), a.nbytes, got, t0)
    return got


def _sendrecv(comm, a: np.ndarray, dst: int, out: np.ndarray, src: int, tag: int) -> np.ndarray:
    """Send ``a`` to ``dst`` while receiving ``out`` from ``src`` (deadlock-free exchange):
    :func:`_exchange`, and a message of another size or collective raises here."""
    got = _exchange(comm, a, dst, out, src, tag)
    if got != out.nbytes:
        state = _tls.state
        mismatch = state.mismatch  # another collective's message (this one's, or an earlier one's)
        if mismatch is not None:
            state.mismatch = None
            raise mismatch
        raise _size_error(comm, src, tag, out.nbytes, got)
    return out


def _waitall(requests) -> None:
    """Complete sends (or receives whose size the caller does not check)."""
    tr = trace  # read once: trace.stop() on another thread may clear it meanwhile
    t0 = tr.clock() if tr is not None else 0.0
    state = _tls.state
    state.wait = ("waitall", None, None, None)
    try:
        MPI.Request.Waitall(requests)
    finally:
        state.wait = None
    if t0 and tr is not None:
        tr.message("wait", None, 0, 0, t0)


def _withdraw(requests) -> None:
    """Cancel the receives a failing collective leaves posted and wait until each is cancelled
    (or has arrived): nothing may land in a receive buffer once the call has raised.  Open MPI
    would otherwise write a late message into memory Python has freed, or crash completing a
    request nobody holds; MPICH happened not to.  Sends are left to finish or to be dropped
    with the job: cancelling a send is deprecated (MPI 4.0) and may never complete."""
    for req in requests:
        if req != MPI.REQUEST_NULL:
            req.Cancel()
            try:
                req.Wait()
            except MPI.Exception:  # it arrived, with another size or identity: it is gone either way
                pass


_ABANDONED: list = []  # sends failing collectives left in flight, with the buffers they read


def _abandon(requests) -> None:
    """Keep the sends a failing collective leaves in flight alive, and with them (mpi4py's
    request holds its buffer) the memory they read, until each completes: the peer may be
    copying that memory straight out of this process (MPICH's CMA reads the sender's pages),
    and freeing it under the copy fails the peer's receive (seen: process_vm_readv EFAULT,
    a CommError where the peer should have raised the collective mismatch)."""
    _ABANDONED[:] = [r for r in _ABANDONED if not r.Test()] + [r for r in requests if r != MPI.REQUEST_NULL]


def _stage_in(out, buf: np.ndarray) -> None:
    """Copy a received host buffer into ``out`` (a device array; a span on the timeline)."""
    out[...] = from_host(buf)


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
    with stats.scope("send", None, group.name):
        _send(group.user_comm, _send_buffer(x), dst, tag)


def recv_into(out, src: int, group, tag: int = 0):
    """Blocking receive into the preallocated array ``out`` (its size must match exactly)."""
    src, tag = _check_peer(src, group, "src"), _check_tag(tag)
    buf = _receive_buffer(out)
    with stats.scope("recv", None, group.name):
        _recv(group.user_comm, buf, src, tag)
    if buf is not out:
        _stage_in(out, buf)
    return out


def recv(shape, dtype, src: int, group, tag: int = 0):
    """Blocking receive of a new array of ``shape``/``dtype`` from group rank ``src``."""
    return recv_into(xp.empty(shape, dtype), src, group, tag)


def sendrecv(x, dst: int, src: int, group, out=None, tag: int = 0):
    """Send ``x`` to ``dst`` and receive an array like ``x`` (or into ``out``) from ``src``."""
    dst, src = _check_peer(dst, group, "dst"), _check_peer(src, group, "src")
    tag = _check_tag(tag)
    sendbuf = _send_buffer(x)
    target = out if out is not None else xp.empty(x.shape, x.dtype)
    buf = _receive_buffer(target)
    with stats.scope("sendrecv", None, group.name):
        _sendrecv(group.user_comm, sendbuf, dst, buf, src, tag)
    if buf is not target:
        _stage_in(target, buf)
    return target


class Request:
    """Handle of a nonblocking send or receive: ``wait()`` completes it (a receive returns
    its array), ``is_completed()`` polls without blocking."""

    def __init__(self, comm, req, keep, out=None, staged=None, src=None, tag=None):
        self._comm, self._req, self._keep = comm, req, keep
        self._out, self._staged, self._src, self._tag = out, staged, src, tag
        self._done = False
        self.group = None  # the group's name: the wait is charged there (a timeline names its axis)

    def is_completed(self) -> bool:
        # Get_status tests without freeing the request (Test would free it, and wait() would
        # then find an empty request and report a 0-byte message).
        if not self._done and self._req.Get_status():
            self.wait()
        return self._done

    def wait(self):
        if not self._done:
            with stats.scope("wait", None, self.group):
                if self._out is None:
                    _waitall([self._req])
                else:
                    buf = self._staged if self._staged is not None else self._out
                    _wait_recv(self._comm, self._req, self._src, self._tag, buf.nbytes)
            if self._staged is not None:
                _stage_in(self._out, self._staged)
            self._done, self._keep = True, None
        return self._out


def isend(x, dst: int, group, tag: int = 0) -> Request:
    """Start sending ``x`` to ``dst``; don't modify ``x`` before ``wait()``."""
    dst, tag = _check_peer(dst, group, "dst"), _check_tag(tag)
    buf = _send_buffer(x)
    with stats.scope("isend", None, group.name):
        req = _isend(group.user_comm, buf, dst, tag)
    request = Request(group.user_comm, req, keep=buf)
    request.group = group.name
    return request


def irecv(out, src: int, group, tag: int = 0) -> Request:
    """Start receiving into ``out`` from ``src``; ``wait()`` returns ``out``."""
    src, tag = _check_peer(src, group, "src"), _check_tag(tag)
    buf = _receive_buffer(out)
    staged = None if buf is out else buf
    with stats.scope("irecv", None, group.name):
        req = _irecv(group.user_comm, buf, src, tag)
    request = Request(group.user_comm, req, keep=None, out=out, staged=staged, src=src, tag=tag)
    request.group = group.name
    return request
