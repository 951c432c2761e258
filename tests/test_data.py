"""Data pipeline: tokenizer, default corpus, split, global-batch sampler, sharding, entropies."""
import math

import numpy as np
import pytest

from minidist.state.data import (
    ByteTokenizer, Sampler, entropy_bigram, entropy_unigram, load_corpus, shard,
    split_corpus, stdlib_source_files,
)
from minidist.layout.split import shard_bounds


@pytest.fixture(scope="module")
def corpus():
    return load_corpus(max_bytes=1 << 20)


def test_tokenizer_round_trip_ascii_and_non_ascii():
    tok = ByteTokenizer()
    assert tok.vocab_size == 256
    for text in ["", "def f(x):\n    return x\n", "naïve café — Ελληνικά 日本語 🙂"]:
        ids = tok.encode(text)
        assert ids.dtype == np.uint8 and len(ids) == len(text.encode("utf-8"))
        assert tok.decode(ids) == text
        assert tok.decode(ids.astype(np.int64)) == text  # model outputs are int64
    assert list(tok.encode("é")) == [0xC3, 0xA9]


def test_tokenizer_decode_cut_character_and_bad_ids():
    tok = ByteTokenizer()
    assert tok.decode(tok.encode("é")[:1]) == "\ufffd"
    with pytest.raises(ValueError, match="256"):
        tok.decode([65, 256])


def test_default_corpus_is_nonempty_deterministic_bytes(corpus):
    assert corpus.dtype == np.uint8 and corpus.ndim == 1
    assert len(corpus) == 1 << 20  # the stdlib holds far more than 1 MiB: the cap applies
    again = load_corpus(max_bytes=1 << 20)
    np.testing.assert_array_equal(corpus, again)
    # a smaller cap is a prefix of the same concatenation
    np.testing.assert_array_equal(load_corpus(max_bytes=1000), corpus[:1000])
    text = ByteTokenizer().decode(corpus[:200000])
    assert "def " in text and "import " in text


def test_stdlib_file_list_is_sorted_and_filtered():
    files = stdlib_source_files()
    assert files == sorted(files) and len(files) > 100
    assert all(f.endswith(".py") for f in files)
    parts = {seg for f in files for seg in f.split("/")[:-1]}
    assert not parts & {"site-packages", "test", "tests", "__pycache__"}
    assert not any(f.startswith(("encodings/", "pydoc_data/")) for f in files)
    assert "os.py" in files


def test_corpus_file_errors_name_the_path(tmp_path):
    missing = tmp_path / "nope.txt"
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        load_corpus(missing)
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="empty.txt.*empty"):
        load_corpus(empty)
    short = tmp_path / "short.txt"
    short.write_bytes(b"0123456789")
    data = load_corpus(str(short))
    assert data.tobytes() == b"0123456789"
    Sampler(data, seq_len=9, global_batch=2, source=str(short))  # exactly seq_len + 1: fine
    with pytest.raises(ValueError, match=r"short\.txt.*10 tokens.*seq_len \+ 1 = 11"):
        Sampler(data, seq_len=10, global_batch=2, source=str(short))
    with pytest.raises(ValueError, match="is not a regular file"):
        load_corpus(tmp_path)
    with pytest.raises(ValueError, match="max_bytes"):
        load_corpus(max_bytes=0)


def test_split_is_disjoint_tail(corpus):
    train, val = split_corpus(corpus, val_fraction=0.05)
    assert len(train) + len(val) == len(corpus)
    assert len(val) == round(0.05 * len(corpus))
    np.testing.assert_array_equal(np.concatenate([train, val]), corpus)
    # the concatenation is the corpus, so the validation bytes are exactly the last ones
    for bad in (0.0, 1.0, -0.1):
        with pytest.raises(ValueError, match="val_fraction"):
            split_corpus(corpus, bad)


def test_sampler_deterministic_and_shifted(corpus):
    s = Sampler(corpus, seq_len=16, global_batch=6, seed=3)
    x, y = s.batch(7)
    assert x.shape == y.shape == (6, 16) and x.dtype == y.dtype == np.int64
    np.testing.assert_array_equal(x[:, 1:], y[:, :-1])
    # each row is a real window of the corpus: y's last token follows x's last token
    for row_x, row_y in zip(x, y):
        hits = np.flatnonzero(np.all(np.lib.stride_tricks.sliding_window_view(corpus, 17)
                                     == np.append(row_x, row_y[-1]), axis=1))
        assert hits.size >= 1
    # same (seed, step) -> same batch, even from a fresh sampler and out of order
    s2 = Sampler(corpus, seq_len=16, global_batch=6, seed=3)
    s2.batch(0)
    x2, y2 = s2.batch(7)
    np.testing.assert_array_equal(x, x2)
    np.testing.assert_array_equal(y, y2)
    # a different step or seed -> a different batch
    assert not np.array_equal(x, s.batch(8)[0])
    assert not np.array_equal(x, Sampler(corpus, 16, 6, seed=4).batch(7)[0])
    with pytest.raises(ValueError, match="step"):
        s.batch(-1)


