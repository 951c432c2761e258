"""Checks of the CuPy emulator itself; run as a script with the emulator first on the path and
MINIDIST_BACKEND=cupy (tests/test_emulated_gpu.py does).  Prints one line per check, exits
non-zero on the first failure."""

import math
import os
import sys
import threading

import numpy as np

import cupy
import cupyx
from cupy import _emulator

CHECKS = []


def check(fn):
    CHECKS.append(fn)
    return fn


def raises(exc, fn, match=""):
    try:
        fn()
    except exc as e:
        assert match in str(e), f"{exc.__name__} without {match!r}: {e}"
        return
    raise AssertionError(f"no {exc.__name__} from {fn}")


@check
def device_arrays_are_not_numpy():
    a = cupy.arange(6.0).reshape(2, 3)
    assert not isinstance(a, np.ndarray) and isinstance(a, cupy.ndarray)
    assert isinstance(a + 1, cupy.ndarray) and isinstance(np.exp(a), cupy.ndarray)
    assert isinstance(np.concatenate([a, a]), cupy.ndarray)
    s = a.sum()
    assert isinstance(s, cupy.ndarray) and s.ndim == 0  # a 0-d device array, not a scalar
    assert isinstance(a[0, 0], cupy.ndarray)
    assert (a @ a.T).shape == (2, 2) and len(a) == 2 and [r.shape for r in a] == [(3,), (3,)]
    raises(TypeError, lambda: len(s), "unsized")


@check
def implicit_conversion_raises():
    a = cupy.ones(3)
    msg = "Implicit conversion to a NumPy array is not allowed"
    raises(TypeError, lambda: np.asarray(a), msg)
    raises(TypeError, lambda: np.testing.assert_allclose(a, a), msg)


@check
def mixing_with_numpy_raises():
    a = cupy.ones(3)
    h = np.ones(3)
    msg = "Unsupported type <class 'numpy.ndarray'>"
    for fn in (lambda: a + h, lambda: h + a, lambda: cupy.add(a, h), lambda: np.add(h, a),
               lambda: cupy.matmul(a, h), lambda: cupy.concatenate([a, h]), lambda: np.stack([a, h])):
        raises(TypeError, fn, msg)
    raises(ValueError, lambda: a.__setitem__(slice(None), h), "non-scalar numpy.ndarray")
    # scalars (Python, NumPy, 0-d NumPy) are fine, and a NumPy array may index
    assert isinstance(a * np.float32(2) + 1 + np.array(2.0), cupy.ndarray)
    assert a[np.array([0, 2])].shape == (2,)
    raises(TypeError, lambda: cupy.ascontiguousarray(h))


@check
def transfers_are_recorded():
    a = cupy.arange(4.0)
    _emulator.reset()
    float(a.sum()), int(a[1]), bool(a[2] > 0), a.item(0), a.tolist(), a.get(), cupy.asnumpy(a), range(cupy.arange(3)[1])
    a[a > 1], cupy.flatnonzero(a)
    kinds = [t.kind for t in _emulator.transfers()]
    assert kinds == ["float()", "int()", "bool()", "item()", "tolist()", "get", "get", "index()",
                     "sync:boolean mask index", "sync:flatnonzero"], kinds
    t = _emulator.transfers()[0]
    assert t.nbytes == 8 and t.site.startswith(__file__) and "transfers_are_recorded" in t.site, t
    assert len(_emulator.hidden()) == len(kinds)
    _emulator.reset()
    assert _emulator.transfers() == []


@check
def to_host_is_the_accounted_path():
    from minidist.model import backend

    assert backend.xp is cupy and backend.device_memory()["name"] == "Emulated GPU"
    _emulator.reset()
    h = backend.to_host(cupy.ones((2, 3), dtype=np.float32))
    assert type(h) is np.ndarray and h.dtype == np.float32 and h.shape == (2, 3)
    assert len(_emulator.transfers()) == 1 and _emulator.hidden() == []
    assert type(cupyx.empty_pinned((2,), dtype=np.float16)) is np.ndarray


