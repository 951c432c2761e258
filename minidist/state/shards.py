"""Token shards: a tokenized corpus on disk, read by memory-mapping (``--data DIR``).

``python -m minidist.state.prepare`` writes a directory (:mod:`minidist.state.prepare`)::

    manifest.json         the tokenizer's hash and vocabulary, the token dtype, every shard of
                          each split with its token count, and each split's bytes and tokens
    tokenizer.json        the tokenizer itself (its hash is the manifest's)
    train-000000.bin ...  the training split, in order; val-000000.bin ...  the validation split

Each shard is a 64-byte header (:data:`HEADER`: magic, version, bytes per token, token count,
the tokenizer's hash) then the tokens, little-endian uint16 where the vocabulary fits, else
uint32.  The header repeats what the manifest says, so a shard moved in from another set, or
cut short, is caught by itself (its hash, its size) before a token is read.

Training never reads a shard whole: :class:`Tokens` presents a split's shards as one sequence
and ``gather`` reads only the windows a batch draws (``np.memmap``: the OS pages them in), so a
corpus larger than memory trains as the embedded one does, and windows cross shard boundaries
as if the shards were one array.  Batches stay a function of the step (:class:`~minidist.state.data.Sampler`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
from dataclasses import dataclass

import numpy as np

from minidist.host.files import write_synced

MAGIC = b"MDTOKENS"
VERSION = 1
HEADER = np.dtype([("magic", "S8"), ("version", "<u4"), ("itemsize", "<u4"), ("count", "<u8"),
                   ("tokenizer", "S16"), ("reserved", "V24")])  # 64 bytes
MANIFEST, TOKENIZER = "manifest.json", "tokenizer.json"
SPLITS = ("train", "val")
_SHARD_NAME = re.compile(r"^(train|val)-\d{6}\.bin$")


class ShardError(ValueError):
    """A shard directory that cannot be used; the message is one line naming the file."""


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 where every token id fits (a vocabulary of at most 65,536), else uint32."""
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


def header(itemsize: int, count: int, tokenizer_hash: str) -> bytes:
    h = np.zeros((), dtype=HEADER)
    h["magic"], h["version"], h["itemsize"], h["count"] = MAGIC, VERSION, itemsize, count
    h["tokenizer"] = tokenizer_hash.encode("ascii")
    return h.tobytes()


def write_shard(path: str, tokens: np.ndarray, dtype: np.dtype, tokenizer_hash: str) -> None:
    """One shard file, header then tokens, flushed to disk (it lies in a directory renamed into
    place whole, so it needs no rename of its own)."""
    write_synced(path, [header(dtype.itemsize, len(tokens), tokenizer_hash),
                        np.ascontiguousarray(tokens, dtype=dtype).tobytes()])


class ShardWriter:
    """Collects one split's tokens and writes a shard every ``shard_tokens`` of them."""

    def __init__(self, directory: str, split: str, dtype: np.dtype, tokenizer_hash: str, shard_tokens: int):
        self.directory, self.split, self.dtype, self.hash = directory, split, dtype, tokenizer_hash
        self.shard_tokens, self.pending, self.files = shard_tokens, [], []

    def add(self, tokens: np.ndarray) -> None:
        self.pending.append(np.asarray(tokens, dtype=self.dtype))
        while sum(len(t) for t in self.pending) >= self.shard_tokens:
            joined = np.concatenate(self.pending)
            self._write(joined[:self.shard_tokens])
            self.pending = [joined[self.shard_tokens:]]

    def close(self) -> list:
        """Write what is left; ``[[file name, token count], ...]`` of the split."""
        rest = np.concatenate(self.pending) if self.pending else np.zeros(0, self.dtype)
        if len(rest):
            self._write(rest)
        return self.files

    def _write(self, tokens: np.ndarray) -> None:
        name = f"{self.split}-{len(self.files):06d}.bin"
        write_shard(os.path.join(self.directory, name), tokens, self.dtype, self.hash)
        self.files.append([name, int(len(tokens))])


class Tokens:
    """A split's shards as one sequence of tokens, memory-mapped: ``gather`` reads only the
    positions asked for (a window may cross from one shard into the next)."""

    ndim = 1

    def __init__(self, maps: list):
        self.maps = maps
        self.dtype = maps[0].dtype
        self.starts = np.cumsum([0] + [len(m) for m in maps])

    def __len__(self) -> int:
        return int(self.starts[-1])

    def gather(self, positions) -> np.ndarray:
        """The tokens at ``positions`` (any shape of int64), read from the shards that hold them."""
        positions = np.asarray(positions, dtype=np.int64)
        out = np.empty(positions.shape, dtype=self.dtype)
        shard = np.searchsorted(self.starts, positions, side="right") - 1
        for s in np.unique(shard):
            here = shard == s
            out[here] = self.maps[s][positions[here] - self.starts[s]]
        return out


@dataclass(frozen=True)
class DataInfo:
    """What a run's data is: its tokenizer (hash; ``bytes`` for the byte tokenizer), the shard
    set's identity (the manifest's hash; None for text), the vocabulary and the bytes per token
    of each split (1 for bytes: bits per byte = loss / ln 2 / bytes per token)."""
    tokenizer: str = "bytes"
    shards: str | None = None
    vocab_size: int = 256
    bytes_per_token: tuple = (1.0, 1.0)  # train, val


