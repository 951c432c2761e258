"""Byte-level text data: tokenizer, corpus, train/validation split and a deterministic sampler.

Everything here runs on the host and returns NumPy integer arrays; the trainer moves batches
to the backend (``minidist.model.backend.from_host``).

* **Tokens are bytes** (:class:`ByteTokenizer`, vocabulary 256): no tokenizer file to ship,
  every text is encodable, and the model's loss is directly comparable to the byte entropies
  below.
* **The default corpus is the Python standard library's own source** (:func:`load_corpus`):
  it is present on every machine that runs minidist, so examples and tests need no download.
* **The sampler is defined on the GLOBAL batch** (:class:`Sampler`): ``batch(step)`` depends
  only on ``(seed, step)``, so any rank can compute any step's batch on its own, a restart
  resumes exactly, and data parallelism / gradient accumulation only *split* that batch
  (:func:`shard`) instead of drawing different data.  That is what lets a parallel run be
  checked against the single-process run step for step.
"""

from __future__ import annotations

import os
import sysconfig

import numpy as np

from minidist.layout.split import shard

DEFAULT_MAX_BYTES = 8 * 1024 * 1024

# Directories never read for the default corpus: installed third-party packages are not the
# standard library (and differ between machines); the test suites hold deliberately malformed
# files, odd encodings and large data blobs that are not representative Python code.
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"})
# Top-level packages that are generated data rather than hand-written code: the codec tables of
# `encodings` (1.4 MB of '\uXXXX' literals) and the help text in `pydoc_data`.  Left in, they
# would fill a quarter of the default 8 MiB and raise the byte entropy by ~0.14 nats.
_SKIP_TOP_LEVEL = frozenset({"encodings", "pydoc_data"})


class ByteTokenizer:
    """UTF-8 bytes as tokens: ``encode`` gives values 0..255, ``decode`` inverts it."""

    vocab_size = 256
    hash = "bytes"  # the tokenizer's name in shards and checkpoints (a trained BPE: its file's hash)
    bytes_per_token = 1.0

    def encode(self, text: str) -> np.ndarray:
        if not isinstance(text, str):
            raise TypeError(f"encode() expects str, got {type(text).__name__}")
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).copy()

    def decode(self, ids) -> str:
        """Bytes back to text; a cut multi-byte character becomes U+FFFD instead of raising."""
        ids = np.asarray(ids)
        if ids.size and (ids.min() < 0 or ids.max() > 255):
            raise ValueError(f"token ids must be in 0..255, got range {ids.min()}..{ids.max()}")
        return ids.astype(np.uint8).tobytes().decode("utf-8", errors="replace")


# -- corpus -----------------------------------------------------------------------------------


def stdlib_source_files() -> list[str]:
    """The standard library's ``.py`` files, as paths relative to its root, in sorted order.

    Sorting the '/'-joined relative paths (not the walk order, which depends on the file
    system) makes the list identical on every machine with the same Python.
    """
    root = sysconfig.get_paths()["stdlib"]
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        skip = _SKIP_DIRS | (_SKIP_TOP_LEVEL if rel == os.curdir else frozenset())
        dirnames[:] = [d for d in dirnames if d not in skip]
        for name in filenames:
            if name.endswith(".py"):
                found.append(os.path.normpath(os.path.join(rel, name)).replace(os.sep, "/"))
    return sorted(found)


def _load_stdlib(max_bytes: int) -> np.ndarray:
    """The first ``max_bytes`` of the sorted stdlib sources joined by newlines.

    Files are read in order only until the cap is reached, so start-up stays fast; the cap is
    a byte prefix of one fixed concatenation, hence deterministic.
    """
    root = sysconfig.get_paths()["stdlib"]
    parts, total = [], 0
    for rel in stdlib_source_files():
        with open(os.path.join(root, *rel.split("/")), "rb") as f:
            parts.append(f.read())
        total += len(parts[-1]) + 1
        if total >= max_bytes:
            break
    if not parts:
        raise FileNotFoundError(f"no .py files found under the standard library at {root!r}")
    return np.frombuffer(b"\n".join(parts)[:max_bytes], dtype=np.uint8).copy()


def load_corpus(path: str | os.PathLike | None = None, max_bytes: int = DEFAULT_MAX_BYTES) -> np.ndarray:
    """The training text as a 1-D ``uint8`` array of byte tokens.

    ``path=None``: the Python standard library's ``.py`` sources (without ``site-packages``,
    test directories and the generated ``encodings``/``pydoc_data`` tables), in sorted path order, separated by newlines, capped at
    ``max_bytes`` (default 8 MiB, a prefix of that concatenation).  Nothing is cached on disk.

    ``path`` given: that file's bytes (all of them; ``max_bytes`` applies only to the default).
    """
    if max_bytes is None or int(max_bytes) < 1:
        raise ValueError(f"max_bytes must be a positive integer, got {max_bytes!r}")
    if path is None:
        return _load_stdlib(int(max_bytes))
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"corpus file {path!r} does not exist")
    if not os.path.isfile(path):
        raise ValueError(f"corpus path {path!r} is not a regular file")
    with open(path, "rb") as f:
        data = np.frombuffer(f.read(), dtype=np.uint8).copy()
    if data.size == 0:
        raise ValueError(f"corpus file {path!r} is empty")
    return data


def load_corpora(paths=None, max_bytes: int = DEFAULT_MAX_BYTES) -> np.ndarray:
    """Several files' bytes joined by newlines (``load_corpus`` of each); none: the default corpus."""
    if not paths:
        return load_corpus(None, max_bytes)
    parts = [load_corpus(p) for p in paths]
    joined = [part for p in parts for part in (p, np.frombuffer(b"\n", dtype=np.uint8))][:-1]
    return np.concatenate(joined)


