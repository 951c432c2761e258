"""`make bench` keeps working: its driver (benchmarks/run_all.py) runs every benchmark in its
smallest form, once per session, and each writes the JSON its table is made from.  No timing
is asserted here (benchmarks check speed, tests never do: the machines are shared and noisy),
only that every row is there and every number is sane, and that the driver says what it runs,
skips what cannot run with a reason, and shows a failing part's output.  A part that ran
and wrote no JSON fails (only a part skipped with its reason may leave none)."""
import importlib
import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest

BENCH = os.path.join(os.path.dirname(__file__), "..", "benchmarks")
pytestmark = pytest.mark.xdist_group(name="bench")  # one worker runs the quick_run fixture, once


def _import(name):
    sys.path.insert(0, BENCH)
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(BENCH)


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """`run_all.py --quick`: every benchmark in its smallest form (seconds), run once a session:
    under pytest-xdist the workers share one run (the first to take the lock runs it)."""
    import fcntl

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the workers' common base
    out, said = root / "bench-quick", root / "bench-quick.stdout"
    with open(root / "bench-quick.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not said.exists():
            out.mkdir(exist_ok=True)
            r = subprocess.run([sys.executable, os.path.join(BENCH, "run_all.py"), "--quick", "--out", str(out)],
                               timeout=600, capture_output=True, text=True)
            assert r.returncode == 0, r.stdout + r.stderr
            said.write_text(r.stdout)
    return out, said.read_text()


@pytest.mark.mpi
@pytest.mark.slow
def test_run_all_quick_says_what_it_runs(quick_run):
    out, stdout = quick_run
    parts = [p.name for p in _import("run_all").PARTS]
    n = len(parts)
    assert f"benchmarks (quick): {n} part(s)" in stdout and "expected ~" in stdout
    assert f"[1/{n}] collectives: running, expected ~" in stdout and f"[1/{n}] collectives: done in" in stdout
    torch_here = importlib.util.find_spec("torch") is not None
    k = parts.index("model") + 1
    assert (f"[{k}/{n}] model: done in" if torch_here else f"[{k}/{n}] model: skipped: PyTorch is not installed") in stdout
    assert f"[{parts.index('context') + 1}/{n}] context: done in" in stdout
    with open(out / "run_all.json") as f:
        durations = json.load(f)["quick"]
    assert durations["collectives"] > 0 and ("model" in durations) == torch_here
    assert all(durations[name] > 0 for name in parts if name != "model")


# The JSON each part of run_all.py writes (a part it skips, with its reason, writes none).
RESULTS = {"collectives": "collectives.json", "model": "model_step.json", "ddp": "ddp.json",
           "tensor": "tensor_parallel.json", "context": "context.json", "pipeline": "pipeline.json",
           "compose": "compose.json", "tracing": "tracing.json", "plan": "plan.json", "gpu": "gpu.json",
           "checkpoint": "checkpoint.json", "data": "data.json", "moe": "moe.json", "launches": "launches.json", "oversubscribed": "oversubscribed.json"}


def _skipped(stdout: str) -> set:
    """The parts the driver said it skipped (``[k/n] name: skipped: reason``)."""
    parts = _import("run_all").PARTS
    return {p.name for k, p in enumerate(parts, 1) if f"[{k}/{len(parts)}] {p.name}: skipped: " in stdout}


@pytest.mark.mpi
@pytest.mark.slow
def test_every_part_that_ran_wrote_its_json(quick_run):
    """A part that exits 0 without writing its JSON fails here: the only parts allowed no file
    are those the driver named as skipped, with a reason (the tests below read the files)."""
    out, stdout = quick_run
    parts = _import("run_all").PARTS
    assert {p.name for p in parts} == set(RESULTS)  # a new part needs its file named here
    skipped = _skipped(stdout)
    for k, p in enumerate(parts, 1):
        path = out / RESULTS[p.name]
        if p.name in skipped:
            assert not path.exists(), (p.name, "skipped, yet a result file is there")
            continue
        assert f"[{k}/{len(parts)}] {p.name}: done in" in stdout, p.name
        assert path.exists(), f"{p.name} finished without writing {path.name}"
        with open(path) as f:
            assert json.load(f), path.name


def test_run_all_writes_one_report(quick_run):
    """REPORT.md: the machine at the top, then a section per benchmark whose figures are
    numbers read from its JSON (no part unreadable).  A missing JSON fails unless its part
    was skipped with a reason."""
    out, stdout = quick_run
    assert "report: " in stdout
    text = (out / "REPORT.md").read_text()
    assert text.index("## The machine") < text.index("CPU: ") < text.index("MPI: ")
    skipped = {RESULTS[name] for name in _skipped(stdout)}
    for name in ("collectives.json", "model_step.json", "ddp.json", "pipeline.json", "compose.json",
                 "checkpoint.json", "context.json", "tensor_parallel.json", "tracing.json", "plan.json",
                 "launches.json", "data.json", "moe.json"):
        assert (out / name).exists() or name in skipped, f"{name} missing, and its part was not skipped"
        if name not in skipped:
            section = text.split(f"(`{name}`)", 1)[1].split("\n## ", 1)[0]
            rows = [r for r in section.splitlines() if r.startswith("| ") and "---" not in r][1:]
            assert rows and all("could not be read" not in r and "unreadable" not in r for r in rows), section
            assert any(r.split("|")[2].strip().replace(".", "").replace("-", "").replace(",", "").isdigit()
                       for r in rows), section


def test_the_report_puts_the_planners_error_beside_the_launches_own_spread():
    """The planner's step-time row says how far two launches of one configuration differed
    (the validation's own noise, with two launches or more) and says nothing of it with one."""
    report = _import("report")
    v = {"configurations": [{}] * 3, "median_step_error": 0.12, "median_peak_error": 0.07,
         "targets": {"median_step_error": 0.1, "median_peak_error": 0.1}, "launch_spread": 0.114}
    step, peak = report._plan({"validation": v})
    assert step[1] == 0.12 and step[2] == "target <= 0.10; two launches of one configuration differ by a median of 0.11"
    assert report._plan({"validation": {**v, "launch_spread": None}})[0][2] == "target <= 0.10"
    assert peak[2] == "target <= 0.10"


def test_run_all_shows_a_failing_part_and_progress(tmp_path, capsys):
    run_all = _import("run_all")
    rc, seconds, tail = run_all.run_part(
        [sys.executable, "-c", "import sys, time; print('first'); print('the error'); time.sleep(1.2); sys.exit(3)"],
        "[1/1] demo", expected=1.0, progress_every=0.4)
    assert rc == 3 and seconds >= 1.2 and tail == ["first", "the error"]
    assert "[1/1] demo: still running" in capsys.readouterr().out
    # A part that fails (here an import of a broken torch) is named at the end with its error.
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text("raise RuntimeError('broken torch build')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path)] + sys.path))
    r = subprocess.run([sys.executable, os.path.join(BENCH, "run_all.py"), "--quick", "--only", "model",
                        "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "[1/1] model: FAILED (exit status 1)" in r.stdout
    assert "broken torch build" in r.stdout[r.stdout.index("failed: model"):]
    r = subprocess.run([sys.executable, os.path.join(BENCH, "run_all.py"), "--only", "bogus"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "unknown part(s) bogus" in r.stderr


@pytest.mark.mpi
@pytest.mark.slow
def test_bench_collectives_quick(quick_run):
    bc = _import("bench_collectives")
    tmp_path, _ = quick_run
    with open(tmp_path / "collectives.json") as f:
        report = json.load(f)
    rows = {(r["collective"], r["ranks"], r["bytes"]): r for r in report["results"]}
    assert set(rows) == {(c, 2, s) for c in bc.COLLECTIVES for s in bc.QUICK_SIZES}
    for row in rows.values():
        for field in ("minidist_s", "mpi_s", "minidist_busbw_GBps", "mpi_busbw_GBps", "ratio", "ratio_after_other"):
            assert math.isfinite(row[field]) and row[field] > 0, (row, field)
        assert row["ratio"] == pytest.approx(row["mpi_s"] / row["minidist_s"])
        assert row["ratio_min"] <= row["ratio"] <= row["ratio_max"]
    assert {r["collective"] for r in report["crossover"]} == set(bc.COLLECTIVES)
    assert report["memcpy_GBps"] > 0
    assert "ratio = MPI time / minidist time" in bc.table(report)


@pytest.mark.mpi
@pytest.mark.slow
def test_bench_model_quick(quick_run):
    pytest.importorskip("torch")
    tmp_path, _ = quick_run
    for name in ("model_step.json", "llama_step.json"):  # the GPT and its Llama form
        with open(tmp_path / name) as f:
            (row,) = json.load(f)["results"]
        for side in ("minidist", "torch"):
            assert row[side]["tokens_per_s"] > 0 and 0 < row[side]["mfu"] < 1, (name, row)
        assert row["ratio"] == pytest.approx(row["minidist"]["tokens_per_s"] / row["torch"]["tokens_per_s"])
        assert row["first_loss"]["minidist"] == pytest.approx(row["first_loss"]["torch"], rel=1e-4)


@pytest.mark.mpi
@pytest.mark.slow
def test_bench_ddp_quick(quick_run):
    tmp_path, _ = quick_run
    with open(tmp_path / "ddp.json") as f:
        r = json.load(f)
    assert all(v > 0 for v in r["tokens_per_s"].values()), r
    assert r["minidist_scaling_2_over_1"] > 0 and all(r[f"zero{z}_step_time_over_ddp"] > 0 for z in (1, 2, 3))
    if importlib.util.find_spec("torch") is not None:
        assert r["minidist_2_over_torch_2"] > 0 and r["torch_scaling_2_over_1"] > 0


@pytest.mark.mpi
@pytest.mark.slow
def test_bench_tensor_quick(quick_run):
    tmp_path, _ = quick_run
    with open(tmp_path / "tensor_parallel.json") as f:
        report = json.load(f)
    modes = report["mlp"]["modes"]
    assert set(modes) == {"sync", "ring", "bidirectional"}
    for mode, row in modes.items():
        assert row["step_s"] > 0 and row["exposed_comm_s"] >= 0, (mode, row)
        if mode != "sync":
            assert row["hidden_s"] == pytest.approx(modes["sync"]["step_s"] - row["step_s"])
            assert row["ideal_hidden_s"] >= 0 and math.isfinite(row["share_of_ideal"]), (mode, row)
    ratios = report["gpt"]["ratio_vs_1_rank"]
    assert set(ratios) == {"1 rank", "tp=2", "tp=2 sequence parallel"} and ratios["1 rank"] == 1.0
    assert all(v > 0 for v in report["gpt"]["tokens_per_s"].values())


@pytest.mark.mpi
@pytest.mark.slow
def test_bench_context_quick(quick_run):
    tmp_path, _ = quick_run
    with open(tmp_path / "context.json") as f:
        report = json.load(f)
    one = report["one_rank"]
    for side in ("plain", "blockwise"):
        assert one[side]["step_s"] > 0 and one[side]["peak_attention_bytes"] > 0, one
    assert one["attention_memory_ratio"] == pytest.approx(
        one["blockwise"]["peak_attention_bytes"] / one["plain"]["peak_attention_bytes"])
    for side in ("ring cp=2", "ulysses cp=2", "one rank (plain)", "one rank (blockwise)"):
        row = report["cp2"][side]
        assert row["tokens_per_s"] > 0 and len(row["peak_bytes_per_rank"]) == 2, (side, row)
        assert (row["attention_bytes_sent"] > 0) == ("cp=2" in side), (side, row)


@pytest.mark.mpi
@pytest.mark.slow
def test_bench_pipeline_quick(quick_run):
    tmp_path, _ = quick_run
    with open(tmp_path / "pipeline.json") as f:
        report = json.load(f)
    (result,) = report["results"]
    assert result["P"] == 2 and result["serial_tokens_per_s"] > 0
    assert [r["schedule"] for r in result["rows"]] == ["gpipe", "1f1b", "interleaved", "looping"]
    for row in result["rows"]:
        assert 0 <= row["bubble_measured"] < 1 and row["tokens_per_s"] > 0 and row["speedup_vs_1_rank"] > 0, row
        assert 0 <= row["bubble_best"] <= row["bubble_measured"] and 0 <= row["bubble_replayed"] < 1, row
    theory = {r["schedule"]: r["bubble_theory"] for r in result["rows"]}
    assert theory["gpipe"] == pytest.approx(1 / 9) and theory["interleaved"] == pytest.approx(1 / 17)


@pytest.mark.mpi
@pytest.mark.slow
def test_bench_compose_quick(quick_run):
    tmp_path, _ = quick_run
    with open(tmp_path / "compose.json") as f:
        report = json.load(f)
    rows = {r["mesh"]: r for r in report["results"]}
    assert list(rows) == ["1 rank", "dp4", "dp2·tp2", "pp2·tp2", "tp2·cp2"]
    assert rows["1 rank"]["vs_one_rank"] == 1.0 and not rows["1 rank"]["bytes_sent_last_step"]
    for name, row in rows.items():
        assert row["tokens_per_s"] > 0 and math.isfinite(row["vs_one_rank"]), row
    # each mesh's traffic travels on the groups of its own axes
    assert "tp" in rows["dp2·tp2"]["bytes_sent_last_step"] and "dp" in rows["dp2·tp2"]["bytes_sent_last_step"]
    assert "pp" in rows["pp2·tp2"]["bytes_sent_last_step"] and "cp" in rows["tp2·cp2"]["bytes_sent_last_step"]


@pytest.mark.mpi
@pytest.mark.slow
def test_bench_checkpoint_quick(quick_run):
    tmp_path, _ = quick_run
    with open(tmp_path / "checkpoint.json") as f:
        r = json.load(f)
    assert r["mesh"] == "dp2·tp2" and len(r["bytes_written_per_rank"]) == 4
    assert sum(r["bytes_written_per_rank"]) == r["whole_bytes"] > 0  # the same bytes, sharded or gathered
    for key in ("sharded_save_s", "gathered_save_s", "sharded_load_s", "whole_load_s", "sync_save_s"):
        assert r[key] > 0, (key, r)
    assert r["async_blocking_s"] >= 0 and r["hidden_share"] <= 1


@pytest.mark.mpi
@pytest.mark.slow
def test_bench_data_quick(quick_run):
    tmp_path, _ = quick_run
    with open(tmp_path / "data.json") as f:
        r = json.load(f)
    assert set(r["prepare"]) == {"1 thread", "default threads"}
    for p in r["prepare"].values():
        assert p["bytes"] == 1 << 20 and p["cpu_s"] > 0 and p["mb_per_cpu_s"] > 0, p
    load = r["loading"]
    assert load["step_s"] > 0 and load["batch_from_shards_s"] > 0 and load["batch_from_memory_s"] > 0
    assert load["overhead"] == pytest.approx((load["batch_from_shards_s"] - load["batch_from_memory_s"]) / load["step_s"])


@pytest.mark.mpi
@pytest.mark.slow
def test_bench_moe_quick(quick_run):
    tmp_path, _ = quick_run
    with open(tmp_path / "moe.json") as f:
        r = json.load(f)
    dense, *mixtures = r["arms"].values()
    assert dense["over_dense"] == 1.0 and len(mixtures) == 2
    for m in mixtures:  # 8 experts of width h against one feed-forward of width 2h: more parameters
        assert m["step_s"] > 0 and m["parameters"] > dense["parameters"] and m["over_dense"] > 0, m


@pytest.mark.mpi
@pytest.mark.slow
def test_bench_trace_quick(quick_run):
    tmp_path, _ = quick_run
    with open(tmp_path / "tracing.json") as f:
        r = json.load(f)
    assert r["meshes"] and r["target"] == 0.1
    for mesh, row in r["meshes"].items():
        assert row["untraced_s"] > 0 and row["traced_s"] > 0 and row["spans_per_traced_step"] > 0, (mesh, row)
        assert row["overhead"] == pytest.approx(row["traced_s"] / row["untraced_s"] - 1)


@pytest.mark.mpi
@pytest.mark.slow
def test_bench_plan_quick(quick_run):
    tmp_path, _ = quick_run
    with open(tmp_path / "plan.json") as f:
        r = json.load(f)
    runs = r["validation"]["configurations"]
    assert runs and all(c["step_s_measured"] > 0 and c["peak_mb_measured"] > 0 for c in runs)
    assert 0 <= r["validation"]["median_step_error"] and 0 <= r["validation"]["median_peak_error"]
    assert len(r["llama3_405b"]) == 3 and all(abs(x["predicted_mfu"] - x["published_mfu"]) <= 0.05
                                              for x in r["llama3_405b"])


@pytest.mark.mpi
@pytest.mark.slow
def test_bench_launches_quick(quick_run):
    """Operation counts of a step (2 layers in --quick): the loss and the clipping norm are its
    only device reads; minidist's CUDA kernels run as often as the model needs them: the
    attention's (ops/cuda/flash.py's three, or the softmax and its gradient) and GELU's two once per
    layer, LayerNorm's two once per LayerNorm, each in its bf16 form under bf16, the ordered
    scatter-add once per embedding, and the update's multi-tensor launches once per step."""
    tmp_path, _ = quick_run
    with open(tmp_path / "launches.json") as f:
        r = json.load(f)
    layers = r["shape"]["n_layer"]
    assert set(r["modes"]) | set(r["skipped_modes"]) == {"fp32", "bf16", "fp32 flash", "bf16 flash"}
    assert {"fp32", "bf16"} <= set(r["modes"])
    for mode, row in r["modes"].items():
        m = row["minidist"]
        assert m["ops"] == m["forward_backward"] + m["update"] and m["forward_backward"] > m["update"] > 0, (mode, m)
        assert m["d2h_copies"] == 2, (mode, m)
        kernels = m["kernel_launches"]
        low = "_bf16" if mode.startswith("bf16") else ""
        if row["attention"] == "blockwise":
            want = {k: layers for k in ("flash_forward", "flash_backward_dq", "flash_backward_dkdv")}
        else:
            want = {"softmax_rows" + low: layers, "softmax_grad_rows" + low: layers}
        want.update({"gelu_forward" + low: layers, "gelu_backward" + low: layers,
                     "layer_norm_forward" + low: 2 * layers + 1, "layer_norm_backward" + low: 2 * layers + 1,
                     "add_rows": 2,  # the token and position embeddings' gradients, in index order
                     "sum_squares": 1, "adamw": 1})
        scale = kernels.pop("RawKernel:scale", 0)  # the clipping scale: only when the norm is above 1
        assert kernels == {f"RawKernel:{k}": n for k, n in want.items()} and scale <= 1, (mode, kernels)
        assert m["update"] < 12, (mode, m)  # a handful of launches, however many parameters
        if importlib.util.find_spec("torch") is not None:
            t = row["torch"]
            assert t["ops"] == t["forward_backward"] + t["update"] and t["update"] > 0 < t["top_level_ops"] <= t["ops"]
            assert row["ratio"] == pytest.approx(m["ops"] / t["ops"])
    assert r["modes"]["bf16"]["minidist"]["ops"] > r["modes"]["fp32"]["minidist"]["ops"]  # the casts
