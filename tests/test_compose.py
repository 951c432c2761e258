"""4D parallelism: every mesh of dp x pp x tp x cp trains exactly like one process.

One parametrised equivalence matrix: each entry is a mesh, run once under mpiexec, with a few
variants (data-parallel flavour, schedule, context implementation, per-device techniques);
each variant's 5 steps in float64 must equal the single-process run to 1e-9 relative in the
loss trajectory, the final validation loss and every parameter each rank holds (no gradient
clipping, but in one variant: clipping would hide a gradient of the wrong scale from the
losses).  The mixed-precision entries train 30 steps on real text and compare losses and
parameters with the one-process run in the same precision, at bars set by the compute dtype's
round-off (tests/mpi/compose_bodies.py says how).  Every entry also proves that its ranks
split the work: their shares of the parameters and of the optimizer state, and the bytes they
sent on each axis.

The last test breaks runs on purpose (tests/mpi/faults.py) and shows that these checks fail:
no gradient reduction over dp, negated gradients, a skipped update, fp16's loss scale never
applied, gradients twice too large, every rank training the whole model alone.
"""
import json
import math
import os

import pytest

from minidist.train.testing import run_mpi

BODIES = os.path.join(os.path.dirname(__file__), "mpi", "compose_bodies.py")

LLAMA = dict(arch="llama", kv_heads=2)  # 4 query heads, 2 key/value heads
MQA = dict(arch="llama", kv_heads=1)    # one key/value head: with tp=2 each rank shares it (K < tp)
# A mixture of 4 experts in every block (docs/moe.md): with every axis, ZeRO-3 / HSDP and
# checkpointing, expert parallelism splitting dp x cp (ep2, ep4).
MOE = dict(experts=4)
PAIRS = {  # every pair of axes at size 2 (4 ranks) x {DDP, ZeRO-1, ZeRO-3} where the design allows, GPT-2 and Llama
    "dp2-pp2": [dict(dp=2, pp=2, zero=0, bucket_mb=0.0, optimizer="sgd"),
                dict(dp=2, pp=2, zero=1, schedule="gpipe", grad_accum=2),
                dict(dp=2, pp=2, zero=2), dict(dp=2, pp=2, zero=3, schedule="interleaved", tied=False),
                dict(dp=2, pp=2, zero=1, **LLAMA, grad_accum=2), dict(dp=2, pp=2, zero=3, schedule="zb-h1", tied=False),
                dict(dp=2, pp=2, zero=1, schedule="zbv", microbatches=3), dict(dp=2, pp=2, zero=3, schedule="zbv", microbatches=3),
                dict(dp=4, **MOE, ep=2, zero=1, capacity_factor=1.25, grad_accum=2, clip_grad=0.05, moe_every=2),
                # a mixture on every stage: each backpropagates its auxiliary losses, the loss adds them all
                dict(dp=2, pp=2, **MOE, ep=2, zero=1), dict(dp=2, pp=2, **MOE, schedule="gpipe", zero=2, moe_every=2),
                dict(dp=2, pp=2, **MOE, ep=2, schedule="zb-h1", capacity_factor=0.5, zero=3),
                dict(dp=2, pp=2, **MOE, **LLAMA, schedule="zb-h2", top_k=1, clip_grad=0.05),
                dict(dp=2, pp=2, **MOE, ep=2, schedule="zbv", microbatches=3, checkpoint_activations=True)],
    "dp2-tp2": [dict(dp=2, tp=2, zero=0, sequence_parallel=True), dict(dp=2, tp=2, zero=1, tp_async="ring", clip_grad=0.05),
                dict(dp=2, tp=2, zero=3, checkpoint_activations=True),
                dict(dp=2, tp=2, zero=3, **MQA, sequence_parallel=True, clip_grad=0.05),
                dict(dp=4, **MOE, ep=4, top_k=1, capacity_factor=1.0, zero=2, clip_grad=0.05),
                dict(dp=4, **MOE, ep=2, zero=2, **LLAMA),
                # ZeRO-3 / HSDP and checkpointing recompute each block in backward: its auxiliary losses too
                dict(dp=4, **MOE, hsdp_shard=2, checkpoint_activations=True, grad_accum=2),
                dict(dp=4, **MOE, ep=2, hsdp_shard=2, capacity_factor=0.5, **LLAMA),
                # the router and experts replicated over tp; sequence parallelism gathers whole sequences
                dict(dp=2, tp=2, **MOE, ep=2, zero=1, top_k=1, capacity_factor=1.0, grad_accum=2)],
    "dp2-cp2": [dict(dp=2, cp=2, zero=0), dict(dp=2, cp=2, zero=1, cp_impl="ulysses", optimizer="sgd"),
                dict(dp=2, cp=2, zero=3, grad_accum=2), dict(dp=2, cp=2, zero=2, **LLAMA),
                dict(dp=4, **MOE, ep=2, top_k=2), dict(dp=4, **MOE, top_k=1),
                # each cp rank routes the whole sequences, gathered and put in order (zig-zag)
                dict(dp=2, cp=2, **MOE, ep=2, capacity_factor=0.5)],
    "pp2-tp2": [dict(pp=2, tp=2, sequence_parallel=True),
                dict(pp=2, tp=2, schedule="interleaved", tp_async="bidirectional", tied=False),
                dict(pp=2, tp=2, **MQA, schedule="interleaved", checkpoint_activations=True),
                dict(pp=2, tp=2, schedule="zb-h1", sequence_parallel=True, tp_async="ring"),
                dict(pp=2, tp=2, **MQA, schedule="zb-h2", sequence_parallel=True),
                dict(pp=2, tp=2, schedule="zbv", sequence_parallel=True, microbatches=3, grad_accum=2),
                dict(pp=2, tp=2, **MOE, **LLAMA, sequence_parallel=True, tp_async="ring", capacity_factor=0.5,
                     schedule="zb-h1"),
                dict(pp=2, tp=2, **MOE, checkpoint_activations=True, schedule="interleaved", top_k=1)],
    "pp2-cp2": [dict(pp=2, cp=2, zero=0), dict(pp=2, cp=2, zero=1, cp_impl="ulysses", schedule="gpipe"),
                dict(pp=2, cp=2, zero=3, checkpoint_activations=True),
                dict(pp=2, cp=2, **LLAMA, cp_impl="ulysses", attention="blockwise", attention_block=2),
                dict(pp=2, cp=2, zero=1, schedule="zb-h1", cp_impl="ulysses")],
    "tp2-cp2": [dict(tp=2, cp=2, zero=0, sequence_parallel=True), dict(tp=2, cp=2, zero=1, cp_impl="ulysses"),
                dict(tp=2, cp=2, zero=3, tp_async="ring", attention="blockwise", attention_block=2),
                dict(tp=2, cp=2, **LLAMA, cp_impl="ulysses", zero=1),  # one kv head per tp rank, repeated for cp
                dict(tp=2, cp=2, **LLAMA, sequence_parallel=True, hsdp_shard=2),
                dict(tp=2, cp=2, **MOE, cp_impl="ulysses", sequence_parallel=True, top_k=1, capacity_factor=1.0)],
}
TRIPLES = {  # 8 ranks
    "dp2-pp2-tp2": [dict(dp=2, pp=2, tp=2, schedule="1f1b", zero=1),
                    dict(dp=2, pp=2, tp=2, schedule="interleaved", sequence_parallel=True, grad_accum=2),
                    dict(dp=2, pp=2, tp=2, schedule="zb-h2", sequence_parallel=True, zero=3)],
    "dp2-tp2-cp2": [dict(dp=2, tp=2, cp=2, cp_impl="ring", zero=0), dict(dp=2, tp=2, cp=2, **MQA, cp_impl="ulysses"),
                    dict(dp=2, tp=2, cp=2, cp_impl="ulysses", hsdp_shard=2)],
    "pp2-tp2-cp2": [dict(pp=2, tp=2, cp=2, sequence_parallel=True, zero=3)],
    "dp2-pp2-cp2": [dict(dp=2, pp=2, cp=2, hsdp_shard=2, grad_accum=2)],  # HSDP over (dp, cp) of a pipeline
}
BF16, FP16 = dict(dtype="float32", mixed_precision="bf16"), dict(dtype="float32", mixed_precision="fp16")
MIXED = {  # float32 master weights, low-precision compute: close to one process's mixed-precision run
    "dp2-pp2-tp2-bf16": [dict(dp=2, pp=2, tp=2, **BF16, sequence_parallel=True), dict(dp=2, pp=2, tp=2, **FP16, zero=3)],
    "tp2-cp2-bf16": [dict(tp=2, cp=2, **BF16, zero=1, cp_impl="ulysses", sequence_parallel=True, tp_async="ring")],
    "dp2-cp2-bf16": [dict(dp=2, cp=2, **BF16, zero=2), dict(dp=2, cp=2, **BF16, **LLAMA, zero=1, lr=1e-2)],
    "dp2-tp2-fp16": [dict(dp=2, tp=2, **FP16, zero=0)],
}
FULL = {"dp2-pp2-tp2-cp2": [dict(dp=2, pp=2, tp=2, cp=2, zero=1, sequence_parallel=True, checkpoint_activations=True),
                           dict(dp=2, pp=2, tp=2, cp=2, **LLAMA, zero=1, sequence_parallel=True),
                           # experts with every axis: ep over dp x cp, ZeRO-3, sequence parallelism
                           dict(dp=2, pp=2, tp=2, cp=2, **MOE, ep=4, sequence_parallel=True, zero=3, top_k=1,
                                capacity_factor=1.0, schedule="interleaved")]}


