"""Pipeline parallelism equals the single-process run (float64), on 1, 2 and 4 ranks; on
each rank, for every schedule, the most microbatches the runtime held in flight equals what
the schedule simulator (simulate.py) finds for the same schedule."""
import json
import os
import sys
import types

import pytest

from minidist.train.testing import run_mpi, run_train

BODIES = os.path.join(os.path.dirname(__file__), "mpi", "pipeline_bodies.py")
sys.path.insert(0, os.path.dirname(BODIES))
import pipeline_bodies as B  # noqa: E402

from minidist.model.nn import GPT  # noqa: E402
from minidist.parallel.pipeline.runtime import PipelineRuntime, graph_activation_bytes  # noqa: E402
from minidist.layout.schedules import make_schedule  # noqa: E402
from minidist.layout.simulate import simulate  # noqa: E402


def _group(size, rank=0):
    return types.SimpleNamespace(size=size, rank=rank, name="pp")


@pytest.mark.parametrize("schedule, M, V", [("gpipe", 4, 1), ("1f1b", 2, 1), ("looping", 2, 2),
                                             ("interleaved", 4, 2), ("naive", 2, 1), ("zb-h1", 2, 1),
                                             ("zb-h2", 3, 1), ("zbv", 2, 2)])
def test_one_rank_pipeline_equals_serial(schedule, M, V):
    """P = 1: every stage on this rank, activations handed over locally (no MPI).  The most
    microbatches whose activations the runtime held at once is the schedule simulator's
    count (simulate.simulate plays the same schedule with no model), not the runtime's own."""
    ref_losses, ref_state = B.serial_run(4)
    losses, state, pipe = B.pipeline_run(_group(1), schedule, M, V, layers=4)
    assert len(losses) == len(ref_losses) == B.STEPS
    assert B._rel(losses, ref_losses) <= 1e-9
    assert state.keys() == ref_state.keys()
    for name in state:
        assert B._rel(state[name], ref_state[name]) <= 1e-9, name
    (expected,) = simulate(make_schedule(schedule, 1, M, V)).peak_in_flight
    assert pipe.stats["peak_in_flight"] == expected, (pipe.stats["peak_in_flight"], expected)


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(schedule="1f1b", num_microbatches=2, virtual_stages=2), "has no virtual stages"),
    (dict(schedule="zigzag", num_microbatches=2), "unknown pipeline schedule"),
    (dict(schedule="interleaved", num_microbatches=3, virtual_stages=2), "multiple of the pipeline stages"),
    (dict(schedule="looping", num_microbatches=2, virtual_stages=3), "4 layers cannot be cut into 2 pipeline"),
    (dict(schedule="zbv", num_microbatches=4, virtual_stages=1), "runs exactly 2 virtual stages per rank"),
    (dict(schedule="zbv", num_microbatches=2, virtual_stages=2), "needs at least 2P-1 = 3 microbatches"),
])
def test_bad_pipelines_are_refused_before_any_message(kwargs, fragment):
    """The group here cannot send anything: the checks come first."""
    with pytest.raises(ValueError, match=fragment):
        PipelineRuntime(GPT(B._config(4, False)), _group(2), **kwargs)


def test_each_rank_keeps_only_its_stage():
    first = PipelineRuntime(GPT(B._config(4, False)), _group(2, 0), "1f1b", 2)
    last = PipelineRuntime(GPT(B._config(4, False)), _group(2, 1), "1f1b", 2)
    names0 = set(first.model.state_dict())
    names1 = set(last.model.state_dict())
    assert "wpe.weight" in names0 and "wpe.weight" not in names1
    assert "wte.weight" in names0 and "wte.weight" in names1  # tied: used by embed and head
    assert "ln_f.weight" in names1 and "ln_f.weight" not in names0
    assert {n.split(".")[1] for n in names0 if n.startswith("h.")} == {"0", "1"}
    assert {n.split(".")[1] for n in names1 if n.startswith("h.")} == {"2", "3"}
    looped = PipelineRuntime(GPT(B._config(4, True)), _group(2, 0), "looping", 2, 2)
    assert {n.split(".")[1] for n in looped.model.state_dict() if n.startswith("h.")} == {"0", "2"}
    assert "wte.weight" in looped.model.state_dict() and "lm_head.weight" not in looped.model.state_dict()


