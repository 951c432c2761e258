"""Every ``MINIDIST_*`` environment variable: read here, checked here, listed here.

minidist reads its environment in this one module, so that every variable has one meaning,
one default and one check, and a bad value stops the program with one line that names the
variable, the value and what it accepts, instead of a traceback from deep inside an import
or a value silently taken for something else::

    from minidist.host import env
    env.get("MINIDIST_TIMEOUT_S")    # the checked value (300.0 when unset or empty)
    env.check_all()                  # EnvError on the first bad variable, e.g.
    # EnvError: MINIDIST_TIMEOUT_S='abc': expected seconds >= 0 (0 turns the watchdog off)

:data:`VARIABLES` is the table of them all (name, what it accepts, default, meaning); the
README's section "Environment variables" is :func:`readme_table` (a test keeps them equal).
Who checks when: the training command (``minidist.train.flags``) runs :func:`check_all` with its
other input checks (one line on stderr, exit code 2); ``import minidist.comm`` raises the
first bad variable's :class:`EnvError` before anything else loads; every module that reads
a variable reads it through :func:`get`.

This module imports nothing heavy (no NumPy, no MPI): it is read before NumPy loads.
"""

from __future__ import annotations

import math
import os
from typing import Callable, NamedTuple


class EnvError(ValueError):
    """A ``MINIDIST_*`` variable holds a value it does not accept.  The message is one line:
    ``NAME='value': expected <what it accepts>``."""


class Variable(NamedTuple):
    """One environment variable: ``parse`` turns its (stripped, non-empty) text into the
    value or raises ValueError; ``accepts`` says in words what ``parse`` accepts."""

    name: str
    parse: Callable[[str], object]
    accepts: str
    default: object  # the value when the variable is unset or empty
    meaning: str  # one line
    internal: bool = False  # set by minidist itself (minidist.train.testing), not by users


# ----------------------------------------------------------------------------- parsers
def _number(lo: float, *, above: bool = False):
    """A finite number >= lo (> lo with ``above``)."""

    def parse(text: str) -> float:
        value = float(text)
        if not math.isfinite(value) or value < lo or (above and value == lo):
            raise ValueError(text)
        return value

    return parse


def _integer(lo: int):
    """An integer >= lo."""

    def parse(text: str) -> int:
        value = int(text)
        if value < lo:
            raise ValueError(text)
        return value

    return parse


_ON, _OFF = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
SWITCH = "1 or 0 (or true/false, yes/no, on/off)"


def _switch(text: str) -> bool:
    word = text.lower()
    if word in _ON:
        return True
    if word in _OFF:
        return False
    raise ValueError(text)


def _choice(*choices: str):
    def parse(text: str) -> str:
        word = text.lower()
        if word not in choices:
            raise ValueError(text)
        return word

    return parse


def _text(text: str) -> str:
    return text


def _kill_point(text: str) -> tuple[int, str, int]:
    """RANK:POINT:STEP, e.g. ``1:part-written:4``."""
    rank, point, step = text.split(":")
    if point not in ("part-written", "renamed") or int(rank) < 0 or int(step) < 1:
        raise ValueError(text)
    return int(rank), point, int(step)


