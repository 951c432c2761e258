"""The byte-level BPE tokenizer: Hugging Face's trainer against the textbook loop, exact round
trips of any bytes, and the command's bad input (one line, exit code 2, nothing written)."""
import json
import os

import numpy as np
import pytest

pytest.importorskip("tokenizers")

from minidist.host.files import replace_atomically  # noqa: E402
from minidist.state import tokenizer as tk  # noqa: E402
from minidist.state.bpe import learn_merges, word_counts  # noqa: E402
from minidist.state.data import load_corpus  # noqa: E402


@pytest.fixture(scope="module")
def corpus() -> bytes:
    return load_corpus(max_bytes=20_000).tobytes()


@pytest.fixture(scope="module")
def tok_file(corpus, tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "tok.json"
    replace_atomically(str(path), tk.train(corpus, 320).to_str())
    return str(path)


def test_the_library_and_the_textbook_learn_the_same_merges(corpus):
    library = [tuple(m) for m in json.loads(tk.train(corpus, 300).to_str())["model"]["merges"]]
    textbook = learn_merges(word_counts(corpus), 300)
    assert len(library) == 300 - 256 and textbook == library


def test_the_textbook_breaks_ties_by_the_smallest_token_ids():
    # "ab" and "cd" are equally frequent: the pair of smaller ids ("a" < "c") merges first
    assert learn_merges({"ab": 2, "cd": 2}, 258) == [("a", "b"), ("c", "d")]
    assert learn_merges({"aaa": 1}, 300) == [("a", "a"), ("aa", "a")]  # then nothing is left to merge


def test_any_byte_string_survives_the_round_trip(tok_file, corpus):
    tok = tk.BPETokenizer(tok_file)
    assert tok.vocab_size == 320 and len(tok.hash) == 16
    rng = np.random.default_rng(0)
    samples = [b"", b"\x00", b"\xff\xfe not UTF-8 \xc3", "naïve café — 日本語 🙂".encode(), corpus[:3000],
               rng.integers(0, 256, 2000, dtype=np.uint8).tobytes(), bytes(range(256)) * 3]
    for data in samples:
        ids = tok.encode_bytes(data)
        assert ids.dtype == np.int64 and (ids.size == 0 or 0 <= ids.min() <= ids.max() < 320)
        assert tok.decode_bytes(ids) == data
    assert len(tok.encode_bytes(corpus)) < 0.8 * len(corpus)  # the merges compress text
    assert tok.decode(tok.encode("def f(x):\n    return x\n")) == "def f(x):\n    return x\n"


def test_encoding_in_pieces_gives_the_whole_texts_tokens(tok_file, corpus, monkeypatch):
    """The library gets text in small pieces (fast), cut only where GPT-2's word pattern starts
    a word, so the ids are those of the whole text at once -- indentation, blank lines with
    trailing spaces and all (a cut after a newline would split a "\n    " run in two)."""
    tok = tk.BPETokenizer(tok_file)
    text = corpus.decode() + "x = 1  \n\n  \n    y = 2\n\tz\n"
    whole = tok.hf.encode(text).ids
    for chars in (16, 100, 1024):
        monkeypatch.setattr(tk, "CHUNK_CHARS", chars)
        pieces = [p for _, p in tk.text_pieces(text.encode())]
        assert len(pieces) > 1 and "".join(pieces) == text
        assert tok.encode(text).tolist() == whole, chars


def test_training_is_deterministic(corpus):
    assert tk.train(corpus, 300).to_str() == tk.train(corpus, 300).to_str()


def test_the_command_writes_a_tokenizer_file(tmp_path, capsys):
    data = tmp_path / "text.txt"
    data.write_bytes(b"hello world, hello tokens\n" * 50)
    out = tmp_path / "tok.json"
    assert tk.main(["train", "--vocab-size", "270", "-o", str(out), "--data", str(data)]) == 0
    tok = tk.BPETokenizer(str(out))
    assert tok.vocab_size == 270 and f"hash {tok.hash}" in capsys.readouterr().out
    assert set(os.listdir(tmp_path)) == {"text.txt", "tok.json"}  # no temporary file left


@pytest.mark.parametrize("args, needle", [
    (["--vocab-size", "255"], "--vocab-size 255 is too small: byte-level BPE needs the 256 byte tokens"),
    (["--vocab-size", "300", "--data", "/no/such/file"], "'/no/such/file' does not exist"),
    (["--vocab-size", "300", "-o", "/no/such/dir/tok.json"], "its directory does not exist"),
])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(args, needle, tmp_path, capsys):
    argv = ["train"] + args + ([] if "-o" in args else ["-o", str(tmp_path / "tok.json")])
    with pytest.raises(SystemExit) as stop:
        tk.main(argv)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and needle in err and len(err.strip().splitlines()) == 1, err
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("text, needle", [
    ("{not json", "not a tokenizers file"),
    ('{"version": "1.0", "model": {"type": "WordLevel", "vocab": {"a": 0}, "unk_token": "a"}}',
     "not a byte-level tokenizer"),
])
def test_a_tokenizer_file_that_does_not_parse_is_named(text, needle, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(text)
    with pytest.raises(tk.TokenizerError, match=needle) as err:
        tk.BPETokenizer(str(bad))
    assert str(bad) in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(tk.TokenizerError, match="cannot be read"):
        tk.BPETokenizer(str(tmp_path / "missing.json"))
