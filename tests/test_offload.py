"""Optimizer offload (``--offload optimizer``, minidist/model/optim/offload.py): AdamW's state in
host memory and its step on the CPU train exactly like AdamW on the device.

Run on the active backend: on NumPy the offloaded step is the same arithmetic on the same
arrays (bit for bit); on CuPy (``make test-gpu``'s way, or the emulator) the host's NumPy
against the device's fused kernel, float64 to 1e-12.  The CPU suite also runs the
single-process tests and dp2 under the CuPy emulator (``test_under_the_cupy_emulator``).
"""
import os
import gc
import subprocess
import sys
import time

import numpy as np
import pytest

from minidist.model.backend import host, to_host, xp
from minidist.train.config import RunConfig
from minidist.train.testing import run_mpi, run_train, train_run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EMULATOR = os.path.join(ROOT, "tests", "emulated_gpu")
ON_NUMPY = xp is host
STEPS = 4

# clip_grad 0.05 is below the gradients' norm, so every step clips; weight decay on
BASE = RunConfig().replace(model=dict(layers=3, d_model=16, heads=2, dtype="float64"),
                           data=dict(seq_len=8, batch_size=4),
                           optim=dict(lr=1e-2, warmup=1, steps=STEPS, clip_grad=0.05, weight_decay=0.1))


def cfg(offload=True, overlap=True, model=None, device=None, **parallel):
    dev = dict(offload="optimizer" if offload else "none", offload_overlap=overlap, **(device or {}))
    return BASE.replace(model=model or {}, device=dev, parallel={"dp": 1, **parallel}).resolved()


def rel(a, b) -> float:
    a, b = np.asarray(to_host(a)), np.asarray(to_host(b))
    return float(np.max(np.abs(a - b)) / max(1e-30, float(np.max(np.abs(b)))))


def assert_equal_runs(got, want, tol):
    """Losses (the steps' and a validation loss) and every parameter; exact where ``tol`` is 0."""
    assert set(got.params) == set(want.params)
    if tol == 0:
        assert got.losses == want.losses
        for name in want.params:
            assert np.array_equal(got.params[name], want.params[name]), name
        return
    for g, w in zip(got.losses, want.losses):
        assert abs(g - w) <= tol * abs(w), (got.losses, want.losses)
    for name in want.params:
        assert rel(got.params[name], want.params[name]) <= tol, name


_reference = {}


def reference(key, config):
    if key not in _reference:
        _reference[key] = train_run(config, STEPS)
    return _reference[key]


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_float64_equals_adamw_on_the_device(overlap):
    """Clipping, weight decay, bias corrections: the run equals the one without offload
    (float64: bit for bit on NumPy, 1e-12 on a GPU), and so the two overlap settings agree."""
    run = train_run(cfg(overlap=overlap), STEPS)
    assert_equal_runs(run, reference("float64", cfg(offload=False)), 0 if ON_NUMPY else 1e-12)
    opt = run.strategy.optimizer
    assert type(opt).__name__ == "OffloadAdamW" and opt.totals["steps"] == STEPS
    for st in opt.state.values():  # m and v live in host memory
        assert isinstance(st["exp_avg"], np.ndarray) and isinstance(st["exp_avg_sq"], np.ndarray)


def test_accumulation_and_activation_checkpointing():
    """The block runner the offload wraps is the checkpointing one: both compose."""
    device = dict(grad_accum=2, checkpoint_activations=True)
    run = train_run(cfg(device=device), STEPS)
    assert_equal_runs(run, reference("accum", cfg(offload=False, device=device)), 0 if ON_NUMPY else 1e-12)


def test_overlap_and_no_overlap_are_identical():
    assert_equal_runs(train_run(cfg(overlap=True), STEPS), train_run(cfg(overlap=False), STEPS), 0)


@pytest.mark.parametrize("mp", ["bf16", "fp16"])
def test_mixed_precision_equals_adamw_loosely(mp):
    """float32 master weights under bf16 (and fp16 with loss scaling): near the run without
    offload, equal on NumPy.  On a GPU the host's float32 AdamW and the device's fused kernel
    round differently; a weight one float32 ulp apart may round to another fp16 value, and
    Adam's normalised step amplifies that where a gradient is near eps: an element or two
    ~3e-3 of the largest weight apart (under the emulator), the losses 3e-6."""
    model, device = dict(dtype="float32"), dict(mixed_precision=mp)
    run = train_run(cfg(model=model, device=device), STEPS)
    want = reference(mp, cfg(offload=False, model=model, device=device))
    if ON_NUMPY:
        return assert_equal_runs(run, want, 0)
    for g, w in zip(run.losses, want.losses):
        assert abs(g - w) <= 1e-3 * abs(w), (run.losses, want.losses)
    for name in want.params:
        assert rel(run.params[name], want.params[name]) <= 2e-2, name