# ------------------------------------------------------------------------------- table
VARIABLES: dict[str, Variable] = {v.name: v for v in (
    Variable("MINIDIST_BACKEND", _choice("numpy", "cupy"), "'numpy' or 'cupy'", "numpy",
             "the array backend, read when minidist.model.backend is first imported (--backend sets it)"),
    Variable("MINIDIST_OPS_PATH", _choice("auto", "whole", "tuned"), "'auto', 'whole' or 'tuned'", "auto",
             "how the ops run: whole-array (one matmul per layer; what CuPy runs) or tuned for a CPU's "
             "caches and BLAS threads; auto: tuned on NumPy, whole on CuPy (minidist/model/ops/tuning.py)"),
    Variable("MINIDIST_CUDA_KERNELS", _choice("auto", "off"), "'auto' or 'off'", "auto",
             "minidist's own CUDA kernels on CuPy (auto): FlashAttention for blockwise attention "
             "(ops/cuda/flash.py), the causal softmax of plain attention and its gradient "
             "(ops/cuda/softmax.py), GELU (ops/cuda/gelu.py), LayerNorm (ops/cuda/layernorm.py) and "
             "the one-launch optimizer step (ops/cuda/multi_tensor.py); off: the xp forms they are "
             "tested against"),
    Variable("MINIDIST_FLASH_MMA", _choice("auto", "off"), "'auto' or 'off'", "auto",
             "attention with bf16/fp16 operands and head size 64 or 128 on CuPy runs as the "
             "tensor-core FlashAttention-2 kernels (auto: no T x T array), or as batched products "
             "(off) (minidist/model/ops/cuda/flash_mma.py)"),
    Variable("MINIDIST_CUBLAS_BATCHED", _choice("auto", "off"), "'auto' or 'off'", "auto",
             "matrix products on CuPy call cuBLAS's strided batched GEMM on the arrays' own strides, "
             "and write float32 products of bf16/fp16 operands directly (auto), or use CuPy's matmul, "
             "which copies non-contiguous operands, and casts (off) (minidist/model/ops/cuda/gemm.py)"),
    Variable("MINIDIST_CAUSAL_BLOCKS", _integer(1), "an integer >= 1", 4,
             "plain causal attention with minidist's CUDA kernels cuts its T x T products into this "
             "many query blocks and skips the masked ones above the diagonal, (n + 1) / 2n of the work "
             "in n cuBLAS calls a product, on contiguous copies of self-attention's heads; 1: whole "
             "products on the heads' views (minidist/model/ops/causal_blocks.py)"),
    Variable("MINIDIST_CUDA_AWARE_MPI", _switch, SWITCH, False,
             "the MPI library reads GPU memory: point-to-point messages pass CuPy arrays to MPI "
             "directly instead of staging them through host buffers (docs/gpu.md)"),
    Variable("MINIDIST_TIMEOUT_S", _number(0), "seconds >= 0 (0 turns the watchdog off)", 300.0,
             "a communication wait without progress for this long aborts the job with a report "
             "(--timeout-s, comm.set_timeout)"),
    Variable("MINIDIST_FAST_PATH", _switch, SWITCH, True,
             "cached plans for repeated collectives; 0 runs only the textbook algorithms "
             "(comm.set_fast_path)"),
    Variable("MINIDIST_COLLECTIVE_TAGS", _switch, SWITCH, True,
             "each collective message carries its call's identity in its MPI tag, so mismatched "
             "calls raise CollectiveMismatchError"),
    Variable("MINIDIST_CHECK_COLLECTIVES", _switch, SWITCH, False,
             "debug mode: every collective first compares all ranks' calls (shapes too) "
             "(comm.set_check)"),
    Variable("MINIDIST_LINK_LATENCY_US", _number(0), "microseconds >= 0", 0.0,
             "simulated latency added to every message (comm.set_link_model)"),
    Variable("MINIDIST_LINK_GBPS", _number(0, above=True), "gigabits per second > 0", None,
             "simulated bandwidth of every link; unset: no limit (comm.set_link_model)"),
    Variable("MINIDIST_LINK_SCOPE", _choice("all", "internode"), "'all' or 'internode'", "all",
             "which messages pay the simulated link: all, or only those between nodes (comm/nodes.py)"),
    Variable("MINIDIST_RANKS_PER_NODE", _integer(1), "an integer >= 1", None,
             "pretend every K consecutive ranks are one node, for testing multi-node layouts on "
             "one machine"),
    Variable("MINIDIST_HANG_DIR", _text, "a directory", None,
             "where each rank dumps its stacks when a test job hangs (set by minidist.train.testing.run_mpi)",
             internal=True),
    Variable("MINIDIST_HANG_AFTER_S", _number(0, above=True), "seconds > 0", None,
             "when each rank dumps its stacks (set by minidist.train.testing.run_mpi)", internal=True),
    Variable("MINIDIST_TEST_KILL_IN_SAVE", _kill_point, "RANK:POINT:STEP (POINT: part-written or renamed)", None,
             "tests of checkpoints: rank RANK kills itself (SIGKILL) at that point of the save of "
             "step STEP (minidist/state/checkpoint.py); only in a job's first attempt (MINIDIST_RESTART "
             "unset or 0), so a restarted job runs on", internal=True),
    Variable("MINIDIST_RESTART", _integer(0), "an integer >= 0", 0,
             "which attempt of a job this is: set by the restarting launcher (minidist-launch) to 0, "
             "then 1, 2, ... after each restart (as torchrun's TORCHELASTIC_RESTART_COUNT)"),
    Variable("MINIDIST_TEST_LOST_RANKS", _integer(1), "an integer >= 1", None,
             "tests of the restarting launcher: pretend this many ranks were lost with the first "
             "failure, so the job restarts on the ranks left (minidist/train/launch.py)", internal=True),
)}


def get(name: str, environ=None):
    """The checked value of variable ``name`` (its default when unset or empty); EnvError
    naming it when the value is not one it accepts.  ``environ``: a mapping to read
    instead of ``os.environ``."""
    var = VARIABLES.get(name)
    if var is None:
        raise KeyError(f"{name} is not a minidist environment variable; add it to minidist/host/env.py's VARIABLES")
    raw = (os.environ if environ is None else environ).get(name)
    if raw is None or not raw.strip():
        return var.default
    try:
        return var.parse(raw.strip())
    except (ValueError, OverflowError):
        raise EnvError(f"{name}={raw!r}: expected {var.accepts}") from None


def problem(environ=None) -> EnvError | None:
    """The EnvError of the first variable (in table order) with a bad value, or None."""
    for name in VARIABLES:
        try:
            get(name, environ)
        except EnvError as err:
            return err.with_traceback(None)  # raised again by the caller: only its frames show
    return None


def check_all(error: type = EnvError, environ=None) -> None:
    """Raise ``error`` (EnvError, or e.g. the training command's InputError) with the one-line
    message of the first variable that holds a bad value; return None when all are good."""
    err = problem(environ)
    if err is not None:
        raise (err if error is EnvError else error(str(err))) from None


def _shown(value) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def readme_table() -> str:
    """The README's table of every variable (a test checks that the README holds it)."""
    rows = ["| Variable | Accepts | Default | Meaning |", "| --- | --- | --- | --- |"]
    for v in VARIABLES.values():
        meaning = f"internal: {v.meaning}" if v.internal else v.meaning
        rows.append(f"| `{v.name}` | {v.accepts} | {_shown(v.default)} | {meaning} |")
    return "\n".join(rows) + "\n"