@check
def ufunc_methods_as_cupy():
    for name in ("at", "reduce", "accumulate", "reduceat", "outer"):
        assert hasattr(cupy.add, name), name  # CuPy >= 13
    z = cupy.zeros(4)
    cupy.add.at(z, cupy.asarray([0, 0, 3]), cupy.ones(3))
    assert z.get().tolist() == [2.0, 0.0, 0.0, 1.0]
    raises(TypeError, lambda: cupy.add.at(cupy.zeros(4, dtype=np.int64), cupy.asarray([0]), 1), "scatter_add")
    assert cupy.add.reduceat(cupy.arange(6.0), cupy.asarray([0, 2]), axis=0).get().tolist() == [1.0, 14.0]


@check
def memory_pool_and_hook():
    pool = cupy.get_default_memory_pool()
    seen = []

    class Hook(cupy.cuda.MemoryHook):
        name = "selfcheck"

        def malloc_postprocess(self, **kw):
            seen.append(kw["mem_size"])

    before = pool.used_bytes()
    with Hook():
        a = cupy.empty((1000,), dtype=np.float64)
        v = a[10:20]  # a view: no new buffer
    assert seen == [8000] and pool.used_bytes() - before == 8000, (seen, pool.used_bytes() - before)
    del a, v
    assert pool.used_bytes() == before


@check
def devices():
    assert cupy.cuda.runtime.getDeviceCount() == int(os.environ.get("MINIDIST_EMULATED_GPUS", "1"))
    assert cupy.cuda.Device().id == 0 and cupy.ones(1).device == cupy.cuda.Device(0)
    raises(cupy.cuda.runtime.CUDARuntimeError, lambda: cupy.cuda.Device(99).use())
    cupy.cuda.get_current_stream().synchronize()


@check
def the_current_device_is_per_thread():
    """As in CUDA: each host thread has its own current device, 0 in a new thread; an array
    stays on the device it was allocated on, and so do its views."""
    import threading

    if cupy.cuda.runtime.getDeviceCount() < 2:
        print("skip the_current_device_is_per_thread: MINIDIST_EMULATED_GPUS < 2")
        return
    seen = {}
    with cupy.cuda.Device(1):
        a = cupy.ones(4)
        t = threading.Thread(target=lambda: seen.update(dev=cupy.cuda.Device().id, b=cupy.zeros(2)))
        t.start()
        t.join()
        assert cupy.cuda.Device().id == 1 and cupy.cuda.runtime.getDevice() == 1
        assert a.reshape(2, 2).device.id == 1 and a[1:].device.id == 1 and a.T.device.id == 1
    assert seen["dev"] == 0 and seen["b"].device == cupy.cuda.Device(0)
    assert a.device == cupy.cuda.Device(1) and cupy.cuda.Device().id == 0


@check
def cross_device_uses_are_recorded_and_refused_without_peer_access():
    """A kernel given another device's array: CuPy's PerformanceWarning with peer access (the
    kernel runs), its ValueError without; a view is no kernel; asarray and copy copy across."""
    import warnings

    if cupy.cuda.runtime.getDeviceCount() < 2:
        print("skip cross_device_uses_are_recorded_and_refused_without_peer_access: MINIDIST_EMULATED_GPUS < 2")
        return
    with cupy.cuda.Device(1):
        a = cupy.arange(4.0)
    _emulator.reset()
    v = a.reshape(2, 2)[0]  # views: no kernel, nothing to check
    b = cupy.asarray(a)  # a device-to-device copy onto device 0
    c = a.copy()
    assert b.device.id == 0 and c.device.id == 0 and _emulator.cross_device() == []
    assert [t.direction for t in _emulator.transfers(None)] == ["d2d", "d2d"]
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert (a + b).get().tolist() == [0.0, 2.0, 4.0, 6.0]
    assert [type(x.message).__name__ for x in w] == ["PerformanceWarning"], w
    assert "Peer access has been activated automatically" in str(w[0].message)
    (t,) = _emulator.cross_device()
    assert t.kind == "ufunc:add: array on device 1, current device 0" and "selfcheck.py" in t.site, t
    os.environ["MINIDIST_EMULATED_PEER_ACCESS"] = "0"
    try:
        raises(ValueError, lambda: a * 2, "Peer access is unavailable between these devices")
        raises(ValueError, lambda: b.__setitem__(slice(None), a), "is different from the current device (0)")
        raises(ValueError, lambda: cupy.concatenate([b, v]), "resides (1)")
        c[...] = 1.0  # same device: fine
    finally:
        del os.environ["MINIDIST_EMULATED_PEER_ACCESS"]
    assert len(_emulator.cross_device()) == 4