@functools.lru_cache(maxsize=8)
def describe(path: str | None) -> DataInfo:
    """The DataInfo of ``--data``: a text file or nothing (bytes), or a shard directory (checked
    whole by :func:`open_shards`)."""
    if path is None or not os.path.isdir(path):
        return DataInfo()
    return open_shards(path)[0]


def open_shards(path: str):
    """``(DataInfo, {split: Tokens})`` of a shard directory, every shard's header and size checked
    against the manifest (ShardError, one line naming the file, otherwise)."""
    manifest = read_manifest(path)
    dtype = np.dtype(manifest["dtype"]).newbyteorder("<")
    splits = {split: Tokens([_map(os.path.join(path, name), count, dtype, manifest["tokenizer"])
                             for name, count in manifest["splits"][split]["files"]]) for split in SPLITS}
    bpt = tuple(manifest["splits"][s]["bytes"] / manifest["splits"][s]["tokens"] for s in SPLITS)
    with open(os.path.join(path, MANIFEST), "rb") as f:
        identity = hashlib.sha256(f.read()).hexdigest()[:16]
    return DataInfo(manifest["tokenizer"], identity, manifest["vocab_size"], bpt), splits


def read_manifest(path: str) -> dict:
    """The manifest of shard directory ``path``, every field checked; the tokenizer file's hash
    must be the manifest's."""
    from minidist.state.tokenizer import file_hash

    where = os.path.join(path, MANIFEST)
    if not os.path.isfile(where):
        raise ShardError(f"{path}: is a directory without {MANIFEST}: neither a text file nor token shards "
                         "(python -m minidist.state.prepare writes them)")
    try:
        with open(where, encoding="utf-8") as f:
            m = json.load(f)
    except (OSError, ValueError) as exc:
        raise ShardError(f"{where}: cannot be read as JSON ({exc})") from None
    _check_manifest(where, m)
    tok = os.path.join(path, TOKENIZER)
    try:
        with open(tok, encoding="utf-8") as f:
            found = file_hash(f.read())
    except (OSError, UnicodeDecodeError):
        raise ShardError(f"{tok}: missing or unreadable (every shard directory holds its tokenizer)") from None
    if found != m["tokenizer"]:
        raise ShardError(f"{tok}: tokenizer {found}, but the shards are of tokenizer {m['tokenizer']}")
    return m


def _check_manifest(where: str, m) -> None:
    def need(ok, what):
        if not ok:
            raise ShardError(f"{where}: {what}")

    need(isinstance(m, dict) and m.get("format") == "minidist-token-shards", "not a token shard manifest")
    need(m.get("version") == VERSION, f"version {m.get('version')!r}, this minidist reads version {VERSION}")
    need(isinstance(m.get("tokenizer"), str) and re.fullmatch(r"[0-9a-f]{16}", m["tokenizer"]),
         "tokenizer is not a 16-digit hash")
    need(type(m.get("vocab_size")) is int and 256 <= m["vocab_size"] <= 1 << 32, "vocab_size is not a vocabulary size")
    need(m.get("dtype") == token_dtype(m["vocab_size"]).name, f"dtype {m.get('dtype')!r} does not fit vocab_size")
    splits = m.get("splits")
    need(isinstance(splits, dict) and sorted(splits) == sorted(SPLITS), "splits must be train and val")
    for split in SPLITS:
        s = splits[split]
        need(isinstance(s, dict) and isinstance(s.get("files"), list) and s["files"], f"{split} has no shards")
        for entry in s["files"]:
            need(isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], str)
                 and _SHARD_NAME.match(entry[0]) and entry[0].startswith(split) and type(entry[1]) is int
                 and entry[1] > 0, f"{split}: {entry!r} is not a [shard name, token count] pair")
        tokens = sum(count for _, count in s["files"])
        need(s.get("tokens") == tokens, f"{split}: tokens {s.get('tokens')!r} is not the shards' sum {tokens}")
        need(type(s.get("bytes")) is int and s["bytes"] > 0, f"{split}: bytes is not a positive count")


def _map(path: str, count: int, dtype: np.dtype, tokenizer_hash: str) -> np.memmap:
    """Shard ``path`` memory-mapped, after its header and size are checked against the manifest."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            raw = f.read(HEADER.itemsize)
    except OSError:
        raise ShardError(f"{path}: missing (the manifest lists it)") from None
    if len(raw) < HEADER.itemsize:
        raise ShardError(f"{path}: truncated: {size} bytes, shorter than the {HEADER.itemsize}-byte header")
    h = np.frombuffer(raw, dtype=HEADER)[0]
    if h["magic"] != MAGIC:
        raise ShardError(f"{path}: not a minidist token shard (magic {bytes(h['magic'])!r})")
    if h["version"] != VERSION:
        raise ShardError(f"{path}: shard version {h['version']}, this minidist reads version {VERSION}")
    found = h["tokenizer"].decode("ascii", errors="replace")
    if found != tokenizer_hash:
        raise ShardError(f"{path}: a shard of tokenizer {found}, but this set's tokenizer is {tokenizer_hash}")
    if h["itemsize"] != dtype.itemsize or h["count"] != count:
        raise ShardError(f"{path}: header says {h['count']} tokens of {h['itemsize']} bytes, "
                         f"the manifest {count} of {dtype.itemsize}")
    want = HEADER.itemsize + count * dtype.itemsize
    if size != want:
        raise ShardError(f"{path}: {'truncated' if size < want else 'too long'}: {size} bytes, "
                         f"the header says {want}")
    return np.memmap(path, dtype=dtype, mode="r", offset=HEADER.itemsize, shape=(count,))
