"""Traffic accounting: bytes and time per collective, and a short log of recent operations.

Every message minidist sends goes through :mod:`minidist.comm.p2p`, which adds its size to
the counters of the *current collective*: a thread-local label set by :class:`scope`.  So
``stats()["all_reduce"]["bytes_sent"]`` is exactly what this rank put on the wire for all
its all-reduces, which the tests compare with the textbook formulas (e.g. 2(N-1)/N * X for
a ring all-reduce) and the profiler shows next to compute time.

The label is thread-local because async collectives run on a progress thread while the main
thread may send its own messages: each thread charges its own traffic to its own label.

Every byte sent is also charged to the *group* it travels on (``Group.name``; a ``comm.Mesh``
names its groups by their axes of size > 1: "tp", "pp", "dp", "dp+cp"...), so
:func:`bytes_by_group` says what this rank sent on each mesh axis, e.g. per training step
(layout/traffic.py gives the same numbers from closed-form formulas; tests/test_axis_bytes.py
compares them).  The scope of each collective and of each public send/recv names its group.
"""

from __future__ import annotations

import collections
import threading
import time



NO_GROUP = "(no group)"
"""Where :func:`bytes_by_group` lists bytes sent outside any scope that names a group (p2p's
underscored helpers called directly): none in minidist itself."""


def _group_record(groups: dict, name: str) -> list:
    rec = groups.get(name)
    if rec is None:
        rec = groups[name] = [0]
    return rec


class _State:
    """One thread's state: the label of the running collective and the thread's counters,
    the running collective's identity tag (``ident``, see identity.identity: what its messages
    carry, set by :class:`scope`), a CollectiveMismatchError found by a receive whose caller
    goes on to the end of its rounds (``mismatch``: the scope raises it when it closes),
    and what the thread is blocked on right now (``wait``:
    p2p stores a small tuple before each blocking MPI call and None after it, which the
    watchdog polls; comm/watchdog.py).

    Each thread adds only to its own counters (name -> [calls, bytes_sent, bytes_recv,
    time_s]) and to its own bytes sent per group (``groups``: group name -> [bytes]; ``grec``
    is the record of the group the running scope names, so a message adds to it with one
    item store and no lookup), so the hot path takes no lock: an uncontended lock costs
    about as much as the rest of a small collective's bookkeeping.  :func:`stats` and
    :func:`bytes_by_group` sum the threads' dicts and the cached plans' counters
    (:class:`Tally`, :func:`group_tally`: shared by threads, but only synchronous calls run
    plans, normally all on one thread; two threads running plans at once could lose a
    count, never a message).  The per-group count costs a message ~25 ns, a plan call
    ~25 ns and a scope ~70 ns (timeit, Nov 2026): under 1% of the cheapest collective."""

    __slots__ = ("label", "counters", "ident", "wait", "thread", "mismatch", "groups", "grec")

    def __init__(self):
        self.label = self.ident = self.wait = self.mismatch = None
        self.counters: dict[str, list] = {}
        self.groups: dict[str, list] = {}  # group name -> [bytes sent] (reset_stats zeroes, never drops, one)
        self.grec = _group_record(self.groups, NO_GROUP)  # messages outside any scope naming a group
        self.thread = threading.current_thread().name
        with _lock:  # once per thread; the registry outlives the thread, so do its counts
            _per_thread.append(self.counters)
            states.append(self)


class _Local(threading.local):
    """``_tls.state`` is this thread's :class:`_State`.  One object behind one thread-local
    lookup instead of one lookup per attribute (docs/perf-notes.md, "Per-call costs")."""

    def __init__(self):
        self.state = _State()


_lock = threading.Lock()
_per_thread: list[dict] = []
states: list[_State] = []  # every thread's state, for the watchdog
_tls = _Local()
_recent: collections.deque = collections.deque(maxlen=32)  # append is atomic: no lock
# How many threads are inside a scope now (under _lock).  Zero, the usual case when a plan
# runs, proves that this thread is in none, without the thread-local lookup (a cost paid
# about ten times over on oversubscribed ranks).
_labelled = 0
_clock = time.perf_counter


def _record(counters: dict, name: str) -> list:
    rec = counters.get(name)
    if rec is None:
        rec = counters[name] = [0, 0, 0, 0.0]
    return rec


