"""The planner's mixture of experts and expert parallelism (minidist/plan: model.py, stages.py,
moe_cost.py, feasible.py, search.py): parameter and FLOP counts against the built model and
by hand, the Mixtral 8x7B preset against its published sizes, the experts' memory and
ZeRO over the ranks holding them, the all-to-all's bytes and link, ep in the search, the
command line.  No MPI: the planner is arithmetic."""
import json
import subprocess
import sys
from dataclasses import replace

import pytest

from minidist.layout.memory import memory_formula
from minidist.layout.model import ModelConfig
from minidist.plan.collectives import all_to_all
from minidist.plan.cost import FLOAT64, MIXED_BF16, Plan, Step, estimate, memory_parts, problems
from minidist.plan.machine import INF, PRESETS as MACHINES, Link
from minidist.plan.model import (PRESETS, Preset, active_params, block_matmul_flops, model_flops_per_token,
                                 moe_blocks, num_params)
from minidist.plan.moe_cost import ep_span, ep_time, sent_bytes
from minidist.plan.search import expert_degrees, search
from minidist.plan.stages import stage_params

H100 = MACHINES["h100-nvlink-ib"]
MIXTRAL = PRESETS["mixtral-8x7b"]


def tiny_moe(experts=4, top_k=2, moe_every=1, layers=2, d=16, gated=False, seq=8) -> ModelConfig:
    return ModelConfig(arch="llama" if gated else "gpt2", layers=layers, d_model=d, heads=2, block_size=seq,
                       experts=experts, top_k=top_k, moe_every=moe_every)


# ------------------------------------------------------------------ counts


def test_mixtral_8x7b_preset_reproduces_the_published_sizes():
    m = MIXTRAL
    assert (m.layers, m.d_model, m.heads, m.kv, m.ffn, m.vocab_size) == (32, 4096, 32, 8, 14336, 32000)
    assert (m.experts, m.top_k, m.moe_every, m.gated, m.untied) == (8, 2, 1, True, True)
    assert moe_blocks(m) == 32
    # Jiang et al. 2024: 46.7B parameters, 12.9B active per token (13B in the paper's rounding)
    assert abs(num_params(m) / 46.7e9 - 1) < 0.002
    assert abs(active_params(m) / 12.9e9 - 1) < 0.002
    # by hand: per block q, o d x d; k, v d x 1024; 8 SwiGLU experts 3 d f; router d x 8; two RMSNorms
    d, f = 4096, 14336
    block = 2 * d * d + 2 * d * 1024 + 2 * d + d * 8
    outside = 2 * 32000 * d + d
    assert num_params(m) == 32 * (block + 8 * 3 * d * f) + outside
    assert active_params(m) == 32 * (block + 2 * 3 * d * f) + outside


def test_flops_count_the_active_experts_only():
    m = MIXTRAL
    d, f, T = 4096, 14336, m.block_size
    per_block = 2 * (2 * d * d + 2 * d * 1024 + 2 * 3 * d * f + d * 8)  # two experts and the router
    assert block_matmul_flops(m, moe=True) == per_block
    assert model_flops_per_token(m) == 3 * (32 * (per_block + 2 * T * d) + 2 * d * 32000)  # causal half
    # top-1 of 64 experts costs what one dense MLP costs (plus the router): Switch's point
    switch = replace(m, experts=64, top_k=1)
    dense = replace(m, experts=0)
    assert model_flops_per_token(switch) - model_flops_per_token(dense) == 3 * 32 * 2 * d * 64
    assert num_params(switch) > 7 * num_params(m)


@pytest.mark.parametrize("arch,experts,top_k,moe_every,layers", [
    ("gpt2", 4, 2, 1, 2), ("gpt2", 3, 1, 2, 3), ("llama", 4, 2, 1, 2), ("llama", 8, 2, 2, 4)])
def test_counts_equal_the_built_model_and_the_profile(arch, experts, top_k, moe_every, layers):
    from minidist.model.nn import GPT
    from minidist.observe.profile import flops_per_token

    run = ModelConfig(layers=layers, d_model=32, heads=4, arch=arch, kv_heads=2 if arch == "llama" else None,
                      experts=experts, top_k=top_k, moe_every=moe_every, block_size=16)
    assert num_params(run) == GPT(run).num_parameters()
    # by hand: each mixture runs top_k MLPs and a d x E router per token, the dense blocks one MLP
    d, f = 32, run.ffn
    attn = 2 * d * d + 2 * d * (run.d_kv)
    mlp = (3 if arch == "llama" else 2) * d * f
    n_moe = layers // moe_every
    fwd = layers * (attn + 16 * d * 2) + (layers - n_moe) * mlp + n_moe * (top_k * mlp + d * experts)
    assert flops_per_token(run, 16) == model_flops_per_token(run) == 3 * (2 * fwd + 2 * d * 256)


