"""A byte-level BPE tokenizer trained here: ``python -m minidist.state.tokenizer train``.

Byte-pair encoding (Sennrich et al. 2016, on bytes as in GPT-2, Radford et al. 2019): start
from the 256 byte values and repeatedly add the most frequent adjacent pair as a new token,
until the vocabulary has ``--vocab-size`` tokens.  Text is first cut into words by GPT-2's
pattern (letters, digits, punctuation and whitespace runs), so no token crosses a word.

* Training is Hugging Face's ``tokenizers`` (Rust, the production trainer); :mod:`minidist.state.bpe`
  is the same merge loop in a screen of Python, tested to learn the same merges.
* **Any byte string survives the round trip exactly.**  ``tokenizers`` takes text, so
  :meth:`BPETokenizer.encode_bytes` gives it the valid UTF-8 runs and maps every other byte to
  its own single-byte token; :meth:`BPETokenizer.decode_bytes` joins the tokens' bytes.
* **A tokenizer is named by its hash** (SHA-256 of its file, 16 hex digits): token shards and
  checkpoints record it, so data and models of different tokenizers are never mixed.

The byte tokenizer (:class:`minidist.state.data.ByteTokenizer`) stays the default: nothing
else needs this module or ``tokenizers`` (``pip install -e '.[data]'``).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import sys

import numpy as np

from minidist.host.cli_checks import OneLineParser
from minidist.host.files import replace_atomically

BYTES = 256  # the byte alphabet: the smallest vocabulary that encodes everything
_ESCAPED = re.compile("([\udc80-\udcff]+)")  # bytes that are not UTF-8, as surrogateescape writes them
# Texts go to the library in pieces of about this many characters.  Small pieces encode 2-3
# times faster than large ones (measured: 1.3 MB/s per core at 1 KiB, 0.5 at 64 KiB and at
# 1 MiB), and a piece is cut just before a newline that follows a non-space character: there
# GPT-2's word pattern always ends one word and starts the next (a run of spaces and newlines
# is one word, so a cut inside it would change the tokens), and the pieces' ids are the whole
# text's.
CHUNK_CHARS = 1 << 10


class TokenizerError(ValueError):
    """A tokenizer file that cannot be used; the message is one line naming the file."""


def byte_chars() -> list[str]:
    """GPT-2's printable stand-in for each byte (``bytes_to_unicode``): printable Latin-1 bytes
    stand for themselves, the others for 256, 257, ...  Byte-level BPE works on these strings."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    out, extra = {}, 0
    for b in range(BYTES):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b], extra = chr(BYTES + extra), extra + 1
    return [out[b] for b in range(BYTES)]


def text_pieces(data: bytes):
    """``data`` cut for the library: ``(True, text)`` for valid UTF-8 (in pieces of about
    CHUNK_CHARS, cut where a word starts), ``(False, raw bytes)`` for bytes that are not UTF-8."""
    text = bytes(data).decode("utf-8", errors="surrogateescape")
    for i, part in enumerate(_ESCAPED.split(text)):
        if i % 2:
            yield False, part.encode("utf-8", errors="surrogateescape")
            continue
        start = 0
        while start < len(part):
            end = _word_boundary(part, start + CHUNK_CHARS)
            yield True, part[start:end]
            start = end


def _word_boundary(text: str, at: int) -> int:
    """The first position from ``at`` (or the end) just before a newline that follows a
    non-space character: the start of a word under GPT-2's pattern, whatever comes after."""
    while True:
        cut = text.find("\n", max(at, 1))
        if cut < 0:
            return len(text)
        if not text[cut - 1].isspace():
            return cut
        at = cut + 1


def new_tokenizer():
    """An untrained byte-level BPE: GPT-2's word pattern, no normalisation, no special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    return tok


def train(data: bytes, vocab_size: int):
    """A byte-level BPE trained on ``data`` by Hugging Face's trainer (a ``tokenizers.Tokenizer``).
    The 256 byte tokens come first; training stops early when no pair is left to merge."""
    from tokenizers import pre_tokenizers, trainers

    if vocab_size < BYTES:
        raise TokenizerError(f"--vocab-size {vocab_size} is too small: byte-level BPE needs the {BYTES} byte tokens")
    tok = new_tokenizer()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=[], show_progress=False)
    tok.train_from_iterator((text for is_text, text in text_pieces(data) if is_text), trainer)
    return tok


def file_hash(text: str) -> str:
    """The tokenizer's name in shards and checkpoints: SHA-256 of its file, 16 hex digits."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


