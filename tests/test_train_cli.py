"""`python -m minidist.train`: bad input, the metrics file, float64, and real learning."""

import json
import os
import subprocess
import sys

import pytest

TRAIN = [sys.executable, "-m", "minidist.train"]
TINY = ["--layers", "1", "--d-model", "16", "--heads", "2", "--seq-len", "16", "--batch-size", "4",
        "--peak-gflops", "10", "--eval-batches", "1"]


def run(args, timeout=300, threads=1):
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), OPENBLAS_NUM_THREADS=str(threads))
    return subprocess.run(TRAIN + args, capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.parametrize("args, needle", [
    (["--no-such-flag"], "--no-such-flag"),
    (["--d-model", "30", "--heads", "4"], "--d-model 30 is not divisible by --heads 4"),
    (["--seq-len", "64", "--block-size", "32"], "--seq-len 64 is larger than the position table"),
    (["--data", "/nonexistent/corpus.txt"], "/nonexistent/corpus.txt: no such file"),
    (["--steps", "0"], "--steps must be positive, got 0"),
    (["--steps", "-3"], "--steps must be positive, got -3"),
    (["--grad-accum", "8", "--batch-size", "4"], "--grad-accum 8 exceeds --batch-size 4"),
])
def test_bad_input_is_one_clear_message(args, needle):
    r = run(args)
    assert r.returncode == 2, r.stderr
    assert needle in r.stderr
    assert "Traceback" not in r.stderr


def test_empty_and_too_short_data_files(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    r = run(["--data", str(empty)])
    assert r.returncode == 2 and "empty" in r.stderr and "Traceback" not in r.stderr
    short = tmp_path / "short.txt"
    short.write_text("just a few bytes")
    r = run(TINY + ["--data", str(short), "--steps", "1"])
    assert r.returncode == 2 and str(short) in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_float64_run_writes_metrics(tmp_path):
    metrics = tmp_path / "m.jsonl"
    trace = tmp_path / "trace.json"
    r = run(TINY + ["--steps", "6", "--dtype", "float64", "--eval-every", "3", "--log-every", "2",
                    "--metrics-jsonl", str(metrics), "--trace", str(trace), "--grad-accum", "2",
                    "--checkpoint-activations"])
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(6))
    for row in rows:
        for key in ("step", "loss", "lr", "tokens_per_s", "mfu", "step_time_s"):
            assert key in row
        assert row["tokens_per_s"] > 0 and 0 < row["mfu"]
    # peak memory is traced on step 0 and on each step before a printed one (0, 2, 4 and the last)
    assert [row["step"] for row in rows if "peak_mem_mb" in row] == [0, 1, 3, 4]
    assert all(row["peak_mem_mb"] > 0 for row in rows if "peak_mem_mb" in row)
    assert "val_loss" in rows[2] and "val_loss" in rows[5] and "val_loss" not in rows[0]
    assert "step     6/6" in r.stdout and "tok/s" in r.stdout and "MFU" in r.stdout and "ETA" in r.stdout
    events = json.loads(trace.read_text())["traceEvents"]
    assert {e["name"] for e in events} >= {"forward_backward", "optimizer"}


@pytest.mark.slow
def test_default_model_learns_the_default_corpus(tmp_path):
    """The default small model goes from ~5.5 nats/byte to below 2.6 in 300 steps."""
    metrics = tmp_path / "m.jsonl"
    r = run(["--steps", "300", "--metrics-jsonl", str(metrics), "--eval-every", "0", "--quiet"], timeout=900, threads=2)
    assert r.returncode == 0, r.stderr
    losses = [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]
    assert 5.0 < losses[0] < 6.0
    assert sum(losses[-10:]) / 10 < 2.6, losses[-10:]
