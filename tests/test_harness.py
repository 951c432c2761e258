"""The mpiexec harness itself: results come back, failures are fast and show every rank."""
import os
import time

import pytest

from minidist.train.testing import MPIJobFailed, run_mpi

BODIES = os.path.join(os.path.dirname(__file__), "mpi", "harness_bodies.py")


@pytest.mark.mpi
def test_runs_function_on_every_rank():
    out = run_mpi(3, f"{BODIES}::say_rank", timeout=60).stdout
    for r in range(3):
        assert f"hello from {r}/3" in out


@pytest.mark.mpi
def test_raising_rank_aborts_job_fast():
    t0 = time.monotonic()
    with pytest.raises(MPIJobFailed) as err:
        run_mpi(4, f"{BODIES}::one_rank_raises", timeout=90)
    elapsed = time.monotonic() - t0
    msg = str(err.value)
    assert "deliberate failure on rank 2" in msg
    assert "[rank 2]" in msg
    assert "timed out" not in msg  # aborted by the raising rank, not by the timer
    assert elapsed < 60


@pytest.mark.mpi
def test_hang_times_out_with_each_ranks_stack():
    with pytest.raises(MPIJobFailed) as err:
        run_mpi(3, f"{BODIES}::everyone_waits", timeout=15)
    msg = str(err.value)
    for r in range(3):
        assert f"rank{r}: stacks when the hang timer fired" in msg
    assert "everyone_waits" in msg
