"""The one place that decides how the ops run: whole-array, or tuned for a CPU's caches.

**Whole-array** (the textbook form, and what CuPy runs): one matrix product per linear layer,
attention as batched products over every (batch, head) pair at once, each elementwise op one
expression over the whole activation.  On a GPU every array call is a kernel launch, so the
fewer and bigger the calls, the closer a step gets to the matmul rate.

**CPU-tuned** (NumPy's default): the same arithmetic cut to a CPU's measure, because a CPU's
bottleneck is memory traffic and its BLAS threads, not launches:

* elementwise chains (GELU) run block by block so the temporaries stay in the L2 cache;
* LayerNorm normalises chunks of rows, its row means as BLAS matrix-vector products;
* attention runs one batch element (a "slab" of all heads) at a time, its scores cut into
  causal query blocks that skip the masked tiles, the slabs spread over the BLAS threads
  (``blas_threads.parallel_for``), each with a one-thread BLAS.

Both paths compute the same function (``tests/test_ops_paths.py`` checks values and gradients
to float64 round-off).  ``MINIDIST_OPS_PATH`` picks one for the whole process: ``auto`` (the
default) is tuned on NumPy and whole on CuPy; ``whole`` or ``tuned`` force one.  Tests and
benchmarks switch with :func:`use`.  No op decides for itself: each asks :func:`tuned`, and
self-attention also :func:`fused_attention` (tensor-core FlashAttention for 16-bit operands).
"""

from __future__ import annotations

import contextlib

from minidist.host import env
from minidist.model.backend import BACKEND

PATHS = ("whole", "tuned")


def default_path(backend: str = BACKEND, setting: str | None = None) -> str:
    """The path ``setting`` (MINIDIST_OPS_PATH's value; read from the environment when None)
    selects on ``backend``: 'auto' means tuned on NumPy and whole-array on anything else."""
    setting = env.get("MINIDIST_OPS_PATH") if setting is None else setting
    if setting == "auto":
        return "tuned" if backend == "numpy" else "whole"
    if setting not in PATHS:
        raise ValueError(f"unknown ops path {setting!r}; choose from {('auto',) + PATHS}")
    return setting


_state = {"path": default_path()}


def current() -> str:
    """'whole' or 'tuned': how the ops run now."""
    return _state["path"]


def tuned() -> bool:
    """True when the ops take their CPU-tuned path (blocks, row chunks, slabs, BLAS threads)."""
    return _state["path"] == "tuned"


def fused_attention(dtype, head_dim: int) -> bool:
    """Does self-attention run as the tensor-core FlashAttention-2 kernels (``cuda/flash_mma.py``)?
    On the whole-array path with bf16/fp16 operands of head size 64 or 128 on CuPy, unless
    ``MINIDIST_FLASH_MMA=off`` (or ``MINIDIST_CUDA_KERNELS=off``); otherwise batched products."""
    if tuned():
        return False
    from minidist.model.ops.cuda import flash_mma  # the kernels import the backend, not the ops

    return flash_mma.why_not(dtype, head_dim) is None


def set_path(name: str) -> str:
    """Switch every op to path ``name`` ('whole', 'tuned' or 'auto'); returns the previous one."""
    previous = _state["path"]
    _state["path"] = default_path(setting=name)
    return previous


@contextlib.contextmanager
def use(name: str):
    """``with tuning.use("whole"): ...`` runs the block on that path (process-wide, not per
    thread: switch only between steps, never while another thread runs ops)."""
    previous = set_path(name)
    try:
        yield
    finally:
        _state["path"] = previous
