"""The emulator's own record: every device->host transfer and implicit synchronisation.

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
when the process exits, so a test can inspect a subprocess or an mpiexec run.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
from typing import NamedTuple

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/emulated_gpu
_HERE = tuple(os.path.join(_ROOT, pkg) + os.sep for pkg in ("cupy", "cupyx"))  # the emulator's frames


class Transfer(NamedTuple):
    """One recorded event. ``direction``: 'd2h' (device to host, including implicit
    synchronisations, whose ``kind`` starts with 'sync:') or 'h2d'; also 'compile' and 'launch'
    (kind 'RawKernel:NAME') of RawModule kernels, which move no data.  ``site`` is the first
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
    """Forget every recorded event."""
    del _record[:]


def passes_through(t: Transfer, path_suffix: str, function: str) -> bool:
    """True when ``function`` of a file ending in ``path_suffix`` is on ``t``'s stack."""
    return any(fn.endswith(path_suffix) and name == function for fn, _, name in t.stack)


def hidden(allowed=(("minidist/backend.py", "to_host"),), direction="d2h") -> list:
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


atexit.register(_dump)
