"""The planner's DeepSpeed-Ulysses (minidist/plan: settings.py, feasible.py, cost.py, search.py,
the command line): which meshes it allows, its all-to-alls' bytes against the traffic
formulas the real runs are checked with (layout/traffic.py), the memory minidist's Ulysses
keeps, and that ring attention's probe does not price it.  No MPI: the planner is arithmetic."""
import json
import subprocess
import sys
from dataclasses import replace

import pytest

from minidist.layout.model import ModelConfig
from minidist.layout.traffic import cp_bytes, qkv_width
from minidist.plan.cost import (FLOAT32, Plan, Step, cp_time, estimate, memory_parts,
                                minidist_block_values, problems, ulysses_values)
from minidist.plan.feasible import cp_problem
from minidist.plan.machine import PRESETS as MACHINES, Link, Machine
from minidist.plan.search import meshes

H100 = MACHINES["h100-nvlink-ib"]
CPU = Machine("cpu", {"float32": 50e9}, 8e9, 5e9, (Link("shm", float("inf"), 5e9, 0.0),), overlap=0.0, cores=8,
              coll_overhead_s=0.0)


def model(arch="gpt2", kv_heads=None, layers=4, d=128, heads=4, seq=64) -> ModelConfig:
    return ModelConfig(arch=arch, layers=layers, d_model=d, heads=heads, kv_heads=kv_heads, block_size=seq)


def test_ulysses_needs_the_heads_of_a_tp_rank_and_the_sequence_split_by_cp():
    m = model(heads=4, seq=12)
    assert cp_problem(m, 1, 2, "ulysses") is None and cp_problem(m, 2, 2, "ulysses") is None
    assert "the 4 heads of a tp=1 rank" in cp_problem(m, 1, 3, "ulysses")
    assert "the 2 heads of a tp=2 rank" in cp_problem(m, 2, 4, "ulysses")
    assert cp_problem(m, 1, 3, "ring") is None        # 12 tokens: 6 chunks
    assert "2 x 4 equal chunks" in cp_problem(m, 1, 4, "ring")
    assert cp_problem(m, 1, 4, "ulysses") is None     # Ulysses needs no zig-zag
    assert "not one of ring, ulysses" in cp_problem(m, 1, 2, "allgather")
    plan = Plan(cp=3, dp=1, cp_impl="ulysses")
    assert any("Ulysses" in x for x in problems(m, plan, 3, 12 * 4))
    # the search keeps the meshes each implementation allows
    ring = {mesh[1] for mesh in meshes(m, 8, 12 * 8)}
    ulysses = {mesh[1] for mesh in meshes(m, 8, 12 * 8, "ulysses")}
    assert ring == {1, 2} and ulysses == {1, 2, 4}


@pytest.mark.parametrize("arch,kv,tp,cp,ckpt", [("gpt2", None, 1, 2, False), ("gpt2", None, 2, 2, True),
                                                ("llama", 2, 1, 2, False), ("llama", 1, 1, 2, False),
                                                ("llama", 2, 2, 2, False), ("gpt2", None, 1, 4, False)])
