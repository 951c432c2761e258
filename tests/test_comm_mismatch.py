"""Every collective mismatch is caught by default (no check mode): ranks that pass different
roots, force different algorithms, or call all_reduce against all_gather raise
CollectiveMismatchError (comm/identity.py: the root and the algorithm ride in each message's
identity tag; a rooted call starts with an empty handshake message around the ring), on
the fast path and the textbook path, at 4 and 1M elements, within seconds, never by a hang."""
import os
import time

import pytest

from minidist.train.testing import MPIJobFailed, run_mpi

BODIES = os.path.join(os.path.dirname(__file__), "mpi", "comm_mismatch_bodies.py")
ROOTED = ["broadcast", "reduce", "scatter", "gather"]


@pytest.fixture(params=["fast", "textbook"])
def env(request):
    """The fast path on or off; a watchdog short enough that a hang fails by its report
    (which the tests reject) well before the job's timeout."""
    return {"MINIDIST_FAST_PATH": "1" if request.param == "fast" else "0", "MINIDIST_TIMEOUT_S": "20"}


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", [2, 3])
@pytest.mark.parametrize("name", ROOTED)
def test_per_rank_roots_raise_on_every_rank(name, nprocs, env):
    out = run_mpi(nprocs, f"{BODIES}::per_rank_roots", name, timeout=120, env=env).stdout
    for r in range(nprocs):
        for size in ("4", "1M"):
            assert f"rank {r}: {name} with per-rank roots raised at {size} elements" in out, out
        assert f"rank {r}: {name} per-rank roots done" in out


@pytest.mark.mpi
@pytest.mark.parametrize("size", ["4", "1M"])
@pytest.mark.parametrize("name", ROOTED)
def test_one_rank_with_another_root_ends_the_job_fast(name, size, env):
    """Roots 0, 0, 0, 1: ranks 0 and 3 raise at the handshake (uncaught), and the abort hook
    ends the job, though ranks 1 and 2 agree with their neighbours and wait for rank 0."""
    t0 = time.monotonic()
    with pytest.raises(MPIJobFailed) as err:
        run_mpi(4, f"{BODIES}::one_rank_other_root", name, size, timeout=90, env=env)
    msg = str(err.value)
    assert time.monotonic() - t0 < 40, msg
    assert "went on" not in msg and "timed out after" not in msg and "watchdog" not in msg, msg
    assert "CollectiveMismatchError" in msg and "root=0" in msg and "root=1" in msg, msg


@pytest.mark.mpi
def test_different_algorithms_raise_on_both_ranks(env):
    out = run_mpi(2, f"{BODIES}::different_algorithms", timeout=90, env=env).stdout
    for r in range(2):
        assert f"rank {r}: different algorithms raised" in out


@pytest.mark.mpi
def test_ppermute_with_different_pairs_raises(env):
    out = run_mpi(2, f"{BODIES}::different_pairs", timeout=90, env=env).stdout
    for r in range(2):
        assert f"rank {r}: ppermute pairs checked" in out


@pytest.mark.mpi
@pytest.mark.parametrize("size", ["4", "3", "1000", "1000000"])
def test_all_reduce_against_all_gather_raises_collective_mismatch_first(size, env):
    out = run_mpi(2, f"{BODIES}::all_reduce_against_all_gather", size, timeout=90, env=env).stdout
    for r in range(2):
        assert f"rank {r}: all_reduce against all_gather raised CollectiveMismatchError first" in out


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", [2, 3])
def test_all_reduce_against_all_gather_shows_only_the_mismatch(nprocs, env):
    """Left uncaught, the job's output names CollectiveMismatchError as the error: no
    CommError about the all-gather's room with the mismatch chained behind it."""
    with pytest.raises(MPIJobFailed) as err:
        run_mpi(nprocs, f"{BODIES}::all_reduce_against_all_gather", "3", "0", timeout=90, env=env)
    msg = str(err.value)
    assert "CollectiveMismatchError" in msg and "timed out after" not in msg, msg
    assert "CommError" not in msg and "During handling of the above exception" not in msg, msg


def test_identity_tags_carry_root_and_algorithm():
    import numpy as np

    from minidist.comm import identity

    if not identity.tags_enabled:
        pytest.skip("this MPI's TAG_UB is too small for identity tags")
    f64 = np.dtype(np.float64)
    base = identity.identity("broadcast", "", f64, 64, "binomial", 0)
    others = [identity.identity("broadcast", "", f64, 64, "binomial", 1),
              identity.identity("broadcast", "", f64, 64, "chain", 0),
              identity.identity("reduce", "sum", f64, 64, "binomial", 0)]
    assert len({base, *others}) == 4
    if identity.ROOT_BITS >= 3:
        assert len({identity.identity("gather", "", f64, None, None, root) for root in range(8)}) == 8
        assert identity.describe_tag(others[0], 4) == "broadcast(float64, [64 B, 128 B), root=1) by binomial"
    assert identity.describe_tag(identity.identity("all_reduce", "sum", f64, 64, "ring")).endswith(") by ring")
    # pair_even sends the one-shot round's messages: the same identity as direct
    assert identity.identity("all_gather", "", f64, None, "pair_even") == identity.identity("all_gather", "", f64,
                                                                                          None, "direct")
    tag_ub = identity.MPI.COMM_WORLD.Get_attr(identity.MPI.TAG_UB)
    biggest = identity.identity("gather", "min", np.dtype([("a", "i1")]), 1 << 61, "bruck", (1 << 40) - 1)
    assert biggest + 1 <= tag_ub


@pytest.mark.parametrize("tag_ub, bits, root_bits", [
    (32767, 0, 0),                    # MPI's promise: no identity tags
    ((1 << 16) + (1 << 19) - 1, 18, 0),  # name, op, dtype and size only
    ((1 << 23) - 1, 21, 0),           # Open MPI over UCX: the algorithm too
    ((1 << 29) - 1, 27, 6),           # MPICH: the root mod 64
    ((1 << 31) - 1, 29, 8),
])
def test_the_code_takes_the_bits_the_tag_bound_leaves(tag_ub, bits, root_bits):
    from minidist.comm import identity

    got = identity._code_bits(tag_ub)
    assert got == bits and max(0, got - 21) == root_bits
    if got:
        assert identity.IDENT_BASE + (2 << got) - 1 <= tag_ub


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", [2, 3, 4, 5])
def test_plans_and_the_general_path_carry_the_same_identity(nprocs):
    out = run_mpi(nprocs, f"{BODIES}::mixed_paths", timeout=120).stdout
    for r in range(nprocs):
        assert f"rank {r}: mixed paths agree" in out, out
    assert "Plan" in out.split("rank 1: mixed paths agree; plans", 1)[1].splitlines()[0], out