class Call:
    """What a cached plan records of each call (see :func:`record_call`): its recent-ops
    entry ``op = (name, group_name, shape, dtype, "")``, fixed for the plan, the counters
    of ``name`` shared by all plans (:func:`tally`) and the bytes sent on its group
    (``sent_on``, shared by the plans of every group of that name: :func:`group_tally`)."""

    __slots__ = ("op", "tally", "sent_on")

    def __init__(self, name: str, group_name: str, shape, dtype):
        self.op = (name, group_name, tuple(shape), dtype, "")
        self.tally = tally(name)
        self.sent_on = group_tally(group_name)


class Tally:
    """Counters of one collective name for the fast path: [calls, sent, received, time],
    updated in place without a dict or thread-local lookup.  Only synchronous calls run
    plans, so in practice one thread writes them; :func:`stats` adds them in."""

    __slots__ = ("calls", "sent", "received", "time")

    def __init__(self):
        self.calls = self.sent = self.received = 0
        self.time = 0.0


_tallies: dict[str, Tally] = {}
_group_tallies: dict[str, list] = {}  # group name -> [bytes sent by cached plans]


def tally(name: str) -> Tally:
    with _lock:
        return _tallies.setdefault(name, Tally())


def group_tally(group_name: str) -> list:
    """The plans' [bytes sent] on groups called ``group_name``, like :class:`Tally`: written
    in place by synchronous calls only (in practice one thread), added in by :func:`bytes_by_group`."""
    with _lock:
        return _group_tallies.setdefault(group_name, [0])


def record_call(call: Call, sent: int, received: int, t0: float) -> None:
    """Account one whole collective at once, the small-message fast path's only bookkeeping:
    its recent-ops entry (what :func:`note_op` records) and a call that started at ``t0``
    (perf_counter) with these byte counts, or, inside another collective's scope, just its
    bytes, charged to that outer collective as :class:`scope` would.  One clock read serves
    both the elapsed time and the recent-ops timestamp.  The bytes sent count on the plan's
    own group either way (``call.sent_on``: no thread-local lookup)."""
    t1 = _clock()
    _recent.append((call.op, t1))
    call.sent_on[0] += sent
    if not _labelled or _tls.state.label is None:  # _labelled first: it spares most calls the thread-local
        t = call.tally
        t.calls += 1
        t.sent += sent
        t.received += received
        t.time += t1 - t0
    else:
        rec = _record(_tls.state.counters, _tls.state.label)  # the outer collective's, as scope would
        rec[1] += sent
        rec[2] += received


class scope:
    """``with scope("all_reduce", ident, g.name):`` labels the messages inside and times the
    whole call; ``ident`` (identity.identity) is the tag its collective messages carry, and
    ``group`` the name of the group they travel on (their bytes sent count there too).

    Scopes nest (all_reduce is built from reduce_scatter + all_gather): only the outermost
    one counts, so the traffic of a ring all-reduce is charged to "all_reduce" once.  An
    inner scope's ``ident`` and ``group`` (if given) hold inside it: its messages are its own
    call's, on its own group.
    """

    __slots__ = ("name", "t0", "outer", "ident", "outer_ident", "group", "outer_grec")

    def __init__(self, name: str, ident: int | None = None, group: str | None = None):
        self.name, self.ident, self.group = name, ident, group

    def __enter__(self):
        global _labelled
        state = _tls.state
        self.outer, self.outer_ident = state.label, state.ident
        if self.ident is not None:
            state.ident = self.ident
        if self.group is not None:
            self.outer_grec = state.grec
            rec = state.groups.get(self.group)
            state.grec = rec if rec is not None else _group_record(state.groups, self.group)
        if self.outer is None:
            with _lock:
                _labelled += 1
            state.label = self.name
            self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        global _labelled
        if self.outer is None:
            elapsed = time.perf_counter() - self.t0
            state = _tls.state
            state.label, state.ident = None, self.outer_ident
            if self.group is not None:
                state.grec = self.outer_grec
            with _lock:
                _labelled -= 1
            rec = _record(state.counters, self.name)
            rec[0] += 1
            rec[3] += elapsed
            mismatch = state.mismatch
            if mismatch is not None:  # what this call got wrong first, in place of any error it raised since
                state.mismatch = None
                raise mismatch from None  # not chained: the later error was only a consequence
        else:
            state = _tls.state
            state.ident = self.outer_ident
            if self.group is not None:
                state.grec = self.outer_grec
        return False


