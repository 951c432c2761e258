"""The restarting launcher (minidist/train/launch.py): a fault drill, on the same mesh and on
fewer ranks, against runs that were never interrupted or were resumed by hand."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from minidist.host.blas_env import blas_threads
from minidist.train.launch import latest_step, shrink
from minidist.train.testing import run_train

TINY = ["--layers", "2", "--d-model", "16", "--heads", "2", "--seq-len", "16", "--batch-size", "8",
        "--eval-every", "0", "--dtype", "float64", "--warmup", "0", "--quiet"]
DRILL = TINY + ["--steps", "6", "--save-every", "2"]
KILL_RANK_1_SAVING_STEP_4 = {"MINIDIST_TEST_KILL_IN_SAVE": "1:part-written:4"}


def _launch(args, env=None, timeout=240):
    env = {**os.environ, **(env or {}), **blas_threads(1)}
    return subprocess.run([sys.executable, "-m", "minidist.train.launch", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _restart_lines(stderr):
    """The launcher's lines about the job (not its warning about --save-every)."""
    return [line for line in stderr.splitlines()
            if line.startswith("minidist-launch:") and not line.startswith("minidist-launch: warning:")]


def test_the_mesh_shrinks_data_parallelism_and_keeps_the_global_batch():
    mesh = {"dp": 4, "pp": 2, "tp": 2, "cp": 1}
    assert shrink(mesh, 1, 16) == (mesh, 1)
    assert shrink(mesh, 1, 15) == ({**mesh, "dp": 2}, 2)  # 3 does not divide 4: dp 2, twice the micro-steps
    assert shrink(mesh, 3, 8) == ({**mesh, "dp": 2}, 6)
    assert shrink(mesh, 1, 4) == ({**mesh, "dp": 1}, 4)
    assert shrink(mesh, 1, 3) is None  # pp2 x tp2 needs 4


def test_the_step_to_resume_from(tmp_path):
    """No ``latest``: from the start; an unreadable one: "?" (the job then refuses it, exit 2,
    instead of a restart from scratch over the checkpoints); else its step."""
    assert latest_step(str(tmp_path)) is None
    (tmp_path / "latest").write_text("step-000007\n")
    assert latest_step(str(tmp_path)) == "?"  # it names a checkpoint that is not there
    (tmp_path / "step-000007").mkdir()
    assert latest_step(str(tmp_path)) == 7


@pytest.mark.mpi
def test_a_killed_job_restarts_from_latest_and_equals_a_resume_by_hand(tmp_path):
    """dp2 x tp2, float64: rank 1 killed while saving step 4; the launcher restarts on the same
    mesh from step 2, and every loss after it equals a run resumed by hand from step 2 (bit for
    bit); the metrics file holds each of the 6 steps once."""
    ck, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
    ck.mkdir()
    r = _launch(["-n", "4", "--", "--dp", "2", "--tp", "2", *DRILL, "--save", str(ck), "--metrics-jsonl", str(metrics)],
                env=KILL_RANK_1_SAVING_STEP_4)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = _restart_lines(r.stderr)
    assert len(lines) == 1 and "restart 1/3 from step 2 on dp2 x tp2 (--grad-accum 1), 4 ranks" in lines[0], r.stderr
    assert "minidist: rank 1 (" in r.stderr  # the sentinel named the rank that died
    records = _records(metrics)
    assert [rec["step"] for rec in records] == [1, 2, 3, 4, 5, 6]

    hand = tmp_path / "hand.jsonl"
    (tmp_path / "ck2").mkdir()
    by_hand = run_train(4, ["--dp", "2", "--tp", "2", *DRILL, "--resume", str(ck / "step-000002"),
                            "--save", str(tmp_path / "ck2"), "--metrics-jsonl", str(hand)], timeout=180)
    assert by_hand.returncode == 0, by_hand.stderr
    assert [rec["loss"] for rec in records[2:]] == [rec["loss"] for rec in _records(hand)]


