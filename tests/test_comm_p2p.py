"""The point-to-point layer, groups, async progress and simulated links (under mpiexec)."""
import os

import pytest

from minidist.train.testing import run_mpi

BODIES = os.path.join(os.path.dirname(__file__), "mpi", "comm_p2p_bodies.py")


@pytest.mark.mpi
def test_p2p_groups_and_async():
    out = run_mpi(3, f"{BODIES}::all_p2p_cases", timeout=90).stdout
    for r in range(3):
        for what in ("p2p", "groups", "async"):
            assert f"rank {r}: {what} ok" in out


@pytest.mark.mpi
def test_simulated_link_from_environment():
    out = run_mpi(2, f"{BODIES}::link_model_from_env", timeout=60,
                  env={"MINIDIST_LINK_LATENCY_US": "3000"}).stdout
    assert "rank 0: link model ok" in out and "rank 1: link model ok" in out


@pytest.mark.mpi
def test_async_overlap_example_is_correct():
    """examples/03_async_overlap.py checks its overlapped result against the sequential one
    (the wall times it prints are for people, not asserted here)."""
    example = os.path.join(os.path.dirname(__file__), "..", "examples", "03_async_overlap.py")
    out = run_mpi(2, example, "--quick", timeout=120).stdout
    assert "overlapped result == sequential result" in out
