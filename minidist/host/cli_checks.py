"""Checks on the training CLI's input, all made before any model is built or any file written.

Each check raises :class:`InputError` with one line that names the flag and the bad value;
the training command (``minidist.train.flags``) turns it into ``minidist-train: error: ...``
and exit code 2.  The checks read only the arguments, the environment and the file system, so every rank of a job reaches
the same verdict on its own, before any message is exchanged (a rank that refused alone
would leave the others waiting in their first collective).

* numbers: :func:`int_in` / :func:`float_in` build argparse ``type=`` functions that refuse
  NaN, infinities and values outside the flag's range while the command line is parsed;
* files: :func:`check_input_file` (``--data``: an existing, readable, regular file) and
  :func:`check_output_files` (``--metrics-jsonl``, ``--trace``, and any later output: its
  directory exists and is writable, it is not a directory, it is not the ``--data`` file
  under another name, and no two outputs share a file), which writes nothing that exists;
* memory: :func:`check_memory` refuses a run whose estimated peak (train/estimate.py) cannot
  fit in the memory available.
"""

from __future__ import annotations

import argparse
import math
import os


class OneLineParser(argparse.ArgumentParser):
    """argparse with errors as one line, ``PROG: error: MESSAGE (see --help)``, and exit code 2
    (argparse's usage block would bury the message).  ``speaks=False`` exits without a word: under
    mpiexec every rank of the training command finds the same error, and rank 0 says it once."""

    def __init__(self, *args, speaks: bool = True, **kwargs):
        super().__init__(*args, **kwargs)
        self.speaks = speaks

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n" if self.speaks else None)




class InputError(ValueError):
    """Bad command-line input; the message is one line and names the flag."""


# -- numbers ----------------------------------------------------------------------------------


def _bound_text(lo, lo_open, hi, hi_open) -> str:
    parts = []
    if lo is not None:
        parts.append(f"{'>' if lo_open else '>='} {lo:g}")
    if hi is not None:
        parts.append(f"{'<' if hi_open else '<='} {hi:g}")
    return " and ".join(parts)


def _in_range(value, lo, lo_open, hi, hi_open) -> bool:
    if lo is not None and (value <= lo if lo_open else value < lo):
        return False
    if hi is not None and (value >= hi if hi_open else value > hi):
        return False
    return True


def int_in(lo=None, hi=None):
    """An argparse ``type=`` for an integer flag in ``[lo, hi]`` (either end may be None)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if not _in_range(value, lo, False, hi, False):
            raise argparse.ArgumentTypeError(f"expected an integer {_bound_text(lo, False, hi, False)}, got {text}")
        return value

    parse.__name__ = "integer"
    return parse


def float_in(lo=None, hi=None, lo_open=False, hi_open=False):
    """An argparse ``type=`` for a finite float flag in the given range (open ends exclude)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        bounds = _bound_text(lo, lo_open, hi, hi_open)
        if not math.isfinite(value) or not _in_range(value, lo, lo_open, hi, hi_open):
            raise argparse.ArgumentTypeError(f"expected a finite number{' ' + bounds if bounds else ''}, got {text}")
        return value

    parse.__name__ = "number"
    return parse


# -- files ------------------------------------------------------------------------------------


def check_input_file(flag: str, path: str) -> None:
    """``path`` is an existing, readable, non-empty regular file."""
    if not path:
        raise InputError(f"{flag} needs a file name")
    if not os.path.exists(path):
        raise InputError(f"{flag} {path}: no such file")
    if os.path.isdir(path):
        raise InputError(f"{flag} {path}: is a directory, not a text file")
    if not os.path.isfile(path):
        raise InputError(f"{flag} {path}: not a regular file")
    try:
        with open(path, "rb") as f:
            f.read(1)
    except OSError as exc:
        raise InputError(f"{flag} {path}: cannot be read ({exc.strerror or exc})") from None
    if os.path.getsize(path) == 0:
        raise InputError(f"{flag} {path}: the file is empty")


def _same_file(a: str, b: str) -> bool:
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return os.path.samefile(a, b)  # hard links too
    except OSError:
        return False


def check_output_files(outputs: dict, inputs: dict | None = None) -> None:
    """Every output path (``{flag: path}``, None entries skipped) can be written, and none
    is an input file (``{flag: path}``) or another output under another name.

    Nothing that exists is changed: an existing output file is opened for appending (and
    closed unwritten), and a new one is tried as a probe file beside it that is removed
    at once, so an old trace stays whole until the new one replaces it.
    """
    outputs = {flag: path for flag, path in outputs.items() if path is not None}
    inputs = {flag: path for flag, path in (inputs or {}).items() if path is not None}
    seen = {}
    for flag, path in outputs.items():
        if not path:
            raise InputError(f"{flag} needs a file name")
        for in_flag, in_path in inputs.items():
            if _same_file(path, in_path):
                raise InputError(f"{flag} {path} is the {in_flag} file: writing it would destroy the input; "
                                 "choose another name")
        for other_flag, other_path in seen.items():
            if _same_file(path, other_path):
                raise InputError(f"{flag} {path} and {other_flag} {other_path} name the same file")
        seen[flag] = path
        if os.path.isdir(path):
            raise InputError(f"{flag} {path}: is a directory; give a file name")
        parent = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(parent):
            raise InputError(f"{flag} {path}: the directory {parent} does not exist")
        try:
            if os.path.exists(path):
                with open(path, "ab"):
                    pass
            else:
                probe = os.path.join(parent, f".{os.path.basename(path)}.probe{os.getpid()}")
                with open(probe, "xb"):
                    pass
                os.remove(probe)
        except OSError as exc:
            raise InputError(f"{flag} {path}: cannot be written ({exc.strerror or exc})") from None


# -- memory -----------------------------------------------------------------------------------


def available_memory_bytes() -> int | None:
    """Memory this process can still take: MemAvailable, lowered by a cgroup limit; None if unknown."""
    avail = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError):
        pass
    if avail is None:
        try:
            avail = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return None
    try:  # cgroup v2 (containers): the limit minus what the group already uses
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        if limit != "max":
            with open("/sys/fs/cgroup/memory.current") as f:
                avail = min(avail, int(limit) - int(f.read().strip()))
    except (OSError, ValueError):
        pass
    return avail


def _gib(n: int) -> str:
    if n >= 2**30:
        return f"{n / 2**30:,.1f} GiB"
    return f"{n / 2**20:,.0f} MiB" if n >= 2**20 else f"{n / 2**10:,.0f} KiB"


ADVICE = {
    "weights, gradients and optimizer state": "use a smaller --d-model or --layers",
    "activations": "use a smaller --batch-size or --seq-len, or --grad-accum or --checkpoint-activations",
    "data": "use fewer --eval-batches or a smaller --data file",
}


def check_memory(estimate: dict, available: int | None) -> None:
    """Refuse a run whose estimated peak (of every rank on this machine: flags.memory_estimate)
    exceeds the available memory, naming the largest part."""
    if available is None or estimate["total"] <= available:
        return
    parts = {name: n for name, n in estimate.items() if name in ADVICE}
    largest = max(parts, key=parts.get)
    shown = ", ".join(f"{name} {_gib(n)}" for name, n in parts.items() if n)
    ranks = estimate.get("ranks", 1)
    who = f" on the {ranks} ranks this machine holds ({_gib(estimate['per_rank'])} each)" if ranks > 1 else ""
    raise InputError(f"this run needs about {_gib(estimate['total'])} of memory{who} ({estimate['total']:,} bytes: "
                     f"{shown}) but {_gib(max(available, 0))} is available; {ADVICE[largest]}")
