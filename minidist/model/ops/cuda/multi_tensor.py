"""Multi-tensor kernels: one launch applies the same elementwise work to many arrays.

A step ends with the same small computation on every parameter: the squares of its gradient
for the clipping norm, the gradient scaled by the clipping factor, the AdamW update.  Done
array by array that is a few kernel launches per parameter (GPT-2 small has about 150), and
on a GPU each launch costs microseconds of Python and CuPy on the CPU, more than the
arithmetic of a small array: the update of a step measured 739 launches and 20 ms on an H100
against PyTorch's ~1 ms.  The remedy is NVIDIA Apex's ``multi_tensor_apply`` (PyTorch's
``_foreach`` ops and ``AdamW(fused=True)``): the arrays' addresses go to the device as one
table, and each thread block of ONE launch takes a chunk of CHUNK elements of one array.

* ``sum_squares``: each block's partial sum of squares (float64, as ``optim.clip``), then one
  sum over the partials;
* ``scale``: every element times a factor (gradient clipping);
* ``adamw``: the update of ``ops.fused.adamw_kernel`` (the same lines, in the parameter's
  dtype; the GPU compiler may fuse a multiply and an add differently), with each array's own
  decay and bias corrections (parameters skipped in an earlier step have their own step
  counts).

The arrays must be C-contiguous and of one dtype, float32 or float64; otherwise, or with
``MINIDIST_CUDA_KERNELS=off``, the callers keep their per-array loop.  The source is tested
on the CPU through tests/cuda_on_cpu.py (tests/test_multi_tensor_kernel.py), where the
addresses are the host arrays' own.
"""

from __future__ import annotations

from minidist.model.backend import current_device, host, xp
from minidist.model.ops.cuda import source

CHUNK = 1 << 16  # elements per thread block
THREADS = 256

SOURCE = r"""
// REAL: float or double.  A launch has one block per chunk: block b works on elements
// [start[b], start[b] + CHUNK) of array tensor[b] (fewer at the array's end).  ptrs holds the
// arrays' device addresses, sizes their lengths.
__device__ __forceinline__ long long chunk_end(long long lo, long long size) {
    return lo + CHUNK < size ? lo + CHUNK : size;
}

extern "C" __global__ void sum_squares(const unsigned long long* ptrs, const long long* sizes, const int* tensor,
                                       const long long* start, double* partial) {
    __shared__ double part[THREADS];
    const int b = blockIdx.x, t = tensor[b];
    const REAL* x = (const REAL*)ptrs[t];
    double acc = 0;
    for (long long i = start[b] + threadIdx.x; i < chunk_end(start[b], sizes[t]); i += blockDim.x) {
        double v = (double)x[i];
        acc += v * v;
    }
    part[threadIdx.x] = acc;
    __syncthreads();
    for (int half = blockDim.x / 2; half > 0; half /= 2) {
        if (threadIdx.x < half) part[threadIdx.x] += part[threadIdx.x + half];
        __syncthreads();
    }
    if (threadIdx.x == 0) partial[b] = part[0];
}

extern "C" __global__ void scale(const unsigned long long* ptrs, const long long* sizes, const int* tensor,
                                 const long long* start, REAL factor) {
    const int b = blockIdx.x, t = tensor[b];
    REAL* x = (REAL*)ptrs[t];
    for (long long i = start[b] + threadIdx.x; i < chunk_end(start[b], sizes[t]); i += blockDim.x) x[i] *= factor;
}

// ptrs: n parameters, then their n gradients, n first and n second moments.  hyper: per
// array decay (1 - lr * wd), 1 / sqrt(bias correction 2) and step size (lr / bias correction 1).
extern "C" __global__ void adamw(const unsigned long long* ptrs, const long long* sizes, const int* tensor,
                                 const long long* start, int n, const REAL* hyper, REAL beta1, REAL beta2, REAL eps) {
    const int b = blockIdx.x, t = tensor[b];
    REAL* p = (REAL*)ptrs[t];
    const REAL* g = (const REAL*)ptrs[n + t];
    REAL* m = (REAL*)ptrs[2 * n + t];
    REAL* v = (REAL*)ptrs[3 * n + t];
    const REAL decay = hyper[t], inv_sqrt_bc2 = hyper[n + t], step_size = hyper[2 * n + t];
    for (long long i = start[b] + threadIdx.x; i < chunk_end(start[b], sizes[t]); i += blockDim.x) {
        REAL pi = p[i] * decay, gi = g[i];
        REAL mi = m[i] + (gi - m[i]) * (1 - beta1);
        REAL vi = v[i] * beta2 + gi * gi * (1 - beta2);
        p[i] = pi - step_size * (mi / (sqrt(vi) * inv_sqrt_bc2 + eps));
        m[i] = mi;
        v[i] = vi;
    }
}
"""