def test_overlap_is_real(monkeypatch):
    """With a slow host step, ``step`` returns while the blocks are still being stepped; the
    next forward starts (block 0 after its group) before the last block's group is back, and
    waits for each."""
    from minidist.model.optim import offload
    from minidist.parallel.compose import build

    fast = offload._adamw_chunk

    def slow(task):
        time.sleep(0.02)
        fast(task)

    monkeypatch.setattr(offload, "_adamw_chunk", slow)
    model, strategy = build(cfg())
    opt, seen = strategy.optimizer, []
    opt.threads = 1  # one chunk at a time: each block's group takes 12 x 20 ms

    def spy(plain):
        def run(block, x):
            job = opt._job
            seen.append(None if job is None else job.ready[-1].is_set())
            return plain(block, x)
        return run

    model.use_block_runner(spy)  # outside the offload's runner: sees the state before its wait
    from minidist.state.data import Sampler
    from minidist.train.loop import update

    sampler = Sampler(host.random.default_rng(1).integers(0, 256, 4000).astype(host.uint8), 8, 4, 0)
    for step in range(2):
        opt.lr = 1e-2
        strategy.forward_backward(*sampler.batch(step))
        update(strategy, None, 0.05)
        if step == 0:
            assert opt._job is not None and not opt._job.ready[-1].is_set(), "step waited for every block"
    assert seen[:3] == [None] * 3 and seen[3] is False, seen  # the second forward's block 0: last group pending
    assert opt.totals["wait_s"] > 0


def test_checkpoint_resumes_with_and_without_offload(tmp_path):
    """Saved from an offloaded run after 2 steps, resumed for 2 more with and without offload:
    both equal 4 straight steps (the state's layout is AdamW's)."""
    from minidist.parallel.compose import build
    from minidist.state import checkpoint
    from minidist.state.data import Sampler
    from minidist.model.optim import lr_at
    from minidist.train.loop import update

    corpus = host.random.default_rng(1).integers(0, 256, 4000).astype(host.uint8)

    def steps(strategy, c, lo, hi):
        sampler, o = Sampler(corpus, c.data.seq_len, c.data.batch_size, c.model.seed), c.optim
        for step in range(lo, hi):
            strategy.optimizer.lr = lr_at(step, o.lr, o.warmup, o.steps, o.min_lr)
            strategy.forward_backward(*sampler.batch(step))
            update(strategy, None, o.clip_grad)
        return {k: host.array(to_host(v)) for k, v in strategy.parameters().items()}

    straight = steps(build(cfg())[1], cfg(), 0, STEPS)
    _, first = build(cfg())
    steps(first, cfg(), 0, 2)
    path = checkpoint.save(str(tmp_path), 2, first, cfg().model)
    for offloaded in (True, False):
        c = cfg(offload=offloaded)
        _, again = build(c)
        checkpoint.load(path, again)
        got = steps(again, c, 2, STEPS)
        tol = 0 if ON_NUMPY else 1e-12
        for name, want in straight.items():
            assert (np.array_equal(got[name], want) if tol == 0 else rel(got[name], want) <= tol), (offloaded, name)


@pytest.mark.skipif(ON_NUMPY, reason="device memory: CuPy (or its emulator) only")
def test_the_device_holds_no_optimizer_state():
    """After a step the device pool holds the weights and nothing of AdamW's: m and v (2 x the
    weights' bytes) are what the offload saves."""
    from minidist.parallel.compose import build

    pool = xp.get_default_memory_pool()
    used = {}
    for offloaded in (False, True):
        gc.collect()
        base = pool.used_bytes()
        model, strategy = build(cfg(offload=offloaded))
        train_x = host.random.default_rng(0).integers(0, 256, (4, 8))
        strategy.forward_backward(train_x, train_x)
        strategy.clip_grad_norm(1.0)
        strategy.step()
        strategy.zero_grad()
        strategy.optimizer.wait()
        used[offloaded] = pool.used_bytes() - base
        weights = sum(p.data.nbytes for p in model.parameters())
        del model, strategy
    assert used[False] - used[True] >= 2 * weights, (used, weights)


# -- bad input: one line, exit 2, before any work (every rank) ------------------------------------
TINY = ["--layers", "2", "--d-model", "16", "--heads", "2", "--seq-len", "16", "--batch-size", "4",
        "--peak-gflops", "10", "--eval-batches", "1", "--steps", "2"]


