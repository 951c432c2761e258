"""The backend switch: CuPy's absence said in one line naming both wheels, ``make test-gpu``
skipping cleanly where there is no GPU, each rank's GPU from its node-local rank, the GPU
peak table for MFU, and the ops path the backend picks.  Runs on any machine; the parts
that need CuPy or its absence skip where they do not apply."""
import os
import subprocess
import sys

import pytest

from minidist.model import backend
from minidist.observe import profile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NO_GPU = backend.gpu_unavailable_reason()
TINY = ["--steps", "1", "--layers", "1", "--d-model", "16", "--heads", "2", "--seq-len", "8",
        "--batch-size", "2", "--eval-every", "0", "--quiet"]


def _train(*args, env=None):
    e = dict(os.environ, **(env or {}))
    return subprocess.run([sys.executable, "-m", "minidist.train", *args], cwd=ROOT, env=e,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(NO_GPU is None, reason="CuPy and a GPU are present here")
def test_missing_cupy_is_one_line_naming_both_wheels():
    r = _train("--backend", "cupy", *TINY)
    assert r.returncode == 2, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert "cupy-cuda12x" in last and "cupy-cuda13x" in last and "Traceback" not in r.stderr
    # the same through the environment variable
    r = _train(*TINY, env={"MINIDIST_BACKEND": "cupy"})
    assert r.returncode == 2 and "cupy-cuda13x" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.skipif(NO_GPU is None, reason="CuPy and a GPU are present here: make test-gpu runs for real")
def test_make_test_gpu_skips_in_one_line_without_a_gpu():
    r = subprocess.run(["make", "--no-print-directory", "-o", ".venv/.installed", "test-gpu",
                        f"BIN={os.path.dirname(sys.executable)}"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("make test-gpu: skipped") and "cupy-cuda12x" in lines[0]


def test_bad_ops_path_is_one_line():
    r = _train(*TINY, env={"MINIDIST_OPS_PATH": "fast"})
    assert r.returncode == 2 and "MINIDIST_OPS_PATH='fast'" in r.stderr and "Traceback" not in r.stderr


def test_tf32_on_numpy_says_it_has_no_effect():
    if backend.BACKEND != "numpy":
        pytest.skip("the note is for the numpy backend")
    r = _train("--tf32", *TINY)
    assert r.returncode == 0, r.stderr
    assert "--tf32 has no effect on the numpy backend" in r.stderr


def test_each_rank_picks_its_gpu_from_its_node_local_rank():
    assert backend.local_rank({}) == 0
    assert backend.local_rank({"MPI_LOCALRANKID": "3"}) == 3  # MPICH (Hydra)
    assert backend.local_rank({"OMPI_COMM_WORLD_LOCAL_RANK": "1"}) == 1  # Open MPI
    assert backend.local_rank({"SLURM_LOCALID": "2", "PMI_RANK": "9"}) == 2
    assert [backend.device_for(r, 2) for r in range(4)] == [0, 1, 0, 1]  # ranks share GPUs
    assert backend.device_for(1, 1) == 0
    with pytest.raises(ValueError, match="no CUDA device"):
        backend.device_for(0, 0)


def test_local_rank_under_mpiexec():
    code = "from minidist.model.backend import local_rank; print(local_rank())"
    r = subprocess.run(["mpiexec", "-n", "2", sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                       text=True, timeout=60, env=dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep
                                                        + os.environ["PATH"]))
    assert r.returncode == 0, r.stderr
    # One digit per rank; mpiexec may interleave the two ranks' lines ("01\n\n"), so read digits.
    assert sorted("".join(r.stdout.split())) == ["0", "1"]


def test_gpu_peak_table():
    assert profile.gpu_peak_gflops("NVIDIA H100 80GB HBM3", "bfloat16") == 989.4e3
    assert profile.gpu_peak_gflops("NVIDIA H100 80GB HBM3", "float32") == 67e3
    assert profile.gpu_peak_gflops("NVIDIA H100 80GB HBM3", "float32", tf32=True) == 494.7e3
    assert profile.gpu_peak_gflops("NVIDIA H100 PCIe", "float16") == 756.5e3
    assert profile.gpu_peak_gflops("NVIDIA H200", "float64") == 67e3
    assert profile.gpu_peak_gflops("NVIDIA A100-SXM4-80GB", "bfloat16") == 312e3
    assert profile.gpu_peak_gflops("Tesla T4", "float32") is None  # unknown: measured instead


def test_peak_for_mfu_on_numpy_is_a_measured_gemm():
    if backend.BACKEND != "numpy":
        pytest.skip("numpy backend")
    rate, source = profile.peak_gflops(32, 64, "float32", low=backend.bfloat16, seconds=0.05)
    assert rate > 0 and source == "measured float32 GEMM"


def test_to_host_and_back():
    import numpy as np

    a = backend.from_host(np.arange(6.0).reshape(2, 3))
    h = backend.to_host(a[:, 1:])  # a strided view
    assert isinstance(h, np.ndarray) and h.tolist() == [[1.0, 2.0], [4.0, 5.0]]
    assert backend.on_device(a) == (backend.BACKEND == "cupy")


@pytest.mark.skipif(NO_GPU is None, reason="a GPU is present: bench_gpu.py measures for real")
def test_bench_gpu_skips_with_its_reason(tmp_path):
    import json

    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_gpu.py"), "--out", str(tmp_path)],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("bench_gpu.py: skipped: ")
    result = json.loads((tmp_path / "gpu.json").read_text())
    assert result["skipped"] and "title" in result


def test_bench_gpu_runs_its_modes_and_profiles_on_the_cpu(tmp_path):
    """The script's own check (--cpu-smoke): every mode times both frameworks on a tiny GPT and,
    with --profile, tables what one step of each runs (on a GPU: the kernels, by time)."""
    import json

    pytest.importorskip("torch")
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_gpu.py"), "--cpu-smoke", "--no-parallel",
                        "--profile", "--steps", "1", "--out", str(tmp_path)],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    modes = json.loads((tmp_path / "gpu.json").read_text())["modes"]
    assert set(modes) == {"fp32", "bf16", "bf16 batched", "fp32 whole", "fp32 flash", "bf16 flash"}
    for mode, m in modes.items():
        assert "error" not in m, (mode, m)
        assert m["ratio"] > 0 and m["minidist"]["first_loss"] > 0
        table = m["torch"]["kernels"]
        assert table["launches"] > 0 and table["top"][0]["ms"] > 0, mode
        assert "kernel_ms" in m["minidist"]["kernels"]
        fb = m["minidist"]["forward_backward"]
        assert fb["issue_ms"] > 0 and fb["wait_ms"] >= 0


def test_bench_gpu_names_a_mode_it_does_not_have():
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_gpu.py"), "--modes", "fp32,bf61"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--modes 'fp32,bf61': 'bf61' is not a mode" in r.stderr, r.stderr
    assert "fp32, bf16, bf16 batched, fp32 whole, fp32 flash, bf16 flash" in r.stderr


def test_the_summary_names_the_gpu_and_its_memory(monkeypatch):
    """On a GPU the summary gains a 'device' row (the name, total memory, what the pool holds);
    on NumPy it has none."""
    from minidist.model import backend
    from minidist.train import report

    if backend.BACKEND == "numpy":
        assert report._device_rows() == []
    monkeypatch.setattr(backend, "device_memory", lambda: {"device": 1, "name": "NVIDIA H100 80GB HBM3",
                                                           "total_bytes": 80 * 2**30, "pool_used_bytes": 3 * 2**20})
    (row,) = report._device_rows()
    assert row == ("device", "GPU 1: NVIDIA H100 80GB HBM3, 80.0 GiB; CuPy's memory pool holds 3 MiB at the end")


@pytest.mark.parametrize("extra, want", [
    ([], {"loss": 1}),
    (["--clip-grad", "1"], {"loss": 1, "gradient norm": 1}),
    (["--mixed-precision", "fp16", "--clip-grad", "1"], {"loss": 1, "gradient norm": 1, "overflow check": 1}),
])
def test_each_step_counts_the_values_it_brings_to_the_host(tmp_path, extra, want):
    """Every value a step reads on the host (a synchronisation on a GPU) goes through
    backend.host_read and is counted in the step's record: per step the loss (the microbatches'
    losses add up on the device), the gradient norm when clipping and the overflow check with
    loss scaling; nothing else.  The batch's indices are checked on the host, before they move
    (that they are never read back from a device is checked under the CuPy emulator,
    tests/test_emulated_gpu.py)."""
    import json

    from minidist.train.testing import run_train

    metrics = tmp_path / "m.jsonl"
    r = run_train(None, ["--layers", "1", "--d-model", "16", "--heads", "2", "--seq-len", "16", "--batch-size", "4",
                         "--grad-accum", "2", "--steps", "2", "--eval-every", "0", "--clip-grad", "0", "--quiet",
                         "--metrics-jsonl", str(metrics), *extra], timeout=120)
    assert r.returncode == 0, r.stderr
    rows = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert [row["host_reads"] for row in rows] == [want, want]