@pytest.mark.mpi
def test_ranks_lost_restart_on_the_ranks_left_with_the_same_losses(tmp_path):
    """Two of dp2 x tp2's ranks reported lost: the job goes on as tp2 with twice the gradient
    accumulation, and its losses equal one process's uninterrupted run to 1e-9."""
    ck, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
    ck.mkdir()
    r = _launch(["-n", "4", "--min-ranks", "2", "--", "--dp", "2", "--tp", "2", *DRILL, "--save", str(ck),
                 "--metrics-jsonl", str(metrics)], env={**KILL_RANK_1_SAVING_STEP_4, "MINIDIST_TEST_LOST_RANKS": "2"})
    assert r.returncode == 0, r.stdout + r.stderr
    assert "restart 1/3 from step 2 on tp2 (--grad-accum 2), 2 ranks" in r.stderr, r.stderr

    one = tmp_path / "one.jsonl"
    (tmp_path / "ck1").mkdir()
    whole = run_train(None, [*DRILL, "--save", str(tmp_path / "ck1"), "--metrics-jsonl", str(one)], timeout=120)
    assert whole.returncode == 0, whole.stderr
    got, want = [rec["loss"] for rec in _records(metrics)], [rec["loss"] for rec in _records(one)]
    assert len(got) == len(want) == 6
    assert all(abs(a - b) <= 1e-9 * abs(b) for a, b in zip(got, want)), (got, want)


@pytest.mark.mpi
def test_no_restart_left_or_too_few_ranks_ends_with_the_jobs_exit_code(tmp_path):
    (tmp_path / "a").mkdir()
    r = _launch(["-n", "2", "--max-restarts", "0", "--", "--dp", "2", *DRILL, "--save", str(tmp_path / "a")],
                env=KILL_RANK_1_SAVING_STEP_4)
    assert r.returncode not in (0, 2), r.stderr
    assert _restart_lines(r.stderr)[-1].endswith("no restart is left (--max-restarts 0)"), r.stderr
    (tmp_path / "b").mkdir()
    r = _launch(["-n", "2", "--", "--dp", "2", *DRILL, "--save", str(tmp_path / "b")],
                env={**KILL_RANK_1_SAVING_STEP_4, "MINIDIST_TEST_LOST_RANKS": "1"})
    assert r.returncode not in (0, 2), r.stderr
    assert "the 1 rank(s) left cannot go on (--min-ranks 2" in r.stderr, r.stderr


@pytest.mark.parametrize("args, message", [
    (["-n", "2", "--", "--dp", "2"], "the training flags need --save DIR"),
    (["-n", "2", "--min-ranks", "3", "--", "--dp", "2", "--save", "x"], "--min-ranks 3 is above -n 2"),
    (["-n", "3", "--", "--dp", "2", "--save", "x"], "-n 3 does not fit the training flags' mesh"),
    (["-n", "0", "--", "--save", "x"], "argument -n/--nprocs: expected an integer >= 1, got 0"),
])
def test_bad_input_is_one_line_and_exit_code_2(args, message):
    r = _launch(args, timeout=60)
    assert r.returncode == 2 and r.stdout == "", r
    assert len(r.stderr.splitlines()) == 1 and message in r.stderr, r.stderr


@pytest.mark.mpi
def test_a_job_refusing_its_input_is_not_restarted(tmp_path):
    (tmp_path / "ck").mkdir()
    r = _launch(["-n", "2", "--", "--tp", "2", *TINY, "--heads", "3", "--d-model", "24", "--save", str(tmp_path / "ck")])
    assert r.returncode == 2, r.stderr
    assert "--heads 3 is not divisible by --tp 2" in r.stderr and not _restart_lines(r.stderr), r.stderr


@pytest.mark.mpi
def test_sigterm_to_the_launcher_stops_the_job_with_a_checkpoint_and_no_restart(tmp_path):
    """A preemption: SIGTERM to the launcher goes to mpiexec and the ranks, which finish the step,
    save and exit 143; the launcher does not restart and exits 143."""
    ck, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
    ck.mkdir()
    env = {**os.environ, **blas_threads(1)}
    proc = subprocess.Popen([sys.executable, "-m", "minidist.train.launch", "-n", "2", "--", "--dp", "2", *TINY,
                             "--steps", "100000", "--save", str(ck), "--metrics-jsonl", str(metrics)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.time() + 120
    while time.time() < deadline and not (metrics.exists() and metrics.read_text().count("\n") >= 2):
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, out + err
    assert "SIGTERM" in err and not _restart_lines(err), err
    assert (ck / "latest").exists()
