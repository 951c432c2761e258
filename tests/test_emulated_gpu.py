"""minidist's CuPy code paths on the CPU, under the CuPy emulator in tests/emulated_gpu.

Every run here is a subprocess with ``PYTHONPATH=tests/emulated_gpu MINIDIST_BACKEND=cupy``, so
minidist imports the emulator as ``cupy`` and takes its real CuPy branches (fused kernels,
whole-array ops, pinned staging, the memory-pool peak) with device arrays that refuse implicit
conversion to NumPy and record every device->host transfer.  Checked:

(a) the emulator itself (tests/emulated_gpu/selfcheck.py);
(b) short training runs, one process and 2 ranks, against the NumPy run (1e-9 relative);
(c) that a training step brings nothing to the host except through ``backend.to_host``
    (host_read and the MPI staging go through it): any other read is a synchronisation the
    step does not account for;
(d) ``--attention blockwise``, which on CuPy runs cuda.flash's CUDA kernels (the emulator's
    RawModule compiles them for the CPU with tests/cuda_on_cpu.py) and on NumPy the batched-
    product reference: equal losses check the kernels in training, forward and backward, one
    process and under Ulysses, float64 and float32, and the launch record shows they ran;
(e) two emulated GPUs (``MINIDIST_EMULATED_GPUS=2``): each rank selects the GPU of its
    launcher's local rank, and the async collectives run on comm's progress thread (which, as
    every new thread in CUDA, starts on GPU 0) put their results on the rank's own GPU: no
    array is used on another device than its thread's current one;
(f) with a CUDA-aware MPI (the emulator's stand-in), point-to-point messages between device
    arrays and pp2 training pass the arrays to MPI unstaged, each once its queued work is done.
"""

import json
import os
import re
import sys
from collections import Counter

import pytest

from minidist.train.testing import run_train

pytestmark = pytest.mark.xdist_group(name="emulated_gpu")  # its module fixture runs once, in one worker

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EMULATOR = os.path.join(ROOT, "tests", "emulated_gpu")
TINY = ["--layers", "2", "--d-model", "16", "--heads", "2", "--seq-len", "16", "--batch-size", "4",
        "--peak-gflops", "10", "--eval-batches", "1", "--steps", "3", "--dtype", "float64"]


def emulated_env(**extra):
    path = os.pathsep.join(p for p in (EMULATOR, os.environ.get("PYTHONPATH")) if p)
    return {"PYTHONPATH": path, "MINIDIST_BACKEND": "cupy", **extra}


