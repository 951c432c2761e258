"""What a new user meets first: Ctrl-C, a diverging run, numbers that agree, true words."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from minidist.host.launcher import mpiexec_command
from minidist.train.testing import run_train

ROOT = os.path.join(os.path.dirname(__file__), "..")
TINY = ["--layers", "1", "--d-model", "16", "--heads", "2", "--seq-len", "16", "--batch-size", "4",
        "--peak-gflops", "10", "--eval-every", "0"]


def _no_nan(token):
    raise ValueError(f"not strict JSON: {token}")


def _strict_lines(path):
    """Every line of a metrics file, parsed by a parser that rejects NaN and Infinity."""
    return [json.loads(line, parse_constant=_no_nan) for line in path.read_text().splitlines()]


@pytest.mark.mpi
@pytest.mark.parametrize("ranks, mesh, sig, words, code", [
    (2, [], signal.SIGINT, "interrupted", 130), (4, ["--tp", "2"], signal.SIGINT, "interrupted", 130),
    (None, [], signal.SIGTERM, "stopped by SIGTERM", 143), (2, [], signal.SIGTERM, "stopped by SIGTERM", 143)])
def test_ctrl_c_stops_the_run_with_one_line_the_summary_and_exit_130(tmp_path, ranks, mesh, sig, words, code):
    """Without --save too: SIGTERM (how a scheduler preempts a job) stops as Ctrl-C does, exit 143."""
    metrics = tmp_path / "m.jsonl"
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    cmd = (mpiexec_command(ranks) if ranks else []) + [sys.executable, "-m", "minidist.train", *TINY, *mesh, "--steps", "100000",
                                "--log-every", "1000", "--metrics-jsonl", str(metrics)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 5):
            time.sleep(0.2)
        proc.send_signal(sig)  # SIGINT: what Ctrl-C in the terminal sends to mpiexec
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == code, (proc.returncode, out, err)
    # minidist's one line; MPICH adds one of its own saying that rank 0 called MPI_Abort(130)
    lines = [line for line in err.splitlines() if line.strip() and "MPI_Abort" not in line]
    assert len(lines) == 1 and f"{words} at step" in lines[0] and "Traceback" not in err, err
    rows = _strict_lines(metrics)
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1)) and len(rows) >= 5
    step = int(lines[0].split(f"{words} at step ")[1].split()[0])
    assert step == len(rows) + 1, (step, len(rows))  # the step in progress; the finished ones are written
    (steps_row,) = [line for line in out.splitlines() if line.startswith("steps ")]
    assert "summary" in out and steps_row.split("|")[1].strip() == str(len(rows)), out  # the summary so far


def test_a_diverged_run_names_one_step_everywhere_and_writes_strict_json(tmp_path):
    metrics = tmp_path / "m.jsonl"
    r = run_train(None, TINY + ["--lr", "1e6", "--warmup", "0", "--clip-grad", "0", "--steps", "30",
                                "--log-every", "1", "--metrics-jsonl", str(metrics)], timeout=120)
    assert r.returncode == 1, r.stderr
    assert "RuntimeWarning" not in r.stderr and "Traceback" not in r.stderr, r.stderr
    (message,) = [line for line in r.stderr.splitlines() if line.strip()]
    step = int(message.split("at step ")[1].split(";")[0])
    rows = _strict_lines(metrics)
    assert rows[-1]["step"] == step and rows[-1]["loss"] is None and rows[-1]["diverged"] is True
    assert all("diverged" not in row for row in rows[:-1])
    assert f"step {step:>5}/30 | loss nan" in r.stdout, r.stdout  # the progress line of the same step


def test_binary_data_gets_one_warning(tmp_path):
    blob = tmp_path / "blob.bin"
    blob.write_bytes(bytes(range(256)) * 8 + b"\0" * 4096)
    r = run_train(None, TINY + ["--data", str(blob), "--steps", "1", "--quiet"], timeout=120)
    assert r.returncode == 0, r.stderr
    warnings = [line for line in r.stderr.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "does not look like text" in warnings[0] and str(blob) in warnings[0], r.stderr
    text = tmp_path / "text.txt"
    text.write_text("hello world\n" * 500)
    r = run_train(None, TINY + ["--data", str(text), "--steps", "1", "--quiet"], timeout=120)
    assert r.returncode == 0 and "warning" not in r.stderr, r.stderr


@pytest.mark.mpi
def test_the_start_line_names_the_mesh_not_single_process():
    r = run_train(2, TINY + ["--tp", "2", "--steps", "1"], timeout=120)
    assert r.returncode == 0, r.stderr
    start = r.stdout.splitlines()[0]
    assert "single process" not in start and "tp=2" in start and "tensor parallel over 2 ranks" in start, start


def test_make_help_lists_the_targets():
    r = subprocess.run(["make", "-s", "help"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    for target in ("demo", "test", "test-fast", "bench", "install", "clean"):
        assert f"make {target} " in r.stdout, r.stdout


@pytest.mark.mpi
def test_the_node_layout_in_the_summary_and_a_warning_for_tp_across_nodes():
    """MINIDIST_RANKS_PER_NODE=2 on 4 ranks: two pretend nodes; --tp 4 spans both, which rank 0
    warns about once; the summary ends with the node layout."""
    args = ["--layers", "1", "--d-model", "16", "--heads", "4", "--seq-len", "16", "--batch-size", "4",
            "--steps", "1", "--eval-every", "0", "--quiet"]
    r = run_train(4, args + ["--tp", "4"], timeout=120, env={"MINIDIST_RANKS_PER_NODE": "2"})
    assert r.returncode == 0, r.stderr
    warnings = [line for line in r.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "tp group [0 1 2 3] spans nodes 0 and 1" in warnings[0], r.stderr
    assert "nodes: 2 (pretend: MINIDIST_RANKS_PER_NODE=2): node 0: ranks 0-1, node 1: ranks 2-3" in r.stdout, r.stdout
    r = run_train(4, args + ["--tp", "2"], timeout=120, env={"MINIDIST_RANKS_PER_NODE": "2"})
    assert r.returncode == 0 and "warning" not in r.stderr, r.stderr