# ------------------------------------------------------------------ memory


@pytest.mark.parametrize("zero", [0, 1, 2])
@pytest.mark.parametrize("dp,ep", [(4, 2), (4, 4), (2, 1)])
def test_expert_state_is_split_over_ep_and_sharded_over_the_ranks_holding_it(zero, dp, ep):
    """Dense parameters' state by ZeRO over dp; the experts': E/ep of them per rank, ZeRO over
    the dp/ep ranks that hold the same experts (layout/memory.py's table for each set)."""
    m = tiny_moe(experts=4, layers=2, d=16)
    p = Plan(dp=dp, ep=ep, zero=zero)
    mlp = 2 * 16 * 64 + 64 + 16                 # one GELU expert with biases
    experts = 2 * 4 * mlp                       # two mixtures of four
    dense = num_params(m) - experts
    assert stage_params(m, p) == (dense, experts / ep)
    parts = memory_parts(m, p, FLOAT64, dp * 8 * 2, minidist=True)
    want_d = memory_formula(zero, dense, dense / dp, 8, 2)
    want_e = memory_formula(zero, experts / ep, experts / ep / (dp // ep), 8, 2)
    for key in ("params", "grads", "optimizer"):
        assert parts[key] == pytest.approx(want_d[key] + want_e[key], rel=1e-12)


def test_ep_shrinks_the_memory_of_mixtral_per_rank():
    p1 = Plan(dp=64, zero=1, microbatches=16)
    m = replace(MIXTRAL, block_size=4096)
    mem = [sum(memory_parts(m, replace(p1, ep=ep), MIXED_BF16, 2**22).values()) for ep in (1, 2, 4, 8)]
    # at least 2 + 2 bytes (weights, gradients) of the 7/8 of 45B expert parameters ep=8 moves away
    assert mem == sorted(mem, reverse=True) and mem[0] - mem[-1] > 60e9


# ------------------------------------------------------------------ the all-to-all


def test_all_to_all_bytes_by_hand_and_the_link_it_spans():
    m = replace(MIXTRAL, block_size=4096)
    tokens = 2**22
    p = Plan(dp=64, ep=8, zero=1, microbatches=16)
    s = Step.of(m, H100, p, MIXED_BF16, tokens, False)
    n = tokens // 64 // 16                      # one rank's microbatch: 4096 tokens
    assert sent_bytes(s) == n * 2 * 4096 * 2 * 7 / 8
    assert ep_span(p) == 8                      # eight consecutive dp ranks: one node, NVLink
    nvlink = H100.links[0]
    one = all_to_all(n * 2 * 4096 * 2, 8, nvlink, H100.link_eff)
    assert ep_time(s) == pytest.approx(32 * 4 * one)   # 32 mixtures, dispatch + combine, forward + backward
    # with pp=2 consecutive dp ranks are two ranks apart: ep=8 spans ranks 0..14, InfiniBand
    q = Plan(pp=2, dp=32, ep=8, zero=1, microbatches=16)
    assert ep_span(q) == 15 and H100.link_for(ep_span(q)).name == "infiniband"
    assert ep_span(Plan(tp=2, dp=32, ep=4)) == 8 and ep_span(Plan(dp=64)) == 1
    # tp=2: ep=4 spans a node, ep=8 two: the same rows over InfiniBand's 50 GB/s instead of 450
    e_in, e_out = (estimate(m, H100, Plan(tp=2, dp=32, ep=ep, zero=1, microbatches=8), tokens) for ep in (4, 8))
    assert e_out.time["ep"] > 5 * e_in.time["ep"]


def test_a_capacity_factor_pads_the_rows_of_a_fused_implementation_only():
    """GShard/Switch pad every expert's buffer to c x T x k / E rows: c x k rows per token
    travel and compute; minidist computes and sends the kept rows, at most k."""
    m = replace(MIXTRAL, block_size=4096)
    p = Plan(dp=64, ep=8, zero=1, microbatches=16)
    for minidist, factor in ((False, 1.25), (True, 1.0)):
        base, padded = (Step.of(x, H100, p, MIXED_BF16, 2**22, minidist) for x in (m, replace(m, capacity_factor=1.25)))
        assert sent_bytes(padded) == pytest.approx(factor * sent_bytes(base))
    plain, padded = (estimate(x, H100, p, 2**22) for x in (m, replace(m, capacity_factor=1.25)))
    assert padded.time["compute"] > plain.time["compute"] and padded.mfu < plain.mfu  # model FLOPs stay k experts'


def test_experts_gradients_reduce_over_dp_over_ep_ranks():
    """ep = dp leaves no rank holding the same experts: only the dense gradients travel."""
    m = tiny_moe(experts=4, layers=2, d=64, seq=64)
    mc = replace(H100, overlap=0.0)  # nothing hidden: the reduction's own time
    t = {ep: estimate(m, mc, Plan(dp=4, ep=ep, zero=0), 4 * 64 * 4).time["dp"] for ep in (1, 2, 4)}
    assert t[1] > t[2] > t[4] > 0
    dense_only = estimate(replace(m, experts=0), mc, Plan(dp=4), 4 * 64 * 4).time["dp"]
    assert t[4] < dense_only          # dense MLPs reduce where the experts no longer do


# ------------------------------------------------------------------ feasibility and the search


def test_ep_must_divide_the_experts_and_dp_and_needs_experts():
    m = tiny_moe(experts=4)
    assert any("does not divide the 4 experts" in x for x in problems(m, Plan(dp=6, ep=3), 6, 6 * 8))
    assert any("does not divide dp=2" in x for x in problems(m, Plan(dp=2, ep=4), 2, 16))
    assert any("no experts" in x for x in problems(replace(m, experts=0), Plan(dp=2, ep=2), 2, 16))
    assert problems(m, Plan(dp=4, ep=4), 4, 32) == []
    # priced as minidist, a mixture with tp, pp, cp or ZeRO-3 is not priced; as fused kernels it is
    assert problems(m, Plan(tp=2, dp=2, ep=2), 4, 16) == []
    assert any("tp" in x for x in problems(m, Plan(tp=2, dp=2, ep=2), 4, 16, minidist=True))
    assert any("ZeRO-3" in x for x in problems(m, Plan(dp=2, zero=3), 2, 16, minidist=True))
    assert expert_degrees(m, 8) == [1, 2, 4] and expert_degrees(replace(m, experts=0), 8) == [1]


def test_the_planner_picks_ep_for_mixtral_where_it_is_cheaper():
    """64 H100s, 4M-token batches of 4,096 tokens: expert parallelism within a node wins over
    every ep = 1 mesh, and the plan fits in memory."""
    m = replace(MIXTRAL, block_size=4096)
    ranked, _ = search(m, H100, 64, 2**22)
    best = ranked[0]
    assert best.fits and best.mem_bytes <= H100.mem_bytes * H100.mem_usable
    assert best.plan.ep > 1 and best.plan.dp % best.plan.ep == 0
    assert H100.link_for(ep_span(best.plan)).name == "nvlink"
    dense_best = min((e for e in ranked if e.plan.ep == 1), key=lambda e: e.step_s)
    assert best.step_s < dense_best.step_s
    # the same mesh with ep = 1 is slower (or does not fit)
    same = [e for e in ranked if (e.plan.tp, e.plan.cp, e.plan.pp, e.plan.dp, e.plan.ep)
            == (best.plan.tp, best.plan.cp, best.plan.pp, best.plan.dp, 1)]
    assert all(e.step_s > best.step_s for e in same)


def test_the_planner_keeps_ep_1_where_the_all_to_all_costs_more_than_it_saves():
    """A small mixture that fits anyway, on a machine whose every link is slow: ep would only
    add all-to-alls."""
    m = Preset(name="small-moe", arch="llama", layers=4, d_model=512, heads=8, vocab_size=32000, block_size=2048,
               causal_skip=True, experts=8, top_k=2)
    slow = replace(H100, links=(Link("nvlink", 1, 450e9, 3e-6), Link("ethernet", INF, 5e9, 20e-6)))
    ranked, _ = search(m, slow, 8, 2**21)
    assert ranked[0].plan.ep == 1
    with_ep = [e for e in ranked if e.plan.ep > 1]
    assert with_ep and min(e.step_s for e in with_ep) > ranked[0].step_s


# ------------------------------------------------------------------ the command line


def _plan(*args):
    return subprocess.run([sys.executable, "-m", "minidist.plan", *args], capture_output=True, text=True, timeout=120)


def test_cli_prices_an_ep_mesh_and_refuses_a_bad_one_in_one_line():
    base = ["--preset", "mixtral-8x7b", "--gpus", "64", "--global-batch-tokens", "4194304", "--seq-len", "4096"]
    r = _plan(*base, "--mesh", "dp=64,ep=8", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["ep"] == 8 and out["fits"] and out["time_s"]["ep"] > 0
    r = _plan(*base, "--mesh", "dp=64,ep=3")
    assert r.returncode == 2 and "ep=3 does not divide the 8 experts" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    r = _plan("--layers", "2", "--d-model", "64", "--heads", "4", "--vocab", "256", "--seq-len", "32", "--gpus", "4",
              "--global-batch-tokens", "512", "--experts", "2", "--top-k", "3")
    assert r.returncode == 2 and "--top-k 3 is more than the --experts 2" in r.stderr
    r = _plan(*base, "--top", "2")
    assert r.returncode == 0 and "12.88B active per token" in r.stdout and "ep=8" in r.stdout


def test_a_float32_plan_on_a_gpu_preset_finds_its_peak_rate():
    """The presets name fp32 as NVIDIA does, --precision float32 as NumPy does."""
    r = _plan("--preset", "minidist-bench", "--gpus", "2", "--mesh", "dp=2", "--precision", "float32", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["step_s"] > 0


# ------------------------------------------------------------------ against a real run


@pytest.mark.mpi
def test_validation_predicts_the_all_to_all_bytes_of_a_real_ep_run():
    """The validation's ep row in small: the bytes rank 0 sends per step on its ep group
    (``bytes_sent``, the all-to-alls) against the planner's, balanced routing assumed: 2
    sequences of 16 tokens per rank, top-2 of 4 experts, d 16, float32, half the rows leave,
    dispatch and combine forward and backward: 4 x 32 x 2 x 16 x 4 / 2 = 8,192 bytes."""
    from minidist.plan.validate import CONFIGS, plan_of, predict, run

    assert any(plan_of(mesh).ep > 1 for _, mesh, _ in CONFIGS)
    cpu = replace(H100, name="cpu", peak={"float32": 50e9}, cores=2)
    tiny = dict(layers=1, d_model=16, heads=2, seq_len=16, batch_size=4, experts=4)
    mesh = dict(dp=2, ep=2, zero=1)
    pred = predict(cpu, tiny, mesh)
    assert pred["ep_bytes"] == 4 * 32 * 2 * 16 * 4 / 2
    assert pred["time"]["ep"] > 0
    meas = run(tiny, mesh, steps=4)
    assert meas["ep_bytes"] == pytest.approx(pred["ep_bytes"], rel=0.25)


def test_the_routing_measured_prices_the_busiest_expert_rank():
    """validate.expert_load reads the metrics' router counts (experts split over the ep ranks
    in order); the estimate's expert_load adds that share of the experts' rows to the busiest
    rank's compute with ep > 1, and nothing without ep."""
    from minidist.plan.cost import FLOAT32
    from minidist.plan.machine import Machine
    from minidist.plan.moe_cost import expert_flops, expert_values
    from minidist.plan.validate import expert_load

    rows = [{"router": {"tokens": [[6, 2, 0, 0], [1, 1, 3, 3]]}}, {"router": {"tokens": [[2, 2, 2, 2]]}}, {}]
    assert expert_load(rows, 2) == pytest.approx((2.0 + 1.5 + 1.0) / 3)  # 8 of 8 on rank 0; 6 of 8; balanced
    assert expert_load(rows, 1) == 1.0 and expert_load([{}], 2) == 1.0
    m = ModelConfig(layers=2, d_model=64, heads=4, block_size=32, experts=4, top_k=2)
    cpu = Machine("cpu", {"float32": 50e9}, 8e9, 5e9, (Link("shm", float("inf"), 5e9, 2e-6),), overlap=0.0, cores=8)
    for plan, extra in ((Plan(dp=2, ep=2), True), (Plan(dp=2), False)):
        even, busy = (estimate(m, cpu, plan, 8 * 32, FLOAT32, minidist=True, expert_load=x) for x in (1.0, 1.5))
        flops = 0.5 * expert_flops(m, True) * 4 * 32 * 2 * 3 / 50e9  # 4 sequences x 32 tokens, 2 mixtures, fwd + bwd
        values = 0.5 * expert_values(m) * 4 * 4 * 32 * 2 * 2 * 3 / 5e9  # float32, written and read, fwd + bwd
        assert busy.time["compute"] - even.time["compute"] == pytest.approx(flops + values if extra else 0.0)


def test_fused_experts_padded_to_a_capacity_pay_no_routing_imbalance():
    """With a capacity factor a fused implementation pads every expert to its capacity: the
    busiest rank runs the same rows, so the measured imbalance adds nothing; minidist (and
    dropless routing) runs the rows it got."""
    from minidist.plan.cost import FLOAT32
    from minidist.plan.machine import Machine

    cpu = Machine("cpu", {"float32": 50e9}, 8e9, 5e9, (Link("shm", float("inf"), 5e9, 2e-6),), overlap=0.0, cores=8)
    m = ModelConfig(layers=2, d_model=64, heads=4, block_size=32, experts=4, top_k=2, capacity_factor=1.25)
    for minidist, moves in ((False, False), (True, True)):
        even, busy = (estimate(m, cpu, Plan(dp=2, ep=2), 8 * 32, FLOAT32, minidist=minidist, expert_load=x).step_s
                      for x in (1.0, 1.5))
        assert (busy > even) == moves
