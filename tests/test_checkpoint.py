"""Checkpoints: sharded, atomic, bit-exact to resume, reshardable onto any mesh, damage refused."""
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from minidist.host.launcher import mpiexec_command
from minidist.train.testing import run_mpi, run_train

ARGS = ["--layers", "2", "--d-model", "16", "--heads", "2", "--seq-len", "16", "--batch-size", "8",
        "--eval-every", "0", "--dtype", "float64", "--warmup", "0", "--quiet", "--steps", "6"]
BODIES = os.path.join(os.path.dirname(__file__), "mpi", "checkpoint_bodies.py")


def _losses(path):
    return [json.loads(line)["loss"] for line in path.read_text().splitlines()]


def _train(n, args, tmp_path, name):
    out = tmp_path / f"{name}.jsonl"
    r = run_train(n, ARGS + args + ["--metrics-jsonl", str(out)], timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    return _losses(out), r


def _params(path):
    from minidist.state.checkpoint import load_full

    return load_full(str(path))[1]


def _resumes_like_one_process(tmp_path, flags, meshes, straight):
    """The step-3 checkpoint in tmp_path/ck, resumed with ``flags`` on each ``(ranks, mesh flags)``,
    trains steps 4-6 as the uninterrupted one-process run (``straight``, saved in tmp_path/one)
    did: losses and every parameter to 1e-9."""
    want = _params(tmp_path / "one")
    for i, (n, mesh) in enumerate(meshes):
        out = tmp_path / f"resumed-{i}"
        out.mkdir()
        losses, _ = _train(n, flags + mesh + ["--resume", str(tmp_path / "ck" / "step-000003"), "--save", str(out)],
                           tmp_path, f"resumed-{i}")
        assert len(losses) == 3 and _rel(np.array(losses), np.array(straight[3:])) < 1e-9, (mesh, losses, straight)
        got = _params(out)
        assert got.keys() == want.keys(), (mesh, sorted(got.keys() ^ want.keys()))
        assert max(_rel(got[k], want[k]) for k in want) < 1e-9, mesh


def _rel(a, b):
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-300))


@pytest.mark.mpi
@pytest.mark.parametrize("n, mesh", [(None, []), (None, ["--dtype", "float32"]), (4, ["--dp", "2", "--tp", "2"])],
                         ids=["one-process", "one-process-float32", "dp2-tp2"])
def test_resume_is_bit_exact(n, mesh, tmp_path):
    """A 6-step run checkpointed after step 3, and a run resumed from that checkpoint for steps
    4-6: the same losses and the same final parameters as the uninterrupted run, bit for bit."""
    for d in "abc":
        (tmp_path / d).mkdir()
    straight, _ = _train(n, mesh + ["--save", str(tmp_path / "a")], tmp_path, "straight")
    first, _ = _train(n, mesh + ["--save", str(tmp_path / "b"), "--save-every", "3"], tmp_path, "first")
    assert sorted(os.listdir(tmp_path / "b")) == ["latest", "step-000003", "step-000006"]
    second, r = _train(n, mesh + ["--save", str(tmp_path / "c"), "--resume", str(tmp_path / "b" / "step-000003")],
                       tmp_path, "second")
    assert first[:3] + second == straight
    a, c = _params(tmp_path / "a"), _params(tmp_path / "c")
    assert a.keys() == c.keys() and all(np.array_equal(a[k], c[k]) for k in a)