@check
def device_operations_are_counted():
    """One per call that launches: ufuncs, operators, copies, kernels, fused functions as one;
    not views, empty, or a no-op conversion."""
    a = cupy.ones((4, 4), dtype=np.float32)
    f = cupy.fuse(kernel_name="fma")(lambda x, y: x * y + y)
    _emulator.reset_operations()
    b = a + 1  # ufunc:add
    b *= 2  # ufunc:multiply (in place)
    a.reshape(16), a.T, a[1:], a[0], cupy.empty((3,)), cupy.ascontiguousarray(a), a.astype(np.float32, copy=False)
    cupy.matmul(a, b)  # ufunc:matmul
    a.sum(axis=0)  # method:sum
    a.T.copy()  # method:copy
    a[cupy.asarray([0, 2])]  # h2d:asarray, getitem (a gather)
    a[1:3] = 0.0  # setitem
    f(a, b)  # fuse:fma, not its multiply and add
    cupy.zeros(3)  # function:zeros (a memset)
    ops = _emulator.operations()
    assert ops == {"ufunc:add": 1, "ufunc:multiply": 1, "ufunc:matmul": 1, "method:sum": 1, "method:copy": 1,
                   "h2d:asarray": 1, "getitem": 1, "setitem": 1, "fuse:fma": 1, "function:zeros": 1}, ops
    assert _emulator.op_count() == 10
    _emulator.count_sites(True)
    try:
        _emulator.reset_operations()
        a - b
        ((kind, site),) = _emulator.operations(by_site=True)
        assert kind == "ufunc:subtract" and "selfcheck.py" in site, site
    finally:
        _emulator.count_sites(False)


@check
def fuse_runs_the_function():
    f = cupy.fuse(kernel_name="k")(lambda x, y: x * y + 1)
    assert f(cupy.ones(2), 2.0).get().tolist() == [3.0, 3.0]
    raises(TypeError, lambda: f(np.ones(2), 2.0), "Unsupported type")


@check
def elementwise_kernel_equals_plain_adamw():
    from minidist.model.ops.fused import adamw_kernel
    from minidist.model.optim.functional import _adamw_block

    rng = np.random.default_rng(0)
    for dt, tol in ((np.float64, 1e-13), (np.float32, 2e-6)):
        p0, g, m0, v0 = (rng.standard_normal(257).astype(dt) for _ in range(4))
        v0 = np.abs(v0)
        lr, wd, b1, b2, eps, step = 1e-2, 0.1, 0.9, 0.95, 1e-8, 3
        bc2 = 1 - b2 ** step
        hyper = (1 - lr * wd, b1, b2, eps, bc2, lr / (1 - b1 ** step))
        ref = [cupy.asarray(x) for x in (p0, m0, v0)]
        _adamw_block(ref[0], cupy.asarray(g), ref[1], ref[2], cupy.empty_like(ref[0]), *hyper)
        got = [cupy.asarray(x) for x in (p0, m0, v0)]
        t = np.dtype(dt).type
        adamw_kernel()(cupy.asarray(g), t(hyper[0]), t(b1), t(b2), t(eps), t(1 / math.sqrt(bc2)), t(hyper[5]), *got)
        for r, x in zip(ref, got):
            assert x.dtype == dt
            np.testing.assert_allclose(x.get(), r.get(), rtol=tol, atol=tol)
    k = cupy.ElementwiseKernel("T x", "T y", "T t = x * 2.5f; y = sqrt(t) + x / 2;", "k")
    assert np.allclose(k(cupy.asarray([4.0, 1.0])).get(), [np.sqrt(10) + 2, np.sqrt(2.5) + 0.5])
    for body in ("if (x > 0) y = x;", "y = x > 0 ? x : 0;", "for (int i = 0; i < 2; i++) y += x;", "y = x[0];"):
        raises(NotImplementedError, lambda: cupy.ElementwiseKernel("T x", "T y", body, "bad"), "emulated")
    raises(NotImplementedError, lambda: cupy.ElementwiseKernel("raw T x", "T y", "y = x", "bad"), "raw")