def test_zbv_puts_both_ends_of_the_model_on_rank_0():
    """ZB-V's V: rank 0 holds stages 0 and 3 (blocks 0 and 3, the embeddings, the final
    LayerNorm and the head: one tied embedding, nothing to exchange), rank 1 the turn of the V
    (blocks 1 and 2, handed over locally).  The loss comes from rank 0."""
    ends = PipelineRuntime(GPT(B._config(4, False)), _group(2, 0), "zbv", 3, 2)
    turn = PipelineRuntime(GPT(B._config(4, False)), _group(2, 1), "zbv", 3, 2)
    names0, names1 = set(ends.model.state_dict()), set(turn.model.state_dict())
    assert {n.split(".")[1] for n in names0 if n.startswith("h.")} == {"0", "3"}
    assert {n.split(".")[1] for n in names1 if n.startswith("h.")} == {"1", "2"}
    assert {"wte.weight", "wpe.weight", "ln_f.weight"} <= names0 and not any(n.startswith(("wte", "wpe", "ln_f")) for n in names1)
    assert ends.is_first and ends.is_last and ends.last_rank == turn.last_rank == 0
    assert ends.tied_weight() is None and turn.tied_weight() is None  # one copy: no tied-gradient exchange
    # ... but the head's chunk finishes its W's before the embedding's: data parallelism reduces it after the pass
    assert ends.held_weights() == [ends.model.wte.weight] and turn.held_weights() == []
    assert all(a.peer in (None, 1) for a in ends.actions) and all(a.peer in (None, 0) for a in turn.actions)


def test_graph_activation_bytes_counts_the_kept_arrays():
    import numpy as np

    from minidist.model.autograd import Parameter, Tensor

    w = Parameter(np.ones((4, 4)))
    x = Tensor(np.ones((2, 4)), requires_grad=True)
    y = x @ w
    assert graph_activation_bytes(y) == x.data.nbytes + y.data.nbytes


@pytest.mark.mpi
def test_two_ranks_every_schedule_equals_serial():
    out = run_mpi(2, f"{BODIES}::two_ranks", timeout=180).stdout
    assert "pipeline configs: 36 worst rel" in out, out
    assert out.count("pipeline accounting ok") == 2, out
    assert out.count("train path ok: dp=1 x pp=2") == 9 and "train path done" in out, out


@pytest.mark.mpi
def test_four_ranks_every_schedule_equals_serial():
    out = run_mpi(4, f"{BODIES}::four_ranks", timeout=240).stdout
    assert "pipeline configs: 22 worst rel" in out, out
    assert out.count("pipeline accounting ok") == 4, out
    assert out.count("train path ok: dp=2 x pp=2") == 9 and "train path done" in out, out


@pytest.mark.parametrize("schedule, M, V", [("1f1b", 3, 1), ("looping", 2, 2), ("interleaved", 2, 2),
                                             ("zb-h1", 3, 1), ("zb-h2", 2, 1), ("zbv", 3, 2)])
def test_each_parameter_is_final_once_inside_the_last_backward_window(schedule, M, V):
    """Data parallelism opens its hooks around each chunk's last backward (zero-bubble: last B
    and last W): there every parameter's gradient becomes final exactly once (its other
    backward passes are outside)."""
    import contextlib

    import numpy as np

    model = GPT(B._config(4, True))
    pipe = PipelineRuntime(model, _group(1), schedule, M, V)
    state = {"open": False}
    inside, total = {}, {}

    def hook(p):
        total[p.name] = total.get(p.name, 0) + 1
        inside[p.name] = inside.get(p.name, 0) + state["open"]

    for p in model.parameters():
        p.register_grad_hook(hook)

    @contextlib.contextmanager
    def window():
        state["open"] = True
        yield
        state["open"] = False

    x, y = B._batches()[0]
    pipe.forward_backward(np.asarray(x[:6]), np.asarray(y[:6]), around_last_backward=window)
    assert set(inside.values()) == {1} and set(total.values()) == {M}


def _given(**kw):
    """The run configuration as given: --pp 2 --layers 4 --batch-size 16 --dp 1 unless ``kw``
    says otherwise (pp, microbatches, schedule, virtual_stages, layers, batch_size, dp, grad_accum)."""
    from minidist.train.config import RunConfig

    f = dict(pp=2, microbatches=None, schedule=None, virtual_stages=None, layers=4, batch_size=16, dp=1,
             grad_accum=1)
    f.update(kw)
    return RunConfig().replace(model=dict(layers=f["layers"]), data=dict(batch_size=f["batch_size"]),
                               device=dict(grad_accum=f["grad_accum"]),
                               parallel={k: f[k] for k in ("pp", "dp", "microbatches", "schedule", "virtual_stages")})