def test_the_emulator_itself():
    """selfcheck.py with two emulated GPUs (its per-thread device checks need a second)."""
    import subprocess

    r = subprocess.run([sys.executable, os.path.join(EMULATOR, "selfcheck.py")], cwd=ROOT,
                       env={**os.environ, **emulated_env(MINIDIST_EMULATED_GPUS="2")}, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def _losses(path):
    with open(path) as fh:
        rows = [json.loads(line) for line in fh]
    return [r["loss"] for r in rows] + [rows[-1]["val_loss"]]


_numpy_runs = {}


def numpy_run(args, tmp_path_factory):
    """The losses of the one-process NumPy run of TINY + ``args``, run once per module."""
    key = tuple(args)
    if key not in _numpy_runs:
        out = tmp_path_factory.mktemp("numpy") / "m.jsonl"
        r = run_train(None, TINY + list(args) + ["--metrics-jsonl", str(out)], env={"MINIDIST_BACKEND": "numpy"})
        assert r.returncode == 0, r.stderr
        _numpy_runs[key] = _losses(out)
    return _numpy_runs[key]


@pytest.fixture(scope="module")
def numpy_losses(tmp_path_factory):
    return numpy_run([], tmp_path_factory)


_runs = {}


def emulated_run(name, nprocs, args, tmp_path_factory, **env):
    """(losses, the d2h transfers of every rank) of one emulated run, run once per module;
    ``env``: variables for the run (e.g. MINIDIST_EMULATED_GPUS)."""
    if name not in _runs:
        d = tmp_path_factory.mktemp(name)
        log = str(d / "transfers.{pid}.jsonl")
        r = run_train(nprocs, TINY + args + ["--metrics-jsonl", str(d / "m.jsonl")],
                      env=emulated_env(MINIDIST_EMULATED_TRANSFER_LOG=log, **env))
        transfers, launches, ranks = [], [], []
        for f in sorted(d.glob("transfers.*.jsonl")):
            with open(f) as fh:
                events = list(map(json.loads, fh))
            transfers += [t for t in events if t["direction"] == "d2h"]
            launches.append(Counter(t["kind"] for t in events if t["direction"] == "launch"))
            ranks.append(events)
        rows = [] if r.returncode else [json.loads(line) for line in open(d / "m.jsonl")]
        _runs[name] = (r, None if r.returncode else _losses(d / "m.jsonl"), transfers, launches, rows, ranks)
    r, losses, transfers = _runs[name][:3]
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return losses, transfers


def kernel_launches(name):
    """The RawKernel launches of an emulated run, one Counter {'RawKernel:NAME': n} per rank."""
    return _runs[name][3]


# One process and one run per parallel axis on 2 ranks.  (Before the reads were fixed, every
# 2-rank run read the device outside to_host: scalar collectives on device arrays, a boolean-
# mask index in the vocabulary-parallel loss; the check below is what found them.)
RUNS = [
    ("single", None, []),
    ("dp2_zero3", 2, ["--dp", "2", "--zero", "3"]),
    ("tp2", 2, ["--tp", "2"]),
    ("pp2", 2, ["--pp", "2"]),
    ("cp2_ring", 2, ["--cp", "2", "--cp-impl", "ring"]),
    ("cp2_ulysses", 2, ["--cp", "2", "--cp-impl", "ulysses"]),
]


@pytest.mark.parametrize("name, nprocs, args", RUNS, ids=[r[0] for r in RUNS])
def test_emulated_gpu_training_equals_numpy(name, nprocs, args, numpy_losses, tmp_path_factory):
    losses, _ = emulated_run(name, nprocs, args, tmp_path_factory)
    assert len(losses) == len(numpy_losses)
    for got, want in zip(losses, numpy_losses):
        assert abs(got - want) <= 1e-9 * abs(want), (name, losses, numpy_losses)


def _in_step(t):
    return any(fn.endswith(os.path.join("minidist", "train", "loop.py")) and f == "_one_step" for fn, _, f in t["stack"])


def _through_to_host(t):
    return any(fn.endswith(os.path.join("minidist", "model", "backend.py")) and f == "to_host" for fn, _, f in t["stack"])


@pytest.mark.parametrize("name, nprocs, args", RUNS, ids=[r[0] for r in RUNS])
def test_a_step_reads_the_device_only_through_to_host(name, nprocs, args, tmp_path_factory):
    _, transfers = emulated_run(name, nprocs, args, tmp_path_factory)
    step = [t for t in transfers if _in_step(t)]
    assert any(_through_to_host(t) for t in step), "no transfer recorded in a step: is the emulator in use?"
    hidden = sorted({f"{t['kind']} at {t['site']}" for t in step if not _through_to_host(t)})
    assert not hidden, "device->host reads in a step outside backend.to_host:\n" + "\n".join(hidden)


@pytest.mark.parametrize("name, nprocs, args", RUNS, ids=[r[0] for r in RUNS])
def test_a_step_reads_only_the_scalars_its_algorithm_needs(name, nprocs, args, tmp_path_factory):
    """The counted reads (backend.host_read) of each step: the loss once (none on a pipeline
    rank before the last stage) and the clipping norm; no index-range read, since the batch's
    indices are checked on the host before they move (ops.basic.check_index)."""
    emulated_run(name, nprocs, args, tmp_path_factory)
    rows = _runs[name][4]
    assert rows
    for row in rows:
        reads = row["host_reads"]
        assert set(reads) <= {"loss", "gradient norm"}, reads
        assert reads.get("loss", 0) == (0 if name == "pp2" else 1) and reads.get("gradient norm", 0) <= 1, reads


# --attention blockwise: cuda.flash's kernels under the emulator (head size 8 here, within
# cuda.flash.MAX_HEAD_DIM), blockwise.py's batched products on NumPy.  Ulysses' inner attention is
# the blockwise op, on all heads' share of each rank.  float32: the kernels and the reference sum
# in different orders, so the losses agree to float32's rounding, not bit for bit.
BLOCKWISE = ["--attention", "blockwise"]
KERNEL_RUNS = [
    ("blockwise", None, BLOCKWISE, "float64", 1e-9),
    ("cp2_ulysses_blockwise", 2, ["--cp", "2", "--cp-impl", "ulysses"] + BLOCKWISE, "float64", 1e-9),
    ("blockwise_float32", None, BLOCKWISE, "float32", 1e-5),
]


def _needs_a_compiler():
    import cuda_on_cpu  # tests/cuda_on_cpu.py, which the emulated RawModule compiles with

    if cuda_on_cpu.compiler() is None:
        pytest.skip("no C++ compiler to run the CUDA kernels on the CPU")


@pytest.mark.parametrize("name, nprocs, args, dtype, rtol", KERNEL_RUNS, ids=[r[0] for r in KERNEL_RUNS])
def test_flash_kernels_train_as_the_numpy_reference(name, nprocs, args, dtype, rtol, tmp_path_factory):
    _needs_a_compiler()
    losses, _ = emulated_run(name, nprocs, args + ["--dtype", dtype], tmp_path_factory)  # last --dtype wins
    want = numpy_run(BLOCKWISE + ["--dtype", dtype], tmp_path_factory)
    launches = kernel_launches(name)
    assert len(launches) == (nprocs or 1)
    for rank in launches:  # forward in every step and the evaluation, backward in every step
        assert rank["RawKernel:flash_forward"] > rank["RawKernel:flash_backward_dq"] > 0, launches
        assert rank["RawKernel:flash_backward_dq"] == rank["RawKernel:flash_backward_dkdv"], launches
    assert len(losses) == len(want)
    for got, ref in zip(losses, want):
        assert abs(got - ref) <= rtol * abs(ref), (name, losses, want)


def test_the_flash_kernels_read_nothing_back_in_a_step(tmp_path_factory):
    """The kernels' wrappers (cuda.flash.forward/backward) keep everything on the device."""
    _needs_a_compiler()
    _, transfers = emulated_run("blockwise", None, BLOCKWISE + ["--dtype", "float64"], tmp_path_factory)
    step = [t for t in transfers if _in_step(t)]
    assert any(_through_to_host(t) for t in step), "no transfer recorded in a step: is the emulator in use?"
    hidden = sorted({f"{t['kind']} at {t['site']}" for t in step if not _through_to_host(t)})
    assert not hidden, "device->host reads in a step outside backend.to_host:\n" + "\n".join(hidden)


def test_the_timeline_shows_every_copy_between_host_and_device(tmp_path):
    """--trace on 2 ranks: the gradient all-reduce's staging through host memory, the batch's
    move to the device and the step's host reads are spans of every rank (on NumPy there are
    none: nothing moves)."""
    trace = tmp_path / "trace.json"
    r = run_train(2, TINY + ["--dp", "2", "--trace", str(trace)], env=emulated_env())
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    events = json.loads(trace.read_text())["traceEvents"]
    for pid in {e["pid"] for e in events if e.get("ph") == "X"}:
        kinds = Counter(e["name"] for e in events if e.get("pid") == pid and e.get("cat") in ("staging", "sync"))
        assert kinds["to_host"] and kinds["from_host"] and kinds["host read"], (pid, kinds)
        assert all(e["args"]["bytes"] > 0 for e in events if e.get("pid") == pid and e.get("cat") == "staging")


# (e) Two GPUs: rank 1 computes on GPU 1.  The async collectives (on the group's progress
# thread, which starts on GPU 0) are DDP's bucket all-reduces overlapped with backward, ZeRO-3's
# parameter prefetch and gradient reduce-scatters, ring attention's K/V ppermutes, and the
# collective matmuls' ring steps (--tp-async), whose ppermute results land on the device from
# the progress thread itself: the run that shows a result put on the wrong GPU (comm/launch.py).
TWO_GPUS = [
    ("gpus2_dp2", ["--dp", "2"]),
    ("gpus2_dp2_zero3", ["--dp", "2", "--zero", "3"]),
    ("gpus2_cp2_ring", ["--cp", "2", "--cp-impl", "ring"]),
    ("gpus2_tp2_async", ["--tp", "2", "--tp-async", "ring"]),
]


@pytest.mark.parametrize("name, args", TWO_GPUS, ids=[r[0] for r in TWO_GPUS])
def test_two_gpus_each_rank_on_its_own_and_nothing_crosses(name, args, numpy_losses, tmp_path_factory):
    from minidist.model.backend import LOCAL_RANK_VARIABLES

    losses, _ = emulated_run(name, 2, args, tmp_path_factory, MINIDIST_EMULATED_GPUS="2")
    for got, want in zip(losses, numpy_losses, strict=True):
        assert abs(got - want) <= 1e-9 * abs(want), (name, losses, numpy_losses)
    ranks = _runs[name][5]
    crossing = sorted({f"{t['kind']} at {t['site']}" for events in ranks for t in events
                       if t["direction"] == "cross-device"})
    assert not crossing, "arrays used on another GPU than their thread's current one:\n" + "\n".join(crossing)
    summaries = [events[-1] for events in ranks]
    assert len(summaries) == 2 and all(s["direction"] == "summary" for s in summaries)
    # the launcher says each rank's local rank, and the rank's main thread is on that GPU
    for s in summaries:
        (variable, value), = s["local_rank_env"].items()
        assert variable in LOCAL_RANK_VARIABLES and s["device_count"] == 2, s
        assert s["device"] == int(value) and s["allocated_devices"] == [s["device"]], s
    assert sorted(s["device"] for s in summaries) == [0, 1]


# (f) A CUDA-aware MPI (MINIDIST_CUDA_AWARE_MPI=1): the point-to-point calls hand device arrays
# to MPI as they are.  The emulator's stand-in (MINIDIST_EMULATED_CUDA_AWARE_MPI=1) lets MPI
# read and write the arrays' memory, and refuses an array while its thread has device work
# queued: MPI works outside the stream's order, so a send must wait for the kernels that wrote
# the array (and for the copy that makes a strided view contiguous), and a receive for those
# that still read memory the pool may reuse for it -- races on a GPU, errors here.
P2P_BODIES = os.path.join(os.path.dirname(__file__), "mpi", "comm_p2p_bodies.py")


@pytest.mark.parametrize("aware", [True, False], ids=["cuda-aware", "staged"])
def test_point_to_point_between_device_arrays(aware):
    from minidist.train.testing import run_mpi

    flag = "1" if aware else "0"
    env = emulated_env(MINIDIST_CUDA_AWARE_MPI=flag, MINIDIST_EMULATED_CUDA_AWARE_MPI=flag)
    out = run_mpi(2, f"{P2P_BODIES}::device_p2p", timeout=90, env=env).stdout
    counts = sorted(int(n) for n in re.findall(r"rank \d+: (\d+) staged device->host copies", out))
    assert len(counts) == 2, out
    # staged: every send copies to the host (2 steps x 4 sends); CUDA-aware: none
    assert counts == ([0, 0] if aware else [8, 8]), out


def test_pipeline_training_with_a_cuda_aware_mpi(numpy_losses, tmp_path_factory):
    """pp2, whose activations and gradients travel by point-to-point messages, trains as the
    NumPy run with the messages passed as device arrays, and they are not staged: the step's
    device->host copies are the scalar collectives' and the counted reads."""
    env = dict(MINIDIST_CUDA_AWARE_MPI="1", MINIDIST_EMULATED_CUDA_AWARE_MPI="1", MINIDIST_EMULATED_GPUS="2")
    losses, transfers = emulated_run("pp2_cuda_aware", 2, ["--pp", "2"], tmp_path_factory, **env)
    for got, want in zip(losses, numpy_losses, strict=True):
        assert abs(got - want) <= 1e-9 * abs(want), (losses, numpy_losses)
    _, staged_transfers = emulated_run("pp2", 2, ["--pp", "2"], tmp_path_factory)
    p2p = os.path.join("comm", "p2p", "__init__.py")

    def through_p2p(ts):
        return [t for t in ts if _in_step(t) and any(f.endswith(p2p) for f, _, _ in t["stack"])]
    assert through_p2p(staged_transfers), "the staged pp2 run sent nothing through p2p: is the check blind?"
    assert not through_p2p(transfers)
