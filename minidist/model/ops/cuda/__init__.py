"""The GPU speed-ups of the ops: minidist's own CUDA kernels, compiled with NVRTC, and
cuBLAS's strided batched GEMM.

Every op is written first as ``xp`` code in ``minidist.model.ops`` (the reference, and all that runs
on NumPy).  The modules here replace pieces of it on CuPy:

* ``gemm``: batched matrix products through ``cublasGemmStridedBatchedEx`` on the arrays' own
  strides (no copies), and float32 products of 16-bit operands.  ``gemm.matmul`` is the ops'
  entry point for every product: on NumPy it is ``xp.matmul``;
* ``softmax``: attention's causal softmax and its gradient, a thread block per row;
* ``flash``: FlashAttention's forward and backward, for blockwise attention;
* ``flash_mma``: FlashAttention-2 on tensor cores (``mma`` instructions) for bf16/fp16
  operands, the attention of a mixed-precision step; ``mma``: the warp's tensor-core product
  and shuffle it uses, with their CPU form;
* ``gelu``, ``layernorm``: GELU and LayerNorm each way in one kernel, reading and writing
  bfloat16 as it is;
* ``scatter``: the embedding's gradient (rows added at repeated indices) summed in index
  order, without atomics, so that it is the same on every run;
* ``multi_tensor``: one launch for the optimizer's update, clipping's norm and scale over
  every parameter;
* ``source``: what the kernels share: whether they can run here, their compilation (CuPy's
  ``RawModule``, NVRTC, once per process and set of macros), bfloat16 loads and stores, the
  row-per-block reductions.

When they run: each kernel module's ``why_not`` says, before every call, why it cannot take
those arrays (None when it can), and the op keeps its ``xp`` form otherwise.  The one switch
behind all of them is ``source.unavailable()``: the kernels run on CuPy only, never with
``MINIDIST_CUDA_KERNELS=off``; ``why_not`` adds each kernel's dtypes and shapes.  cuBLAS's
batched GEMM has its own switch, ``MINIDIST_CUBLAS_BATCHED=off`` (``gemm``).  How the rest of
an op runs, whole-array or CPU-tuned, is ``ops/tuning.py``'s choice; on CuPy it is
whole-array, the path these kernels belong to.

Imports: ``minidist.model.backend`` and ``minidist.host.env``, and one another; never the ops, the
autograd or anything above them, so each kernel is tested alone against its ``xp`` form
(on a CPU through tests/cuda_on_cpu.py).
"""

from __future__ import annotations

from minidist.model.ops.cuda import flash, flash_mma, gelu, gemm, layernorm, mma, multi_tensor, scatter, softmax, source

__all__ = ["flash", "flash_mma", "gelu", "gemm", "layernorm", "mma", "multi_tensor", "scatter", "softmax",
           "source"]