@pytest.mark.mpi
def test_a_checkpoint_of_dp2_tp2_zero1_resumes_on_other_meshes(tmp_path):
    """Saved on dp2·tp2 with ZeRO-1, resumed on pp2·dp2, cp2, one process and dp2·tp2 ZeRO-3:
    the trajectory equals the uninterrupted single-process run to 1e-9.  Each mesh saves into
    a directory of its own, made empty for it, so the parameters compared are the ones that
    mesh wrote (a save that wrote nothing cannot be judged on another mesh's checkpoint)."""
    (tmp_path / "one").mkdir(), (tmp_path / "ck").mkdir()
    straight, _ = _train(None, ["--save", str(tmp_path / "one")], tmp_path, "straight")
    saved, _ = _train(4, ["--dp", "2", "--tp", "2", "--zero", "1", "--save", str(tmp_path / "ck"),
                          "--save-every", "3"], tmp_path, "saved")
    assert len(saved) == len(straight) == 6
    assert _rel(np.array(saved), np.array(straight)) < 1e-9
    want = _params(tmp_path / "one")
    for i, (n, mesh) in enumerate([(4, ["--pp", "2", "--dp", "2"]), (2, ["--cp", "2"]), (None, []),
                                   (4, ["--dp", "2", "--tp", "2", "--zero", "3"])]):
        out = tmp_path / f"resumed-{i}"
        out.mkdir()
        losses, r = _train(n, mesh + ["--resume", str(tmp_path / "ck" / "step-000003"), "--save", str(out)],
                           tmp_path, f"resumed-{i}")
        assert len(losses) == 3, (mesh, losses)
        assert _rel(np.array(losses), np.array(straight[3:])) < 1e-9, (mesh, losses, straight)
        assert sorted(os.listdir(out)) == ["latest", "step-000006"], (mesh, os.listdir(out))
        got = _params(out)
        assert got.keys() == want.keys(), (mesh, sorted(got.keys() ^ want.keys()))
        assert max(_rel(got[k], want[k]) for k in want) < 1e-9, mesh


@pytest.mark.mpi
def test_each_rank_reads_only_what_it_needs(tmp_path):
    """Resharding reads pieces, not the model: on pp2·dp2 each rank reads less than the whole
    checkpoint, and a rank of the same layout reads exactly what it holds."""
    (tmp_path / "ck").mkdir()
    _train(4, ["--dp", "2", "--tp", "2", "--save", str(tmp_path / "ck")], tmp_path, "saved")
    out = run_mpi(4, BODIES, str(tmp_path / "ck" / "step-000006"), timeout=120).stdout
    assert out.count("read ok") == 4, out


def test_a_flipped_byte_is_refused_naming_the_file(tmp_path):
    (tmp_path / "ck").mkdir()
    _train(None, ["--save", str(tmp_path / "ck")], tmp_path, "saved")
    shard = tmp_path / "ck" / "step-000006" / "rank-00000.bin"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x10
    shard.write_bytes(bytes(data))
    r = run_train(None, ARGS + ["--steps", "8", "--resume", str(tmp_path / "ck")], timeout=120)
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    assert str(shard) in r.stderr and "checksum" in r.stderr, r.stderr


@pytest.mark.mpi
def test_a_flipped_byte_found_by_one_rank_ends_the_job_without_blaming_another(tmp_path):
    """On tp2 only rank 1 reads its own shard: it names the file and exits; the launcher then
    ends rank 0, whose sentinel must not report it as a rank that died without a word."""
    (tmp_path / "ck").mkdir()
    _train(2, ["--tp", "2", "--save", str(tmp_path / "ck")], tmp_path, "saved")
    shard = tmp_path / "ck" / "step-000006" / "rank-00001.bin"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x10
    shard.write_bytes(bytes(data))
    r = run_train(2, ARGS + ["--tp", "2", "--steps", "8", "--resume", str(tmp_path / "ck")], timeout=120)
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    assert str(shard) in r.stderr and "checksum" in r.stderr, r.stderr
    assert "died without a report" not in r.stderr, r.stderr


def test_a_damaged_latest_names_the_previous_good_one(tmp_path):
    ck = tmp_path / "ck"
    ck.mkdir()
    _train(None, ["--save", str(ck), "--save-every", "3"], tmp_path, "saved")
    shard = ck / "step-000006" / "rank-00000.bin"
    shard.write_bytes(shard.read_bytes()[:100])  # truncated
    r = run_train(None, ARGS + ["--resume", str(ck)], timeout=120)
    assert r.returncode == 2, r.stderr
    (line,) = [x for x in r.stderr.splitlines() if x.strip()]
    assert "latest checkpoint" in line and "damaged" in line and str(ck / "step-000003") in line, line


def test_a_crashed_save_leaves_the_previous_checkpoint(tmp_path):
    """A save killed half-way leaves only its temporary directory: latest still points at the
    previous checkpoint, which resumes; the next save replaces the leftovers."""
    ck = tmp_path / "ck"
    ck.mkdir()
    _train(None, ["--save", str(ck), "--save-every", "3"], tmp_path, "saved")
    for name in ("step-000006", "latest"):  # as if the run had been killed saving step 6
        os.remove(ck / name) if name == "latest" else __import__("shutil").rmtree(ck / name)
    (ck / "latest").write_text("step-000003\n")
    tmp = ck / ".tmp-step-000006"
    tmp.mkdir()
    (tmp / "rank-00000.bin").write_bytes(b"half a file")
    assert (ck / "latest").read_text().strip() == "step-000003"
    losses, _ = _train(None, ["--save", str(ck), "--resume", str(ck)], tmp_path, "resumed")
    assert len(losses) == 3 and not tmp.exists()
    assert (ck / "latest").read_text().strip() == "step-000006"