def test_the_all_to_alls_move_the_bytes_of_the_traffic_formulas(arch, kv, tp, cp, ckpt):
    """On a link with no latency and no call cost, the Ulysses part of a microbatch is its
    bytes over the bandwidth: those layout.traffic.cp_bytes counts for the real runs (each
    rank's Q|K|V, repeated where cp cannot split the key/value heads, and its output;
    forward and backward, the forward again when recomputed)."""
    m = model(arch, kv, layers=3, d=64, heads=8, seq=32)
    plan = Plan(tp=tp, cp=cp, checkpoint_activations=ckpt, cp_impl="ulysses")
    s = Step.of(m, CPU, plan, FLOAT32, 4 * 32, False)
    llama = {"kv_heads": m.kv} if arch == "llama" else None
    expected = cp_bytes([4], 32 // cp, 64 // tp, 3, cp, 0, 4, "ulysses", ckpt, qkv_local=qkv_width(64, 8, cp, tp, llama))
    assert cp_time(s) * 5e9 == pytest.approx(expected)


def test_fewer_key_value_heads_than_cp_splits_are_repeated():
    qkv = {kv: qkv_width(64, 8, 4, 1, {"kv_heads": kv}) for kv in (8, 4, 2)}
    assert qkv == {8: 3 * 64, 4: (8 + 8) * 8, 2: 3 * 64}  # K=2 over cp 4: each repeated for its queries
    # three Q|K|V widths; the repeated copy replaces the one plain attention makes
    assert ulysses_values(model("llama", 2, d=64, heads=8), 1, 4) == 3 * 3 * 64
    assert ulysses_values(model("llama", 4, d=64, heads=8), 1, 4) == 3 * 16 * 8
    for kv in (2, 4):
        m = model("llama", kv, d=64, heads=8)
        assert minidist_block_values(m, 64) - minidist_block_values(m, 64, ring=True) == 8 * 64  # scores only


def test_minidist_ulysses_keeps_plain_attentions_scores_and_its_copies():
    """Ulysses runs plain attention on whole sequences of heads / cp heads: per token of a
    rank the same H x T scores as one rank's plain attention, which ring attention does not
    keep, and three Q|K|V widths of regrouped copies."""
    m = model()
    ring, ulysses = (memory_parts(m, Plan(cp=2, cp_impl=impl), FLOAT32, 16 * 64, minidist=True)["activations"]
                     for impl in ("ring", "ulysses"))
    per_token = (4 * 64 + ulysses_values(m, 1, 2)) * 4
    assert ulysses - ring == pytest.approx(4 * per_token * 8 * 64)   # 4 blocks, 8 sequences of 32 tokens a rank
    assert minidist_block_values(m, 64, ring=False) - minidist_block_values(m, 64, ring=True) == 4 * 64


def test_the_ring_probe_does_not_price_ulysses():
    m = model()
    rated = replace(CPU, ring_tile_s=4e-4, ring_score_s=1e-7)
    for minidist in (True, False):
        a, b = (estimate(m, mc, Plan(cp=2, cp_impl="ulysses"), 16 * 64, FLOAT32, minidist=minidist).time
                for mc in (CPU, rated))
        assert a == b
    ring = estimate(m, rated, Plan(cp=2), 16 * 64, FLOAT32, minidist=True)
    assert ring.time != estimate(m, CPU, Plan(cp=2), 16 * 64, FLOAT32, minidist=True).time


def test_cli_prices_a_ulysses_mesh_and_refuses_one_cp_cannot_split():
    base = [sys.executable, "-m", "minidist.plan", "--layers", "4", "--d-model", "128", "--heads", "4", "--vocab",
            "256", "--seq-len", "64", "--global-batch-tokens", "1024", "--precision", "bf16"]
    ok = subprocess.run(base + ["--gpus", "2", "--mesh", "tp=1,cp=2,pp=1,dp=1", "--cp-impl", "ulysses"],
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert "CP2 (Ulysses)" in ok.stdout
    bad = subprocess.run(base + ["--gpus", "8", "--mesh", "tp=1,cp=8,pp=1,dp=1", "--cp-impl", "ulysses"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2
    assert (
        "mesh tp=1,cp=8,pp=1,dp=1 is infeasible: cp=8 (Ulysses): the 4 heads of a tp=1 rank and the sequence of "
        "64 tokens must split into 8 equal parts") in bad.stderr.strip().splitlines()[-1]
    searched = subprocess.run(base + ["--gpus", "4", "--cp-impl", "ulysses", "--machine", "h100-nvlink-ib"],
                              capture_output=True, text=True, timeout=120)
    assert searched.returncode == 0, searched.stderr
    assert "cp as DeepSpeed-Ulysses" in searched.stdout.splitlines()[0]
    no_cp = subprocess.run(base + ["--gpus", "2", "--mesh", "tp=1,cp=1,pp=1,dp=2", "--cp-impl", "ulysses"],
                           capture_output=True, text=True, timeout=120)
    assert no_cp.returncode == 2 and "--cp-impl ulysses needs cp greater than 1" in no_cp.stderr
    plain = subprocess.run(base + ["--gpus", "2", "--mesh", "tp=1,cp=1,pp=1,dp=2", "--json"],
                           capture_output=True, text=True, timeout=120)
    assert json.loads(plain.stdout)["cp_impl"] is None  # no cp, no implementation of it


def test_the_validation_runs_a_ulysses_row_with_the_runs_flag(monkeypatch):
    from minidist.plan import validate

    rows = [mesh for _, mesh, _ in validate.CONFIGS if validate.plan_of(mesh).ulysses]
    assert rows
    seen = []

    def fake_run(cmd, **kwargs):
        seen.append(cmd)
        return subprocess.CompletedProcess(cmd, 1, "", "stopped here")

    monkeypatch.setattr(validate.subprocess, "run", fake_run)
    with pytest.raises(RuntimeError, match="stopped here"):
        validate.run(validate.SHAPE, rows[0], steps=2)
    cmd = " ".join(seen[-1])
    assert "--cp 2" in cmd and "--cp-impl ulysses" in cmd


def test_ranks_sharing_cores_wait_at_each_of_ulysses_all_to_alls():
    """Each step of an all-to-all (C-1 pairwise steps; two all-to-alls per block forward, two
    backward, two more when recomputed) is a sync point, where ring attention has its
    3 (C-1) ring steps; plus the gradients' all-reduce over the cp ranks (a bucket per block
    and one more) and the step's three."""
    from minidist.plan.cost import sync_wait

    shared = replace(CPU, cores=1, sync_slice_s=1e-3)
    for cp, ckpt, per_block in ((2, False, 4), (2, True, 6), (4, False, 4 * 3)):  # 3 pairwise steps each on 4
        s = Step.of(model(layers=3), shared, Plan(cp=cp, cp_impl="ulysses", checkpoint_activations=ckpt), FLOAT32,
                    4 * 64, True)
        assert sync_wait(s) == pytest.approx((3 * per_block + 4 + 3) * (1 - 1 / cp) * 1e-3)
    ring = Step.of(model(layers=3), shared, Plan(cp=2), FLOAT32, 4 * 64, True)
    assert sync_wait(ring) == pytest.approx((3 * 3 + 4 + 3) * 0.5 * 1e-3)
