"""``python -m minidist.observe.plot``: a merged trace drawn as a PNG (skipped without matplotlib).

The traces are written by a real --trace run: one process, and a 2-rank pipeline whose
figure gets the measured chart next to the schedule's simulated one."""
import json
import subprocess
import sys

import pytest

from minidist.train.testing import run_train

pytestmark = pytest.mark.xdist_group(name="plot")  # its module fixture runs once, in one worker

TINY = ["--layers", "2", "--d-model", "16", "--heads", "2", "--seq-len", "8", "--batch-size", "8", "--steps", "2",
        "--eval-every", "0", "--peak-gflops", "10"]


def plot(*args):
    return subprocess.run([sys.executable, "-m", "minidist.observe.plot", *args], capture_output=True, text=True, timeout=120)


def png(path) -> bool:
    with open(path, "rb") as f:
        return f.read(8) == b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def matplotlib():
    return pytest.importorskip("matplotlib", reason="minidist.observe.plot needs matplotlib (pip install 'minidist[plot]')")


@pytest.mark.mpi
@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_pipeline_trace_draws_measured_and_simulated_charts(tmp_path, matplotlib, schedule):
    trace = tmp_path / "trace.json"
    proc = run_train(2, ["--pp", "2", "--microbatches", "4", "--schedule", schedule, *TINY, "--trace", str(trace)],
                     timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    if schedule == "zb-h1":  # the weight gradients are spans of their own, and the simulation runs them
        from minidist.observe import plot as plot_module

        doc = plot_module.load(str(trace))
        weights = [e for e in doc["traceEvents"] if e.get("cat") == "compute" and e["name"].startswith("W")]
        assert len(weights) == 2 * 4 * 2, len(weights)  # 2 ranks x 4 microbatches x 2 steps
        t0, t1 = plot_module.window(doc, "last")
        _, rows, _ = plot_module.simulated(doc, plot_module.pipeline_timelines(doc, t0, t1))
        assert [sum(op == "weight" for _, _, op, *_ in row) for row in rows] == [4, 4], rows
    out = tmp_path / "timeline.png"
    res = plot(str(trace), "-o", str(out))
    assert res.returncode == 0, res.stderr
    assert png(out)
    assert "pipeline bubble" in res.stdout and "simulated" in res.stdout
    res = plot(str(trace), "-o", str(tmp_path / "all.png"), "--step", "all")
    assert res.returncode == 0 and png(tmp_path / "all.png"), res.stderr


def test_one_process_trace_and_bad_input(tmp_path, matplotlib):
    trace = tmp_path / "trace.json"
    proc = run_train(None, [*TINY, "--trace", str(trace)], timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    res = plot(str(trace), "-o", str(tmp_path / "one.png"), "--step", "1")
    assert res.returncode == 0 and png(tmp_path / "one.png"), res.stderr
    res = plot(str(trace), "-o", str(tmp_path / "x.png"), "--step", "9")  # no such step: one line, exit 2
    assert res.returncode == 2 and "steps 1..2" in res.stderr
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"not": "a trace"}))
    res = plot(str(bad), "-o", str(tmp_path / "y.png"))
    assert res.returncode == 2 and "not a Chrome trace" in res.stderr


def test_expert_load_from_a_metrics_file(tmp_path, matplotlib):
    """An --experts run's metrics file draws its expert load over the steps: the series are
    the records' tokens per expert; a dense run's metrics file is refused in one line."""
    from minidist.observe import expert_load

    metrics = tmp_path / "m.jsonl"
    proc = run_train(None, [*TINY, "--experts", "4", "--capacity-factor", "1", "--quiet",
                            "--metrics-jsonl", str(metrics)], timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    records = expert_load.read_metrics(metrics.read_text(), str(metrics))
    steps, load = expert_load.series(records)
    assert steps == [1, 2] and len(load) == 2 and len(load[0]) == 4  # 2 mixtures of 4 experts
    assert [sum(e[i] for e in load[1]) for i in range(2)] == [sum(r["router"]["tokens"][1]) for r in records]
    res = plot(str(metrics), "-o", str(tmp_path / "load.png"))
    assert res.returncode == 0 and png(tmp_path / "load.png"), res.stderr
    assert "expert load of 2 mixture(s) over 2 steps" in res.stdout
    dense = tmp_path / "dense.jsonl"  # a dense run's record: one line, no router statistics
    dense.write_text(json.dumps({k: v for k, v in records[0].items() if k != "router"}) + "\n")
    res = plot(str(dense), "-o", str(tmp_path / "z.png"))
    assert res.returncode == 2 and "no router statistics" in res.stderr and res.stderr.count("\n") <= 3, res.stderr
