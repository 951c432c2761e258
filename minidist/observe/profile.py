"""Measuring a training step: model FLOPs, MFU and peak memory (the timeline: minidist/observe/trace.py).

**MFU** (model FLOPs utilisation; Chowdhery et al. 2022, PaLM, appendix B) is the FLOPs the
model *needs* for a step divided by what the hardware could do in the step's wall time:

    MFU = model_flops_per_step / (step_time * peak_flops)

Model FLOPs count the matrix multiplications of forward and backward (backward costs twice
the forward), attention's score and value products included, and never the recomputation of
activation checkpointing: MFU measures useful work, so recompute lowers it.

The peak FLOP rate: on a GPU the datasheet's dense tensor-core rate for the dtype the matmuls
run in (:data:`GPU_PEAK_TFLOPS`: H100, H200, A100), since that is the ceiling PaLM's MFU and
PyTorch's tools compare against; on a CPU (or an unknown GPU) a GEMM of the model's size
measured on the spot; ``--peak-gflops`` overrides both.

Peak memory on a CPU uses :mod:`tracemalloc`, which sees NumPy's array allocations (NumPy
reports them to it), so the peak of a step is the high-water mark of live arrays during that
step.  It sees no GPU memory: under CuPy the peak is the high-water mark of the bytes CuPy's
memory pool hands out during the step (a memory hook, :class:`PeakMemory`), and
``backend.device_memory()`` gives the device's total.
"""

from __future__ import annotations

import contextlib
import os
import time
import tracemalloc

import numpy as np


def flops_per_token(model, seq_len: int) -> int:
    """Model FLOPs of forward + backward per token of a run's model (a
    ``layout.model.ModelConfig``, GPT-2 or Llama), counting a multiply-add as 2.

    The planner's count of the same model (minidist.plan.model, one copy of the formulas):
    per block the weight matmuls, 2 x (2 C² + 2 C·C_kv + 2 or 3 C·F) (GPT-2: C_kv = C, F = 4C,
    two MLP matrices; Llama: C_kv = K·C/H for grouped-query attention's smaller key and value
    projections, SwiGLU's three matrices of width F); attention's QKᵀ and AV, 2·2·T·C (the full
    T×T scores are computed, so the causal half is counted too); the LM head 2·C·V.  Positions,
    norms, biases and activations are not matmuls and cost no model FLOPs.  Backward is twice
    the forward (PaLM, Chowdhery et al. 2022, appendix B).
    """
    from minidist.plan.model import model_flops_per_token as planned

    return planned(model, seq_len)


def recompute_flops_per_token(model, seq_len: int) -> int:
    """FLOPs per token that activation checkpointing adds: one more forward of every block
    (hardware FLOPs count them, model FLOPs do not; the head is not recomputed)."""
    from minidist.plan.model import recompute_flops_per_token as planned

    return planned(model, seq_len)


def model_flops_per_token(n_layer: int, d_model: int, seq_len: int, vocab_size: int) -> int:
    """:func:`flops_per_token` of a GPT-2 given by its four numbers (the benchmarks' shape):
    per layer 2·12·C² of matmuls and 2·2·T·C of attention forward, the head 2·C·V, x 3."""
    from minidist.layout.model import ModelConfig

    return flops_per_token(ModelConfig(layers=n_layer, d_model=d_model, heads=1, vocab_size=vocab_size), seq_len)


def measure_peak_gflops(d_model: int, tokens: int, dtype="float32", seconds: float = 0.5) -> float:
    """The machine's GEMM rate on a matmul shaped like the model's MLP (tokens x C @ C x 4C)."""
    from minidist.model.backend import synchronize, xp

    rng = np.random.default_rng(0)
    a = xp.asarray(rng.standard_normal((tokens, d_model)), dtype=dtype)
    b = xp.asarray(rng.standard_normal((d_model, 4 * d_model)), dtype=dtype)
    out = xp.empty((tokens, 4 * d_model), dtype=dtype)
    xp.matmul(a, b, out=out)  # warm up (thread pool, caches)
    best, deadline = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        t0 = time.perf_counter()
        xp.matmul(a, b, out=out)
        synchronize()
        best = min(best, time.perf_counter() - t0)
    return 2.0 * tokens * d_model * 4 * d_model / best / 1e9


