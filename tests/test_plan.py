"""The cost model and mesh planner (minidist/plan): formulas against hand-computed cases and
the real code, the bubble against the schedule simulator, infeasible meshes, the search,
the Llama 3 405B rows, and the command line.  No MPI: the planner is arithmetic."""
import json
import subprocess
import sys
from dataclasses import replace

import pytest

from minidist.layout.model import ModelConfig
from minidist.layout.schedules import make_schedule, theoretical_bubble
from minidist.layout.simulate import simulate
from minidist.plan.cost import FLOAT32, FLOAT64, MIXED_BF16, Plan, estimate, memory_parts, problems, \
    stage_blocks
from minidist.plan.machine import PRESETS as MACHINES, Machine, Link, load
from minidist.plan.probes import others_load
from minidist.plan.model import PRESETS, block_matmul_flops, model_flops_per_token, num_params
from minidist.plan.search import meshes, rank_of, search

H100 = MACHINES["h100-nvlink-ib"]
LLAMA = PRESETS["llama3-405b"]
GBS = 16 * 2**20


def tiny_gpt(layers=2, d=16, heads=2, seq=8) -> ModelConfig:
    return ModelConfig(layers=layers, d_model=d, heads=heads, block_size=seq)


# ------------------------------------------------------------------ formulas, by hand and against the code


def test_flops_per_token_by_hand():
    # L=2, d=4, T=8, V=16: forward per layer 24 d^2 + 4 T d = 384 + 128; head 2 d V = 128.
    m = ModelConfig(layers=2, d_model=4, heads=2, vocab_size=16, block_size=8)
    assert model_flops_per_token(m) == 3 * (2 * (384 + 128) + 128)
    # Llama: QKV with 8 of 128 heads for K and V, SwiGLU's three matrices, causal half of the scores.
    assert block_matmul_flops(LLAMA) == 2 * (2 * 16384**2 + 2 * 16384 * 1024 + 3 * 16384 * 53248)
    per_token = model_flops_per_token(LLAMA)
    dense = 6 * (126 * (2 * 16384**2 + 2 * 16384 * 1024 + 3 * 16384 * 53248) + 16384 * 128256)
    assert per_token == dense + 3 * 126 * 2 * 8192 * 16384


def test_flops_equal_minidist_profile_for_its_gpt():
    from minidist.observe.profile import model_flops_per_token as profile_flops

    for layers, d, seq in ((2, 16, 8), (12, 768, 1024), (4, 256, 128)):
        assert model_flops_per_token(tiny_gpt(layers, d, 4, seq)) == profile_flops(layers, d, seq, 256)


def test_parameter_counts_equal_the_real_model_and_the_published_sizes():
    from minidist.model.nn import GPT

    for layers, d, heads, seq in ((2, 16, 2, 8), (3, 32, 4, 16)):
        model = GPT(tiny_gpt(layers, d, heads, seq))
        assert num_params(tiny_gpt(layers, d, heads, seq)) == sum(p.data.size for p in model.parameters())
    assert abs(num_params(LLAMA) / 405e9 - 1) < 0.01
    assert abs(num_params(PRESETS["llama3-70b"]) / 70.6e9 - 1) < 0.01
    assert abs(num_params(PRESETS["gpt3-175b"]) / 175e9 - 1) < 0.01


LLAMA_SHAPES = [  # (layers, d, heads, kv_heads, ffn_hidden, seq): K < H, K = 1, K = H, an explicit width
    (2, 32, 4, 2, None, 16), (2, 32, 4, 1, None, 16), (1, 64, 4, 4, None, 8), (3, 48, 6, 3, 100, 12)]


