"""``python -m minidist.state.prepare --tokenizer tok.json [--data PATH ...] -o DIR``: token shards.

Tokenizes a corpus once, so that training reads token ids instead of text
(``python -m minidist.train --data DIR``; the format: :mod:`minidist.state.shards`):

1. the corpus (the ``--data`` files joined by newlines, or the standard library corpus) is
   split by bytes as training splits text (:func:`minidist.state.data.split_corpus`: the
   last ``--val-fraction`` is validation), so each split's bytes per token is exact;
2. each split is encoded in pieces of about a MiB, cut after a newline, into shards of
   ``--shard-tokens`` tokens, with a progress line every few seconds on a long corpus;
3. everything is written into a temporary directory beside DIR, flushed to disk and renamed
   into place whole: DIR is complete or absent, never half-written.

Bad input (a tokenizer file that does not parse, a missing corpus, an ``-o`` that exists with
other content) is one line and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

from minidist.host.cli_checks import OneLineParser, float_in, int_in
from minidist.host.files import write_synced

PIECE_BYTES = 1 << 20  # bytes encoded at a time
PROGRESS_S = 5.0       # seconds between progress lines
DEFAULT_SHARD_TOKENS = 1 << 24


def pieces(data: bytes, size: int = PIECE_BYTES):
    """``data`` in pieces of about ``size`` bytes, each cut after a newline where there is one."""
    start = 0
    while start < len(data):
        cut = data.find(b"\n", start + size)
        end = len(data) if cut < 0 else cut + 1
        yield data[start:end]
        start = end


def prepare(tokenizer, corpus: bytes, out: str, val_fraction: float = 0.05,
            shard_tokens: int = DEFAULT_SHARD_TOKENS, log=None) -> dict:
    """Write the shard directory ``out`` (absent before) of ``corpus`` encoded by ``tokenizer``
    (a BPETokenizer); return its manifest.  Atomic: a temporary directory renamed into place."""
    import numpy as np

    from minidist.state.data import split_corpus
    from minidist.state.shards import MANIFEST, TOKENIZER, ShardWriter, token_dtype

    train, val = (part.tobytes() for part in split_corpus(np.frombuffer(corpus, dtype=np.uint8), val_fraction))
    parent, name = os.path.split(os.path.abspath(out))
    tmp = os.path.join(parent, f".{name}.tmp-{os.getpid()}")
    os.makedirs(tmp)
    try:
        dtype = token_dtype(tokenizer.vocab_size)
        manifest = {"format": "minidist-token-shards", "version": 1, "tokenizer": tokenizer.hash,
                    "vocab_size": tokenizer.vocab_size, "dtype": dtype.name, "splits": {}}
        progress = Progress(len(corpus), log)
        for split, data in (("train", train), ("val", val)):
            writer = ShardWriter(tmp, split, dtype, tokenizer.hash, shard_tokens)
            tokens = 0
            for piece in pieces(data):
                ids = tokenizer.encode_bytes(piece)
                writer.add(ids)
                tokens += len(ids)
                progress.advance(len(piece), len(ids))
            manifest["splits"][split] = {"files": writer.close(), "bytes": len(data), "tokens": tokens}
        shutil.copyfile(tokenizer.path, os.path.join(tmp, TOKENIZER))
        write_synced(os.path.join(tmp, MANIFEST), json.dumps(manifest, indent=1))
        _fsync_dir(tmp)
        os.rename(tmp, out)  # onto an absent or empty directory: all at once
        _fsync_dir(parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return manifest


class Progress:
    """A progress line (bytes encoded, tokens, rate) every PROGRESS_S seconds."""

    def __init__(self, total: int, log):
        self.total, self.log, self.done, self.tokens = total, log, 0, 0
        self.start = self.last = time.perf_counter()

    def advance(self, nbytes: int, ntokens: int) -> None:
        self.done, self.tokens = self.done + nbytes, self.tokens + ntokens
        now = time.perf_counter()
        if self.log is None or now - self.last < PROGRESS_S:
            return
        self.last = now
        rate = self.done / max(now - self.start, 1e-9) / 2**20
        self.log(f"prepare: {self.done / 2**20:.1f} of {self.total / 2**20:.1f} MiB encoded "
                 f"({100 * self.done / self.total:.0f}%), {self.tokens:,} tokens, {rate:.2f} MiB/s")


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m minidist.state.prepare",
                      description="Tokenize a corpus into token shards for python -m minidist.train --data DIR.")
    p.add_argument("--tokenizer", required=True, metavar="FILE",
                   help="a tokenizer file (python -m minidist.state.tokenizer train)")
    p.add_argument("--data", action="append", default=None, metavar="PATH",
                   help="a text file; repeat for several, joined by newlines (default: the standard library corpus)")
    p.add_argument("-o", "--out", required=True, metavar="DIR", help="the directory to write (absent or empty)")
    p.add_argument("--val-fraction", type=float_in(0, 1, lo_open=True, hi_open=True), default=0.05, metavar="X",
                   help="share of the corpus's bytes held out for validation (its tail)")
    p.add_argument("--shard-tokens", type=int_in(lo=1), default=DEFAULT_SHARD_TOKENS, metavar="N",
                   help="tokens per shard")
    return p


def check_out(out: str) -> str | None:
    """Why ``-o`` cannot be written (None if it can): it must be absent or an empty directory,
    in an existing directory."""
    if os.path.islink(out):
        return f"-o {out}: a symbolic link; give a new directory"
    if os.path.exists(out):
        if not os.path.isdir(out):
            return f"-o {out}: exists and is not a directory"
        if os.listdir(out):
            return f"-o {out}: exists with other content (give a new or empty directory)"
    if not os.path.isdir(os.path.dirname(os.path.abspath(out))):
        return f"-o {out}: its parent directory does not exist"
    return None


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if problem := check_out(args.out):
        parser.error(problem)
    from minidist.state.data import load_corpora
    from minidist.state.tokenizer import BPETokenizer

    try:
        tokenizer = BPETokenizer(args.tokenizer)
        corpus = load_corpora(args.data).tobytes()
        log = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
        m = prepare(tokenizer, corpus, args.out, args.val_fraction, args.shard_tokens, log)
    except ImportError:
        parser.error("reading a tokenizer needs Hugging Face tokenizers: pip install -e '.[data]'")
    except (ValueError, OSError) as exc:
        parser.error(str(exc))
    except KeyboardInterrupt:
        parser.exit(130, f"{parser.prog}: interrupted; {args.out} was not written\n")
    t, v = m["splits"]["train"], m["splits"]["val"]
    print(f"wrote {args.out}: {t['tokens']:,} training tokens in {len(t['files'])} shard(s), {v['tokens']:,} "
          f"validation tokens, {t['bytes'] / t['tokens']:.3f} bytes per token ({m['dtype']}), "
          f"tokenizer {m['tokenizer']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
