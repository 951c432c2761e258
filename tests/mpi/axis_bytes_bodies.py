"""Bodies run on every rank by tests/test_axis_bytes.py (4 ranks, float64).

``counting``: ``comm.stats.bytes_by_group()`` charges every byte a rank sends to the group it
travels on: collectives (here and on the progress threads), the cached plans of repeated
calls, and the plain point-to-point calls a pipeline uses.

``step_matrix`` (dp2 x tp2, dp2 x pp2, dp2 x cp2), ``more_settings`` and ``composed``: a
training step (``strategy.forward_backward`` then ``train.update``, the run built from the
training flags as ``python -m minidist.train`` builds it) measured with bytes_by_group must
equal ``layout.traffic.step_bytes`` to the byte on every rank and group; the second step
too (its repeated collectives run as cached plans).
"""
import sys

import numpy as np

from minidist import comm
from minidist.comm.stats import bytes_by_group, reset_stats, stats
from minidist.layout import rank_params, traffic
from minidist.layout.schedules import placement_of, rank_stages

TINY = ["--layers", "2", "--d-model", "16", "--heads", "2", "--seq-len", "8", "--batch-size", "8",
        "--dtype", "float64", "--steps", "2", "--eval-every", "0", "--quiet"]


def _delta(fn) -> dict:
    """Bytes sent per group while ``fn()`` runs (only the groups that changed)."""
    before = bytes_by_group()
    fn()
    after = bytes_by_group()
    return {k: after.get(k, 0) - before.get(k, 0) for k in set(before) | set(after)
            if after.get(k, 0) != before.get(k, 0)}


# ------------------------------------------------------------------ the counters


