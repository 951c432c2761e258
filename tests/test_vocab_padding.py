"""Any vocabulary under tensor parallelism: padded to a multiple of tp, the padding masked out of
the loss, so every mesh equals one process (parallel/tensor/vocab_parallel.py)."""
import json
import os

import numpy as np
import pytest

from minidist.model.backend import from_host, to_host
from minidist.parallel import tensor as tpm
from minidist.train.testing import run_mpi

pytestmark = pytest.mark.xdist_group(name="vocab_padding")  # its module fixture runs once, in one worker

BODIES = os.path.join(os.path.dirname(__file__), "mpi", "vocab_padding_bodies.py")


def test_a_shard_of_a_padded_vocabulary_ends_in_zero_rows():
    full = np.arange(7 * 2, dtype=np.float64).reshape(7, 2) + 1  # 7 tokens on 3 ranks: 3 rows each, 2 padding
    parts = [tpm.Shard(dim=0, index=r, parts=3) for r in range(3)]
    assert all(s.local_shape(full.shape) == (3, 2) for s in parts)
    assert [to_host(s.indices(7)).tolist() for s in parts] == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    np.testing.assert_array_equal(to_host(parts[2].take(from_host(full))), [[13, 14], [0, 0], [0, 0]])
    np.testing.assert_array_equal(np.concatenate([to_host(s.take(full)) for s in parts])[:7], full)
    assert [tpm.real_columns(7, 3, r) for r in range(3)] == [3, 3, 1]
    assert tpm.real_columns(5, 2, 3) == 0  # a rank all of whose rows are padding


@pytest.mark.mpi
def test_tp4_tp2_dp2_x_tp2_and_pp2_x_tp2_with_301_tokens_equal_one_process():
    out = run_mpi(4, f"{BODIES}::training_matches_serial", timeout=240).stdout
    for label in ("tp=4 tied", "tp=4 untied, sequence parallel", "tp=4 llama", "tp=2 ring", "dp=2 x tp=2",
                  "dp=2 x tp=2 ZeRO-1", "pp=2 x tp=2"):
        assert f"padded ok: {label}" in out, out
    assert out.count("padded done") == 4, out


# -- a checkpoint of a padded vocabulary ----------------------------------------------------------
ARGS = ["--layers", "2", "--d-model", "24", "--heads", "6", "--seq-len", "12", "--batch-size", "6", "--steps", "6",
        "--eval-every", "0", "--dtype", "float64", "--warmup", "0", "--quiet"]


@pytest.fixture(scope="module")
def shards301(tmp_path_factory):
    """Token shards of a 301-token BPE: a vocabulary neither tp 2 nor tp 3 divides."""
    pytest.importorskip("tokenizers")
    from minidist.host.files import replace_atomically
    from minidist.state import prepare as pr
    from minidist.state import tokenizer as tk
    from minidist.state.data import load_corpus

    root = tmp_path_factory.mktemp("bpe301")
    corpus = load_corpus(max_bytes=16_000).tobytes()
    replace_atomically(str(root / "tok.json"), tk.train(corpus, 301).to_str())
    pr.prepare(tk.BPETokenizer(str(root / "tok.json")), corpus, str(root / "shards"), 0.1, 4000)
    return str(root / "shards")


def _run(n, args, tmp_path, name):
    from minidist.train.testing import run_train

    (tmp_path / name).mkdir()
    out = tmp_path / f"{name}.jsonl"
    r = run_train(n, ARGS + args + ["--save", str(tmp_path / name), "--metrics-jsonl", str(out)], timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    return np.array([json.loads(line)["loss"] for line in out.read_text().splitlines()])


def _rel(a, b):
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-300))


@pytest.mark.mpi
def test_a_checkpoint_saved_at_tp2_resumes_at_tp3_and_on_one_process(shards301, tmp_path):
    """Saved at tp 2 (302 rows) after step 3, it holds the unpadded 301 tokens and resumes at tp 3
    (303 rows) and on one process (301): steps 4-6 as the uninterrupted one-process run, losses
    and every parameter to 1e-9."""
    from minidist.state.checkpoint import load_full, metadata

    data = ["--data", shards301]
    straight = _run(None, data, tmp_path, "one")
    saved = _run(2, data + ["--tp", "2", "--save-every", "3"], tmp_path, "tp2")
    assert _rel(saved, straight) < 1e-9
    ck = str(tmp_path / "tp2" / "step-000003")
    assert metadata(ck)["tensors"]["wte.weight/param"]["global_shape"] == [301, 24]
    config, params = load_full(ck)
    assert config["vocab_size"] == 301 and params["wte.weight"].shape == (301, 24)
    want = load_full(str(tmp_path / "one"))[1]
    for n, mesh in ((3, ["--tp", "3"]), (None, [])):
        name = f"resumed-{n or 1}"
        losses = _run(n, data + mesh + ["--resume", ck], tmp_path, name)
        assert len(losses) == 3 and _rel(losses, straight[3:]) < 1e-9, (mesh, losses, straight)
        got = load_full(str(tmp_path / name))[1]
        assert got.keys() == want.keys() and max(_rel(got[k], want[k]) for k in want) < 1e-9, mesh