def test_sampler_reaches_both_ends_of_tiny_data():
    data = np.arange(12, dtype=np.uint8)
    s = Sampler(data, seq_len=4, global_batch=8, seed=0)
    starts = {int(s.batch(k)[0][i, 0]) for k in range(50) for i in range(8)}
    assert starts == set(range(12 - 4))  # every window, and none running past the end


def test_sampler_rejects_bad_arguments(corpus):
    with pytest.raises(ValueError, match="seq_len"):
        Sampler(corpus, 0, 4)
    with pytest.raises(ValueError, match="global_batch"):
        Sampler(corpus, 8, 2.5)
    with pytest.raises(ValueError, match="1-D integer"):
        Sampler(np.zeros(100, dtype=np.float32), 8, 4)


@pytest.mark.parametrize("rows,count", [(8, 1), (8, 2), (8, 4), (8, 8), (7, 2), (7, 3), (10, 4), (5, 5)])
def test_shards_concatenate_to_global_batch(rows, count):
    x = np.arange(rows * 3).reshape(rows, 3)
    blocks = [shard(x, i, count) for i in range(count)]
    np.testing.assert_array_equal(np.concatenate(blocks), x)
    for got, want in zip(blocks, np.array_split(x, count)):
        np.testing.assert_array_equal(got, want)
    sizes = [stop - start for start, stop in (shard_bounds(rows, i, count) for i in range(count))]
    assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1
    np.testing.assert_array_equal(Sampler.shard(x, count - 1, count), blocks[-1])


def test_nested_shards_match_rank_then_microbatch():
    # data parallel rank r of 2, then micro-batch j of 3: contiguous blocks of the global batch
    x = np.arange(12)
    pieces = [shard(shard(x, r, 2), j, 3) for r in range(2) for j in range(3)]
    np.testing.assert_array_equal(np.concatenate(pieces), x)


def test_shard_bad_arguments():
    x = np.arange(4)
    with pytest.raises(ValueError, match="index"):
        shard(x, 2, 2)
    with pytest.raises(ValueError, match="count"):
        shard(x, 0, 0)
    with pytest.raises(ValueError, match="4 rows into 5"):
        shard(x, 0, 5)


def test_val_batches_fixed_and_cover_the_split(corpus):
    _, val = split_corpus(corpus)
    batches = Sampler(val, seq_len=32, global_batch=4, seed=0).val_batches(3)
    again = Sampler(val, seq_len=32, global_batch=4, seed=99).val_batches(3)
    assert len(batches) == 3
    for (x, y), (x2, y2) in zip(batches, again):  # independent of the seed
        assert x.shape == y.shape == (4, 32)
        np.testing.assert_array_equal(x, x2)
        np.testing.assert_array_equal(x[:, 1:], y[:, :-1])
    # on data whose token equals its position, x[:, 0] is the window's start
    data = np.arange(1000, dtype=np.int64)
    s = Sampler(data, seq_len=32, global_batch=4)
    starts = np.concatenate([x[:, 0] for x, _ in s.val_batches(3)])
    assert starts[0] == 0 and np.all(np.diff(starts) > 0)  # distinct, in order
    assert starts[-1] >= s.num_starts - s.num_starts / 12 - 1  # reaches the end of the split
    assert np.all(np.abs(np.diff(starts) - s.num_starts / 12) <= 1)  # evenly spaced
    np.testing.assert_array_equal(s.val_batches(3)[1][1][2], data[starts[6] + 1:starts[6] + 33])


def test_entropy_on_known_distributions():
    # uniform over 4 symbols: H = log 4; deterministic successor: H(next | current) = 0
    cyc = np.tile(np.array([1, 2, 3, 4], dtype=np.uint8), 1000)
    assert entropy_unigram(cyc) == pytest.approx(math.log(4))
    assert entropy_bigram(cyc) == pytest.approx(0.0, abs=1e-12)
    # p = (1/2, 1/4, 1/4)
    assert entropy_unigram(np.array([0, 0, 1, 2])) == pytest.approx(1.5 * math.log(2))
    # i.i.d. fair bits: conditional entropy ~ log 2
    bits = np.random.default_rng(0).integers(0, 2, 200000)
    assert entropy_bigram(bits) == pytest.approx(math.log(2), abs=1e-3)
    # after 0 always 1; after 1 a fair coin between 0 and 2; after 2 always 0.  Only the
    # 1s (2 of every 5 tokens on average) leave a choice: H(next | current) = 0.4 * log 2
    rng = np.random.default_rng(1)
    seq = [0]
    while len(seq) < 200000:
        seq += [1, 0] if rng.random() < 0.5 else [1, 2, 0]
    assert entropy_bigram(np.array(seq)) == pytest.approx(math.log(2) * 0.4, abs=5e-3)
    with pytest.raises(ValueError):
        entropy_bigram(np.array([1]))


def test_default_corpus_entropies_are_those_the_docs_quote():
    data = load_corpus()
    assert entropy_unigram(data) == pytest.approx(3.15, abs=0.1)
    assert entropy_bigram(data) == pytest.approx(2.42, abs=0.1)
    assert entropy_bigram(data) < entropy_unigram(data)