def split_corpus(data, val_fraction: float = 0.05):
    """Split into ``(train, val)``: the validation set is the LAST ``val_fraction`` of the bytes.

    One contiguous tail (rather than every k-th chunk) means there is a single cut: no training
    window can contain validation text, and no artificial joins appear inside the training set.
    The price is that validation text comes from the end of the corpus (for the default corpus,
    the alphabetically last modules), which is still ordinary Python source.
    """
    data = np.asarray(data)
    if data.ndim != 1:
        raise ValueError(f"corpus must be 1-D, got shape {data.shape}")
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction!r}")
    n_val = max(1, int(round(len(data) * val_fraction)))
    if n_val >= len(data):
        raise ValueError(f"corpus of {len(data)} tokens is too small to hold out {val_fraction!r} of it")
    return data[:-n_val], data[-n_val:]


# -- sampler ----------------------------------------------------------------------------------


class Sampler:
    """Random windows of ``seq_len + 1`` tokens, as a global batch per optimizer step.

    ``batch(step)`` draws ``global_batch`` start positions from a generator seeded with
    ``(seed, step)`` (``np.random.default_rng([seed, step])``), so it is a pure function of
    its arguments: independent of which rank asks, in which order, or after a restart.
    ``source`` names the data in error messages (e.g. the corpus path).  ``data`` is a 1-D
    integer array, or memory-mapped token shards (:class:`minidist.state.shards.Tokens`: anything
    with ``gather(positions)``), read only at the windows drawn.
    """

    def __init__(self, data, seq_len: int, global_batch: int, seed: int = 0, source: str | None = None):
        if not hasattr(data, "gather"):
            data = np.asarray(data)
        if data.ndim != 1 or not np.issubdtype(data.dtype, np.integer):
            raise ValueError(f"data must be a 1-D integer array, got {data.dtype} {data.shape}")
        for name, value in (("seq_len", seq_len), ("global_batch", global_batch)):
            if not (isinstance(value, (int, np.integer)) and value >= 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not (isinstance(seed, (int, np.integer)) and seed >= 0):
            raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
        if len(data) < seq_len + 1:
            what = f"corpus {source!r}" if source else "corpus"
            raise ValueError(
                f"{what} has {len(data)} tokens, fewer than seq_len + 1 = {seq_len + 1}; "
                "use a longer file or a shorter --seq-len"
            )
        self.data = data
        self.seq_len = int(seq_len)
        self.global_batch = int(global_batch)
        self.seed = int(seed)
        self.source = source

    @property
    def num_starts(self) -> int:
        """How many distinct windows exist (start positions 0 .. len - seq_len - 1)."""
        return len(self.data) - self.seq_len

    def windows(self, starts):
        """``(x, y)`` int64 arrays for the given start positions; ``y`` is ``x`` shifted by one."""
        starts = np.asarray(starts, dtype=np.int64)
        idx = starts[:, None] + np.arange(self.seq_len + 1, dtype=np.int64)
        tokens = (self.data.gather(idx) if hasattr(self.data, "gather") else self.data[idx]).astype(np.int64)
        return tokens[:, :-1], tokens[:, 1:]

    def batch(self, step: int):
        """The global batch of optimizer step ``step``: ``(x, y)`` of shape (global_batch, seq_len)."""
        if not (isinstance(step, (int, np.integer)) and step >= 0):
            raise ValueError(f"step must be a non-negative integer, got {step!r}")
        rng = np.random.default_rng([self.seed, int(step)])
        return self.windows(rng.integers(0, self.num_starts, size=self.global_batch))

    shard = staticmethod(shard)

    def val_batches(self, n: int):
        """``n`` fixed batches for evaluation (call it on a sampler over the validation split).

        Start positions are spread evenly over the data (not random), so they are the same
        for every seed and cover the whole split; windows overlap only when the split is
        shorter than ``n * global_batch`` windows.
        """
        if not (isinstance(n, (int, np.integer)) and n >= 1):
            raise ValueError(f"number of validation batches must be a positive integer, got {n!r}")
        total = n * self.global_batch
        starts = np.floor(np.arange(total) * (self.num_starts / total)).astype(np.int64)
        return [self.windows(starts[i * self.global_batch:(i + 1) * self.global_batch]) for i in range(n)]


# -- entropy (what a model that sees 0 or 1 bytes of context could reach) ---------------------


def _entropy_of_counts(counts) -> float:
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def entropy_unigram(data) -> float:
    """H(X) in nats per byte: the loss of the best model that ignores context."""
    data = np.asarray(data)
    if data.size == 0:
        raise ValueError("entropy of an empty corpus is undefined")
    return _entropy_of_counts(np.bincount(data.astype(np.int64).ravel(), minlength=256).astype(np.float64))


def entropy_bigram(data) -> float:
    """Conditional entropy H(X_t+1 | X_t) in nats per byte: the loss of the best model that sees
    only the previous byte.  Computed as H(X_t, X_t+1) - H(X_t) over the n-1 adjacent pairs."""
    data = np.asarray(data).astype(np.int64).ravel()
    if data.size < 2:
        raise ValueError(f"bigram entropy needs at least 2 tokens, got {data.size}")
    if data.min() < 0 or data.max() > 255:
        raise ValueError(f"bigram entropy expects byte tokens 0..255, got range {data.min()}..{data.max()}")
    joint = np.bincount(data[:-1] * 256 + data[1:], minlength=256 * 256).astype(np.float64)
    first = np.bincount(data[:-1], minlength=256).astype(np.float64)
    return _entropy_of_counts(joint) - _entropy_of_counts(first)