@pytest.mark.parametrize("layers,d,heads,kv,ffn,seq", LLAMA_SHAPES)
def test_llama_counts_equal_the_profile_and_the_built_model(layers, d, heads, kv, ffn, seq):
    from minidist.model.nn import GPT
    from minidist.observe.profile import flops_per_token

    run = ModelConfig(layers=layers, d_model=d, heads=heads, arch="llama", kv_heads=kv, ffn_hidden=ffn, block_size=seq)
    assert (run.gated, run.has_bias, run.untied, run.kv) == (True, False, True, kv)
    assert num_params(run) == GPT(run).num_parameters()
    # by hand: q and o d x d, k and v d x K·D, SwiGLU 3 d x F; attention 4 T d; the head 2 d V; x 3
    f, d_kv = run.ffn, kv * (d // heads)
    by_hand = 3 * (layers * (2 * (2 * d * d + 2 * d * d_kv + 3 * d * f) + 4 * seq * d) + 2 * d * 256)
    assert flops_per_token(run, seq) == model_flops_per_token(run) == by_hand


@pytest.mark.parametrize("untied,block_size", [(False, 16), (True, 16), (False, 24)])
def test_gpt2_counts_equal_the_profile_and_the_built_model(untied, block_size):
    """A position table longer than the sequences trained on (--block-size 24 --seq-len 16)."""
    from minidist.model.nn import GPT
    from minidist.observe.profile import flops_per_token, model_flops_per_token as gpt2_flops

    run = ModelConfig(layers=2, d_model=32, heads=4, tied=False if untied else None, block_size=block_size)
    assert num_params(run) == GPT(run).num_parameters()
    assert flops_per_token(run, 16) == model_flops_per_token(run, 16) == gpt2_flops(2, 32, 16, 256)


def test_llama3_8b_preset():
    m = PRESETS["llama3-8b"]
    shape = (m.layers, m.d_model, m.heads, m.kv, m.ffn, m.vocab_size, m.block_size)
    assert shape == (32, 4096, 32, 8, 14336, 128256, 8192)
    assert m.untied and m.gated
    assert abs(num_params(m) / 8.03e9 - 1) < 0.002


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
@pytest.mark.parametrize("dp", [2, 3])
def test_zero_memory_equals_the_bytes_minidist_holds(zero, dp):
    """The planner's parameters, gradients and optimizer state per rank against
    layout/memory.py's memory_formula, which tests/mpi/data_parallel_bodies.py checks equal
    to the bytes the real DDP/ZeRO/FSDP code holds (same tiny float64 AdamW model)."""
    from minidist.layout.memory import memory_formula

    m = tiny_gpt(layers=4, d=16, heads=2, seq=8)
    numel = num_params(m)
    parts = memory_parts(m, Plan(dp=dp, zero=zero, sequence_parallel=True), FLOAT64, dp * 8 * 2, minidist=True)
    want = memory_formula(zero, numel, numel / dp, 8, 2)
    for key in ("params", "grads", "optimizer"):
        assert parts[key] == pytest.approx(want[key], rel=1e-12), key


def test_memory_by_hand_for_mixed_precision_zero():
    m = PRESETS["minidist-gpt"]
    psi = num_params(m)
    for zero, per_param in ((0, 16), (1, 4 + 12 / 8), (2, 2 + 14 / 8), (3, 16 / 8)):
        p = memory_parts(m, Plan(dp=8, zero=zero, sequence_parallel=True), MIXED_BF16, 8 * 1024)
        assert p["params"] + p["grads"] + p["optimizer"] == pytest.approx(per_param * psi, rel=1e-12)


def test_activations_halve_with_tp_and_sequence_parallel_and_shrink_with_checkpointing():
    m = LLAMA
    def activations(**settings):
        plan = Plan(pp=1, dp=1, microbatches=2048, sequence_parallel=True, **settings)
        return memory_parts(m, plan, MIXED_BF16, GBS)["activations"]

    one, tp2, ck = activations(tp=1), activations(tp=2), activations(tp=1, checkpoint_activations=True)
    assert tp2 == pytest.approx(one / 2)
    tokens = GBS // 2048  # one sequence per microbatch: each block keeps only its input (bf16), one block everything
    assert ck == pytest.approx(126 * 16384 * 2 * tokens + one / 126)
    assert ck < one / 10


def test_stages_are_cut_at_whole_blocks_first_and_last_lighter():
    assert stage_blocks(126, 16) == (7,) + (8,) * 14 + (7,)
    assert stage_blocks(8, 4) == (2, 2, 2, 2)
    assert sum(stage_blocks(13, 5)) == 13


# ------------------------------------------------------------------ the bubble against the simulator


@pytest.mark.parametrize("name,P,M,V", [("gpipe", 4, 8, 1), ("1f1b", 4, 8, 1), ("1f1b", 2, 4, 1),
                                        ("interleaved", 4, 8, 2), ("interleaved", 2, 4, 2), ("gpipe", 8, 8, 1),
                                        ("zb-h1", 4, 8, 1), ("zb-h2", 4, 8, 1), ("zbv", 4, 8, 2), ("zbv", 2, 3, 2)])
def test_bubble_equals_the_schedule_simulator(name, P, M, V):
    sim = simulate(make_schedule(name, P, M, V))
    assert theoretical_bubble(name, P, M, V) == pytest.approx(sim.mean_bubble, abs=1e-9)


def test_the_estimated_pipeline_time_is_the_simulated_makespan():
    """With free communication and no other terms, the compute plus the bubble is the
    simulator's makespan for the same per-microbatch forward and backward times."""
    m = tiny_gpt(layers=4, d=64, heads=4, seq=64)
    bare = Machine("bare", {"float32": 1e9}, 1e12, 1e30, (Link("free", float("inf"), 1e30, 0.0),))
    for sched, V in (("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("zb-h2", 1), ("zbv", 2)):
        plan = Plan(pp=2, microbatches=4, schedule=sched, virtual_stages=V, sequence_parallel=True)
        e = estimate(m, bare, plan, 4 * 64, FLOAT32)
        t_f = e.time["compute"] / 4 / 3  # per microbatch, forward; backward is 2 x
        sim = simulate(make_schedule(sched, 2, 4, V), t_forward=t_f, t_backward=2 * t_f)
        assert e.time["compute"] + e.time["bubble"] == pytest.approx(sim.makespan, rel=1e-9)


def test_the_zero_bubble_schedules_are_priced_from_the_schedules():
    """zb-h1, zb-h2 and zbv: the bubble is schedules.theoretical_bubble, the activations in
    flight the simulator's peak (in whole-stage microbatches), so zbv idles least and holds
    1F1B's first-stage memory on every stage, zb-h2 the most."""
    from minidist.plan.cost import in_flight

    m = tiny_gpt(layers=8, d=64, heads=4, seq=64)
    bare = Machine("bare", {"float32": 1e9}, 1e12, 1e30, (Link("free", float("inf"), 1e30, 0.0),))
    est = {}
    for sched, V in (("1f1b", 1), ("zb-h1", 1), ("zb-h2", 1), ("zbv", 2)):
        plan = Plan(pp=4, microbatches=8, schedule=sched, virtual_stages=V)
        assert problems(m, plan, 4, 8 * 64) == []
        sim = simulate(make_schedule(sched, 4, 8, V))
        assert [in_flight(plan, r) for r in range(4)] == [k / V for k in sim.peak_in_flight]
        est[sched] = estimate(m, bare, plan, 8 * 64, FLOAT32)
        share = est[sched].time["bubble"] / (est[sched].time["compute"] + est[sched].time["bubble"])
        assert share == pytest.approx(theoretical_bubble(sched, 4, 8, V), rel=1e-9)
    assert est["zbv"].time["bubble"] < est["zb-h1"].time["bubble"] == est["zb-h2"].time["bubble"] < est["1f1b"].time["bubble"]
    assert [in_flight(Plan(pp=4, microbatches=8, schedule=s, virtual_stages=v), 3) for s, v in
            (("1f1b", 1), ("zb-h1", 1), ("zb-h2", 1), ("zbv", 2))] == [1, 4, 7, 4]
    assert "needs at least 2P-1 = 7 microbatches" in problems(m, Plan(pp=4, microbatches=4, schedule="zbv",
                                                                       virtual_stages=2), 4, 8 * 64)[0]


def test_cli_prices_a_zero_bubble_schedule_on_a_mesh():
    r = _plan("--preset", "minidist-gpt", "--gpus", "4", "--mesh", "tp=1,cp=1,pp=4,dp=1", "--schedule", "zbv", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert (out["pp"], out["schedule"], out["virtual_stages"]) == (4, "zbv", 2), out


# ------------------------------------------------------------------ feasibility and the search


def test_an_infeasible_mesh_is_rejected_with_its_reason():
    m = LLAMA
    def found(**mesh):
        return problems(m, Plan(**mesh, zero=1, sequence_parallel=True), 8192, GBS)

    assert any("tp=16 does not divide" in x for x in found(tp=16, pp=8, dp=64))
    assert any("8192 devices" not in x and "not --gpus" in x for x in found(tp=8, pp=8, dp=8))
    assert any("does not divide the 2048 sequences" in x for x in found(tp=1, dp=8192))
    e = estimate(m, H100, Plan(tp=8, pp=1, dp=1024, zero=0, microbatches=2, sequence_parallel=True), GBS)
    assert not e.fits and e.mem_bytes > 16 * num_params(m) / 8  # 16 bytes per parameter, an eighth per tp rank


def test_the_cli_rejects_an_infeasible_mesh_in_one_line_with_exit_2():
    for mesh, needle in (("tp=16,cp=1,pp=8,dp=64", "tp=16 does not divide the 128 heads"),
                         ("tp=8,cp=1,pp=1,dp=1024", "needs"), ("tp=8,pp=16", "not --gpus 8192")):
        r = subprocess.run([sys.executable, "-m", "minidist.plan", "--preset", "llama3-405b", "--gpus", "8192",
                            "--mesh", mesh, "--zero", "0"], capture_output=True, text=True, timeout=60)
        assert r.returncode == 2, (mesh, r.stdout, r.stderr)
        assert r.stderr.count("\n") == 1 and needle in r.stderr and "infeasible" in r.stderr, r.stderr


def test_enumeration_yields_only_meshes_whose_product_is_the_device_count():
    for devices in (8, 12, 64, 8192):
        found = list(meshes(LLAMA, devices, GBS))
        assert found
        for tp, cp, pp, dp in found:
            assert tp * cp * pp * dp == devices
            assert LLAMA.heads % tp == 0 and LLAMA.kv % tp == 0
            assert pp <= LLAMA.layers and (GBS // LLAMA.block_size) % dp == 0
    assert len(set(meshes(LLAMA, 64, GBS))) == len(list(meshes(LLAMA, 64, GBS)))


def test_search_ranks_feasible_meshes_fastest_first():
    ranked, _ = search(PRESETS["minidist-gpt"], H100, 16, 64 * 1024)
    assert ranked and all(e.fits for e in ranked)
    assert [e.step_s for e in ranked] == sorted(e.step_s for e in ranked)
    assert all(e.plan.devices == 16 for e in ranked)


# ------------------------------------------------------------------ checked against the world: Llama 3 405B

LLAMA_ROWS = [  # (devices, seq, mesh (tp, cp, pp, dp), published MFU) -- Dubey et al. 2024, table 4
    (8192, 8192, (8, 1, 16, 64), 0.43),
    (16384, 8192, (8, 1, 16, 128), 0.41),
    (16384, 131072, (8, 16, 16, 8), 0.38),
]


@pytest.mark.parametrize("devices,seq,mesh,published", LLAMA_ROWS)
def test_llama3_405b_rows(devices, seq, mesh, published):
    model = replace(LLAMA, block_size=seq)
    ranked, _ = search(model, H100, devices, GBS)
    place = rank_of(ranked, *mesh)
    assert place is not None and place <= 5, (place, [e.plan.label() for e in ranked[:6]])
    mfu = ranked[place - 1].mfu
    assert abs(mfu - published) <= 0.05, (mfu, published)


# ------------------------------------------------------------------ the command line


def _plan(*args):
    return subprocess.run([sys.executable, "-m", "minidist.plan", *args], capture_output=True, text=True, timeout=120)


def test_cli_json_of_one_mesh_parses_with_the_promised_fields():
    r = _plan("--preset", "llama3-405b", "--machine", "h100-nvlink-ib", "--gpus", "8192", "--seq-len", "8192",
              "--global-batch-tokens", "16777216", "--mesh", "tp=8,cp=1,pp=16,dp=64", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    for key in ("tp", "cp", "pp", "dp", "zero", "microbatches", "step_s", "mfu", "mem_gb"):
        assert key in out
    assert (out["tp"], out["cp"], out["pp"], out["dp"]) == (8, 1, 16, 64)
    assert 0 < out["mfu"] < 1 and out["mem_gb"] < 80 * 1.074


def test_cli_top_k_json_and_table():
    r = _plan("--preset", "minidist-gpt", "--gpus", "16", "--top", "3", "--json")
    assert r.returncode == 0, r.stderr
    top = json.loads(r.stdout)["top"]
    assert len(top) == 3 and all(t["tp"] * t["cp"] * t["pp"] * t["dp"] == 16 for t in top)
    r = _plan("--layers", "4", "--d-model", "64", "--heads", "4", "--vocab", "256", "--seq-len", "64", "--gpus", "4",
              "--global-batch-tokens", "1024", "--top", "2")
    assert r.returncode == 0 and "limited by" in r.stdout, r.stdout + r.stderr


def test_this_machine_without_calibration_is_one_clear_line(tmp_path):
    with pytest.raises(ValueError, match="--calibrate"):
        load("this-machine", str(tmp_path / "none.json"))
    r = _plan("--preset", "minidist-gpt", "--gpus", "2", "--machine", "this-machine", "--calibration",
              str(tmp_path / "none.json"))
    assert r.returncode == 2 and "--calibrate" in r.stderr


def test_machine_json_round_trips(tmp_path):
    path = tmp_path / "m.json"
    path.write_text(json.dumps(H100.to_json()))
    assert load(str(path)) == H100


def test_background_load_from_cpu_seconds():
    # Others used 1 of 2 cores while our 2 ranks ran: they are 2 runnable processes (fair share).
    assert others_load(busy=3.0, ours=2.0, wall=1.0, ranks=2, cores=2) == pytest.approx(2.0)
    assert others_load(busy=2.0, ours=2.0, wall=1.0, ranks=2, cores=2) == 0.0


# ------------------------------------------------------------------ this machine


def test_validation_predicts_every_configuration_and_measures_one_real_run():
    """The validation's pieces without its minutes: every configuration priced on a made-up
    calibration, and one real single-process run measured (step time, tracemalloc peak)."""
    from minidist.plan.validate import CONFIGS, SHAPE, plan_of, predict, run

    cpu = Machine("cpu", {"float32": 50e9, "float64": 25e9}, 8e9, 10e9, (Link("shm", float("inf"), 5e9, 2e-6),),
                  mem_usable=0.8, overlap=0.0, block_mb_s=3e-4, cores=2, sync_slice_s=1e-3)
    assert len(CONFIGS) >= 8
    axes = set()
    for _, mesh, change in CONFIGS:
        p = predict(cpu, {**SHAPE, **change}, mesh)
        assert p["step_s"] > 0 and p["peak_bytes"] > 0
        plan = plan_of(mesh)
        axes |= {a for a in ("tp", "cp", "pp", "dp") if getattr(plan, a) > 1} | {f"zero{plan.zero}"}
    assert {"tp", "cp", "pp", "dp", "zero1", "zero2", "zero3"} <= axes
    tiny = dict(layers=1, d_model=16, heads=2, seq_len=16, batch_size=4)
    meas = run(tiny, {}, steps=4)
    assert meas["step_s"] > 0 and meas["peak_bytes"] > 0 and meas["load"] >= 0


def test_the_launch_spread_is_how_far_one_launch_predicts_another():
    """The validation's own noise: per configuration, |a - b| / b over its launches' ordered
    pairs; the median over the configurations; None without a second launch."""
    from minidist.plan.validate import launch_spread

    assert launch_spread([[1.0, 1.0], [2.0, 2.0]]) == 0.0
    # 0.1/1.0 and 0.1/1.1 for the first configuration, 0.5/1.0 and 0.5/1.5 for the second
    assert launch_spread([[1.0, 1.1], [1.0, 1.5]]) == pytest.approx(((0.1 + 0.1 / 1.1) / 2 + (0.5 + 0.5 / 1.5) / 2) / 2)
    assert launch_spread([[1.0, 1.1], [3.0, 3.0], [2.0, 2.2]]) == pytest.approx((0.1 + 0.1 / 1.1) / 2)
    pairs = sorted([0.2 / 1.0, 0.1 / 1.0, 0.2 / 1.2, 0.1 / 1.2, 0.1 / 1.1, 0.1 / 1.1])  # three launches: six pairs
    assert launch_spread([[1.0, 1.2, 1.1]]) == pytest.approx((pairs[2] + pairs[3]) / 2)
    assert launch_spread([[1.0], [2.0]]) is None and launch_spread([]) is None


def test_minidist_ring_attention_is_priced_per_tile_and_score_when_calibrated():
    """On a CPU calibrated with the ring probe, a cp rank's attention is its tiles and its
    scores (all heads of its sequences) at the probe's rates, in the cp part; the attention
    FLOPs and the kept scores leave the compute.  Uncalibrated, and for a GPU, as before."""
    from minidist.layout.grid import ring_tiles
    from minidist.plan.cost import Step, cp_time, forward_time

    m = tiny_gpt(layers=4, d=128, heads=4, seq=64)
    cpu = Machine("cpu", {"float32": 50e9}, 8e9, 5e9, (Link("shm", float("inf"), 5e9, 2e-6),), overlap=0.0, cores=8)
    rated = replace(cpu, ring_tile_s=4e-4, ring_score_s=1e-7)
    tiles, scores = max(ring_tiles(2, 64, True, m.attention_block))
    assert (tiles, scores) == (5, 5 * 16 * 16)
    for ckpt, factor in ((False, 1.0), (True, 4 / 3)):
        plan = Plan(cp=2, checkpoint_activations=ckpt)
        s = Step.of(m, rated, plan, FLOAT32, 16 * 64, True)
        assert cp_time(s) == pytest.approx(4 * factor * (tiles * 4e-4 + 16 * 4 * scores * 1e-7))
    plan = Plan(cp=2)
    plain, ring = (Step.of(m, mc, plan, FLOAT32, 16 * 64, True) for mc in (cpu, rated))
    assert forward_time(ring) < forward_time(plain)  # no attention FLOPs, no H x T scores
    assert estimate(m, rated, plan, 16 * 64, FLOAT32, minidist=False).time == \
        estimate(m, cpu, plan, 16 * 64, FLOAT32, minidist=False).time
    assert estimate(m, rated, Plan(dp=2), 16 * 64, FLOAT32, minidist=True).time == \
        estimate(m, cpu, Plan(dp=2), 16 * 64, FLOAT32, minidist=True).time


def test_the_ring_probe_fit_recovers_its_rates():
    from minidist.plan.probes import fit_ring

    rows = [{"tiles": t, "scores": s, "s": t * 5e-4 + s * 8e-8} for t, s in ((5, 81920), (18, 73728), (5, 20480))]
    fit = fit_ring(rows)
    assert fit["ring_tile_s"] == pytest.approx(5e-4) and fit["ring_score_s"] == pytest.approx(8e-8)


def test_the_ring_probe_fit_refits_what_is_left_when_one_rate_is_negative():
    from minidist.plan.probes import fit_ring

    # per-score cost growing with the tile (the real probe's shape): the free fit's tile rate is negative
    rows = [{"tiles": 5, "scores": 81920, "s": 0.012}, {"tiles": 18, "scores": 73728, "s": 0.006},
            {"tiles": 5, "scores": 20480, "s": 0.002}]
    fit = fit_ring(rows)
    b = sum(r["scores"] * r["s"] for r in rows) / sum(r["scores"] ** 2 for r in rows)
    assert fit == {"ring_tile_s": 0.0, "ring_score_s": pytest.approx(b)}


def test_ring_attention_keeps_no_scores_in_the_memory_minidist_is_priced_with():
    m = tiny_gpt(layers=4, d=128, heads=4, seq=64)
    one, cp2 = (memory_parts(m, Plan(cp=cp), FLOAT32, 16 * 64, minidist=True)["activations"] for cp in (1, 2))
    from minidist.plan.cost import minidist_block_values
    per_token = {cp: (minidist_block_values(m, 64, False, cp > 1) - 12 * 128) * 4 + 12 * 128 * 4 for cp in (1, 2)}
    assert per_token[1] - per_token[2] == 4 * 64 * 4  # H x T float32 scores per token
    assert cp2 < one / 2


def test_the_elementwise_rate_is_the_one_that_prices_the_probe_step_exactly():
    """validate.elementwise_rate inverts the cost model on the probe shape: a step priced at
    rate R gives back R."""
    from minidist.plan.validate import PROBE_SHAPE, elementwise_rate, predict

    cpu = Machine("cpu", {"float32": 50e9, "float64": 25e9}, 8e9, 3e9, (Link("shm", float("inf"), 5e9, 2e-6),),
                  overlap=0.0, block_mb_s=3e-4, cores=2)
    step = predict(cpu, PROBE_SHAPE, {})["step_s"]
    assert elementwise_rate(replace(cpu, mem_bw=9e9), {"step_s": step, "load": 0.0}) == pytest.approx(3e9)
    assert elementwise_rate(cpu, {"step_s": step / 100, "load": 0.0}) is None  # less than the matmuls alone
