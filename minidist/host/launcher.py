"""The ``mpiexec`` command line for this Python's MPI, and waiting for it (no MPI import).

The mpich wheel that ``make install`` puts into the virtual environment ships its own
``mpiexec`` next to the Python; a system MPI's is found on ``PATH``.  Open MPI refuses more
ranks than cores unless told ``--oversubscribe``, which the tests, the benchmarks and the
planner's calibration all need on small machines.

:func:`wait` is ``Popen.wait`` for a launcher that may never return.  Open MPI 5.0's launcher
(``prterun``) sometimes deadlocks in its own clean-up when ranks abort while others end
normally (a rank's uncaught exception, comm/abort.py): every rank is gone, yet ``mpirun``
waits forever, two of its threads each holding the lock the other needs (docs/multinode.md;
Open MPI's segmentation faults in the same place end by themselves).  So a launcher that outlives its last rank by ``STUCK_S`` is killed and reported.
And now and then Open MPI's launcher fails before it starts any rank ("The PMIx server's
listener thread failed to start"): :func:`run` starts such a command again.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

STUCK_S = 10.0  # how long a launcher may outlive its ranks: its own clean-up takes well under a second
START_TRIES = 3  # launches of a command whose launcher fails before it starts any process


class LauncherStuck(RuntimeError):
    """The launcher outlived its ranks by ``STUCK_S`` and was killed."""


def mpiexec_command(nprocs: int) -> list[str]:
    """``[mpiexec, -n, N]`` (plus ``--oversubscribe`` for Open MPI); RuntimeError if none is found."""
    local = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    exe = local if os.path.exists(local) else shutil.which("mpiexec")
    if exe is None:
        raise RuntimeError("no mpiexec found: run `make install` (it installs the mpich wheel)")
    return [exe, "--oversubscribe", "-n", str(nprocs)] if open_mpi(exe) else [exe, "-n", str(nprocs)]


def open_mpi(exe: str) -> bool:
    """Whether the launcher ``exe`` is Open MPI's (it then needs ``--oversubscribe``)."""
    try:
        version = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "Open MPI" in version or "OpenRTE" in version


def wait(proc: subprocess.Popen, timeout: float | None = None, stuck_s: float | None = None) -> int | None:
    """Wait for the launcher ``proc`` (started with ``start_new_session=True``): its exit code,
    or None when ``timeout`` seconds passed first (``proc`` is left running).

    Raises :class:`LauncherStuck` after killing ``proc``'s process group when ``proc`` has had
    no running child for ``stuck_s`` (default ``STUCK_S``) seconds after it had one: its ranks
    (Open MPI) or its proxies (MPICH's Hydra) have all ended, so nothing is left for it to wait
    for.  Where ``/proc`` cannot say who the children are, this is a plain wait."""
    return _wait(proc, timeout, stuck_s)[0]


def _wait(proc, timeout, stuck_s) -> tuple[int | None, bool | None]:
    """:func:`wait`'s exit code, and whether the launcher ever had a child (None: unknown)."""
    stuck_s = STUCK_S if stuck_s is None else stuck_s
    deadline = None if timeout is None else time.monotonic() + timeout
    had_children, alone_since = None, None
    while (code := proc.poll()) is None:
        now = time.monotonic()
        if deadline is not None and now >= deadline:
            return None, had_children
        running = _running_children(proc.pid)
        if running:
            had_children, alone_since = True, None
        elif running is not None and had_children:
            alone_since = alone_since or now
            if now - alone_since >= stuck_s:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                raise LauncherStuck(f"{os.path.basename(proc.args[0])} (pid {proc.pid}) was still running "
                                    f"{stuck_s:.0f} s after its last rank ended: killed (Open MPI's launcher "
                                    f"can deadlock after MPI_Abort; host/launcher.py)")
        elif running is not None:
            had_children = False
        time.sleep(0.2)
    return code, had_children


def run(cmd: list[str], timeout: float, env: dict | None = None, merge: bool = False,
        tries: int = START_TRIES) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)`` for a launcher
    command, waited for by :func:`wait` (``merge``: stderr goes into stdout, in order).
    A launcher that got stuck returns code 1 (mpirun's after an abort) with the reason as the
    last line of its error output; on timeout the launcher's whole session is killed and
    ``subprocess.TimeoutExpired`` raised with the output so far.  A launcher that fails
    before it starts any process (Open MPI's "The PMIx server's listener thread failed to
    start", now and then) is started again, up to ``tries`` times in all: nothing ran yet."""
    earlier = ""  # the starts that failed, said at the end of the output
    for attempt in range(1, tries + 1):
        # Files, not pipes: wait() polls, and nobody would read a pipe meanwhile.
        with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT if merge else err, text=True,
                                    env=env, start_new_session=True)
            try:
                (code, started), note = _wait(proc, timeout, None), ""
            except LauncherStuck as e:
                code, started, note = 1, True, f"{e}\n"
            if code is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            out.seek(0)
            err.seek(0)
            stdout, stderr = out.read(), err.read()
        if code not in (0, None) and started is False and attempt < tries:
            earlier += (f"{os.path.basename(cmd[0])} failed before it started any process (exit {code}): "
                        f"started again, try {attempt + 1} of {tries}\n")
            continue
        break
    note = earlier + note
    if merge:
        stdout, stderr = stdout + note, None
    else:
        stderr += note
    if code is None:
        raise subprocess.TimeoutExpired(cmd, timeout, stdout, stderr)
    return subprocess.CompletedProcess(cmd, code, stdout, stderr)


def _running_children(pid: int) -> int | None:
    """How many children of ``pid`` are running (zombies do not count); None without ``/proc``."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    children, read = set(), False
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                children.update(f.read().split())
            read = True
        except OSError:  # a thread that just ended, or a kernel without the children file
            continue
    if not read:
        return None
    running = 0
    for child in children:
        try:
            with open(f"/proc/{child}/stat") as f:
                state = f.read().rpartition(")")[2].split()[0]
        except (OSError, IndexError):
            continue
        running += state not in ("Z", "X")
    return running
