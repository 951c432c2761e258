"""Token shards: prepare writes them whole or not at all, training memory-maps them, a damaged or
foreign shard is refused in one line, bits per byte follow the tokenizer, and a resumed run
draws exactly the batches of the uninterrupted one across shard boundaries."""
import json
import math
import os

import numpy as np
import pytest

pytest.importorskip("tokenizers")

from minidist.host.files import replace_atomically  # noqa: E402
from minidist.state import prepare as pr  # noqa: E402
from minidist.state import shards  # noqa: E402
from minidist.state import tokenizer as tk  # noqa: E402
from minidist.state.data import Sampler, load_corpus  # noqa: E402
from minidist.train.testing import run_train  # noqa: E402

pytestmark = pytest.mark.xdist_group(name="shards")  # its module fixture runs once, in one worker

ARGS = ["--layers", "1", "--d-model", "16", "--heads", "2", "--seq-len", "16", "--batch-size", "8",
        "--eval-every", "0", "--dtype", "float64", "--warmup", "0", "--quiet", "--steps", "6"]
SHARD_TOKENS = 1000
SMALL_SHARDS = 100  # the resumed run's shards: most batches hold a window that crosses one


@pytest.fixture(scope="module")
def corpus() -> bytes:
    return load_corpus(max_bytes=16_000).tobytes()


def _prepared(root, corpus, vocab, shard_tokens=SHARD_TOKENS):
    """(tokenizer file, shard directory) of ``corpus`` with a BPE of ``vocab`` tokens."""
    tok = root / f"tok{vocab}.json"
    replace_atomically(str(tok), tk.train(corpus, vocab).to_str())
    out = root / f"shards{vocab}"
    pr.prepare(tk.BPETokenizer(str(tok)), corpus, str(out), 0.1, shard_tokens)
    return tok, out


@pytest.fixture(scope="module")
def bpe(corpus, tmp_path_factory):
    return _prepared(tmp_path_factory.mktemp("bpe"), corpus, 300)


@pytest.fixture(scope="module")
def bpe256(corpus, tmp_path_factory):
    """A byte-level BPE without merges: the 256-token model every checkpoint reader accepts."""
    return _prepared(tmp_path_factory.mktemp("bpe256"), corpus, 256, SMALL_SHARDS)


def test_prepare_writes_headed_shards_that_decode_to_the_corpus(bpe, corpus):
    tok_path, out = bpe
    tok = tk.BPETokenizer(str(tok_path))
    m = json.loads((out / "manifest.json").read_text())
    assert m["tokenizer"] == tok.hash and m["vocab_size"] == 300 and m["dtype"] == "uint16"
    decoded = b""
    for split in ("train", "val"):
        s = m["splits"][split]
        assert sum(n for _, n in s["files"]) == s["tokens"] and all(n <= SHARD_TOKENS for _, n in s["files"])
        for name, count in s["files"]:
            raw = (out / name).read_bytes()
            h = np.frombuffer(raw[:64], dtype=shards.HEADER)[0]
            assert (h["magic"], h["version"], h["itemsize"], h["count"]) == (b"MDTOKENS", 1, 2, count)
            assert h["tokenizer"].decode() == tok.hash and len(raw) == 64 + 2 * count
            decoded += tok.decode_bytes(np.frombuffer(raw[64:], dtype="<u2"))
    assert len(m["splits"]["train"]["files"]) > 1  # the training split crosses shards
    assert decoded == corpus  # train then val: the whole corpus, exactly
    assert m["splits"]["val"]["bytes"] == round(0.1 * len(corpus))


def test_the_token_dtype_is_uint16_where_the_vocabulary_fits_else_uint32(tmp_path):
    assert shards.token_dtype(65536) == np.uint16 and shards.token_dtype(65537) == np.uint32
    ids = np.array([0, 70000, 2**32 - 1], dtype=np.int64)
    shards.write_shard(str(tmp_path / "s.bin"), ids, shards.token_dtype(2**32), "0" * 16)
    mapped = shards._map(str(tmp_path / "s.bin"), 3, np.dtype("<u4"), "0" * 16)
    assert isinstance(mapped, np.memmap) and mapped.tolist() == ids.tolist()


def test_windows_cross_shard_boundaries_as_one_sequence(bpe):
    info, splits = shards.open_shards(str(bpe[1]))
    tokens = splits["train"]
    whole = np.concatenate([np.asarray(m) for m in tokens.maps])
    assert len(tokens) == len(whole) and all(isinstance(m, np.memmap) for m in tokens.maps)
    positions = np.arange(SHARD_TOKENS - 5, SHARD_TOKENS + 5)[None, :] + np.array([[0], [SHARD_TOKENS]])
    np.testing.assert_array_equal(tokens.gather(positions), whole[positions])
    a, b = Sampler(tokens, 16, 8, seed=3), Sampler(whole, 16, 8, seed=3)
    for step in range(4):
        np.testing.assert_array_equal(a.batch(step)[0], b.batch(step)[0])
    assert info.bytes_per_token[0] > 1.2  # BPE: more than a byte per token