def _problems(**kw):
    from minidist.layout.schedules import problems

    given = _given(**kw)
    return problems(given, given.resolved(given.parallel.world_size))


@pytest.mark.parametrize("kw, fragment", [
    (dict(layers=3), "--layers 3 cannot be cut into --pp 2 x --virtual-stages 1 = 2 equal stages"),
    (dict(schedule="interleaved", layers=8, microbatches=3), "multiple of the pipeline stages (2)"),
    (dict(pp=4, schedule="looping", layers=8, microbatches=2), "at least as many microbatches (2) as pipeline stages (4)"),
    (dict(schedule="gpipe", virtual_stages=2), "--virtual-stages 2: the gpipe schedule has no virtual stages"),
    (dict(schedule="1f1b", virtual_stages=1), "the 1f1b schedule has no virtual stages"),
    (dict(microbatches=9, batch_size=16, dp=2), "--microbatches 9 exceeds the 8 sequence(s) of a pipeline pass"),
    (dict(pp=1, microbatches=4), "--microbatches needs pipeline parallelism: add --pp 2 or more"),
    (dict(pp=4, schedule="zb-h1", layers=8, microbatches=2), "zb-h1 schedule needs at least as many microbatches (2) as pipeline stages (4)"),
    (dict(schedule="zb-h2", virtual_stages=2), "--virtual-stages 2: the zb-h2 schedule has no virtual stages"),
    (dict(schedule="zbv", virtual_stages=3), "--virtual-stages 3: the zbv schedule runs exactly --virtual-stages 2 (a V)"),
    (dict(pp=4, schedule="zbv", layers=8, microbatches=4), "needs at least 2P-1 = 7 microbatches for 4 pipeline stages, got 4"),
])
def test_cli_refuses_bad_pipelines_with_one_line(kw, fragment):
    (found,) = _problems(**kw)
    assert fragment in found and "\n" not in found


def test_cli_defaults():
    assert _problems(pp=2) == [] and _problems(pp=2, schedule="interleaved") == [] and _problems(pp=1) == []
    p = _given(pp=2).resolved(2).parallel
    assert (p.schedule, p.microbatches, p.virtual_stages) == ("1f1b", 4, 1)
    p = _given(pp=2, schedule="interleaved").resolved(2).parallel
    assert (p.microbatches, p.virtual_stages) == (4, 2)
    p = _given(pp=4, schedule="zbv", layers=8).resolved(4).parallel
    assert (p.microbatches, p.virtual_stages) == (8, 2) and _problems(pp=4, schedule="zbv", layers=8) == []
    assert _given(pp=1).resolved(1).parallel.schedule is None


# -- the training CLI under mpiexec -----------------------------------------------------------------
TINY = ["--layers", "4", "--d-model", "16", "--heads", "2", "--seq-len", "16", "--batch-size", "8",
        "--peak-gflops", "10", "--eval-batches", "1", "--dtype", "float64"]


def _train(n, args, timeout=240):
    return run_train(n if n > 1 else None, TINY + args, timeout)


@pytest.mark.mpi
def test_cli_pipeline_trains_like_one_process_and_reports_the_bubble(tmp_path):
    common = ["--steps", "5", "--eval-every", "5", "--grad-accum", "2"]
    one, two = tmp_path / "one.jsonl", tmp_path / "two.jsonl"
    r1 = _train(1, common + ["--metrics-jsonl", str(one)])
    r2 = _train(2, common + ["--pp", "2", "--schedule", "interleaved", "--microbatches", "2",
                             "--checkpoint-activations", "--metrics-jsonl", str(two)])
    assert r1.returncode == 0, r1.stderr
    assert r2.returncode == 0, r2.stderr
    assert r2.stdout.count("summary") == 1 and "pipeline interleaved over 2 stages (M=2, V=2)" in r2.stdout
    assert "pipeline bubble" in r2.stdout and "| bubble " in r2.stdout, r2.stdout
    ref = [json.loads(line) for line in one.read_text().splitlines()]
    got = [json.loads(line) for line in two.read_text().splitlines()]
    assert len(ref) == len(got) == 5, (len(ref), len(got))
    for a, b in zip(ref, got):
        assert abs(a["loss"] - b["loss"]) <= 1e-9 * abs(a["loss"]), (a["loss"], b["loss"])
    assert abs(ref[-1]["val_loss"] - got[-1]["val_loss"]) <= 1e-9 * ref[-1]["val_loss"]
    last = got[-1]
    assert last["mesh"] == "dp=1 pp=2" and 0 <= last["bubble"] < 1 and last["bubble_theory"] == pytest.approx(1 / 5)
    assert len(last["stage_bubble"]) == 2 and len(last["peak_activation_mb"]) == 2


