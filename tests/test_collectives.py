"""minidist's hand-written collectives against MPI's built-ins and NumPy, on 1..8 ranks.

One mpiexec launch per group size runs every case (collective x op x dtype x length x
algorithm x sync/async); see tests/mpi/collectives_bodies.py.  Every multi-process test runs
twice: with the fast path (cached plans) on, and with MINIDIST_FAST_PATH=0, the textbook
algorithms alone.
"""
import os

import pytest

from minidist.train.testing import MPIJobFailed, run_mpi

HERE = os.path.join(os.path.dirname(__file__), "mpi")
BODIES = os.path.join(HERE, "collectives_bodies.py")
ERRORS = os.path.join(HERE, "comm_errors_bodies.py")


@pytest.fixture(params=["fast", "textbook"])
def env(request):
    """The environment of a run: the fast path on, or off (MINIDIST_FAST_PATH=0)."""
    return {"MINIDIST_FAST_PATH": "1" if request.param == "fast" else "0"}


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", [1, 2, 3, 4, 5, 8])
def test_every_collective_matches_oracles(nprocs, env):
    out = run_mpi(nprocs, f"{BODIES}::all_cases", timeout=150, env=env).stdout
    for r in range(nprocs):
        assert f"rank {r}/{nprocs}: all collective cases passed" in out
        assert f"rank {r}: traffic formulas hold" in out


@pytest.mark.mpi
def test_large_messages_take_ring_and_chain_paths(env):
    out = run_mpi(3, f"{BODIES}::large_paths", timeout=120, env=env).stdout
    for r in range(3):
        assert f"rank {r}: large paths passed" in out


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", [2, 3, 4, 8])  # 8: halving and Bruck with three rounds
def test_repeated_calls_run_cached_plans_correctly(nprocs, env):
    out = run_mpi(nprocs, f"{BODIES}::fast_paths", timeout=120, env=env).stdout
    for r in range(nprocs):
        assert f"rank {r}: fast paths passed" in out


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", [2, 3, 4])
def test_one_shot_plans_bound_to_the_callers_arrays(nprocs, env):
    out = run_mpi(nprocs, f"{BODIES}::bound_plans", timeout=60, env=env).stdout
    for r in range(nprocs):
        assert f"rank {r}: bound plans passed" in out


@pytest.mark.mpi
def test_bad_input_raises_on_every_rank(env):
    out = run_mpi(3, f"{ERRORS}::bad_input", timeout=60, env=env).stdout
    for r in range(3):
        assert f"rank {r}: bad input rejected" in out


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", [2, 3, 4])
def test_all_gather_rows_differing_by_more_than_one_raise_on_every_rank(nprocs, env):
    out = run_mpi(nprocs, f"{ERRORS}::all_gather_rows_rule", timeout=60, env=env).stdout
    for r in range(nprocs):
        assert f"rank {r}: all_gather rows rule enforced" in out


@pytest.mark.mpi
def test_check_mode_reports_each_ranks_call_on_every_rank(env):
    out = run_mpi(3, f"{ERRORS}::check_mode_mismatch", timeout=60,
                  env={"MINIDIST_CHECK_COLLECTIVES": "1", **env}).stdout
    for r in range(3):
        assert f"rank {r} caught: ranks of group 'world' (size 3) called different collectives" in out
        assert f"rank {r}: check mode caught every mismatch" in out