def _run_until_killed(ck, kill, env=None, save_every=1):
    """Train on 2 ranks with a save every ``save_every`` steps until ``kill(proc)`` ends a
    rank; the job must end by itself (no hang).  Returns its stderr."""
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", **(env or {}))
    args = [a for a in ARGS if a not in ("--steps", "6")] + ["--steps", "100000"]
    cmd = mpiexec_command(2) + [sys.executable, "-m", "minidist.train", *args, "--dp", "2", "--save", str(ck),
                                "--save-every", str(save_every)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        kill(proc)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode != 0, err
    return err


def _resumes_losing_at_most(ck, steps_lost_at_most, killed_at=None):
    from minidist.state.checkpoint import check, resolve

    path = resolve(str(ck))
    check(path)
    step = int(path[-6:])
    if killed_at is not None:
        assert killed_at - steps_lost_at_most <= step < killed_at, (step, killed_at)
    r = run_train(None, ARGS + ["--steps", str(step + 1), "--resume", str(ck)], timeout=120)
    assert r.returncode == 0, r.stderr


@pytest.mark.mpi
def test_kill_9_of_a_rank_ends_the_job_names_the_rank_and_the_latest_checkpoint_loads(tmp_path):
    """kill -9 of rank 1 while it saves every step: the job ends (no hang) with a line that
    names rank 1 (its sentinel's, comm/sentinel.py), and the latest checkpoint is whole;
    resuming loses at most --save-every steps."""
    ck = tmp_path / "ck"
    ck.mkdir()

    def kill(proc):
        deadline = time.time() + 120
        while time.time() < deadline and len([d for d in os.listdir(ck) if d.startswith("step-")]) < 3:
            time.sleep(0.05)
        os.kill(_rank_pid(proc.pid, 1), signal.SIGKILL)

    err = _run_until_killed(ck, kill)
    named = [ln for ln in err.splitlines() if ln.startswith("minidist: rank")]
    assert len(named) == 1 and named[0].startswith("minidist: rank 1 (dp1, pid ") and "died" in named[0], err
    _resumes_losing_at_most(ck, 1)


@pytest.mark.mpi
@pytest.mark.parametrize("rank, point", [(1, "part-written"), (0, "renamed")])
def test_a_rank_killed_mid_save_leaves_the_previous_checkpoint(tmp_path, rank, point):
    """The test hook stops a rank with SIGKILL inside the save of step 4 (``--save-every 2``):
    after its array file is written but before it is declared complete, or (rank 0) after the
    checkpoint is renamed into place but before ``latest`` moves.  Either way ``latest`` still
    names step 2, which loads and resumes, and the rank is named."""
    ck = tmp_path / "ck"
    ck.mkdir()
    err = _run_until_killed(ck, lambda proc: None, env={"MINIDIST_TEST_KILL_IN_SAVE": f"{rank}:{point}:4"},
                            save_every=2)
    assert f"minidist: rank {rank} (dp{rank}, pid " in err, err
    assert (ck / "latest").read_text().strip() == "step-000002"
    assert (ck / "step-000004").exists() == (point == "renamed")
    _resumes_losing_at_most(ck, 2, killed_at=4)


def _rank_pid(launcher_pid, rank):
    """The PID of rank ``rank`` among the processes under an mpiexec (by its environment:
    PMI_RANK for MPICH's launcher, OMPI_COMM_WORLD_RANK for Open MPI's)."""
    todo, found = [launcher_pid], []
    while todo:
        pid = todo.pop()
        out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
        todo += [int(p) for p in out]
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
            with open(f"/proc/{pid}/environ", "rb") as f:
                environ = f.read().split(b"\0")
        except OSError:
            continue
        if b"minidist.train" in cmdline and (f"PMI_RANK={rank}".encode() in environ
                                             or f"OMPI_COMM_WORLD_RANK={rank}".encode() in environ):
            found.append(pid)
    assert len(found) == 1, found
    return found[0]


@pytest.mark.parametrize("args, needle", [
    (["--save", "/no/such/dir"], "--save /no/such/dir: no such directory"),
    (["--save-every", "0"], "argument --save-every: expected an integer >= 1, got 0"),
    (["--save-every", "2"], "--save-every 2 needs --save DIR"),
    (["--resume", "/no/such/ckpt"], "--resume /no/such/ckpt: no such checkpoint directory"),
])
def test_bad_checkpoint_flags_are_one_line_exit_2(args, needle):
    r = run_train(None, ARGS + args, timeout=60)
    assert r.returncode == 2 and needle in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_resume_of_another_model_names_the_fields(tmp_path):
    (tmp_path / "ck").mkdir()
    _train(None, ["--save", str(tmp_path / "ck")], tmp_path, "saved")
    (tmp_path / "plain").mkdir()
    r = run_train(None, ARGS + ["--resume", str(tmp_path / "plain")], timeout=60)
    assert r.returncode == 2 and "not a checkpoint" in r.stderr, r.stderr
    bad = [a if a != "16" else "32" for a in ARGS]  # --d-model 32 --seq-len 32
    r = run_train(None, bad + ["--layers", "3", "--untied", "--resume", str(tmp_path / "ck")], timeout=60)
    assert r.returncode == 2, r.stderr
    for field in ("layers 2 -> 3", "d_model 16 -> 32", "tied True -> False"):
        assert field in r.stderr, r.stderr


def test_resuming_a_gpt2_checkpoint_as_llama_names_the_fields_and_writes_nothing(tmp_path):
    """--arch llama on a GPT-2 checkpoint: one line naming every field that differs (the
    family, the MLP's width, the biases and the head), exit 2, and nothing saved or logged."""
    (tmp_path / "ck").mkdir(), (tmp_path / "out").mkdir()
    _train(None, ["--save", str(tmp_path / "ck")], tmp_path, "saved")
    metrics = tmp_path / "resumed.jsonl"
    llama = ["--arch", "llama", "--kv-heads", "1", "--ffn-hidden", "32"]
    r = run_train(None, ARGS + llama + ["--resume", str(tmp_path / "ck"), "--save", str(tmp_path / "out"),
                                        "--metrics-jsonl", str(metrics)], timeout=60)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    for field in ("arch gpt2 -> llama", "kv_heads 2 -> 1", "ffn_hidden 64 -> 32",
                  "bias True -> False", "tied True -> False"):
        assert field in lines[0], (field, lines[0])
    assert "rope_theta" not in lines[0] and "norm_eps" not in lines[0], lines[0]
    assert os.listdir(tmp_path / "out") == [] and not metrics.exists()


def test_a_checkpoint_of_format_1_reads_by_its_old_names(tmp_path):
    """Format 1 named the model's fields as nn.GPTConfig did (n_layer, n_head, seq_len,
    tie_embeddings, ...): such metadata reads as the model it is.  Older still, it lacks arch,
    n_kv_head, ffn_hidden, rope_theta and norm_eps: it reads as GPT-2 (one key/value head per
    query head, a 4 d MLP) and resumes bit-exactly."""
    from minidist.state.checkpoint import metadata
    from minidist.state.checkpoint_meta import FORMAT_1, RENAMED

    (tmp_path / "ck").mkdir(), (tmp_path / "out").mkdir()
    straight, _ = _train(None, ["--save", str(tmp_path / "ck"), "--save-every", "3"], tmp_path, "straight")
    file = tmp_path / "ck" / "step-000003" / "metadata.json"
    meta = json.loads(file.read_text())
    now = metadata(str(file.parent))["model"]
    old = {new: name for name, new in RENAMED.items()}
    meta["format"], meta["model"] = FORMAT_1, {old.get(k, k): v for k, v in meta["model"].items()}
    assert {"n_layer", "n_head", "n_kv_head", "seq_len", "tie_embeddings", "n_experts"} <= set(meta["model"])
    file.write_text(json.dumps(meta))
    assert metadata(str(file.parent))["model"] == now
    for key in ("arch", "n_kv_head", "ffn_hidden", "rope_theta", "norm_eps"):
        del meta["model"][key]
    file.write_text(json.dumps(meta))
    model = metadata(str(file.parent))["model"]
    assert (model["arch"], model["kv_heads"], model["ffn_hidden"]) == ("gpt2", 2, 64) and model["layers"] == 2
    resumed, _ = _train(None, ["--resume", str(file.parent), "--save", str(tmp_path / "out")], tmp_path, "resumed")
    assert resumed == straight[3:]


LLAMA = ["--arch", "llama", "--heads", "4", "--kv-heads", "1"]  # head dim 4; one key/value head


@pytest.mark.mpi
def test_a_llama_checkpoint_of_tp2_with_one_kv_head_resumes_on_other_meshes(tmp_path):
    """Llama with K = 1 key/value head saved on tp2 (the head held by both ranks, written by
    copy 0 only), resumed on one process and on dp2·tp2 with ZeRO-1: the trajectory and the
    parameters equal the uninterrupted single-process run to 1e-9."""
    (tmp_path / "one").mkdir(), (tmp_path / "ck").mkdir()
    straight, _ = _train(None, LLAMA + ["--save", str(tmp_path / "one")], tmp_path, "straight")
    saved, _ = _train(2, LLAMA + ["--tp", "2", "--save", str(tmp_path / "ck"), "--save-every", "3"], tmp_path, "saved")
    assert _rel(np.array(saved), np.array(straight)) < 1e-9
    meta = json.loads((tmp_path / "ck" / "step-000003" / "metadata.json").read_text())
    assert meta["model"]["arch"] == "llama" and meta["model"]["kv_heads"] == 1
    kv = meta["tensors"]["h.0.attn.k_proj.weight/param"]["pieces"]
    assert [pc["file"] for pc in kv] == ["rank-00000.bin"], kv  # the shared head, once
    _resumes_like_one_process(tmp_path, LLAMA, [(None, []), (4, ["--dp", "2", "--tp", "2", "--zero", "1"])],
                              straight)


@pytest.mark.mpi
def test_asynchronous_saving_writes_the_same_checkpoints(tmp_path):
    """--save-async copies the arrays at the step and writes them in the background: every
    checkpoint equals the synchronous one, and the run says how much of the save it hid."""
    (tmp_path / "sync").mkdir(), (tmp_path / "async").mkdir()
    _train(2, ["--save", str(tmp_path / "sync"), "--save-every", "2"], tmp_path, "sync")
    out = tmp_path / "a.jsonl"
    r = run_train(2, [a for a in ARGS if a != "--quiet"] + ["--save", str(tmp_path / "async"), "--save-every", "2",
                                                            "--save-async", "--metrics-jsonl", str(out)], timeout=180)
    assert r.returncode == 0, r.stderr
    assert "asynchronous saving:" in r.stdout and "% of the save time hidden" in r.stdout, r.stdout
    names = ["latest", "step-000002", "step-000004", "step-000006"]
    assert sorted(os.listdir(tmp_path / "async")) == sorted(os.listdir(tmp_path / "sync")) == names
    for step in names[1:]:
        a, s = _params(tmp_path / "async" / step), _params(tmp_path / "sync" / step)
        assert a.keys() == s.keys() and all(np.array_equal(a[k], s[k]) for k in s), step


def test_a_resumed_run_prints_its_progress(tmp_path):
    """Without --quiet: the start line, which checkpoint it resumed, and progress from step 4."""
    ck = tmp_path / "ck"
    ck.mkdir()
    _train(None, ["--save", str(ck), "--save-every", "3"], tmp_path, "saved")
    loud = [a for a in ARGS if a != "--quiet"]
    r = run_train(None, loud + ["--steps", "8", "--log-every", "1", "--resume", str(ck / "step-000003")], timeout=120)
    assert r.returncode == 0, r.stderr
    assert f"resumed from {ck / 'step-000003'} (step 3, saved on one process)" in r.stdout, r.stdout
    assert "step     4/8" in r.stdout and "step     3/8" not in r.stdout, r.stdout


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [None, 2])
@pytest.mark.parametrize("sig, words, code", [(signal.SIGINT, "interrupted", 130),
                                              (signal.SIGTERM, "stopped by SIGTERM", 143)])