class BPETokenizer:
    """A trained byte-level BPE loaded from its file; the same interface as ByteTokenizer."""

    def __init__(self, path: str):
        self.path = path
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as exc:
            why = getattr(exc, "strerror", None) or exc
            raise TokenizerError(f"tokenizer {path}: cannot be read ({why})") from None
        self.hf = _parse(path, text)
        self.hash = file_hash(text)
        vocab = self.hf.get_vocab()
        self.vocab_size = len(vocab)
        unbyte = {c: b for b, c in enumerate(byte_chars())}
        self.byte_ids = np.array([vocab[c] for c in byte_chars()], dtype=np.int64)  # byte value -> its token
        self.token_bytes = [b""] * self.vocab_size  # token -> its bytes
        for token, i in vocab.items():
            self.token_bytes[i] = bytes(unbyte[c] for c in token)

    def encode_bytes(self, data: bytes) -> np.ndarray:
        """Token ids (int64) of any bytes: UTF-8 text through the trained merges, any other byte
        as its own token."""
        pieces = list(text_pieces(data))
        encoded = iter(self.hf.encode_batch([p for is_text, p in pieces if is_text]))
        out = [np.asarray(next(encoded).ids, dtype=np.int64) if is_text else self.byte_ids[list(p)]
               for is_text, p in pieces]
        return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)

    def decode_bytes(self, ids) -> bytes:
        """The bytes of token ids: the exact inverse of :meth:`encode_bytes`."""
        ids = np.asarray(ids, dtype=np.int64).ravel()
        if ids.size and (ids.min() < 0 or ids.max() >= self.vocab_size):
            raise ValueError(f"token ids must be in 0..{self.vocab_size - 1}, got range {ids.min()}..{ids.max()}")
        return b"".join(self.token_bytes[i] for i in ids.tolist())

    def encode(self, text: str) -> np.ndarray:
        return self.encode_bytes(text.encode("utf-8"))

    def decode(self, ids) -> str:
        """Text of token ids; bytes that are not UTF-8 (a cut character) become U+FFFD."""
        return self.decode_bytes(ids).decode("utf-8", errors="replace")


def _parse(path: str, text: str):
    """The library's tokenizer of a file's text, checked to be a byte-level BPE with every byte."""
    from tokenizers import Tokenizer, pre_tokenizers

    try:
        tok = Tokenizer.from_str(text)
    except Exception as exc:  # the library raises its own exception types
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise TokenizerError(f"tokenizer {path}: not a tokenizers file ({reason})") from None
    if not isinstance(tok.pre_tokenizer, pre_tokenizers.ByteLevel):
        raise TokenizerError(f"tokenizer {path}: not a byte-level tokenizer (its pre-tokenizer is "
                             f"{type(tok.pre_tokenizer).__name__})")
    missing = [c for c in byte_chars() if tok.token_to_id(c) is None]
    if missing:
        raise TokenizerError(f"tokenizer {path}: {len(missing)} of the {BYTES} byte tokens are missing")
    return tok


def hf_files(tok: BPETokenizer, max_length: int) -> dict:
    """``{file name: text}`` that transformers' ``AutoTokenizer.from_pretrained`` loads as a
    ``PreTrainedTokenizerFast``: the tokenizer file itself (``tokenizer.json``, byte for byte, so
    its hash is the checkpoint's) and a ``tokenizer_config.json`` declaring no special tokens,
    as the model's config.json does (bos/eos None), and no clean-up of spaces on decoding (it
    would change the text ``minidist.state.generate`` prints)."""
    import json

    with open(tok.path, encoding="utf-8") as f:
        text = f.read()
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_length,
              "bos_token": None, "eos_token": None, "unk_token": None, "pad_token": None,
              "add_prefix_space": False, "clean_up_tokenization_spaces": False, "minidist_tokenizer": tok.hash}
    return {"tokenizer.json": text, "tokenizer_config.json": json.dumps(config, indent=2) + "\n"}


# -- the command --------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    from minidist.host.cli_checks import int_in

    p = OneLineParser(prog="python -m minidist.state.tokenizer",
                      description="Train a byte-level BPE tokenizer (Hugging Face tokenizers).")
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train a tokenizer and write its file")
    t.error = p.error  # one line, exit code 2, for the subcommand's errors too
    t.add_argument("--vocab-size", type=int_in(lo=1, hi=1 << 24), required=True, metavar="N",
                   help=f"tokens in the vocabulary, at least the {BYTES} byte values")
    t.add_argument("-o", "--out", required=True, metavar="FILE", help="the tokenizer file to write (JSON)")
    t.add_argument("--data", action="append", default=None, metavar="PATH",
                   help="a text file to train on; repeat for several (default: the standard library corpus)")
    return p


def main(argv=None) -> int:
    from minidist.state.data import load_corpora

    parser = build_parser()
    args = parser.parse_args(argv)
    if args.vocab_size < BYTES:
        parser.error(f"--vocab-size {args.vocab_size} is too small: byte-level BPE needs the {BYTES} byte tokens")
    if os.path.isdir(args.out):
        parser.error(f"-o {args.out}: is a directory")
    if not os.path.isdir(os.path.dirname(os.path.abspath(args.out))):
        parser.error(f"-o {args.out}: its directory does not exist")
    try:
        data = load_corpora(args.data)
        tok = train(data.tobytes(), args.vocab_size)
        text = tok.to_str()
        replace_atomically(args.out, text)
    except ImportError:
        parser.error("training a tokenizer needs Hugging Face tokenizers: pip install -e '.[data]'")
    except (ValueError, OSError) as exc:
        parser.error(str(exc))
    print(f"wrote {args.out}: {tok.get_vocab_size()} tokens ({tok.get_vocab_size() - BYTES} merges) "
          f"from {len(data):,} bytes, hash {file_hash(text)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