# Dense (no 2:4 sparsity) peak TFLOP/s per matmul dtype, from NVIDIA's datasheets.  float32
# without TF32 runs on the CUDA cores; "tf32" is float32 with CUPY_TF32=1 (--tf32); float64
# matmuls use the FP64 tensor cores (DMMA).  Matched in order against the device name.
GPU_PEAK_TFLOPS = (
    ("H200", {"float64": 67.0, "float32": 67.0, "tf32": 494.7, "bfloat16": 989.4, "float16": 989.4}),
    ("H100 PCIe", {"float64": 51.2, "float32": 51.2, "tf32": 378.0, "bfloat16": 756.5, "float16": 756.5}),
    ("H100", {"float64": 67.0, "float32": 67.0, "tf32": 494.7, "bfloat16": 989.4, "float16": 989.4}),  # SXM5
    ("A100", {"float64": 19.5, "float32": 19.5, "tf32": 156.0, "bfloat16": 312.0, "float16": 312.0}),
)


def gpu_peak_gflops(device_name: str, dtype: str, tf32: bool = False) -> float | None:
    """The datasheet peak (GFLOP/s) of GPU ``device_name`` for matmuls in ``dtype`` ('float64',
    'float32', 'bfloat16', 'float16'; float32 with ``tf32`` reads the TF32 rate), or None for
    a GPU not in :data:`GPU_PEAK_TFLOPS`."""
    key = "tf32" if dtype == "float32" and tf32 else dtype
    for name, rates in GPU_PEAK_TFLOPS:
        if name.lower() in device_name.lower():
            return rates[key] * 1e3 if key in rates else None
    return None


def peak_gflops(d_model: int, tokens: int, dtype: str, low=None, seconds: float = 1.0) -> tuple[float, str]:
    """(peak GFLOP/s for MFU, where it comes from) for a run with master dtype ``dtype`` and
    autocast dtype ``low`` (None: no mixed precision).

    Under CuPy on a known GPU: the datasheet rate of the dtype the matmuls run in (``low`` if
    given: CuPy runs mixed precision's matmuls in it).  Otherwise a GEMM of the model's size
    measured now (in float32 under mixed precision: NumPy computes its products in float32)."""
    from minidist.model import backend

    info = backend.device_memory()
    if info is not None:
        mm = backend.dtype_name(low) if low is not None else dtype
        rate = gpu_peak_gflops(info["name"], mm, os.environ.get("CUPY_TF32") == "1")
        if rate is not None:
            return rate, f"{info['name']} {mm} datasheet"
    mm = "float32" if low is not None else dtype
    return measure_peak_gflops(d_model, tokens, mm, seconds=seconds), f"measured {mm} GEMM"


class PeakMemory:
    """High-water mark of the memory allocated inside ``with memory.measure():``.

    :mod:`tracemalloc` hooks every allocation, Python objects included, which costs 15-30%
    of a training step of the small models here; so the trainer measures only the steps
    just before it prints (the step's shapes, hence its peak, repeat from step to step).
    """

    def __init__(self):
        self.last_bytes = None

    @contextlib.contextmanager
    def measure(self, enabled: bool = True):
        if not enabled:
            yield
            return
        from minidist.model.backend import BACKEND

        if BACKEND == "cupy":
            with self._measure_pool():
                yield
            return
        started_here = not tracemalloc.is_tracing()
        if started_here:
            tracemalloc.start()
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        try:
            yield
        finally:
            self.last_bytes = tracemalloc.get_traced_memory()[1] - base
            if started_here:
                tracemalloc.stop()


    @contextlib.contextmanager
    def _measure_pool(self):
        """The high-water mark of CuPy's default memory pool's used bytes inside the block,
        above what it held at the start (so, like tracemalloc, what the step allocates).

        CuPy's pool keeps no peak of its own; a MemoryHook sees every allocation the pool
        serves and reads the pool's used bytes after it (a Python call per allocation: cheap
        next to a GPU step, and only on the steps that measure)."""
        import cupy

        pool = cupy.get_default_memory_pool()
        cupy.cuda.Device().synchronize()
        base = pool.used_bytes()
        high = [base]

        class _Peak(cupy.cuda.MemoryHook):
            name = "minidist_peak"

            def malloc_postprocess(self, **kwargs):  # device_id, size, mem_size, mem_ptr, pmem_id
                used = pool.used_bytes()
                if used > high[0]:
                    high[0] = used

        try:
            with _Peak():
                yield
        finally:
            self.last_bytes = high[0] - base
