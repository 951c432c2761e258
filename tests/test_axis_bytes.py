"""Bytes per mesh axis: ``comm.stats.bytes_by_group()`` against the closed-form formulas of
``minidist.layout.traffic``, exactly (integer bytes).

The MPI bodies live in tests/mpi/axis_bytes_bodies.py: the counters on every path a byte can
take (collectives on any thread, cached plans, plain point-to-point), then one training step
on dp2 x tp2, dp2 x pp2 and dp2 x cp2 meshes (4 ranks, float64, a 2-layer d_model 16 GPT,
batch 8 of 8 tokens) measured and compared with ``traffic.step_bytes`` on every rank, and
more settings (sequence parallelism, Ulysses, interleaved pipeline, ZeRO-1/2/3, gradient
accumulation, checkpointing, several buckets, uneven batches), and the composer's meshes of
two model axes (tp x cp, pp x tp, pp x cp), ZeRO-1/2/3 beside tp, cp and pp, and bf16 / fp16
mixed precision.
"""
import os

import pytest

from minidist.layout import collective_bytes as cb, rank_params as rp, traffic as t
from minidist.train.testing import run_mpi

BODIES = os.path.join(os.path.dirname(__file__), "mpi", "axis_bytes_bodies.py")


def body(name, timeout=300):
    return run_mpi(4, f"{BODIES}::{name}", timeout=timeout).stdout


