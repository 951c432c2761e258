"""Tensor parallelism (parallel/tensor/): layers, vocabulary-parallel loss, training, overlap."""
import json
import os

import numpy as np
import pytest

from minidist.model.backend import from_host, to_host
from minidist.parallel import tensor as tpm
from minidist.train.testing import run_mpi, run_train

BODIES = os.path.join(os.path.dirname(__file__), "mpi", "tensor_bodies.py")


def test_shard_takes_each_fused_block():
    full = np.arange(2 * 12).reshape(2, 12)  # q | k | v, 4 columns each
    shard = tpm.Shard(dim=1, index=1, parts=2, blocks=3)
    assert shard.local_shape(full.shape) == (2, 6)
    assert to_host(shard.indices(12)).tolist() == [2, 3, 6, 7, 10, 11]
    np.testing.assert_array_equal(to_host(shard.take(from_host(full))), full[:, [2, 3, 6, 7, 10, 11]])


def test_layers_refuse_sizes_their_ranks_cannot_split():
    from minidist.layout.model import ModelConfig
    from minidist.model import nn

    class SplitInTwo(nn.Layers):
        parts = 2

    cfg = ModelConfig(vocab_size=256, block_size=8, layers=1, heads=3, d_model=12)
    with pytest.raises(ValueError, match="heads=3 is not divisible by the 2 ranks"):
        nn.CausalSelfAttention(cfg, np.float64, SplitInTwo())
    fake = tpm.TensorParallelLayers(None)
    fake.parts = 4
    with pytest.raises(ValueError, match="input features=6 is not divisible"):
        fake.row(6, 8, np.float64)


def _tp_problems(tp, heads, d_model, seq_len, sequence_parallel, tp_async):
    """parallel.tensor.problems of the flags --tp --heads --d-model --seq-len
    --sequence-parallel --tp-async (the rest at their defaults)."""
    from minidist.train.config import RunConfig

    given = RunConfig().replace(model=dict(heads=heads, d_model=d_model), data=dict(seq_len=seq_len),
                                parallel=dict(tp=tp, sequence_parallel=sequence_parallel, tp_async=tp_async))
    return tpm.problems(given, given.resolved(tp))


@pytest.mark.parametrize("flags, message", [
    ((1, 4, 32, 16, False, "ring"), "--tp-async ring needs --tp greater than 1"),
    ((1, 4, 32, 16, True, None), "--sequence-parallel needs --tp greater than 1"),
    ((4, 6, 48, 16, False, None), "--heads 6 is not divisible by --tp 4"),
    ((4, 4, 30, 16, False, None), "--d-model 30 is not divisible by --tp 4"),
    ((4, 4, 32, 10, True, None), "--seq-len 10 is not divisible by --tp 4: --sequence-parallel"),
    ((4, 4, 32, 10, False, "bidirectional"), "--seq-len 10 is not divisible by --tp 4: --tp-async bidirectional"),
])
def test_cli_flags_tp_cannot_split_are_named(flags, message):
    import re

    found = _tp_problems(*flags)
    assert found and re.search(message, found[0]) and all("\n" not in line for line in found), found
    assert _tp_problems(2, 4, 32, 16, True, "ring") == []  # and a good combination passes
    assert _tp_problems(3, 3, 33, 15, False, None) == []  # 256 byte values on tp 3: padded, not refused


@pytest.mark.parametrize("tp, kv, ffn, message", [
    (4, 3, None, "--kv-heads 3 and --tp 4: .* one must divide the other"),
    (2, 2, 31, "the MLP width --ffn-hidden 31 is not divisible by --tp 2"),
])
def test_llama_heads_and_width_tp_cannot_split_are_named(tp, kv, ffn, message):
    import re

    from minidist.train.config import RunConfig

    def found(tp, kv, ffn):
        given = RunConfig().replace(model=dict(arch="llama", heads=12, d_model=48, kv_heads=kv, ffn_hidden=ffn),
                                    parallel=dict(tp=tp))
        return tpm.problems(given, given.resolved(tp))

    assert re.search(message, " ".join(found(tp, kv, ffn))), found(tp, kv, ffn)
    assert found(4, 2, None) == [] and found(2, 6, 64) == []  # shared (tp > K) and split key/value heads pass