def _copy(src, dst):
    dst.mkdir()
    for name in os.listdir(src):
        (dst / name).write_bytes((src / name).read_bytes())
    return dst


@pytest.mark.parametrize("damage, needle", [
    (lambda d: os.remove(d / "train-000001.bin"), "train-000001.bin: missing"),
    (lambda d: _truncate(d / "train-000001.bin"), "train-000001.bin: truncated"),
    (lambda d: _patch(d / "train-000000.bin", 24, b"ffffffffffffffff"), "a shard of tokenizer ffffffffffffffff"),
    (lambda d: _patch(d / "val-000000.bin", 0, b"NOTASHRD"), "val-000000.bin: not a minidist token shard"),
    (lambda d: _patch(d / "tokenizer.json", 0, b"["), "tokenizer.json: tokenizer"),
    (lambda d: (d / "manifest.json").write_text("{"), "manifest.json: cannot be read as JSON"),
    (lambda d: os.remove(d / "manifest.json"), "without manifest.json: neither a text file nor token shards"),
])
def test_a_missing_truncated_or_foreign_shard_is_named(bpe, tmp_path, damage, needle):
    d = _copy(bpe[1], tmp_path / "d")
    damage(d)
    with pytest.raises(shards.ShardError) as err:
        shards.open_shards(str(d))
    assert needle in str(err.value) and "\n" not in str(err.value), err.value


def _truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[:-2])


def _patch(path, offset, data):
    raw = bytearray(path.read_bytes())
    raw[offset:offset + len(data)] = data
    path.write_bytes(bytes(raw))


def test_training_refuses_a_damaged_shard_directory_in_one_line(bpe, tmp_path):
    d = _copy(bpe[1], tmp_path / "d")
    _truncate(d / "train-000000.bin")
    r = run_train(None, ARGS + ["--data", str(d)], timeout=60)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "train-000000.bin: truncated" in r.stderr, r.stderr


def test_prepare_bad_input_is_one_line_exit_2_and_writes_nothing(bpe, tmp_path, capsys):
    tok = str(bpe[0])
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine")
    bad_tok = tmp_path / "bad.json"
    bad_tok.write_text("{")
    cases = [(["--tokenizer", tok, "-o", str(full)], "exists with other content"),
             (["--tokenizer", str(bad_tok), "-o", str(tmp_path / "o1")], "not a tokenizers file"),
             (["--tokenizer", tok, "--data", "/no/such", "-o", str(tmp_path / "o2")], "does not exist")]
    for argv, needle in cases:
        with pytest.raises(SystemExit) as stop:
            pr.main(argv)
        err = capsys.readouterr().err
        assert stop.value.code == 2 and needle in err and len(err.strip().splitlines()) == 1, err
    assert sorted(os.listdir(tmp_path)) == ["bad.json", "full"] and os.listdir(full) == ["keep.txt"]


