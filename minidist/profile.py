"""Measuring a training step: model FLOPs, MFU, peak memory and a Chrome/Perfetto trace.

**MFU** (model FLOPs utilisation; Chowdhery et al. 2022, PaLM, appendix B) is the FLOPs the
model *needs* for a step divided by what the hardware could do in the step's wall time:

    MFU = model_flops_per_step / (step_time * peak_flops)

Model FLOPs count the matrix multiplications of forward and backward (backward costs twice
the forward), attention's score and value products included, and never the recomputation of
activation checkpointing: MFU measures useful work, so recompute lowers it.

Peak memory uses :mod:`tracemalloc`, which sees NumPy's array allocations (NumPy reports
them to it), so the peak of a step is the high-water mark of live arrays during that step.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import tracemalloc

import numpy as np


def model_flops_per_token(n_layer: int, d_model: int, seq_len: int, vocab_size: int) -> int:
    """Matmul FLOPs of forward + backward per token of a GPT (counting a multiply-add as 2).

    Per layer the forward does QKV (3C²), the output projection (C²) and the MLP (8C²)
    matmuls: 2·12·C² FLOPs per token; attention adds QKᵀ and AV, 2·2·T·C per token (the full
    T×T scores are computed, so the causal half is counted too).  The LM head adds 2·C·V.
    Backward is twice the forward.
    """
    forward = n_layer * (24 * d_model * d_model + 4 * seq_len * d_model) + 2 * d_model * vocab_size
    return 3 * forward


def measure_peak_gflops(d_model: int, tokens: int, dtype="float32", seconds: float = 0.5) -> float:
    """The machine's GEMM rate on a matmul shaped like the model's MLP (tokens x C @ C x 4C)."""
    from .backend import synchronize, xp

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


class Tracer:
    """Records named spans as Chrome trace events (open the JSON in Perfetto or chrome://tracing)."""

    def __init__(self, rank: int = 0, enabled: bool = True):
        self.rank, self.enabled, self.events = rank, enabled, []
        self._t0 = time.perf_counter()

    @contextlib.contextmanager
    def span(self, name: str, **args):
        if not self.enabled:
            yield
            return
        start = time.perf_counter()
        try:
            yield
        finally:
            end = time.perf_counter()
            self.events.append({"name": name, "ph": "X", "pid": self.rank, "tid": 0,
                                "ts": (start - self._t0) * 1e6, "dur": (end - start) * 1e6,
                                "args": args})

    def save(self, path: str):
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump({"traceEvents": self.events, "displayTimeUnit": "ms"}, f)
        os.replace(tmp, path)  # atomic: a reader never sees half a file