KERNELS = ("sum_squares", "scale", "adamw")


def why_not(arrays) -> str | None:
    """Why these arrays do not go through one launch here (None when they do)."""
    if (reason := source.unavailable()) is not None:
        return reason
    if not arrays:
        return "no arrays"
    dtypes = {a.dtype for a in arrays}
    if len(dtypes) != 1 or dtypes.pop() not in (xp.float32, xp.float64):
        return f"arrays of dtypes {sorted(str(a.dtype) for a in arrays)} (one of float32, float64 needed)"
    if not all(a.flags.c_contiguous and isinstance(a, xp.ndarray) for a in arrays):
        return "an array that is not C-contiguous"
    return None


_tables: dict = {}


def compiled(real: str) -> dict:
    """The kernels for ``real`` ('float' or 'double') by name, compiled once (CuPy RawModule)."""
    return source.compiled(SOURCE, {"REAL": real, "CHUNK": f"{CHUNK}LL", "THREADS": THREADS}, KERNELS)


def _chunks(sizes: tuple):
    """(sizes, tensor, start, number of chunks) on this thread's device for arrays of these
    sizes (cached: the same parameters come back every step)."""
    key = (sizes, current_device())
    if key not in _tables:
        tensor = [i for i, n in enumerate(sizes) for _ in range(0, n, CHUNK)]
        start = [s for n in sizes for s in range(0, n, CHUNK)]
        _tables[key] = (xp.asarray(host.array(sizes, dtype=host.int64)), xp.asarray(host.array(tensor, dtype=host.int32)),
                        xp.asarray(host.array(start, dtype=host.int64)), len(tensor))
    return _tables[key]


def _address(a) -> int:
    """Where ``a``'s first element lies: a CuPy array's device address (a NumPy array's own
    address in the CPU tests, where the kernels run as host code)."""
    return a.data.ptr if hasattr(a.data, "ptr") else a.ctypes.data


def _addresses(*groups):
    """The addresses of the arrays of every group, in order, as one device table."""
    return xp.asarray(host.array([_address(a) for g in groups for a in g], dtype=host.uint64))


def _launch(kernels, name, arrays, addresses, *args):
    """Kernel ``name`` over the chunks of ``arrays``: (addresses, sizes, tensor, start, *args)."""
    sizes, tensor, start, n_chunks = _chunks(tuple(int(a.size) for a in arrays))
    if n_chunks:
        kernels[name]((n_chunks,), (THREADS,), (addresses, sizes, tensor, start) + args)


def _kernels(arrays, kernels):
    return kernels or compiled(source.real(arrays[0].dtype))


def sum_of_squares(arrays, kernels=None):
    """The sum of the squares of every element of ``arrays``, in float64, as a 0-d device array."""
    kernels = _kernels(arrays, kernels)
    partial = xp.zeros(max(_chunks(tuple(int(a.size) for a in arrays))[3], 1), dtype=xp.float64)
    _launch(kernels, "sum_squares", arrays, _addresses(arrays), partial)
    return partial.sum()


def scale(arrays, factor: float, kernels=None):
    """Every array multiplied by ``factor``, in place."""
    _launch(_kernels(arrays, kernels), "scale", arrays, _addresses(arrays), arrays[0].dtype.type(factor))


def adamw(params, grads, exp_avgs, exp_avg_sqs, hyper, beta1, beta2, eps, kernels=None):
    """AdamW on every (p, g, m, v), in place.  ``hyper``: per array (decay, 1/sqrt(bias
    correction 2), step size), as ``ops.fused.adamw_kernel`` takes them."""
    kernels = _kernels(params, kernels)
    t = params[0].dtype.type
    n = len(params)
    table = host.array([h[i] for i in range(3) for h in hyper], dtype=params[0].dtype)
    _launch(kernels, "adamw", params, _addresses(params, grads, exp_avgs, exp_avg_sqs), xp.int32(n),
            xp.asarray(table), t(beta1), t(beta2), t(eps))