def test_ctrl_c_with_save_writes_a_final_checkpoint(tmp_path, ranks, sig, words, code):
    """With --save, Ctrl-C stops after the step in progress, once every rank has saved it: the
    latest checkpoint is that step's, the metrics file holds every step up to it, the trace
    every rank's spans of those steps, exit 130.  SIGTERM (a scheduler's preemption; mpiexec
    forwards it to every rank) is the same stop, with its own words and exit code 143."""
    ck, metrics, trace_file = tmp_path / "ck", tmp_path / "m.jsonl", tmp_path / "trace.json"
    ck.mkdir()
    args = [a for a in ARGS if a not in ("--steps", "6")] + ["--steps", "100000", "--save", str(ck),
                                                             "--save-every", "50000", "--metrics-jsonl", str(metrics),
                                                             "--trace", str(trace_file)]
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    cmd = (mpiexec_command(ranks) if ranks else []) + [sys.executable, "-m", "minidist.train", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 5):
            time.sleep(0.1)
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == code, (proc.returncode, out, err)
    done = len(metrics.read_text().splitlines())
    lines = [line for line in err.splitlines() if line.strip() and "MPI_Abort" not in line]
    assert len(lines) == 1 and f"{words} after step {done}, saved in {ck / f'step-{done:06d}'}" in lines[0], err
    assert (ck / "latest").read_text().strip() == f"step-{done:06d}"
    from minidist.state.checkpoint import check
    assert check(str(ck / f"step-{done:06d}"))["step"] == done
    events = json.loads(trace_file.read_text())["traceEvents"]
    assert {e["pid"] for e in events} == set(range(ranks or 1))
    steps = {e["name"] for e in events if e.get("ph") == "X" and e["name"].startswith("step ")}
    assert steps == {f"step {k}" for k in range(1, done + 1)}, steps