def current() -> str | None:
    """The collective whose messages this thread is sending right now (None outside one)."""
    return _tls.state.label


def stats() -> dict:
    """``{name: {"calls", "bytes_sent", "bytes_recv", "time_s"}}`` for this rank, since the
    last :func:`reset_stats`.  Plain send/recv calls are listed under their own names."""
    totals: dict[str, list] = {}
    with _lock:
        threads = list(_per_thread)
        tallies = list(_tallies.items())
    for name, t in tallies:
        if t.calls or t.sent or t.received:
            totals[name] = [t.calls, t.sent, t.received, t.time]
    for counters in threads:
        # dict.copy() and list() run without releasing the GIL, so a thread adding a new
        # name meanwhile cannot break the iteration; a count read mid-update is one call late.
        for name, rec in counters.copy().items():
            total = _record(totals, name)
            for i, value in enumerate(list(rec)):
                total[i] += value
    return {name: {"calls": c, "bytes_sent": s, "bytes_recv": r, "time_s": t}
            for name, (c, s, r, t) in totals.items()}


def bytes_by_group() -> dict[str, int]:
    """``{group name: bytes sent}`` by this rank since the last :func:`reset_stats`, over
    every thread (progress threads included), the cached plans and the plain point-to-point
    calls; groups with nothing sent are left out.  On a ``comm.Mesh`` the names are its axes
    ("dp", "pp", "tp", "cp", "dp+cp", ...): the bytes this rank sent per mesh axis.  Snapshot
    it around a training step and subtract (layout/traffic.py has the formulas)."""
    totals: dict[str, int] = {}
    with _lock:
        per_thread = [s.groups for s in states]
        plans = list(_group_tallies.items())
    for name, rec in plans:
        totals[name] = totals.get(name, 0) + rec[0]
    for groups in per_thread:
        for name, rec in groups.copy().items():  # copy(): see stats()
            totals[name] = totals.get(name, 0) + rec[0]
    return {name: n for name, n in totals.items() if n}


def reset_stats() -> None:
    """Zero every counter (e.g. between benchmark phases or training steps)."""
    with _lock:
        for counters in _per_thread:
            counters.clear()
        for t in _tallies.values():
            t.calls = t.sent = t.received = 0
            t.time = 0.0
        # Zeroed in place, never dropped: a running scope holds its group's record (state.grec).
        for s in states:
            for rec in s.groups.values():
                rec[0] = 0
        for rec in _group_tallies.values():
            rec[0] = 0


def note_op(name: str, group_name: str, shape, dtype, detail: str = "") -> None:
    """Remember that this rank started ``name``; error messages show the last few."""
    _recent.append(((name, group_name, shape, dtype, detail), _clock()))  # formatted when read


def recent_ops(g=None) -> list[dict]:
    """The last ~32 operations this rank started (oldest first), optionally only on group g.
    ``time`` is a ``time.perf_counter()`` reading (when the op was logged), for ordering and
    intervals: the fast path reads that clock anyway, so the log costs no second clock call."""
    ops = list(_recent)
    if g is not None:
        ops = [(op, t) for op, t in ops if op[1] == g.name]
    return [dict(name=n, group=gr, shape=s, dtype=_dtype_str(d), detail=det, time=t)
            for (n, gr, s, d, det), t in ops]


def _dtype_str(dtype) -> str | None:
    if dtype is None:
        return None
    from minidist.model.backend import dtype_name

    return dtype_name(dtype)


def format_recent(n: int = 8) -> str:
    """A few lines describing the last ``n`` operations, for error messages."""
    ops = list(_recent)[-n:]
    if not ops:
        return "  (no collective started yet)"
    return "\n".join(f"  {name}(group={gr!r}, shape={shape}, dtype={_dtype_str(dt)}{', ' + det if det else ''})"
                     for (name, gr, shape, dt, det), _ in ops)
