"""The watchdog: a wait that makes no progress for too long ends the whole job, with a report.

A distributed job that loses a rank (it exited, crashed, or skipped a collective) leaves
the others waiting for its messages forever.  Like NCCL's watchdog, every process runs one
daemon thread (started with the first Group, e.g. by ``comm.world()``) that looks, about
twice a second, at what each thread is blocked on:

* p2p.py notes every blocking MPI call of the general path on the thread's stats state
  (``state.wait = (what, comm, peer, bytes)`` before the call, None after): the messages
  of the textbook algorithms, the check mode, users' send/recv (pipeline transfers);
* fast.run notes every cached plan it runs on its group (``g.busy``), once per call.

A note is a new tuple for every wait, so the watchdog needs no clock on the hot path: it
remembers the note it saw last and since when; the same note still there ``timeout``
seconds later means that wait made no progress.  It then prints one report (this rank, the
thread, the collective, group, peer, bytes expected, the call's identity and this rank's
recent operations), gives the other stuck ranks a moment to print theirs, and calls
``MPI_Abort``, which ends every rank of the job.  A rank that left the program is reported
the same way, by the ranks still waiting for it.

The timeout: ``MINIDIST_TIMEOUT_S`` (seconds, default 300; 0 turns the watchdog off), or
:func:`set_timeout` (the training CLI's ``--timeout-s``).  Set it alike on every rank.
"""

from __future__ import annotations

import sys
import threading
import time
import weakref

from minidist.host import env
from minidist.comm import identity, stats

POLL_S = 0.5  # how often the thread looks (at most; a quarter of a shorter timeout)
GRACE_S = 1.5  # after its report, how long a rank waits for the other stuck ranks' reports


_timeout = env.get("MINIDIST_TIMEOUT_S")  # its default (300 s) when unset; EnvError when bad
_groups: weakref.WeakSet = weakref.WeakSet()
_thread = None
_lock = threading.Lock()
_fired = False
# fast/ sets this to a function (plan, group) -> text: what a cached plan waits for.
describe_plan = None


def set_timeout(seconds: float) -> None:
    """Abort the job when a wait makes no progress for ``seconds`` (0: never).  Call it
    alike on every rank, e.g. from the training CLI's ``--timeout-s``."""
    global _timeout
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds >= 0:
        raise ValueError(f"set_timeout: seconds={seconds!r} must be a number >= 0 (0 turns the watchdog off)")
    _timeout = float(seconds)
    if _timeout > 0 and len(_groups):
        _start()


def timeout() -> float:
    """The current timeout in seconds (0: the watchdog is off)."""
    return _timeout


def watch(group) -> None:
    """Watch ``group``'s cached plans (Group.__init__ calls this), and start the thread."""
    _groups.add(group)
    if _timeout > 0:
        _start()


def _start() -> None:
    global _thread
    with _lock:
        if _thread is None:
            _thread = threading.Thread(target=_loop, name="minidist-watchdog", daemon=True)
            _thread.start()


def _notes():
    """(holder, note) of every wait in progress: thread states, then groups running a plan."""
    for state in list(stats.states):
        note = state.wait
        if note is not None:
            yield state, note
    for g in list(_groups):
        note = g.busy
        if note is not None:
            yield g, note


def _loop() -> None:
    seen: dict = {}  # id(holder) -> (holder, note, first seen)
    while True:
        limit = _timeout
        time.sleep(min(POLL_S, limit / 4) if limit > 0 else POLL_S)
        if limit <= 0 or _fired:
            seen.clear()
            continue
        now = time.monotonic()
        fresh = {}
        for holder, note in _notes():
            old = seen.get(id(holder))
            since = old[2] if old is not None and old[0] is holder and old[1] is note else now
            fresh[id(holder)] = (holder, note, since)
            if now - since >= limit:
                _fire(holder, note, now - since, limit)
        seen = fresh


def _group_of(comm):
    for g in list(_groups):
        if g.comm == comm or g.user_comm == comm:
            return g
    return None


def describe(holder, note) -> str:
    """One wait in words: the thread or group, the collective, peer(s), bytes expected."""
    if isinstance(holder, stats._State):
        what, comm, peer, nbytes = note
        g = _group_of(comm) if comm is not None else None
        label = holder.label or "point-to-point messages"
        where = f" on group {g.name!r}" if g is not None else ""
        text = f"thread {holder.thread!r} is blocked in {label}{where}: {what}"
        if isinstance(peer, int):
            world = f" (world rank {g.world_ranks[peer]})" if g is not None and 0 <= peer < g.size else ""
            text += f" {'to' if what == 'send' else 'with' if what == 'sendrecv' else 'from'} rank {peer}{world}"
        elif peer:
            text += f" from ranks {sorted(set(peer))}"
        if nbytes is not None:
            text += f", {'sending' if what == 'send' else 'expecting'} {nbytes} bytes"
        if holder.ident is not None:
            text += f"; this rank's messages carry {identity.describe_tag(holder.ident, g and g.size)}"
        return text
    plan = note[0]
    detail = describe_plan(plan, holder) if describe_plan is not None else type(plan).__name__
    return f"a cached plan on group {holder.name!r} is blocked: {detail}"


def _fire(holder, note, stalled: float, limit: float) -> None:
    global _fired
    if _fired:
        return
    _fired = True
    from mpi4py import MPI

    rank = MPI.COMM_WORLD.Get_rank()
    lines = [f"minidist watchdog: no progress for {stalled:.1f} s (timeout {limit:g} s, MINIDIST_TIMEOUT_S or "
             f"comm.set_timeout); aborting the job.",
             "  " + describe(holder, note),
             "  A peer that left the program, crashed or hangs elsewhere, or ranks that skipped a collective or "
             "called collectives in another order, leave a rank waiting like this; every rank still waiting "
             "prints its own report.",
             "  Recent operations on this rank (oldest first):",
             *stats.format_recent(16).splitlines()]
    # One write, so that another rank's abort cannot cut the report in two.
    sys.stderr.write("".join(f"[rank {rank}] {ln}\n" for ln in lines))
    sys.stderr.flush()
    sys.stdout.flush()
    time.sleep(GRACE_S)  # the other stuck ranks print theirs
    from minidist.comm import sentinel

    sentinel.before_abort()  # its own report names the cause: no sentinel speaks
    MPI.COMM_WORLD.Abort(1)