MOE = ["--experts", "4", "--top-k", "1", "--capacity-factor", "1.5"]


@pytest.mark.mpi
def test_a_checkpoint_of_expert_parallelism_resumes_on_one_process_and_another_ep(tmp_path):
    """A mixture of 4 experts saved on dp4·ep2 with ZeRO-1 (each rank holds 2 experts of every
    mixture; each expert's optimizer state sharded over the 2 ranks holding it), resumed on
    one process and on dp2·ep2 without ZeRO: the trajectory and the parameters equal the
    uninterrupted single-process run to 1e-9.  Every expert is written by the ranks of one
    edp group only (under its global name and shape), and its parameter once."""
    (tmp_path / "one").mkdir(), (tmp_path / "ck").mkdir()
    straight, _ = _train(None, MOE + ["--save", str(tmp_path / "one")], tmp_path, "straight")
    saved, _ = _train(4, MOE + ["--ep", "2", "--zero", "1", "--save", str(tmp_path / "ck"), "--save-every", "3"],
                      tmp_path, "saved")
    assert _rel(np.array(saved), np.array(straight)) < 1e-9
    meta = json.loads((tmp_path / "ck" / "step-000003" / "metadata.json").read_text())
    # ep groups {0, 1} and {2, 3}: experts 0-1 on ranks 0 and 2 (edp group {0, 2}), 2-3 on 1 and 3.
    for e, files in enumerate([["rank-00000.bin"], ["rank-00000.bin"], ["rank-00001.bin"], ["rank-00001.bin"]]):
        pieces = meta["tensors"][f"h.1.mlp.experts.{e}.c_fc.weight/param"]["pieces"]
        assert [pc["file"] for pc in pieces] == files, (e, pieces)  # the first rank of its edp group
        state = meta["tensors"][f"h.1.mlp.experts.{e}.c_fc.weight/exp_avg"]["pieces"]
        assert {pc["file"] for pc in state} <= {files[0], f"rank-{int(files[0][5:10]) + 2:05d}.bin"}, (e, state)
    _resumes_like_one_process(tmp_path, MOE, [(None, []), (2, ["--ep", "2"])], straight)


@pytest.mark.mpi
def test_a_zero3_checkpoint_with_expert_parallelism_resumes_on_one_process(tmp_path):
    """ZeRO-3 with --ep shards each block's dense parameters over dp and its experts over the
    ranks that hold them (edp): saved on dp4·ep2, resumed on one process and on dp2·ep2 with
    ZeRO-1, steps 4-6 equal the uninterrupted single-process run to 1e-9."""
    (tmp_path / "one").mkdir(), (tmp_path / "ck").mkdir()
    straight, _ = _train(None, MOE + ["--save", str(tmp_path / "one")], tmp_path, "straight")
    saved, _ = _train(4, MOE + ["--ep", "2", "--zero", "3", "--save", str(tmp_path / "ck"), "--save-every", "3"],
                      tmp_path, "saved")
    assert _rel(np.array(saved), np.array(straight)) < 1e-9
    _resumes_like_one_process(tmp_path, MOE, [(None, []), (2, ["--ep", "2", "--zero", "1"])], straight)