def test_prepare_reports_progress_and_fills_an_empty_directory(bpe, corpus, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(pr, "PROGRESS_S", 0.0)
    data = tmp_path / "c.txt"
    data.write_bytes(corpus)
    out = tmp_path / "empty"
    out.mkdir()
    assert pr.main(["--tokenizer", str(bpe[0]), "--data", str(data), "-o", str(out)]) == 0
    captured = capsys.readouterr()
    assert "prepare: " in captured.err and "MiB encoded" in captured.err and "wrote " in captured.out
    assert (out / "manifest.json").exists() and sorted(os.listdir(tmp_path)) == ["c.txt", "empty"]


def _metrics(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_training_on_shards_reports_bits_per_byte(bpe, tmp_path):
    """The model's vocabulary follows the tokenizer, and bits per byte are the loss / ln 2 / the
    split's bytes per token (in the metrics, the progress line and the summary)."""
    out = tmp_path / "m.jsonl"
    loud = [a for a in ARGS if a != "--quiet"] + ["--eval-every", "3", "--log-every", "1"]
    r = run_train(None, loud + ["--data", str(bpe[1]), "--metrics-jsonl", str(out)], timeout=120)
    assert r.returncode == 0, r.stderr
    m = json.loads((bpe[1] / "manifest.json").read_text())["splits"]
    per = {s: m[s]["bytes"] / m[s]["tokens"] for s in ("train", "val")}
    records = _metrics(out)
    for rec in records:
        assert rec["bpb"] == pytest.approx(rec["loss"] / math.log(2) / per["train"], rel=1e-12)
    assert records[0]["loss"] == pytest.approx(math.log(300), rel=0.05)  # 300 tokens, near uniform at first
    val = [rec for rec in records if "val_loss" in rec]
    assert val and all(rec["val_bpb"] == pytest.approx(rec["val_loss"] / math.log(2) / per["val"]) for rec in val)
    assert "training tokens (tokenizer" in r.stdout and " bpb)" in r.stdout and "bits per byte" in r.stdout, r.stdout


def test_the_byte_tokenizer_has_one_byte_per_token(tmp_path):
    out = tmp_path / "m.jsonl"
    r = run_train(None, ARGS + ["--steps", "2", "--eval-every", "2", "--metrics-jsonl", str(out)], timeout=60)
    assert r.returncode == 0, r.stderr
    for rec in _metrics(out):
        assert rec["bpb"] == rec["loss"] / math.log(2) and rec.get("val_bpb", 0) == rec.get("val_loss", 0) / math.log(2)


def test_a_vocabulary_tp_does_not_divide_is_padded_not_refused(bpe):
    """The shards' vocabulary is the model's; tensor parallelism pads one that tp does not divide
    (parallel/tensor/vocab_parallel.py), so the axes' checks raise nothing about it."""
    from minidist.parallel.compose import problems
    from minidist.train.config import RunConfig

    vocab = shards.describe(str(bpe[1])).vocab_size
    assert vocab == 300
    given = RunConfig().replace(model=dict(vocab_size=vocab, heads=8, d_model=16), parallel=dict(tp=8))
    assert not [p for p in problems(given, 8) if "vocabulary" in p]
    assert not [p for p in problems(given.replace(parallel=dict(tp=4)), 4) if "vocabulary" in p]


def _train(args, tmp_path, name):
    out = tmp_path / f"{name}.jsonl"
    r = run_train(None, ARGS + args + ["--metrics-jsonl", str(out)], timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    return [rec["loss"] for rec in _metrics(out)]


def test_a_resumed_run_draws_the_same_batches_across_shard_boundaries(bpe256, tmp_path):
    """6 steps straight against 3 + 3 resumed from a checkpoint, on shards whose windows cross
    shard boundaries: the same losses and parameters, bit for bit; the checkpoint names the data."""
    from minidist.state.checkpoint import load_full, metadata

    data = str(bpe256[1])
    info, splits = shards.open_shards(data)
    sampler = Sampler(splits["train"], 16, 8)
    starts = np.concatenate([_starts(s, splits["train"]) for s in range(3, 6)])  # steps 4-6 (0-based 3-5)
    np.testing.assert_array_equal(sampler.windows(starts[:8])[0], sampler.batch(3)[0])
    crossing = (starts // SMALL_SHARDS) != ((starts + 16) // SMALL_SHARDS)
    assert crossing.any(), "no window of steps 4-6 crosses a shard boundary"
    for d in "abc":
        (tmp_path / d).mkdir()
    straight = _train(["--data", data, "--save", str(tmp_path / "a")], tmp_path, "straight")
    first = _train(["--data", data, "--save", str(tmp_path / "b"), "--save-every", "3"], tmp_path, "first")
    ck = tmp_path / "b" / "step-000003"
    scalars = metadata(str(ck))["scalars"]
    assert (scalars["data_tokenizer"], scalars["data_shards"]) == (info.tokenizer, info.shards)
    second = _train(["--data", data, "--save", str(tmp_path / "c"), "--resume", str(ck)], tmp_path, "second")
    assert first[:3] + second == straight
    a, c = load_full(str(tmp_path / "a"))[1], load_full(str(tmp_path / "c"))[1]
    assert a.keys() == c.keys() and all(np.array_equal(a[k], c[k]) for k in a)


def _starts(step, tokens):
    rng = np.random.default_rng([0, step])  # Sampler.batch's draw (seed 0)
    return rng.integers(0, len(tokens) - 16, size=8)


def test_a_checkpoint_refuses_data_of_another_tokenizer_naming_both(bpe256, tmp_path):
    ck = tmp_path / "ck"
    ck.mkdir()
    _train(["--steps", "1", "--save", str(ck)], tmp_path, "bytes")  # the byte tokenizer
    info = shards.describe(str(bpe256[1]))
    r = run_train(None, ARGS + ["--data", str(bpe256[1]), "--resume", str(ck)], timeout=60)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert f"trained with tokenizer bytes, --data {bpe256[1]} is of tokenizer {info.tokenizer}" in r.stderr, r.stderr


def test_a_checkpoint_of_a_bpe_model_resumes(bpe, tmp_path):
    ck = tmp_path / "ck"
    ck.mkdir()
    _train(["--data", str(bpe[1]), "--steps", "2", "--save", str(ck)], tmp_path, "saved")
    _train(["--data", str(bpe[1]), "--steps", "3", "--resume", str(ck)], tmp_path, "resumed")


@pytest.mark.mpi
def test_a_dp2_tp2_checkpoint_on_shards_resumes_on_one_process(bpe256, tmp_path):
    """Steps 1-3 on dp2 x tp2, saved; steps 4-6 on one process: the losses of the uninterrupted
    one-process run (to float64 round-off: the meshes add in another order)."""
    data = str(bpe256[1])
    for d in "ab":
        (tmp_path / d).mkdir()
    straight = _train(["--data", data], tmp_path, "straight")
    out = tmp_path / "mesh.jsonl"
    r = run_train(4, ARGS + ["--data", data, "--dp", "2", "--tp", "2", "--steps", "6", "--save", str(tmp_path / "a"),
                             "--save-every", "3", "--metrics-jsonl", str(out)], timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    first = [rec["loss"] for rec in _metrics(out)]
    second = _train(["--data", data, "--resume", str(tmp_path / "a" / "step-000003")], tmp_path, "second")
    np.testing.assert_allclose(first[:3] + second, straight, rtol=1e-9)