def _cases():
    for table in (PAIRS, TRIPLES, MIXED, FULL):
        for name, variants in table.items():
            ranks = math.prod(variants[0].get(axis, 1) for axis in ("dp", "pp", "tp", "cp"))
            yield pytest.param(ranks, variants, id=name, marks=pytest.mark.mpi)


@pytest.mark.parametrize("ranks, variants", list(_cases()))
def test_mesh_trains_like_one_process(ranks, variants):
    out = run_mpi(ranks, BODIES, json.dumps(variants), timeout=120 + 60 * len(variants) * ranks // 4).stdout
    assert out.count("equal to one process:") == len(variants), out


FAULTS = [  # (variant, fault, what the failure must say)
    # SGD: its step is proportional to the gradient (AdamW's m / sqrt(v) cancels a constant scale,
    # so there only its eps tells, at 4e-7), and no clipping, which would rescale it away.
    (dict(dp=2, tp=2, optimizer="sgd"), "grad-scale-2x", "losses differ from one process"),
    (MIXED["dp2-cp2-bf16"][0], "no-dp-reduce", "differ from one process"),
    (MIXED["dp2-cp2-bf16"][0], "negate-grads", "differ from one process"),
    (MIXED["dp2-cp2-bf16"][0], "skip-update", "differ from one process"),
    (MIXED["dp2-tp2-fp16"][0], "no-dp-reduce", "differ from one process"),
    (MIXED["dp2-tp2-fp16"][0], "no-loss-scale", "differ from one process"),
    (dict(pp=2, tp=2), "alone", ("the blocks' parameters are not split over tp", "this rank holds blocks",
                                 "ranks holding each block", "nothing sent on the pp axis",
                                 "nothing sent on the tp axis")),
    (dict(dp=2, cp=2, zero=1), "alone", ("bytes of optimizer state here", "the optimizer state adds up to",
                                         "nothing sent on the dp axis", "nothing sent on the cp axis")),
    (dict(dp=4, experts=4, ep=2, zero=1), "alone", ("this rank holds experts", "ranks holding each expert",
                                                    "nothing sent on the ep groups", "bytes of optimizer state here")),
]


@pytest.mark.mpi
@pytest.mark.parametrize("variant, fault, says", FAULTS,
                         ids=[f"{f}-{'-'.join(f'{k}{v}' for k, v in v.items() if k in ('dp', 'pp', 'tp', 'cp', 'ep', 'mixed_precision', 'clip_grad'))}"
                              for v, f, _ in FAULTS])
def test_a_broken_run_fails_the_matrix(variant, fault, says):
    """The equivalence body, run with a bug injected into the parallel run only, must fail
    with the check that catches that bug (said by the first rank to fail: it ends the job)."""
    from minidist.train.testing import MPIJobFailed

    with pytest.raises(MPIJobFailed) as failed:
        run_mpi(4, BODIES, json.dumps([variant]), fault, timeout=240)
    text = str(failed.value)
    for phrase in (says,) if isinstance(says, str) else says:
        assert text.count(phrase) >= 1, f"{fault}: the failure does not say {phrase!r}:\n{text}"
    assert "AssertionError" in text and "timed out" not in text, text


# -- the composition table and the checks (no MPI) ---------------------------------------------
README = os.path.join(os.path.dirname(__file__), "..", "README.md")


def test_readme_composition_table_is_the_composers():
    from minidist.parallel.compose import composition_table

    text = open(README).read()
    table = text.split("<!-- composition table: begin -->")[1].split("<!-- composition table: end -->")[0]
    assert table.strip() == composition_table()


FLAG_SETS = [dict(), dict(zero=1), dict(zero=2), dict(zero=3), dict(sequence_parallel=True),
             dict(tp_async="ring"), dict(tp_async="bidirectional"), dict(cp_impl="ulysses"),
             dict(attention="blockwise"), dict(grad_accum=2), dict(checkpoint_activations=True),
             dict(mixed_precision="bf16", dtype="float32"), dict(tied=False), dict(schedule="interleaved"),
             dict(schedule="gpipe"), dict(hsdp_shard=2)]
MESHES = [dict(dp=2, pp=2, tp=2, cp=2), dict(dp=4, tp=2, cp=2), dict(pp=2, tp=2, cp=4), dict(dp=4, pp=2, tp=2)]


@pytest.mark.parametrize("mesh", MESHES, ids=lambda m: "-".join(f"{k}{v}" for k, v in m.items()))
def test_every_flag_is_accepted_on_every_mesh(mesh):
    """No axis refuses another: every flag of every axis passes the checks on 4D meshes
    whose sizes divide the model (the equivalence matrix above shows they train right)."""
    import dataclasses

    from minidist.train.config import RunConfig
    from minidist.parallel.compose import problems

    base = RunConfig().replace(model=dict(layers=4, d_model=32, heads=8), data=dict(seq_len=32, batch_size=16))
    sections = {f.name: s for s in ("model", "data", "device", "parallel") for f in dataclasses.fields(getattr(base, s))}
    world = mesh.get("dp", 1) * mesh.get("pp", 1) * mesh.get("tp", 1) * mesh.get("cp", 1)
    for flags in FLAG_SETS:
        flat = {**mesh, **flags}
        needs = {"sequence_parallel": "tp", "tp_async": "tp", "cp_impl": "cp", "schedule": "pp"}
        if any(k in flat and mesh.get(axis, 1) == 1 for k, axis in needs.items()):
            continue
        if "hsdp_shard" in flat and (mesh.get("dp", 1) * mesh.get("cp", 1)) % 2:
            continue
        if flat.get("pp", 1) > 1:
            flat.setdefault("microbatches", 2)
        changes = {}
        for k, v in flat.items():
            changes.setdefault(sections[k], {})[k] = v
        assert problems(base.replace(**changes), world) == [], flat


@pytest.mark.mpi
def test_a_bad_cross_axis_setting_is_one_line_on_every_rank():
    """Ulysses splits each tensor-parallel rank's heads over cp: 2 heads / tp 2 = 1 head
    cannot be split over cp 2.  Refused before any message, one line, exit code 2."""
    from minidist.train.testing import run_train

    r = run_train(4, ["--tp", "2", "--cp", "2", "--cp-impl", "ulysses", "--heads", "2", "--d-model", "16",
                      "--steps", "1"], timeout=60)
    assert r.returncode == 2, r.stdout + r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "not divisible by --cp 2" in lines[0], r.stderr


@pytest.mark.mpi
def test_bytes_per_axis_of_a_3d_run_equal_the_formulas(tmp_path):
    """The training command's metrics give the bytes rank 0 sent in each step on each group of
    a dp2·pp2·tp2 mesh; they equal layout/traffic.py's closed forms to the byte (ring or
    doubling all-reduce of the gradients on dp, activations and gradients per microbatch
    boundary on pp, Megatron's all-reduces per block on tp, the scalars over the world)."""
    from minidist.train.config import from_args
    from minidist.train.flags import build_parser
    from minidist.layout.traffic import expected_step_bytes
    from minidist.train.testing import run_train

    out = tmp_path / "m.jsonl"
    argv = ["--dp", "2", "--pp", "2", "--tp", "2", "--steps", "2", "--layers", "2", "--d-model", "32",
            "--seq-len", "16", "--batch-size", "8", "--eval-every", "0", "--quiet", "--dtype", "float64"]
    r = run_train(8, argv + ["--metrics-jsonl", str(out)], timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    want = expected_step_bytes(from_args(build_parser().parse_args(argv)).resolved(8), rank=0)
    assert set(want) == {"dp", "pp", "tp", "world"} and all(v > 0 for v in want.values()), want
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [rec["bytes_sent"] for rec in records] == [want, want]
    assert "bytes sent per step (rank 0) | dp " in r.stdout and "(formula " in r.stdout, r.stdout