def counting():
    mesh = comm.Mesh(dp=2, tp=2)
    dp, tp, world = mesh.group("dp"), mesh.group("tp"), mesh.group(("dp", "tp"))
    x = np.arange(1000, dtype=np.float64)  # 8000 bytes
    X = x.nbytes

    # the textbook ring: 2(N-1)/N X on the group it runs on, nothing on the others
    W = world.name  # the mesh names it by its axes, "dp+tp"
    assert _delta(lambda: comm.all_reduce(x, dp, algorithm="ring")) == {"dp": X}, "ring over dp"
    assert _delta(lambda: comm.all_reduce(x, world, algorithm="ring")) == {W: 2 * 3 * X // 4}, "ring over 4"
    # recursive doubling (small): log2(N) X; async: sent by the group's progress thread
    assert _delta(lambda: comm.all_reduce(x, world)) == {W: 2 * X}, "doubling over 4"
    assert _delta(lambda: comm.all_reduce(x, comm.world())) == {"world": 2 * X}, "doubling over comm.world()"
    assert _delta(lambda: comm.all_reduce(x, tp, async_op=True).wait()) == {"tp": X}, "async all_reduce"
    assert _delta(lambda: comm.reduce_scatter(x, world, async_op=True).wait()) == {W: 3 * X // 4}
    # the fast path: the second identical call runs a cached plan, charged all the same
    # (an all-gather without out= on 4 ranks is Bruck's: each record carries an 8-byte row count)
    for name, call, sent in [("all_reduce", lambda: comm.all_reduce(x[:64], tp), 512),
                             ("reduce_scatter", lambda: comm.reduce_scatter(x[:64], world), 3 * 128),
                             ("all_gather", lambda: comm.all_gather(x[:16], world), 3 * (128 + 8))]:
        group = tp if name == "all_reduce" else world
        first = _delta(call)
        assert any(key[0][0] == name for key in group._plans), f"no plan cached for {name}"
        again = _delta(call)
        assert first == again == {group.name: sent}, (name, first, again)
    # point to point on the pipeline group, as PipelineRuntime sends: charged to the sender's group
    pipe = comm.Mesh(dp=2, pp=2)
    pp, stage = pipe.group("pp"), pipe.coord("pp")
    a = np.full((3, 5), 1.0 + stage)
    if stage == 0:
        got = _delta(lambda: comm.isend(a, 1, pp, tag=7).wait())
        assert got == {"pp": a.nbytes}, got
        assert _delta(lambda: comm.send(a[:1], 1, pp)) == {"pp": a[:1].nbytes}
    else:
        assert _delta(lambda: comm.irecv(np.empty_like(a), 0, pp, tag=7).wait()) == {}
        assert _delta(lambda: comm.recv(a[:1].shape, a.dtype, 0, pp)) == {}
    assert _delta(lambda: comm.sendrecv(a, 1 - stage, 1 - stage, pp)) == {"pp": a.nbytes}
    # the per-collective counters still count; reset_stats zeroes both
    assert stats()["all_reduce"]["bytes_sent"] > 0
    reset_stats()
    assert bytes_by_group() == {} and stats() == {}, (bytes_by_group(), stats())
    print(f"counting ok on rank {comm.world().rank}", flush=True)


# ------------------------------------------------------------------ one training step


def build(argv, vocab=None):
    """(model, strategy, cfg, mesh) for the training flags ``argv``, built as
    ``python -m minidist.train`` builds them (flags -> RunConfig -> Mesh -> compose.build);
    ``vocab``: another vocabulary than the byte tokenizer's 256."""
    from minidist.parallel.compose import build, build_mesh
    from minidist.train.flags import build_parser, validate

    parser = build_parser()
    cfg = validate(parser.parse_args(argv), parser)
    if vocab:
        cfg = cfg.replace(model=dict(vocab_size=vocab))
    mesh = build_mesh(cfg.parallel)
    model, strategy = build(cfg, mesh)
    return model, strategy, cfg, mesh


def formula(cfg, mesh) -> dict:
    """``traffic.expected_step_bytes`` of this rank, keyed by group name; first the group
    names the formulas assume are checked against the mesh's own."""
    p = cfg.parallel
    sizes = {"dp": p.dp, "pp": p.pp, "tp": p.tp, "cp": p.cp}
    names = {"dp": mesh.group(("dp", "cp")).name, "pp": mesh.group("pp").name, "tp": mesh.group("tp").name,
             "cp": mesh.group("cp").name, "world": mesh.world.name}
    assert traffic.group_names(**sizes) == names, (traffic.group_names(**sizes), names)
    return traffic.expected_step_bytes(cfg, mesh.rank)


def measure_steps(flags, steps=2, vocab=None) -> tuple:
    """bytes_by_group around each of ``steps`` training steps of the flags' run, the
    formula's numbers (per step: with --ep, the ep group's from that step's routing) and the mesh."""
    from minidist.model.backend import dtype
    from minidist.state.data import Sampler
    from minidist.model.optim import DynamicLossScaler
    from minidist.train.loop import update
    from minidist.train.report import router_stats

    model, strategy, cfg, mesh = build(TINY + flags, vocab)
    m, p = cfg.model, cfg.parallel
    if p.zero != 3:  # the formula's parameter list is what this rank holds (ZeRO-3 keeps only shards)
        stages = rank_stages(mesh.coord("pp"), p.pp, p.virtual_stages, placement_of(p.schedule))
        want = rank_params.param_numels(m, p.tp, stages, p.pp * p.virtual_stages, p.ep,
                                        mesh.group(("dp", "cp")).rank % p.ep)
        assert [q.size for q in model.parameters()] == want, ([q.size for q in model.parameters()], want)
    router = router_stats(cfg, strategy)  # --ep: the ep group's bytes from the routing
    corpus = np.random.default_rng(1).integers(0, m.vocab_size, 4000).astype(np.uint8)
    sampler = Sampler(corpus, cfg.data.seq_len, cfg.data.batch_size, m.seed)
    mp = cfg.device.mixed_precision
    low = {"none": None, "bf16": dtype("bfloat16"), "fp16": dtype("float16")}[mp]
    scaler = DynamicLossScaler() if mp == "fp16" else None  # as train() does
    out, wants = [], []
    for step in range(steps):
        x, y = sampler.batch(step)

        def one_step():
            strategy.forward_backward(x, y, cfg.device.grad_accum, low, scaler.scale if scaler else 1.0)
            update(strategy, scaler, cfg.optim.clip_grad)

        out.append(_delta(one_step))
        ep = router.step(m.d_model, 8 if m.dtype == "float64" else 4).get("ep_bytes", {}) if router else {}
        wants.append({**formula(cfg, mesh), **ep})
    return out, wants, mesh


def check(flags, vocab=None) -> None:
    measured, wants, mesh = measure_steps(flags, vocab=vocab)
    label = " ".join(flags) + (f" vocab {vocab}" if vocab else "")
    for step, (got, want) in enumerate(zip(measured, wants)):
        assert got == want, (f"{label}: rank {mesh.rank} {mesh.coords}, step {step}: measured {got}, "
                             f"formula {want}; by collective: {stats()}")
    print(f"axis bytes ok: {label} rank {mesh.rank} {dict(sorted(want.items()))}", flush=True)


MESHES = [["--dp", "2", "--tp", "2"], ["--dp", "2", "--pp", "2"], ["--dp", "2", "--cp", "2"]]
MORE = [
    ["--dp", "2", "--tp", "2", "--sequence-parallel"],
    ["--dp", "2", "--tp", "2", "--grad-accum", "2", "--checkpoint-activations", "--bucket-mb", "0.01",
     "--batch-size", "11", "--untied"],
    ["--dp", "2", "--cp", "2", "--cp-impl", "ulysses"],
    ["--dp", "2", "--cp", "2", "--checkpoint-activations", "--grad-accum", "2", "--batch-size", "7"],
    ["--dp", "2", "--pp", "2", "--schedule", "interleaved", "--layers", "4", "--microbatches", "2",
     "--grad-accum", "2", "--batch-size", "11"],
    ["--dp", "2", "--pp", "2", "--zero", "1", "--untied", "--bucket-mb", "0.01"],
    ["--dp", "4", "--zero", "1", "--bucket-mb", "0.02"],
    ["--dp", "4", "--zero", "2", "--grad-accum", "2", "--batch-size", "9"],
    ["--dp", "4", "--zero", "3", "--batch-size", "10"],
    ["--dp", "4", "--batch-size", "10", "--clip-grad", "0"],
]
# the composer's meshes of two model axes, and ZeRO under the model axes
COMPOSED = [
    ["--tp", "2", "--cp", "2"],
    ["--tp", "2", "--cp", "2", "--cp-impl", "ulysses", "--heads", "4", "--sequence-parallel"],
    ["--pp", "2", "--tp", "2", "--sequence-parallel"],
    ["--pp", "2", "--cp", "2", "--untied"],
    ["--dp", "2", "--tp", "2", "--zero", "1"],
    ["--dp", "2", "--tp", "2", "--zero", "3", "--grad-accum", "2"],
    ["--dp", "2", "--cp", "2", "--zero", "2"],
    ["--dp", "2", "--pp", "2", "--zero", "2", "--grad-accum", "2", "--microbatches", "2"],
    ["--dp", "2", "--pp", "2", "--zero", "3"],
    ["--dp", "2", "--pp", "2", "--zero", "3", "--schedule", "interleaved", "--layers", "4", "--grad-accum", "2",
     "--microbatches", "2"],
    ["--dp", "2", "--pp", "2", "--zero", "3", "--schedule", "looping", "--layers", "4", "--microbatches", "2"],
]


# mixtures of experts (the experts ordinary data-parallel parameters, or with --ep reduced over
# the edp group; replicated over tp; each cp rank routing the whole sequences), and vocabularies
# that tp does not divide (the embedding padded)
MOE = ["--experts", "4", "--capacity-factor", "1.0"]
EXPERTS = [
    ["--dp", "4", *MOE, "--bucket-mb", "0.01"],
    ["--dp", "4", *MOE, "--ep", "2", "--zero", "1", "--moe-every", "2", "--layers", "3"],
    ["--dp", "4", *MOE, "--ep", "2", "--zero", "2", "--grad-accum", "2"],
    ["--dp", "2", "--pp", "2", *MOE, "--ep", "2", "--moe-every", "2", "--layers", "4", "--microbatches", "2"],
    ["--dp", "2", "--tp", "2", *MOE, "--sequence-parallel", "--checkpoint-activations", "--moe-every", "2"],
    ["--tp", "2", "--cp", "2", *MOE, "--top-k", "1"],
    ["--dp", "2", "--cp", "2", *MOE, "--ep", "2", "--zero", "3", "--cp-impl", "ulysses"],
    ["--dp", "2", "--pp", "2", *MOE, "--zero", "3", "--schedule", "interleaved", "--layers", "4",
     "--microbatches", "2", "--moe-every", "2"],
]
PADDED = [["--dp", "2", "--tp", "2"], ["--pp", "2", "--tp", "2", "--sequence-parallel"]]  # vocabulary 255


def experts():
    for flags in EXPERTS:
        check(flags)
    for flags in PADDED:
        check(flags, vocab=255)


# the Llama family: RMSNorm, SwiGLU, no biases nor position table, an untied head; grouped-query
# attention (2 key/value heads of 4: split over tp 2, shared by tp 4, sent as they are or
# repeated by Ulysses), with mixtures of SwiGLU experts
LLAMA = ["--arch", "llama", "--heads", "4", "--kv-heads", "2"]
LLAMAS = [
    [*LLAMA, "--dp", "2", "--tp", "2", "--sequence-parallel", "--zero", "1"],
    [*LLAMA, "--tp", "4", "--kv-heads", "1", "--checkpoint-activations"],
    [*LLAMA, "--tp", "4", "--sequence-parallel"],
    [*LLAMA, "--dp", "2", "--cp", "2", "--cp-impl", "ulysses", *MOE, "--ep", "2", "--zero", "3"],
    [*LLAMA, "--cp", "2", "--tp", "2", "--cp-impl", "ulysses"],
    [*LLAMA, "--dp", "2", "--pp", "2", *MOE, "--moe-every", "2", "--layers", "4",
     "--microbatches", "2"],
    [*LLAMA, "--pp", "2", "--cp", "2"],
]


def llama():
    for flags in LLAMAS:
        check(flags)


def step_matrix():
    for flags in MESHES:
        check(flags)


def more_settings():
    for flags in MORE:
        check(flags)


def composed():
    for flags in COMPOSED:
        check(flags)


# mixed precision: float32 master weights, bf16 / fp16 activations (not with sequence
# parallelism: see layout/traffic.py's docstring)
MIXED = [
    ["--dp", "2", "--tp", "2", "--mixed-precision", "bf16", "--grad-accum", "2"],
    ["--dp", "2", "--pp", "2", "--mixed-precision", "fp16", "--untied"],
    ["--dp", "2", "--cp", "2", "--mixed-precision", "bf16"],
    ["--tp", "2", "--cp", "2", "--cp-impl", "ulysses", "--heads", "4", "--mixed-precision", "fp16"],
    ["--dp", "2", "--tp", "2", "--zero", "3", "--mixed-precision", "bf16"],
    # ZB-V: one activation message fewer per direction (the V turns on rank 1), no tied-gradient swap
    ["--dp", "2", "--pp", "2", "--schedule", "zbv", "--layers", "4", "--microbatches", "3", "--mixed-precision", "bf16"],
]


def mixed_precision():
    for flags in MIXED:
        check(flags + ["--dtype", "float32"])


if __name__ == "__main__":
    globals()[sys.argv[1]]()
