"""The tensor-core FlashAttention-2 kernels (minidist/model/ops/cuda/flash_mma.py) against float64 attention.

No GPU is needed: the source runs on the CPU under tests/cuda_on_cpu.py, with its CPU form of
the warp's ``mma`` and shuffle (the lanes' registers exchanged between barriers), which checks
the fragment layouts, the online softmax, the masks and the strided layouts.  NVRTC (or nvcc)
compiles the GPU form, inline PTX ``mma.sync`` included, for an H100/H200 (sm_90).
"""

from __future__ import annotations

import numpy as np
import pytest

from minidist.model.backend import BACKEND
from minidist.model.ops.cuda import flash_mma

import cuda_on_cpu  # noqa: E402  (tests/cuda_on_cpu.py)

ml_dtypes = pytest.importorskip("ml_dtypes")
if cuda_on_cpu.compiler() is None:
    pytest.skip("no C++ compiler to run CUDA kernels on the CPU", allow_module_level=True)
on_numpy = pytest.mark.skipif(BACKEND != "numpy", reason="the CPU emulation of the kernels runs on NumPy arrays")
LOW = {"bf16": ml_dtypes.bfloat16, "fp16": np.float16}
# bf16 keeps 8 significant bits, fp16 11: the outputs, P and dS are rounded to them
TOL = {"bf16": 8e-3, "fp16": 1e-3}  # measured: 2-3e-3 and 2-3e-4


def emulated(low: str, head_dim: int) -> dict:
    module = cuda_on_cpu.Module(flash_mma.SOURCE, flash_mma.defines(low, head_dim))
    return {name: (lambda grid, block, args, name=name: module.launch(name, grid, block[0], args))
            for name in flash_mma.KERNELS}


def reference(q, k, v, do, scale, causal):
    """O, L, dQ, dK, dV of softmax(scale q k^T) v in float64; q, k, v, do (B, H, T, D)."""
    q, k, v, do = (a.astype(np.float64) for a in (q, k, v, do))
    s = scale * q @ k.swapaxes(-1, -2)
    if causal:
        s = s + np.triu(np.full(s.shape[-2:], -np.inf), 1)
    m = s.max(-1, keepdims=True)
    lse = m + np.log(np.exp(s - m).sum(-1, keepdims=True))
    p = np.exp(s - lse)
    o = p @ v
    dp = do @ v.swapaxes(-1, -2)
    ds = p * (dp - (do * o).sum(-1, keepdims=True))
    return o, lse[..., 0], scale * ds @ k, scale * ds.swapaxes(-1, -2) @ q, p.swapaxes(-1, -2) @ do


def rel(got, want):
    return np.linalg.norm(got.astype(np.float64) - want) / np.linalg.norm(want)


def poisoned(shape, dtype):
    """An output array full of NaN: an element the kernel fails to write stays NaN."""
    return np.full(shape, np.nan, dtype=np.float32).astype(dtype)


@on_numpy
@pytest.mark.parametrize("low, head_dim, T, causal", [("bf16", 64, 80, True), ("fp16", 64, 70, False),
                                                      ("bf16", 128, 64, True)])
def test_fused_layout_equals_float64_attention(low, head_dim, T, causal):
    """Self-attention on a fused (B, T, 3C) projection, the model's call: O straight into the
    heads' columns of (B, T, C), the gradients into (B, T, 3C).  T not a multiple of the 64-row
    tiles checks the bounds; the causal mask crosses tiles."""
    rng = np.random.default_rng(0)
    B, H, D = 2, 2, head_dim
    C = H * D
    dtype = LOW[low]
    X = rng.standard_normal((B, T, 3 * C)).astype(dtype)
    dO = rng.standard_normal((B, T, C)).astype(dtype)
    scale = 1 / np.sqrt(D)
    kernels = emulated(low, D)
    parts = [flash_mma.Layout.of_fused(X, i, H) for i in range(3)]
    Y = poisoned((B, T, C), dtype)
    out = flash_mma.Layout.of_merged(Y, H)
    lse = flash_mma.forward(*parts, out, B, scale, causal, kernels=kernels)
    dX = poisoned(X.shape, dtype)
    flash_mma.backward(*parts, out, dO, lse, dX, dX, dX, B, scale, causal, kernels=kernels)

    def heads(a, part):  # (B, T, nC) -> (B, H, T, D) of one part
        return a[..., part * C:(part + 1) * C].reshape(B, T, H, D).transpose(0, 2, 1, 3)

    want = reference(heads(X, 0), heads(X, 1), heads(X, 2), heads(dO, 0), scale, causal)
    got = (heads(Y, 0), lse.reshape(B, H, T), heads(dX, 0), heads(dX, 1), heads(dX, 2))
    for name, g, w in zip(("O", "L", "dQ", "dK", "dV"), got, want):
        assert np.isfinite(g.astype(np.float32)).all(), f"{name}: elements not written"
        assert rel(g, w) < TOL[low], (name, rel(g, w))