# Without check mode a size mismatch still fails loudly: the general path, a cached
# recursive-doubling plan, a cached one-shot plan (persistent requests).  Per case: ranks,
# rank body, then groups of texts of which the failure must contain at least one each.
SIZE_MISMATCHES = {
    "general path": (2, "unchecked_size_mismatch", [
        ("but 16 bytes arrived", "but more than 16 bytes arrived"), ("MINIDIST_CHECK_COLLECTIVES=1",),
        ("all_reduce(group='world', shape=(",)]),  # the recent-ops log of the failing rank
    "cached plan": (2, "unchecked_size_mismatch_after_plan", [
        ("expected a 16-byte message", "expected a 20-byte message"), ("during all_reduce",),
        ("MINIDIST_CHECK_COLLECTIVES=1",), ("all_reduce(group='world', shape=(",)]),
    # (24 and 36 bytes: sizes of different classes, so the identity tags differ too)
    "one-shot plan": (3, "reduce_scatter_size_mismatch_after_plan", [
        ("during reduce_scatter", "called reduce_scatter(op=sum, float32, [16 B, 32 B))"),
        ("MINIDIST_CHECK_COLLECTIVES=1",),
        ("expected a 8-byte message", "expected a 12-byte message", "sent reduce_scatter(op=sum, float32, [32 B, 64 B))")]),
    # Ranks that disagree on the algorithm itself do not all see a bad message; those that do
    # raise, and the abort hook of comm.world() ends the job instead of a hang.
    "sizes across a threshold": (4, "all_reduce_sizes_across_the_algorithm_threshold", [
        ("during all_reduce", "all_reduce(op=sum, float64, [2 MiB, 4 MiB))"),
        ("but 800 bytes arrived", "all_reduce(op=sum, float64, [512 B, 1 KiB))")]),
    "out= on one rank only": (4, "all_gather_out_on_one_rank_only", [
        ("out= on some ranks only", "out= picks the all-gather's algorithm")]),
    "all_to_all_v rows of another shape": (3, "all_to_all_v_rows_of_another_shape", [
        ("during all_to_all_v",), ("MINIDIST_CHECK_COLLECTIVES=1",)]),
    "all_to_all_v rows of another dtype": (3, "all_to_all_v_rows_of_another_dtype", [
        ("all_to_all_v(float64)",), ("all_to_all_v(float32)",)]),
    "all_to_all_v against all_reduce": (2, "all_to_all_v_against_another_collective", [
        ("all_to_all_v(float64)",), ("all_reduce(op=sum, float64",)]),
}


@pytest.mark.mpi
@pytest.mark.parametrize("case", list(SIZE_MISMATCHES))
def test_size_mismatch_without_check_mode_fails_loudly(case, env):
    nprocs, body, needles = SIZE_MISMATCHES[case]
    with pytest.raises(MPIJobFailed) as err:
        run_mpi(nprocs, f"{ERRORS}::{body}", timeout=60, env=env)
    msg = str(err.value)
    assert "a size mismatch went unnoticed" not in msg
    assert "timed out after" not in msg  # ended by the failing rank, not by the hang timer
    for group in needles:
        assert any(text in msg for text in group), (case, group)


@pytest.mark.mpi
def test_one_shot_round_with_several_bad_messages_raises_everywhere_and_recovers(env):
    out = run_mpi(3, f"{ERRORS}::one_shot_two_oversized_senders", timeout=60, env=env).stdout
    for r in range(3):
        assert f"rank {r}: one-shot errors recovered" in out


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", [2, 3])
def test_all_to_all_v_plan_raises_everywhere_and_recovers(nprocs):
    out = run_mpi(nprocs, f"{ERRORS}::all_to_all_v_errors_recover", timeout=60).stdout
    for r in range(nprocs):
        assert f"rank {r}: all_to_all_v errors recovered" in out


def test_all_gather_schedule_choice_follows_the_measured_thresholds():
    import numpy as np

    from minidist.comm.collectives import all_gather_algorithm

    def pick(n, algorithm, nbytes):  # the schedule for an out= of N equal float32 blocks of nbytes in all
        out = np.empty((n, nbytes // 4 // n), np.float32)
        return all_gather_algorithm(n, out[0], out, algorithm)

    assert pick(4, "auto", 4 << 10) == pick(8, "auto", 4 << 10) == pick(2, "auto", 256 << 10) == "direct"
    assert pick(3, "auto", 4 << 20) == pick(4, "auto", 64 << 20) == "direct"
    assert pick(2, "auto", 1 << 20) == "pair_even"  # two ranks, large: the same one message each way, from x
    assert pick(8, "auto", 1 << 20) == pick(8, "auto", 64 << 20) == "doubling"
    assert pick(5, "auto", 64 << 20) == "even_ring" and pick(4, "ring", 4 << 10) == "even_ring"


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", [2, 3, 4])
def test_switching_the_fast_path_off_runs_the_textbook_algorithms_alone(nprocs):
    out = run_mpi(nprocs, f"{BODIES}::fast_path_switch", timeout=60).stdout
    for r in range(nprocs):
        assert f"rank {r}: fast path switch works" in out


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", [1, 2, 3, 4, 8])
def test_all_to_all_v_matches_mpi_alltoallv(nprocs, env):
    out = run_mpi(nprocs, f"{BODIES}::all_to_all_v_cases", timeout=120, env=env).stdout
    for r in range(nprocs):
        assert f"rank {r}/{nprocs}: all_to_all_v matches Alltoallv" in out
