"""The multi-tensor kernels (minidist/model/ops/cuda/multi_tensor.py): one launch for many arrays.

On the CPU the kernel source runs under tests/cuda_on_cpu.py on NumPy arrays (the address
table holds their own addresses) and is compared with the per-array arithmetic; where nvcc
exists it also compiles for an H100.  On CuPy (make test-gpu, or the emulator) AdamW and the
gradient clipping are compared with and without the kernels.
"""

from __future__ import annotations

import numpy as np
import pytest

from minidist.model import backend
from minidist.model.backend import BACKEND
from minidist.model.ops.cuda import multi_tensor as mt
from minidist.model.optim.functional import adamw_hyper, adamw_update

import cuda_on_cpu  # noqa: E402  (tests/cuda_on_cpu.py)

on_numpy = pytest.mark.skipif(BACKEND != "numpy" or cuda_on_cpu.compiler() is None,
                              reason="the CPU emulation of the kernels runs on NumPy arrays, with a C++ compiler")
SIZES = (1, 5, 17, 30)  # with CHUNK 7: arrays of one chunk, of several, and a partial last chunk


def emulated(real: str, chunk: int, threads: int) -> dict:
    module = cuda_on_cpu.Module(mt.SOURCE, {"REAL": real, "CHUNK": f"{chunk}LL", "THREADS": str(threads)})
    return {name: (lambda grid, block, args, name=name: module.launch(name, (grid[0], 1), block[0], args))
            for name in mt.KERNELS}


@pytest.fixture
def small(monkeypatch):
    monkeypatch.setattr(mt, "CHUNK", 7)
    monkeypatch.setattr(mt, "THREADS", 4)
    monkeypatch.setattr(mt, "_tables", {})


def arrays(dtype, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(n).astype(dtype) for n in SIZES]


@on_numpy
@pytest.mark.parametrize("dtype, real", [(np.float64, "double"), (np.float32, "float")])
def test_sum_of_squares_and_scale(small, dtype, real):
    kernels = emulated(real, 7, 4)
    xs = arrays(dtype)
    want = sum(float(np.dot(x.astype(np.float64), x.astype(np.float64))) for x in xs)
    got = mt.sum_of_squares(xs, kernels=kernels)
    assert got.dtype == np.float64 and abs(float(got) - want) <= 1e-14 * want
    before = [x.copy() for x in xs]
    mt.scale(xs, 0.37, kernels=kernels)
    for x, b in zip(xs, before):
        b *= dtype(0.37)
        np.testing.assert_array_equal(x, b)


@on_numpy
@pytest.mark.parametrize("dtype, real, tol", [(np.float64, "double", 1e-15), (np.float32, "float", 1e-6)])
def test_adamw_equals_the_per_array_update(small, dtype, real, tol):
    """Each array with its own step count and decay, as after steps where some grads were None."""
    ps, gs = arrays(dtype, 1), arrays(dtype, 2)
    ms, vs = [0.1 * x for x in arrays(dtype, 3)], [np.abs(x) for x in arrays(dtype, 4)]
    steps, decays = (1, 3, 2, 7), (0.1, 0.0, 0.1, 0.05)
    lr, b1, b2, eps = 3e-3, 0.9, 0.95, 1e-8
    want = [tuple(a.copy() for a in arrs) for arrs in zip(ps, ms, vs)]
    for (p, m, v), g, step, wd in zip(want, gs, steps, decays):
        adamw_update(p, g, m, v, step, lr, b1, b2, eps, wd)
    hyper = [adamw_hyper(step, lr, b1, b2, wd) for step, wd in zip(steps, decays)]
    mt.adamw(ps, gs, ms, vs, hyper, b1, b2, eps, kernels=emulated(real, 7, 4))
    for got, ref in zip(zip(ps, ms, vs), want):
        for name, a, b in zip("pmv", got, ref):
            np.testing.assert_allclose(a, b, rtol=tol, atol=tol, err_msg=name)


@cuda_on_cpu.needs_cuda_compiler
@pytest.mark.parametrize("real", ["float", "double"])
def test_source_compiles_for_an_h100(tmp_path, real):
    defines = {"REAL": real, "CHUNK": f"{mt.CHUNK}LL", "THREADS": mt.THREADS}
    assert cuda_on_cpu.cuda_entries(mt.SOURCE, defines, tmp_path) == sorted(mt.KERNELS)


@pytest.mark.skipif(BACKEND != "cupy", reason="the compiled kernels run under MINIDIST_BACKEND=cupy (make test-gpu)")
def test_training_updates_equal_with_and_without_the_kernels(monkeypatch):
    """Three AdamW steps with clipping on a float64 GPT: the multi-tensor launches give the
    per-array loop's parameters (to round-off: the norm's squares add up in another order)."""
    from minidist.layout.model import ModelConfig
    from minidist.model.nn import GPT
    from minidist.model.optim import AdamW, clip_grad_norm
    from minidist.model.ops import cross_entropy

    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (2, 16))
    out = {}
    for mode in ("auto", "off"):
        monkeypatch.setenv("MINIDIST_CUDA_KERNELS", mode)
        model = GPT(ModelConfig(block_size=16, layers=1, heads=2, d_model=16, dtype="float64"))
        opt = AdamW(model.parameters(), lr=1e-2)
        assert (mt.why_not([p.data for p in opt.params]) is None) == (mode == "auto")
        norms = []
        for _ in range(3):
            loss = cross_entropy(model(backend.from_host(x[:, :-1])), backend.from_host(x[:, 1:]))
            loss.backward()
            norms.append(clip_grad_norm(opt.params, 0.05))
            opt.step()
            opt.zero_grad()
        out[mode] = norms, {k: backend.to_host(v) for k, v in model.state_dict().items()}
    np.testing.assert_allclose(out["auto"][0], out["off"][0], rtol=1e-12)
    for k, v in out["off"][1].items():
        np.testing.assert_allclose(out["auto"][1][k], v, rtol=1e-10, atol=1e-12, err_msg=k)