@on_numpy
def test_split_layout_and_separate_arrays():
    """(B, H, T, D) q, k, v as three arrays, the gradients into three: what attention(q, k, v) passes."""
    rng = np.random.default_rng(1)
    B, H, T, D = 1, 3, 65, 64
    dtype = LOW["bf16"]
    q, k, v, do = (rng.standard_normal((B, H, T, D)).astype(dtype) for _ in range(4))
    kernels = emulated("bf16", D)
    lay = [flash_mma.Layout.of_split(a) for a in (q, k, v)]
    o = poisoned(q.shape, dtype)
    lse = flash_mma.forward(*lay, flash_mma.Layout.of_split(o), B, 0.125, True, kernels=kernels)
    dq, dk, dv = (poisoned(q.shape, dtype) for _ in range(3))
    flash_mma.backward(*lay, flash_mma.Layout.of_split(o), do, lse, dq, dk, dv, B, 0.125, True, kernels=kernels)
    for name, g, w in zip(("O", "L", "dQ", "dK", "dV"), (o, lse.reshape(B, H, T), dq, dk, dv),
                          reference(q, k, v, do, 0.125, True)):
        assert rel(g, w) < TOL["bf16"], (name, rel(g, w))


@on_numpy
def test_the_cpu_form_of_mma_is_the_instruction():
    """The emulated m16n8k16 against a plain product: one warp, A (16 x 16) and B (16 x 8)
    handed over in the documented fragment layouts, the result read back from the lanes'
    accumulators; checks the layout the kernels rely on, apart from any attention."""
    src = flash_mma.SOURCE + r"""
    extern "C" __global__ void one_mma(const E* a, const E* b, float* d) {
        const int lane = threadIdx.x, g = lane >> 2, tg = lane & 3;
        unsigned af[4], bf[2];
        for (int i = 0; i < 4; ++i) {  // A row-major 16 x 16
            const int r = g + 8 * (i & 1), c = 2 * tg + 8 * (i >> 1);
            af[i] = (unsigned)a[r * 16 + c] | ((unsigned)a[r * 16 + c + 1] << 16);
        }
        for (int i = 0; i < 2; ++i) {  // B 16 x 8, stored row-major here
            const int r = 2 * tg + 8 * i;
            bf[i] = (unsigned)b[r * 8 + g] | ((unsigned)b[(r + 1) * 8 + g] << 16);
        }
        float acc[4] = {0.f, 0.f, 0.f, 0.f};
        mma(acc, af, bf);
        for (int e = 0; e < 4; ++e) d[(g + 8 * (e >> 1)) * 8 + 2 * tg + (e & 1)] = acc[e];
    }
    """
    module = cuda_on_cpu.Module(src, flash_mma.defines("bf16", 64))
    rng = np.random.default_rng(2)
    a = rng.standard_normal((16, 16)).astype(LOW["bf16"])
    b = rng.standard_normal((16, 8)).astype(LOW["bf16"])
    d = np.zeros((16, 8), dtype=np.float32)
    module.launch("one_mma", (1, 1), 32, (a, b, d))
    np.testing.assert_allclose(d, a.astype(np.float64) @ b.astype(np.float64), rtol=1e-6, atol=1e-6)


@cuda_on_cpu.needs_cuda_compiler
@pytest.mark.parametrize("low, head_dim", [("bf16", 64), ("fp16", 128)])  # each macro's two values
def test_source_compiles_for_an_h100(tmp_path, low, head_dim):
    """NVRTC (or nvcc) compiles the GPU form, inline mma.sync PTX included, for sm_90."""
    entries = cuda_on_cpu.cuda_entries(flash_mma.SOURCE, flash_mma.defines(low, head_dim), tmp_path)
    assert entries == sorted(flash_mma.KERNELS)


def test_why_not_names_the_reason():
    assert flash_mma.why_not(np.float32, 64) is not None
    if BACKEND == "numpy":
        assert "CuPy" in flash_mma.why_not(LOW["bf16"], 64)


def _low_dtype(low):
    from minidist.model.backend import bfloat16, xp

    return bfloat16 if low == "bf16" else xp.float16


@pytest.mark.skipif(flash_mma.why_not(_low_dtype("fp16"), 64) is not None,
                    reason="the kernels run under MINIDIST_BACKEND=cupy (make test-gpu; or the CuPy emulator)")
@pytest.mark.parametrize("low", ["bf16", "fp16"])
def test_self_attention_through_the_kernels_equals_batched_products(monkeypatch, low):
    """On CuPy (a GPU, or the emulator): ops.self_attention on 16-bit operands of head size 64
    takes the kernels (tuning.fused_attention), and its output and gradient equal the batched
    products' (MINIDIST_FLASH_MMA=off) to 16-bit rounding."""
    from minidist.model import ops
    from minidist.model.autograd import Tensor
    from minidist.model.backend import from_host, to_host
    from minidist.model.ops import tuning
    from minidist.model.ops.precision import cast

    rng = np.random.default_rng(3)
    B, T, H, D = 2, 70, 2, 64
    x = rng.standard_normal((B, T, 3 * H * D)).astype(np.float32)
    g = rng.standard_normal((B, T, H * D)).astype(np.float32)
    dtype = _low_dtype(low)

    def run(setting):
        monkeypatch.setenv("MINIDIST_FLASH_MMA", setting)
        assert tuning.fused_attention(dtype, D) == (setting == "auto")
        t = Tensor(from_host(x).astype(dtype), requires_grad=True)
        y = ops.self_attention(t, H)
        (cast(y, np.float32) * Tensor(from_host(g))).sum().backward()
        return [to_host(y.data).astype(np.float64), to_host(t.grad).astype(np.float64)]

    for name, got, want in zip(("y", "dqkv"), run("auto"), run("off")):
        assert rel(got, want) < 2 * TOL[low], (name, rel(got, want))