# -- the formulas alone (no MPI: tests/test_layout_no_mpi.py) ------------------------------------
@pytest.mark.parametrize("n", [2, 3, 4, 5, 8])
def test_algorithm_costs_are_the_textbook_ones_on_even_blocks(n):
    X = 64 * n * 8  # float64, divisible into n blocks
    for r in range(n):
        assert cb.all_reduce_bytes(X // 8, 8, n, r, "ring") == 2 * (n - 1) * X // n  # Patarasuk & Yuan
        assert cb.all_reduce_bytes(X // 8, 8, n, r, "pairwise") == 2 * (n - 1) * X // n
        assert cb.reduce_scatter_bytes(X // 8, 1, 8, n, r) == (n - 1) * X // n
        assert cb.all_to_all_bytes(64 * n, 8, n, r) == (n - 1) * X // n
    pof2 = 1 << (n.bit_length() - 1)
    if n == pof2:
        assert all(cb.doubling_messages(n, r) == n.bit_length() - 1 for r in range(n))
    # the root of a binomial broadcast sends ceil(log2 N) times, every other rank receives once
    assert cb.broadcast_bytes(8, n, 0, 0) == 8 * (n - 1).bit_length()
    assert sum(cb.broadcast_bytes(8, n, r, 0) for r in range(n)) == 8 * (n - 1)


def test_small_all_reduces_take_recursive_doubling():
    assert cb.all_reduce_bytes(100, 8, 4, 0) == 2 * 800  # log2(4) rounds of the whole vector
    assert cb.all_reduce_bytes(100, 2, 2, 0) == 400  # bfloat16 travels as float32
    assert [cb.doubling_messages(3, r) for r in range(3)] == [1, 2, 1]  # rank 0 gives, 1 returns the result
    big = (512 << 10) // 8 + 1
    # above 512 KiB: pairwise; on 2 ranks each sends the other's half, then its own (uneven halves)
    assert cb.all_reduce_bytes(big, 8, 2, 0) == cb.all_reduce_bytes(big, 8, 2, 1) == big * 8


def test_param_numels_are_the_models():
    from minidist.layout.model import ModelConfig
    from minidist.model.nn import GPT

    for tied in (True, False):
        model = GPT(ModelConfig(block_size=8, layers=3, heads=2, d_model=16, tied=tied))
        assert rp.param_numels(model.config) == [p.size for p in model.parameters()]
    # tp = 2: the matrices (12 d^2) and the column-parallel biases (3d + 4d) halve; the
    # LayerNorms (4d) and the row-parallel biases (2d) are replicated
    one_block = [n for n, unit in rp.rank_params(ModelConfig(block_size=8, layers=1, heads=2, d_model=16), tp=2)
                 if unit == ("block", 0)]
    assert sum(one_block) == 12 * 16 * 16 // 2 + 7 * 16 // 2 + 6 * 16
    # mixtures in blocks 1 and 3, Llama's blocks with grouped-query attention
    for kw in (dict(experts=3, moe_every=2), dict(arch="llama", kv_heads=2, ffn_hidden=40),
               dict(arch="llama", kv_heads=1, experts=2, moe_every=1)):
        model = GPT(ModelConfig(block_size=8, layers=4, heads=4, d_model=16, **kw))
        assert rp.param_numels(model.config) == [p.size for p in model.parameters()], kw


def test_group_names_follow_the_mesh():
    assert t.group_names(dp=2, tp=2) == {"dp": "dp", "pp": "self", "tp": "tp", "cp": "self", "world": "world"}
    assert t.group_names(dp=2, cp=2)["dp"] == "dp+cp"  # the reduction group: ("dp", "cp")
    assert t.group_names(cp=2)["dp"] == "cp"
    assert t.by_group({"dp": 5, "cp": 7, "tp": 0, "pp": 0, "world": 1}, cp=2) == {"cp": 12, "world": 1}


def test_expected_step_bytes_reads_a_run_configuration():
    from minidist.train.config import ParallelConfig, RunConfig

    cfg = RunConfig(parallel=ParallelConfig(dp=2, tp=2)).replace(model=dict(layers=2, d_model=16, heads=2))
    cfg = cfg.resolved(4)
    got = t.expected_step_bytes(cfg, rank=3)
    per_axis = t.step_bytes(n_layer=2, d_model=16, n_head=2, seq_len=128, batch_size=16, dp=2, tp=2,
                            coords={"dp": 1, "tp": 1}, itemsize=4)
    assert got == {"dp": per_axis["dp"], "tp": per_axis["tp"], "world": per_axis["world"]} and all(got.values())


# -- measured under mpiexec -----------------------------------------------------------------------
@pytest.mark.mpi
def test_bytes_by_group_counts_every_path():
    assert body("counting").count("counting ok") == 4


@pytest.mark.mpi
def test_one_step_on_each_mesh_equals_the_formulas_exactly():
    out = body("step_matrix")
    for mesh in ("--dp 2 --tp 2", "--dp 2 --pp 2", "--dp 2 --cp 2"):
        assert out.count(f"axis bytes ok: {mesh} rank") == 4, out


@pytest.mark.mpi
def test_more_settings_equal_the_formulas_exactly():
    out = body("more_settings", timeout=600)
    assert out.count("axis bytes ok:") == 4 * 10, out


@pytest.mark.mpi
def test_composed_meshes_equal_the_formulas_exactly():
    out = body("composed", timeout=600)
    assert out.count("axis bytes ok:") == 4 * 11, out


@pytest.mark.mpi
def test_mixed_precision_equals_the_formulas_exactly():
    out = body("mixed_precision")
    assert out.count("axis bytes ok:") == 4 * 6, out


@pytest.mark.mpi
def test_experts_and_padded_vocabularies_equal_the_formulas_exactly():
    """Mixtures of experts: without --ep the experts reduce with the dense parameters; with it
    over the edp group (DDP, ZeRO-1/2/3), the dispatch and combine by the routing's closed form;
    a pipeline all-reduces the loss with the auxiliary losses; tp and cp move whole sequences
    to the mixtures.  A vocabulary tp does not divide: the embedding's padded rows travel too."""
    out = body("experts", timeout=600)
    assert out.count("axis bytes ok:") == 4 * 10, out


@pytest.mark.mpi
def test_llama_equals_the_formulas_exactly():
    """The Llama family's blocks (docs/llama.md): tp with key/value heads split and shared
    (their gradients summed over the "tp-kv" groups), sequence parallelism's RMSNorm weights,
    Ulysses sending grouped heads as they are or repeated, mixtures of SwiGLU experts."""
    out = body("llama", timeout=600)
    assert out.count("axis bytes ok:") == 4 * 7, out
