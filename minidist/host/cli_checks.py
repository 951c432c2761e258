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
* memory: :func:`training_memory_bytes` estimates what a training step holds at its peak,
  and :func:`check_memory` refuses a run that cannot fit in the memory available.
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


NUMPY_BYTES = {"float32": 4, "float64": 8}


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


def gpt_num_parameters(n_layer: int, d_model: int, block_size: int, vocab_size: int = 256,
                       tied: bool = True) -> int:
    """Parameters of ``nn.GPT`` (with biases): embeddings, 12C²+13C per block, final LayerNorm."""
    c = d_model
    return (vocab_size * c + block_size * c + n_layer * (12 * c * c + 13 * c) + 2 * c
            + (0 if tied else vocab_size * c))


def training_memory_bytes(n_layer: int, d_model: int, n_head: int, seq_len: int, block_size: int,
                          batch_size: int, grad_accum: int = 1, dtype: str = "float32",
                          mixed_precision: str = "none", checkpoint_activations: bool = False,
                          optimizer: str = "adamw", tied: bool = True, vocab_size: int = 256,
                          data_bytes: int = 0, eval_batches: int = 0, score_values: int | None = None,
                          tp: int = 1, sequence_parallel: bool = False) -> dict:
    """Estimated peak bytes of a training step, by part (``total`` sums them).

    Fitted to :mod:`tracemalloc` peaks of real two-step runs (1-8 layers, d_model 32-1024,
    seq 16-1024, 1-8 heads, float32/64, bf16/fp16, checkpointing, accumulation, SGD: from 6 %
    under to 25 % over the measured peak; tiny models, where Python objects weigh, more over).
    Per block the step keeps about 24 arrays of the micro-batch's
    (tokens x d_model) plus one (T x T) score matrix per head; the logits and their softmax
    and gradients about 8 (tokens x vocab) arrays; the update one temporary the size of the
    largest weight.  Checkpointing keeps each block's input and one block's activations;
    mixed precision (float32 arithmetic on low-precision copies) was measured 25 % above
    float32.  ``data_bytes`` of corpus are held twice while loading; ``eval_batches`` fixed
    validation batches are int64 inputs and targets.  ``score_values``: the attention scores a
    block keeps per sequence (default ``n_head * seq_len**2``, plain attention's; blockwise and
    context-parallel attention keep fewer, see ``estimate.score_values``).  Tensor parallelism
    (``tp``) splits 14 of a block's 24 arrays (the heads' and the MLP's hidden ones) and the
    logits' vocabulary; sequence parallelism splits the other 10 too (Korthikanti et al. 2022).
    """
    item = NUMPY_BYTES[dtype]
    act_item = item if mixed_precision == "none" else 5  # measured: 1.25 x float32
    params = gpt_num_parameters(n_layer, d_model, block_size, vocab_size, tied)
    states = 2 if optimizer == "adamw" else 1  # AdamW: m, v; SGD: momentum
    micro = -(-batch_size // grad_accum)       # the largest micro-batch
    tokens = micro * seq_len
    scores = n_head * seq_len * seq_len if score_values is None else score_values
    block = (10 / (tp if sequence_parallel else 1) + 14 / tp) * tokens * d_model + micro * scores
    stored = (n_layer * tokens * d_model + block) if checkpoint_activations else n_layer * block
    parts = {
        "weights, gradients and optimizer state": params * item * (2 + states),
        "activations": int((stored + 8 * tokens * vocab_size / tp + max(4 * d_model * d_model, vocab_size * d_model))
                           * act_item),
        "data": 2 * data_bytes + eval_batches * batch_size * 2 * seq_len * 8,
    }
    parts["total"] = sum(parts.values())
    return parts


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