RAW_SOURCE = r"""
extern "C" __global__ void scaled_reverse(const REAL* x, REAL* y, int n, REAL a) {
    __shared__ REAL tile[WIDTH];
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    tile[threadIdx.x] = i < n ? x[i] : (REAL)0;
    __syncthreads();  // y[i] takes the block's mirrored element: needs the other threads' loads
    int j = blockDim.x - 1 - threadIdx.x, src = blockIdx.x * blockDim.x + j;
    if (i < n && src < n) y[i] = a * tile[j];
}
"""


@check
def raw_module_runs_cuda_code_in_place():
    if _emulator_compiler() is None:
        print("skip raw_module_runs_cuda_code_in_place: no C++ compiler")
        return
    mod = cupy.RawModule(code=RAW_SOURCE, options=("-std=c++14", "-DREAL=double", "-D", "WIDTH=4"))
    k = mod.get_function("scaled_reverse")
    x = cupy.arange(8.0)
    y = cupy.full(8, -1.0)
    mark = len(_emulator.transfers(None))
    k((2,), (4,), (x, y, np.int32(8), np.float64(2.0)))
    assert [t.kind for t in _emulator.transfers(None)[mark:]] == ["RawKernel:scaled_reverse"]
    assert y.get().tolist() == [6.0, 4.0, 2.0, 0.0, 14.0, 12.0, 10.0, 8.0]  # written in place
    raises(TypeError, lambda: k((2,), (4,), (np.arange(8.0), y, np.int32(8), np.float64(2.0))), "Unsupported type")
    raises(ValueError, lambda: k((2,), (4,), (x[::2], y, np.int32(4), np.float64(2.0))), "C-contiguous")
    raises(TypeError, lambda: k(2, (4,), (x, y, np.int32(8), np.float64(2.0))), "tuple")
    raises(Exception, lambda: mod.get_function("missing"), "named symbol not found")


def _emulator_compiler():
    from cupy import _raw

    return _raw._cuda_on_cpu().compiler()


@check
def bfloat16_arrays():
    from minidist.model.backend import bfloat16

    a = cupy.asarray(np.arange(4, dtype=np.float32)).astype(bfloat16)
    assert a.dtype == bfloat16 and (a.astype(np.float32) * 2).get().tolist() == [0.0, 2.0, 4.0, 6.0]


@check
def mpi_reads_device_memory_only_when_cuda_aware_and_synchronized():
    from mpi4py import MPI

    def sendrecv(a, b):  # as minidist describes its messages: [buffer, MPI.BYTE]
        MPI.COMM_SELF.Sendrecv([a, MPI.BYTE], 0, 0, [b, MPI.BYTE], 0, 0)

    x, out = cupy.arange(6.0), cupy.zeros(6)
    raises(TypeError, lambda: sendrecv(x, out))  # an MPI that is not CUDA-aware
    cupy._CUDA_AWARE_MPI = True
    try:
        y = x * 2  # device work queued on this thread
        raises(RuntimeError, lambda: sendrecv(y, out), "synchronize the stream first")
        cupy.cuda.get_current_stream().synchronize()
        sendrecv(y, out)
        assert out.get().tolist() == [0.0, 2.0, 4.0, 6.0, 8.0, 10.0]
        z = y + 1
        assert z.get()[0] == 1.0  # a blocking copy to the host waits for the queue too
        sendrecv(z, out)
        w = x * 3
        seen = []
        t = threading.Thread(target=lambda: seen.append(cupy._tls.queued))
        t.start()
        t.join()
        assert seen == [False] and cupy._tls.queued and w is not None  # per thread
    finally:
        cupy._CUDA_AWARE_MPI = False


if __name__ == "__main__":
    for fn in CHECKS:
        fn()
        print("ok", fn.__name__)
    sys.stdout.flush()
