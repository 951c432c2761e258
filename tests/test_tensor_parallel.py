"""Tensor parallelism (parallel/tensor.py): layers, vocabulary-parallel loss, training, overlap."""
import os

import numpy as np
import pytest

from minidist.parallel import tensor as tpm
from minidist.testing import run_mpi

BODIES = os.path.join(os.path.dirname(__file__), "mpi", "tensor_bodies.py")


def test_shard_takes_each_fused_block():
    full = np.arange(2 * 12).reshape(2, 12)  # q | k | v, 4 columns each
    shard = tpm.Shard(dim=1, index=1, parts=2, blocks=3)
    assert shard.local_shape(full.shape) == (2, 6)
    assert list(shard.indices(12)) == [2, 3, 6, 7, 10, 11]
    np.testing.assert_array_equal(shard.take(full), full[:, [2, 3, 6, 7, 10, 11]])


@pytest.mark.parametrize("sizes, bad", [((6, 24, 256, 4), "n_head=6"), ((4, 18, 256, 4), "d_model=18"),
                                        ((4, 24, 250, 4), "vocab_size=250"), ((4, 24, 256, 3), "n_head=4"),
                                        ((4, 24, 256, 2, 7), "seq_len=7")])
def test_sizes_not_divisible_by_tp_are_named(sizes, bad):
    with pytest.raises(ValueError, match=bad):
        tpm.check_divisible(*sizes)


@pytest.mark.parametrize("flags, message", [
    ((1, 4, 32, 16, False, "ring"), "--tp-async ring needs --tp greater than 1"),
    ((4, 6, 48, 16, False, None), "--heads 6 is not divisible by --tp 4"),
    ((4, 4, 30, 16, False, None), "--d-model 30 is not divisible by --tp 4"),
    ((3, 3, 33, 15, False, None), r"vocabulary \(256 byte values\) is not divisible by --tp 3"),
    ((4, 4, 32, 10, True, None), "--seq-len 10 is not divisible by --tp 4: --sequence-parallel"),
    ((4, 4, 32, 10, False, "bidirectional"), "--seq-len 10 is not divisible by --tp 4: --tp-async bidirectional"),
])
def test_cli_flags_tp_cannot_split_are_named(flags, message):
    with pytest.raises(ValueError, match=message):
        tpm.check_cli(*flags)
    tpm.check_cli(2, 4, 32, 16, True, "ring")  # and a good combination passes


def test_one_rank_is_the_plain_model():
    from minidist import nn

    cfg = nn.GPTConfig(vocab_size=256, seq_len=8, n_layer=2, n_head=2, d_model=8, dtype="float64")
    plain, single = nn.GPT(cfg), nn.GPT(cfg, tpm.TensorParallelLayers(None, sequence_parallel=True, overlap="ring"))
    ids = np.random.default_rng(0).integers(0, 256, (2, 8))
    assert plain(ids, ids).item() == single(ids, ids).item()


@pytest.mark.mpi
def test_layers_match_plain_layers_tp3_and_tp2():
    out = run_mpi(3, f"{BODIES}::layers_match_plain", timeout=120).stdout
    assert "tensor layers ok: tp=3" in out and "tensor layers ok: tp=2" in out, out
    assert out.count("tensor layers done") == 3, out


@pytest.mark.mpi
def test_vocab_parallel_loss_never_holds_the_full_vocabulary():
    out = run_mpi(2, f"{BODIES}::vocab_parallel_loss", timeout=90).stdout
    assert out.count("vocab parallel loss ok") == 2, out


@pytest.mark.mpi
def test_training_equals_single_process_tp4_and_tp2():
    out = run_mpi(4, f"{BODIES}::training_matches_serial", timeout=180).stdout
    for n in (2, 4):
        for mode in ("tensor", "sequence", "ring", "bidirectional", "untied head"):
            assert f"training ok: tp={n} {mode}" in out, out
    assert "activation checkpointing and 2 accumulated" in out and "tp=2 ring, activation" in out, out
    assert out.count("bf16 within 2e-2") == 2, out
    assert out.count("training done") == 4, out


@pytest.mark.mpi
def test_ring_steps_overlap_the_matmuls_on_a_slow_link():
    out = run_mpi(2, f"{BODIES}::overlap_timeline", timeout=90, env={"MINIDIST_LINK_GBPS": "1"}).stdout
    assert out.count("overlap ok: ring") == 2 and out.count("overlap ok: bidirectional") == 2, out
