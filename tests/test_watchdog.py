"""The watchdog (a lost rank ends the job with a report, within the timeout) and mismatched
calls caught by the identity tags, without the check mode (comm/watchdog.py, identity.identity)."""
import os
import time

import pytest

from minidist.train.testing import MPIJobFailed, run_mpi

BODIES = os.path.join(os.path.dirname(__file__), "mpi", "watchdog_bodies.py")
TIMEOUT_S = 3


@pytest.fixture(params=["fast", "textbook"])
def env(request):
    """The fast path on (cached plans), or off; a short watchdog timeout."""
    return {"MINIDIST_FAST_PATH": "1" if request.param == "fast" else "0", "MINIDIST_TIMEOUT_S": str(TIMEOUT_S)}


def _fails_by_watchdog(nprocs, body, env, *args):
    t0 = time.monotonic()
    with pytest.raises(MPIJobFailed) as err:
        run_mpi(nprocs, f"{BODIES}::{body}", *args, timeout=90, env=env)
    elapsed = time.monotonic() - t0
    msg = str(err.value)
    assert "went unnoticed" not in msg and "timed out after" not in msg, msg
    # The timeout, the watchdog's poll and grace, plus the start of Python and MPI on a busy machine.
    assert elapsed < TIMEOUT_S + 30, elapsed
    return msg


@pytest.mark.mpi
@pytest.mark.parametrize("warm", ["0", "3"])  # 3: rank 0 waits in a cached plan (when the fast path is on)
def test_a_skipped_collective_ends_the_job_with_the_watchdogs_report(warm, env):
    msg = _fails_by_watchdog(2, "skip_collective", env, warm)
    assert "[rank 0] minidist watchdog: no progress for" in msg, msg
    assert f"timeout {TIMEOUT_S} s" in msg
    assert "all_reduce" in msg and "'world'" in msg
    assert "world rank 1" in msg or "world ranks [1]" in msg, msg  # the peer it waits for
    assert "16 bytes" in msg, msg
    assert "all_reduce(op=sum, float32" in msg  # the call's identity
    assert "Recent operations on this rank" in msg and "all_reduce(group='world', shape=(4,)" in msg
    # Rank 1 waits too (for a user message): it reports its own wait.
    assert "[rank 1] minidist watchdog: no progress" in msg and "blocked in recv" in msg, msg


@pytest.mark.mpi
def test_a_rank_that_leaves_is_reported_by_those_waiting_for_it(env):
    msg = _fails_by_watchdog(3, "middle_rank_exits", env)
    assert "rank 1: leaving" in msg
    assert "minidist watchdog: no progress" in msg
    assert "rank 1 (world rank 1)" in msg or "world ranks [1" in msg or "world ranks [0, 1]" in msg, msg


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", [2, 3])
def test_dtype_op_and_collective_mismatches_raise_on_every_rank_without_check_mode(nprocs, env):
    out = run_mpi(nprocs, f"{BODIES}::mismatches", timeout=90, env=env).stdout
    for r in range(nprocs):
        assert f"rank {r}: every mismatch raised" in out


@pytest.mark.mpi
def test_the_watchdog_and_the_tags_can_be_turned_off(env):
    off = {**env, "MINIDIST_TIMEOUT_S": "0", "MINIDIST_COLLECTIVE_TAGS": "0"}
    out = run_mpi(2, f"{BODIES}::switches", timeout=60, env=off).stdout
    for r in range(2):
        assert f"rank {r}: switches work" in out


def test_identity_tags_fit_and_read_back():
    from minidist.comm import identity

    if not identity.tags_enabled:
        pytest.skip("this MPI's TAG_UB is too small for identity tags")
    import numpy as np

    a = identity.identity("all_reduce", "sum", np.dtype(np.float32), 4096)
    b = identity.identity("all_reduce", "max", np.dtype(np.float32), 4096)
    c = identity.identity("all_reduce", "sum", np.dtype(np.int32), 4096)
    d = identity.identity("all_reduce", "sum", np.dtype(np.float32), 8192)
    assert len({a, b, c, d}) == 4 and a == identity.identity("all_reduce", "sum", np.dtype(np.float32), 4096)
    assert identity.describe_tag(a) == "all_reduce(op=sum, float32, [4 KiB, 8 KiB))"
    assert identity.describe_tag(identity.identity("all_gather", "", np.dtype(np.int64))) == "all_gather(int64)"
    assert identity.describe_tag(identity.identity("barrier")) == "barrier()"
    biggest = identity.identity("barrier", "min", np.dtype([("a", "i1")]), 1 << 61)
    assert identity.TAG_RESERVED < a and biggest + 1 <= identity.MPI.COMM_WORLD.Get_attr(identity.MPI.TAG_UB)


def test_set_timeout_checks_its_argument():
    from minidist import comm

    before = comm.timeout()
    for bad in (-1, "10", None, float("nan")):
        with pytest.raises(ValueError):
            comm.set_timeout(bad)
    comm.set_timeout(before)
    assert comm.timeout() == before
