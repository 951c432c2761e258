"""Context parallelism (ring attention, Ulysses): cp in {2, 4} and dp=2 x cp=2 train exactly
like one process (float64); memory below T x T; zig-zag balances the work; bad input."""
import os

import numpy as np
import pytest

from minidist.parallel import context as ctx
from minidist.testing import run_mpi

BODIES = os.path.join(os.path.dirname(__file__), "mpi", "context_bodies.py")


def test_positions_cover_the_sequence_once():
    for zigzag in (True, False):
        for cp in (1, 2, 4):
            seen = np.concatenate([ctx.positions(r, cp, 16, zigzag) for r in range(cp)])
            assert sorted(seen.tolist()) == list(range(16))
    assert ctx.positions(1, 4, 16, True).tolist() == [2, 3, 12, 13]  # chunks 1 and 6 of 8


def test_zigzag_balances_ring_work():
    """Causal attention over 4 ranks, one tile per chunk pair: with contiguous slices rank r
    meets r + 1 blocks of keys; zig-zag gives every rank 2C + 1 chunk pairs (of a quarter of
    the size), the same work everywhere, and the busiest rank less than before."""
    plain, zigzag = ctx.ring_work(4, 64, False), ctx.ring_work(4, 64, True)
    assert plain == [16 * 16 * (r + 1) for r in range(4)]
    assert zigzag == [9 * 8 * 8] * 4 and max(zigzag) < max(plain)


def test_bad_context_configurations():
    with pytest.raises(ValueError, match="sequence length 30 is not divisible by 2 \\* cp = 4"):
        ctx.check_context(2, "ring", 30, 4)
    with pytest.raises(ValueError, match="6 attention heads are not divisible by cp = 4"):
        ctx.check_context(4, "ulysses", 64, 6)
    with pytest.raises(ValueError, match="unknown context-parallel implementation 'tree'"):
        ctx.check_context(2, "tree", 64, 4)
    ctx.check_context(2, "ring", 28, 4)
    ctx.check_context(4, "ulysses", 8, 4)


@pytest.mark.mpi
def test_context_parallel_trains_like_one_process():
    out = run_mpi(4, f"{BODIES}::train_all", timeout=240).stdout
    assert out.count("context done") == 4, out
    assert out.count("cp ok:") == 4 * 8, out
    assert out.count("cp bf16 ok:") == 4 * 2, out


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", [2, 4])
def test_context_parallel_memory_and_work(nprocs):
    out = run_mpi(nprocs, f"{BODIES}::memory_and_work", timeout=120).stdout
    assert out.count("cp memory ok") == 2, out
    assert out.count("cp work ok") == 2, out


def test_training_flags_are_checked_with_their_names():
    from argparse import Namespace

    def args(**kw):
        return Namespace(**{"cp": 2, "cp_impl": "ring", "seq_len": 64, "heads": 4, **kw})

    with pytest.raises(ValueError, match=r"--seq-len 30 is not divisible by 2 x --cp = 4"):
        ctx.check_arguments(args(seq_len=30))
    with pytest.raises(ValueError, match=r"--heads 6 is not divisible by --cp 4"):
        ctx.check_arguments(args(cp=4, cp_impl="ulysses", heads=6))
    with pytest.raises(ValueError, match=r"--seq-len 30 is not divisible by --cp 4"):
        ctx.check_arguments(args(cp=4, cp_impl="ulysses", seq_len=30))
    ctx.check_arguments(args(seq_len=30, cp=1))  # no context parallelism: any length
    ctx.check_arguments(args(seq_len=30, cp=3, cp_impl="ulysses", heads=3))
