"""Name the rank that died without a word: kill -9, the out-of-memory killer, a crash in C.

A rank that raises prints its own traceback (comm/abort.py) and one that stops making
progress is reported by the watchdog; but a rank killed by a signal says nothing, and the
MPI launcher that then ends the job names at best a process id.  So each rank of a
multi-process job starts a *sentinel* at start-up: a small process (plain Python, no MPI)
holding one end of a socket pair whose other end only the rank holds.  However the rank
ends, the kernel closes its end, and the sentinel learns of it at once:

* the rank ends normally, or is about to abort the job after printing its own report: it
  first tells its sentinel ("end" / "abort"), which stays quiet;
* the socket closes without a word: the rank was killed, and the sentinel prints
  ``minidist: rank 1 (dp0 pp0 tp1, pid 4242) died without a report ...``.

When one rank dies the launcher kills the others, whose sentinels then also see their rank
die.  The sentinels of a machine agree on who speaks with a lock: the first to take it (an
abstract Unix socket named after the launcher process the ranks of a machine share) speaks,
and keeps it a few seconds so that the others stay quiet.  A rank about to abort takes the
lock too, since its own report names the cause.  If the launcher itself is gone (the whole
job was killed from outside), nobody speaks.

This file runs as the sentinel's program (``python sentinel.py FD RANK LAUNCHER_PID``), so it
imports only the standard library.
"""

from __future__ import annotations

import os
import socket
import sys
import time

HOLD_S = 5.0  # how long the sentinel that spoke keeps the lock: the launcher's cleanup is faster
ACK_S = 2.0  # how long a rank about to abort waits for its sentinel to take the lock

_link = None  # this rank's end of the socket pair; None: no sentinel (one process, or failed)
_process = None  # the sentinel's Popen, kept so that it is not collected while running


def start(rank: int, size: int) -> None:
    """Start this rank's sentinel (once; nothing for a job of one process)."""
    global _link, _process
    if _link is not None or size <= 1:
        return
    import atexit
    import subprocess

    mine, theirs = socket.socketpair()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "HYDI_", "MPI_", "OMPI_", "PMIX_"))}
    try:
        # A new session: a Ctrl-C of the terminal, or the launcher killing the rank's process
        # group, must not end the sentinel before its rank.
        _process = subprocess.Popen(
            [sys.executable, "-S", os.path.abspath(__file__), str(theirs.fileno()), str(rank), str(os.getppid())],
            pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, env=env,
            start_new_session=True)
    except OSError:  # no process can be started here: the job runs, unwatched
        mine.close()
        return
    finally:
        theirs.close()
    _link = mine
    atexit.register(leaving)


def leaving() -> None:
    """This rank ends on purpose (its message, if any, is printed): its sentinel stays quiet.
    Runs at exit; call it before an ``os._exit``, which skips the exit handlers."""
    _tell(b"end\n")


def describe(where: str) -> None:
    """Give the sentinel the rank's place in the mesh (``dp0 pp1 tp0``) for its message."""
    _tell(f"where {where}\n".encode())


def before_abort() -> None:
    """This rank is about to end the job after its own report (an abort, or an exit with an
    error every rank reaches): the sentinels of this machine stay quiet.
    Waits (briefly) until its sentinel holds the lock, so that the ranks the abort kills
    cannot speak first."""
    if _tell(b"abort\n"):
        _link.settimeout(ACK_S)
        try:
            _link.recv(1)
        except OSError:
            pass


def _tell(message: bytes) -> bool:
    if _link is None:
        return False
    try:
        _link.sendall(message)
        return True
    except OSError:
        return False


# ------------------------------------------------------------------ the sentinel process
def _lock(launcher_pid: int):
    """The machine-wide "someone has spoken" lock of this job, or None if it is taken."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.bind(f"\0minidist-sentinel-{launcher_pid}")  # abstract name: nothing left on disk
        return s
    except OSError:
        s.close()
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _watch(fd: int, rank: int, launcher_pid: int, rank_pid: int) -> None:
    link = socket.socket(fileno=fd)
    where, buffered = "", b""
    while True:
        try:
            chunk = link.recv(4096)
        except OSError:
            chunk = b""
        if not chunk:
            break
        buffered += chunk
        while b"\n" in buffered:
            line, buffered = buffered.split(b"\n", 1)
            word, _, rest = line.decode(errors="replace").partition(" ")
            if word == "end":
                return
            if word == "where":
                where = rest
            elif word == "abort":
                held = _lock(launcher_pid)
                try:
                    link.sendall(b"k")
                except OSError:  # the rank stopped waiting (a loaded machine): it aborts anyway
                    pass
                if held:
                    os.close(2)  # the launcher may wait for this output to close before it returns
                    time.sleep(HOLD_S)
                return
    # The rank is gone without a word.
    if not _alive(launcher_pid):
        return  # the whole job was killed from outside: the rank is not the cause
    held = _lock(launcher_pid)
    if held is None:
        return  # another rank died (or aborted) first: that one is the cause
    place = f"{where}, " if where else ""
    sys.stderr.write(f"minidist: rank {rank} ({place}pid {rank_pid}) died without a report: killed by a "
                     f"signal (kill -9, the out-of-memory killer, or the launcher ending the job after a "
                     f"failure on another machine) or crashed outside Python\n")
    sys.stderr.flush()
    os.close(2)  # the launcher may wait for this output to close before it returns
    time.sleep(HOLD_S)


if __name__ == "__main__":
    _fd, _rank, _launcher = (int(a) for a in sys.argv[1:4])
    _watch(_fd, _rank, _launcher, os.getppid())
