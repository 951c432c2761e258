"""The emulator's own record: every device->host transfer and implicit synchronisation, every
use of an array on another device than the current one, and a count of device operations.

Real CuPy lets a program read device memory in many ways (``.get()``, ``cupy.asnumpy``,
``float(x)``, ``bool(x)``, ``x.item()``, printing an array, boolean-mask indexing, ``nonzero``
...); on a GPU each one waits for the queued kernels.  The emulator allows them all, as CuPy
does, and records each here with its call site, so a test can find the ones a program does not
account for.

    from cupy import _emulator
    _emulator.reset()
    ...                       # run a training step
    for t in _emulator.transfers():
        print(t.kind, t.nbytes, t.site)

``MINIDIST_EMULATED_TRANSFER_LOG=FILE`` (read when cupy is imported) writes the record as JSON
lines to ``FILE`` (``FILE.<pid>`` under several processes: ``{pid}`` in the name is replaced)
when the process exits, so a test can inspect a subprocess or an mpiexec run; its last line
(direction 'summary') gives the main thread's device at exit, the launcher's local-rank
variable, the devices buffers were allocated on and the operation counts.

Cross-device uses.  CUDA's current device is per host thread (a new thread starts on device
0), and every array lives on the device it was allocated on (``ndarray.device``).  A kernel
given an array on another device than the current one is what CuPy checks: a ValueError where
peer access is unavailable (``MINIDIST_EMULATED_PEER_ACCESS=0``), else a PerformanceWarning
and the kernel runs.  Either way the emulator records it (direction ``'cross-device'``, kind
``'OP: array on device A, current device B'``), so a test can require that there are none:
``cross_device()``.  Copies across devices that CuPy makes on purpose (``asarray``/``array``
of another device's array, ``ndarray.copy``) are recorded as direction ``'d2d'``.

Device operations.  Every call that launches work on the device is counted by kind
(``'ufunc:add'``, ``'function:concatenate'``, ``'method:astype'``, ``'getitem'``,
``'setitem'``, ``'fuse:NAME'``, ``'ElementwiseKernel:NAME'``, ``'RawKernel:NAME'``,
``'h2d:asarray'`` ...): ufuncs and kernels always; functions, methods and indexing when they
write a device array (``out=``) or allocate a new buffer, so views (reshape, transpose, basic
slicing), ``empty`` and returning an input unchanged count nothing; a fused function or a
kernel counts once, not the operations of its body.  On a GPU each is at least one launch.

    _emulator.reset_operations()
    ...                       # a training step
    n = _emulator.op_count()  # all kinds; operations() is the Counter by kind
    _emulator.count_sites(True)  # also count by call site (operations(by_site=True))
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import threading
from collections import Counter
from typing import NamedTuple

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/emulated_gpu
_HERE = tuple(os.path.join(_ROOT, pkg) + os.sep for pkg in ("cupy", "cupyx"))  # the emulator's frames


class Transfer(NamedTuple):
    """One recorded event. ``direction``: 'd2h' (device to host, including implicit
    synchronisations, whose ``kind`` starts with 'sync:'), 'h2d' or 'd2d' (a copy from another
    device); also 'compile' and 'launch' (kind 'RawKernel:NAME') of RawModule kernels, which
    move no data, and 'cross-device' (an array used on another device than the current one).  ``site`` is the first
    frame outside the emulator ('file:line in function'); ``stack`` all frames outside it,
    innermost first, as (file, line, function)."""
    direction: str
    kind: str
    nbytes: int
    site: str
    stack: tuple


_record: list = []
_recording = True


def _outside_frames(limit=40):
    f = sys._getframe(2)
    frames = []
    while f is not None and len(frames) < limit:
        fn = f.f_code.co_filename
        if not os.path.abspath(fn).startswith(_HERE):
            frames.append((fn, f.f_lineno, f.f_code.co_name))
        f = f.f_back
    return tuple(frames)


def record(direction: str, kind: str, nbytes: int):
    if not _recording:
        return
    stack = _outside_frames()
    site = "%s:%d in %s" % stack[0] if stack else "?"
    _record.append(Transfer(direction, kind, int(nbytes), site, stack))


def transfers(direction: str | None = "d2h") -> list:
    """The recorded events (device to host by default; None: both directions), oldest first."""
    return [t for t in _record if direction is None or t.direction == direction]


def reset():
    """Forget every recorded event and operation count."""
    del _record[:]
    reset_operations()


def cross_device() -> list:
    """The recorded uses of an array on another device than the calling thread's current one."""
    return transfers("cross-device")


# ----------------------------------------------------------------------- operation counts
_ops: Counter = Counter()
_op_sites: Counter = Counter()
_op_lock = threading.Lock()
_by_site = False


def count_op(kind: str):
    """One device operation of ``kind`` (called by the emulator)."""
    with _op_lock:
        _ops[kind] += 1
        if _by_site:
            frames = _outside_frames(limit=1)
            _op_sites[(kind, "%s:%d in %s" % frames[0] if frames else "?")] += 1


def count_sites(on: bool = True):
    """Also count operations by call site (the first frame outside the emulator): slower."""
    global _by_site
    _by_site = bool(on)


def operations(by_site: bool = False) -> Counter:
    """The operation counts so far: {kind: n}, or {(kind, site): n} (with count_sites on)."""
    with _op_lock:
        return Counter(_op_sites if by_site else _ops)


def op_count() -> int:
    """All device operations counted so far."""
    with _op_lock:
        return sum(_ops.values())


def reset_operations():
    """Forget the operation counts."""
    with _op_lock:
        _ops.clear()
        _op_sites.clear()


def passes_through(t: Transfer, path_suffix: str, function: str) -> bool:
    """True when ``function`` of a file ending in ``path_suffix`` is on ``t``'s stack."""
    return any(fn.endswith(path_suffix) and name == function for fn, _, name in t.stack)


def hidden(allowed=(("minidist/model/backend.py", "to_host"),), direction="d2h") -> list:
    """The device->host events whose stack passes through none of the ``allowed``
    (file suffix, function) pairs: the synchronisations a program does not account for."""
    return [t for t in transfers(direction)
            if not any(passes_through(t, p, f) for p, f in allowed)]


def _dump():
    path = os.environ.get("MINIDIST_EMULATED_TRANSFER_LOG")
    if not path:
        return
    path = path.replace("{pid}", str(os.getpid()))
    with open(path, "w") as fh:
        for t in _record:
            fh.write(json.dumps(t._asdict()) + "\n")
        fh.write(json.dumps(summary()) + "\n")


# The launchers' node-local rank variables (minidist.model.backend.LOCAL_RANK_VARIABLES' names).
_LOCAL_RANK_VARIABLES = ("MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_RANK",
                         "SLURM_LOCALID", "LOCAL_RANK")


def summary() -> dict:
    """This process in one record (direction 'summary'): the calling thread's current device,
    the first local-rank variable the launcher set ({name: value}, empty when none), bytes
    allocated so far per device, and the operation counts."""
    import cupy

    pool = cupy.get_default_memory_pool()
    env = next(({n: os.environ[n]} for n in _LOCAL_RANK_VARIABLES if n in os.environ), {})
    return {"direction": "summary", "kind": "process", "nbytes": 0, "site": "", "stack": [],
            "device": cupy.cuda.runtime.getDevice(), "device_count": cupy.cuda.runtime.getDeviceCount(),
            "local_rank_env": env, "allocated_devices": sorted(d for d, n in pool._high.items() if n),
            "operations": dict(operations())}


atexit.register(_dump)