def test_one_rank_is_the_plain_model():
    from minidist.layout.model import ModelConfig
    from minidist.model import nn

    cfg = ModelConfig(vocab_size=256, block_size=8, layers=2, heads=2, d_model=8, dtype="float64")
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
    assert out.count("training done") == 4, out


@pytest.mark.mpi
def test_ring_steps_overlap_the_matmuls_on_a_slow_link():
    out = run_mpi(2, f"{BODIES}::overlap_timeline", timeout=90, env={"MINIDIST_LINK_GBPS": "1"}).stdout
    assert out.count("overlap ok: ring") == 2 and out.count("overlap ok: bidirectional") == 2, out


@pytest.mark.mpi
def test_dp2_x_tp2_equals_single_process():
    out = run_mpi(4, f"{BODIES}::dp_tp_matches_serial", timeout=120).stdout
    for mode in ("tensor", "sequence", "ring", "bidirectional"):
        assert f"dp x tp ok: {mode}" in out, out
    assert out.count("overflow agreed") == 4, out


# -- the training command ------------------------------------------------------------------------
TINY = ["--layers", "2", "--d-model", "16", "--heads", "4", "--seq-len", "8", "--batch-size", "8",
        "--peak-gflops", "10", "--eval-batches", "1", "--eval-every", "3", "--quiet"]


def _train(n, args, timeout=120):
    return run_train(n if n > 1 else None, TINY + args, timeout)


@pytest.mark.mpi
def test_cli_dp2_x_tp2_async_equals_one_process(tmp_path):
    """dp=2 x tp=2 with collective matmuls, and with ZeRO-1 over the data-parallel ranks (once
    refused, it composes since the 4D composer), train like one process (float64)."""
    common = ["--steps", "3", "--dtype", "float64", "--data", __file__]
    one = tmp_path / "1.jsonl"
    assert _train(1, common + ["--metrics-jsonl", str(one)]).returncode == 0
    a = [json.loads(line) for line in one.read_text().splitlines()]
    for name, extra, mesh in (("async", ["--tp", "2", "--tp-async", "bidirectional"], "dp=2 tp=2"),
                              ("zero", ["--tp", "2", "--zero", "1"], "dp=2 zero=1 tp=2")):
        four = tmp_path / f"4{name}.jsonl"
        r = _train(4, common + extra + ["--metrics-jsonl", str(four)])
        assert r.returncode == 0, r.stderr
        b = [json.loads(line) for line in four.read_text().splitlines()]
        assert b[0]["mesh"] == mesh and len(a) == len(b) == 3, (name, b[0])
        for key in ("loss", "grad_norm", "val_loss"):
            np.testing.assert_allclose([r.get(key, 0) for r in b], [r.get(key, 0) for r in a], rtol=1e-9,
                                       err_msg=f"{name}: {key}")


@pytest.mark.mpi
@pytest.mark.parametrize("n, args, needle", [
    (2, ["--tp", "2", "--heads", "3", "--d-model", "24"], "--heads 3 is not divisible by --tp 2"),
    (2, ["--tp", "2", "--sequence-parallel", "--seq-len", "7"], "--seq-len 7 is not divisible by --tp 2"),
    (2, ["--tp-async"], "--tp-async ring needs --tp greater than 1 (got --tp 1)"),
])
def test_bad_tensor_parallel_input_is_one_message_exit_2(n, args, needle):
    r = _train(n, args, timeout=60)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert r.stderr.count(needle) == 1 and len(r.stderr.splitlines()) == 1, r.stderr
    assert "Traceback" not in r.stderr and r.stdout == ""