@pytest.mark.mpi
@pytest.mark.parametrize("n, args, needle", [
    (2, ["--pp", "2", "--layers", "3"], "--layers 3 cannot be cut into --pp 2 x --virtual-stages 1"),
    (2, ["--pp", "2", "--schedule", "interleaved", "--microbatches", "3"], "multiple of the pipeline stages (2)"),
    (2, ["--pp", "2", "--schedule", "gpipe", "--virtual-stages", "2"], "the gpipe schedule has no virtual stages"),
    (2, ["--pp", "2", "--schedule", "zigzag"], "argument --schedule: invalid choice: 'zigzag'"),
    (2, ["--pp", "2", "--schedule", "zb-h1", "--microbatches", "1"], "needs at least as many microbatches (1) as pipeline stages (2)"),
    (2, ["--pp", "2", "--schedule", "zbv", "--virtual-stages", "3"], "the zbv schedule runs exactly --virtual-stages 2"),
    (2, ["--pp", "2", "--schedule", "zbv", "--microbatches", "2"], "needs at least 2P-1 = 3 microbatches for 2 pipeline stages"),
    (2, ["--pp", "3"], "the world size 2 is not divisible by --pp 3 = 3"),
    (2, ["--pp", "2", "--microbatches", "9"], "--microbatches 9 exceeds the 8 sequence(s)"),
])
def test_bad_pipeline_input_is_one_message_exit_2(n, args, needle):
    r = _train(n, args, timeout=60)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert r.stderr.count(needle) == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stdout == ""


@pytest.mark.mpi
@pytest.mark.parametrize("axis, mesh, what", [
    ("--tp", "dp=1 tp=2 pp=2", "tensor parallel over 2 ranks"),
    ("--cp", "dp=1 cp=2 (ring) pp=2", "ring context parallelism over 2 ranks"),
])
def test_cli_pipeline_with_tp_or_cp_trains_like_one_process(tmp_path, axis, mesh, what):
    """--pp with --tp and --pp with --cp were refused ("do not compose yet"); the 4D composer
    runs them (tests/test_compose.py checks the matrix): same losses as one process."""
    common = ["--steps", "2", "--eval-every", "2"]
    one, four = tmp_path / "one.jsonl", tmp_path / "four.jsonl"
    r1 = _train(1, common + ["--metrics-jsonl", str(one)])
    r4 = _train(4, common + ["--pp", "2", axis, "2", "--metrics-jsonl", str(four)])
    assert r1.returncode == 0, r1.stderr
    assert r4.returncode == 0, r4.stderr
    assert "pipeline 1f1b over 2 stages (M=4)" in r4.stdout and what in r4.stdout, r4.stdout
    ref = [json.loads(line) for line in one.read_text().splitlines()]
    got = [json.loads(line) for line in four.read_text().splitlines()]
    assert len(got) == len(ref) == 2 and got[0]["mesh"] == mesh, got[0]
    for key in ("loss", "grad_norm", "val_loss"):
        assert [r.get(key, 0) for r in got] == pytest.approx([r.get(key, 0) for r in ref], rel=1e-9), key


@pytest.mark.mpi
def test_cli_dp2_x_pp2_with_fp16_loss_scaling(tmp_path):
    """fp16 under dp x pp: the overflow check is agreed over both axes (one skips, all skip)."""
    out = tmp_path / "m.jsonl"
    r = _train(4, ["--steps", "3", "--eval-every", "0", "--pp", "2", "--dp", "2", "--dtype", "float32",
                   "--mixed-precision", "fp16", "--metrics-jsonl", str(out)])
    assert r.returncode == 0, r.stderr
    assert "dp=2 x pp=2: DDP over 2 ranks, pipeline 1f1b over 2 stages (M=4)" in r.stdout, r.stdout
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 3 and all("loss_scale" in rec for rec in records)
    assert records[0]["mesh"] == "dp=2 pp=2" and all(0 < rec["loss"] < 10 for rec in records)
