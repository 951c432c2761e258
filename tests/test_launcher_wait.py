"""host/launcher.py's wait and run against stand-in launchers (plain Python, no MPI): one that
outlives its ranks (Open MPI's prterun deadlocked in its clean-up) is killed and reported;
one that is still starting, or still has ranks, is left alone; exit codes pass through."""
import os
import subprocess
import sys
import time

import pytest

from minidist.host import launcher

RANK = "import time; time.sleep(0.3)"
pytestmark = pytest.mark.skipif(launcher._running_children(os.getpid()) is None,
                                reason="no /proc/PID/task/TID/children here: wait() is a plain wait")


def stand_in(body: str) -> list[str]:
    """A launcher that starts a 0.3 s "rank" as ``rank`` and then runs ``body``."""
    return [sys.executable, "-c", f"import subprocess, sys, time\nrank = subprocess.Popen([sys.executable, '-c', {RANK!r}])\n{body}"]


def start(cmd):
    return subprocess.Popen(cmd, start_new_session=True)


@pytest.mark.parametrize("reaped", [True, False], ids=["rank-reaped", "rank-a-zombie"])
def test_a_launcher_that_outlives_its_ranks_is_killed_and_reported(reaped):
    """The deadlocked prterun left one rank a zombie (never reaped); both count as ended."""
    proc = start(stand_in(("rank.wait()\n" if reaped else "") + "time.sleep(60)"))
    t0 = time.monotonic()
    with pytest.raises(launcher.LauncherStuck, match=r"still running 1 s after its last rank ended: killed"):
        launcher.wait(proc, timeout=30, stuck_s=1)
    assert time.monotonic() - t0 < 10
    assert proc.returncode == -9 and _group_gone(proc.pid)


def _group_gone(pgid: int) -> bool:
    """Whether no process of the group is left (an orphaned zombie takes init a moment to reap)."""
    for _ in range(50):
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


def test_a_launcher_with_running_ranks_or_none_yet_is_waited_for():
    """No child yet (still starting) is not "stuck"; nor is a rank that runs longer than stuck_s."""
    proc = start([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert launcher.wait(proc, timeout=1.5, stuck_s=0.3) is None
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()
    busy = start([sys.executable, "-c", "import subprocess, sys; sys.exit(subprocess.call("
                  "[sys.executable, '-c', 'import time; time.sleep(2)']) + 3)"])
    assert launcher.wait(busy, timeout=30, stuck_s=0.5) == 3


def test_run_reports_a_stuck_launcher_and_a_timeout(monkeypatch):
    monkeypatch.setattr(launcher, "STUCK_S", 1.0)
    done = launcher.run(stand_in("print('ranks done', flush=True); rank.wait(); time.sleep(60)"), timeout=30)
    assert done.returncode == 1 and done.stdout == "ranks done\n"
    assert done.stderr.endswith("after its last rank ended: killed (Open MPI's launcher can deadlock after "
                                "MPI_Abort; host/launcher.py)\n"), done.stderr
    merged = launcher.run([sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr); "
                           "sys.exit(4)"], timeout=30, merge=True, tries=1)
    assert (merged.returncode, sorted(merged.stdout.split()), merged.stderr) == (4, ["err", "out"], None)
    with pytest.raises(subprocess.TimeoutExpired) as late:
        launcher.run([sys.executable, "-c", "import time; print('started', flush=True); time.sleep(60)"], timeout=2)
    assert late.value.stdout == "started\n"


def test_run_starts_again_a_launcher_that_failed_before_starting_anything(tmp_path):
    """Open MPI's "PMIx server's listener thread failed to start" (exit 213), once: run starts the
    command again and says so; a launcher that fails every time ends after three tries; one that
    fails after its rank ran is not started again (the rank's work may have happened)."""
    marker = tmp_path / "failed-once"
    flaky = [sys.executable, "-c", f"import os, subprocess, sys\nif not os.path.exists({str(marker)!r}):\n"
             f"    open({str(marker)!r}, 'w').close(); print('listener failed', flush=True); sys.exit(213)\n"
             f"subprocess.call([sys.executable, '-c', {RANK!r}]); print('ran')"]
    done = launcher.run(flaky, timeout=30)
    assert (done.returncode, done.stdout) == (0, "ran\n")
    assert done.stderr.endswith("failed before it started any process (exit 213): started again, try 2 of 3\n")
    never = launcher.run([sys.executable, "-c", "import sys; sys.exit(213)"], timeout=30, merge=True)
    assert never.returncode == 213 and never.stdout.count("started again") == 2, never.stdout
    counter = tmp_path / "runs"
    late = launcher.run(stand_in(f"rank.wait(); open({str(counter)!r}, 'a').write('x'); sys.exit(5)"), timeout=30)
    assert late.returncode == 5 and counter.read_text() == "x" and "started again" not in late.stderr