@pytest.mark.parametrize("args, needle", [
    (["--offload", "optimizer", "--optimizer", "sgd"], "--optimizer sgd"),
    (["--no-offload-overlap"], "--no-offload-overlap needs --offload optimizer"),
    (["--offload", "gpu"], "invalid choice: 'gpu'"),
])
def test_bad_input_is_refused(args, needle):
    r = run_train(None, TINY + args)
    assert r.returncode == 2 and needle in r.stderr, (r.returncode, r.stderr)


@pytest.mark.mpi
@pytest.mark.parametrize("args, needle", [(["--zero", "2"], "--zero 2"), (["--hsdp-shard", "2"], "--hsdp-shard 2")])
def test_sharded_optimizers_are_refused_on_every_rank(args, needle):
    r = run_train(2, TINY + ["--offload", "optimizer"] + args)
    assert r.returncode == 2 and needle in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_cli_trains_with_offload():
    r = run_train(None, TINY + ["--offload", "optimizer"])
    assert r.returncode == 0 and "summary" in r.stdout, r.stderr


# -- data and pipeline parallelism under mpiexec ----------------------------------------------------
MESHES = {"dp2": dict(dp=2), "pp2": dict(pp=2, microbatches=2)}


def mpi_body(name):
    """On every rank of 2: dp2 (DDP) or pp2 with offload equal the same mesh without it
    (float64: bit for bit on NumPy, 1e-12 on a GPU) and one process (1e-9, as every mesh in
    test_data_parallel.py: the ranks' gradients are summed in another order)."""
    from minidist import comm

    four = dict(layers=4)  # two stages of two blocks
    single = train_run(cfg(offload=False, model=four), STEPS)  # one process, on each rank (no communication)
    got = train_run(cfg(model=four, **MESHES[name]), STEPS)
    same_mesh = train_run(cfg(offload=False, model=four, **MESHES[name]), STEPS)
    assert_equal_runs(got, same_mesh, 0 if ON_NUMPY else 1e-12)
    for g, w in zip(got.losses, single.losses):
        assert abs(g - w) <= 1e-9 * abs(w), (name, got.losses, single.losses)
    for k, v in got.params.items():  # this rank's stage's parameters
        assert rel(v, single.params[k]) <= 1e-9, (name, k)
    print(f"offload ok: {name} rank {comm.world().rank}", flush=True)


@pytest.mark.mpi
@pytest.mark.parametrize("mesh", list(MESHES))
def test_data_and_pipeline_parallel_equal_one_process(mesh):
    out = run_mpi(2, f"{os.path.abspath(__file__)}::mpi_body", mesh, timeout=240).stdout
    assert out.count(f"offload ok: {mesh}") == 2, out


# -- the CuPy code path on the CPU ------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.skipif(not ON_NUMPY, reason="already on the CuPy backend")
def test_under_the_cupy_emulator():
    """This file's float64 equality (one process, with and without the overlap; dp2 under
    mpiexec) and the device's memory under the CuPy emulator on two emulated GPUs without peer
    access: pinned buffers, the copies on their streams, the worker thread on the rank's GPU,
    the host's NumPy against the fused AdamW kernel.  About 12 s on 2 cores; the file's other
    cases run under the emulator in make test-gpu-emulated."""
    path = os.pathsep.join(p for p in (EMULATOR, ROOT, os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, "MINIDIST_BACKEND": "cupy", "MINIDIST_EMULATED_GPUS": "2",
           "MINIDIST_EMULATED_PEER_ACCESS": "0"}
    tests = "float64 or device_holds or dp2"  # the rest runs under the emulator in make test-gpu-emulated
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", os.path.abspath(__file__),
                        "-k", tests], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and "skipped" not in r.stdout.split("\n")[-2], r.stdout[-2000:]


@pytest.mark.skipif(not ON_NUMPY, reason="the smoke run is NumPy's")
def test_benchmark_smoke(tmp_path):
    """benchmarks/bench_offload.py --cpu-smoke: every variant runs and the losses agree."""
    import json

    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_offload.py"), "--cpu-smoke",
                        "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)})
    assert r.returncode == 0, r.stdout + r.stderr
    result = json.loads((tmp_path / "offload.json").read_text())
    for mode in ("fp32", "bf16"):
        rows = result["modes"][mode]
        assert set(rows) == {"on the GPU", "offload", "offload, no overlap"}, rows
        assert all("error" not in row for row in rows.values()), rows
        assert "host_step_s" in rows["offload"] and result["summary"][mode]["loss_rel_diff"] == 0.0
