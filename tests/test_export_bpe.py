"""A model trained on a BPE's token shards: ``python -m minidist.state.generate`` decodes its
tokens, and the export carries the tokenizer, so transformers' AutoTokenizer +
AutoModelForCausalLM generate the same text from the same prompt."""
import json
import subprocess
import sys

import pytest

pytest.importorskip("tokenizers")

from minidist.host.files import replace_atomically  # noqa: E402
from minidist.state import prepare as pr  # noqa: E402
from minidist.state import tokenizer as tk  # noqa: E402
from minidist.state.data import load_corpus  # noqa: E402
from minidist.train.testing import run_train  # noqa: E402

pytestmark = pytest.mark.xdist_group(name="export_bpe")  # its module fixture runs once, in one worker

VOCAB = 301
PROMPT = "def main(self"
ARGS = ["--layers", "2", "--d-model", "32", "--heads", "4", "--seq-len", "32", "--batch-size", "8", "--steps", "4",
        "--lr", "3e-3", "--warmup", "0", "--eval-every", "0", "--dtype", "float64", "--quiet"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(tokenizer file, shard directory, {arch: checkpoint directory}) of a 301-token BPE and a
    GPT-2 and a Llama trained on its shards for a few steps."""
    root = tmp_path_factory.mktemp("bpe")
    corpus = load_corpus(max_bytes=16_000).tobytes()
    tok = root / "tok.json"
    replace_atomically(str(tok), tk.train(corpus, VOCAB).to_str())
    shards = root / "shards"
    pr.prepare(tk.BPETokenizer(str(tok)), corpus, str(shards), 0.1, 4000)
    out = {}
    for arch in ("gpt2", "llama"):
        ck = root / arch
        ck.mkdir()
        r = run_train(None, ARGS + ["--arch", arch, "--data", str(shards), "--save", str(ck)], timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
        out[arch] = str(ck)
    return str(tok), str(shards), out


def _cli(module, *args):
    return subprocess.run([sys.executable, "-m", f"minidist.state.{module}", *args], capture_output=True, text=True,
                          timeout=120)


def test_generation_decodes_the_bpe_tokens(trained):
    """The prompt is encoded by the checkpoint's tokenizer and every sampled id decoded by it:
    a continuation of 301-token ids is not bytes."""
    from minidist.state.generate import generate, generate_ids, load_model

    tok_file, _, checkpoints = trained
    tok, model = tk.BPETokenizer(tok_file), load_model(checkpoints["gpt2"])
    assert model.config.vocab_size == VOCAB
    prompt = tok.encode(PROMPT).tolist()
    assert len(prompt) < len(PROMPT.encode())  # merges were used
    ids = generate_ids(model, prompt, 12, temperature=0)
    assert ids[:len(prompt)] == prompt and len(ids) == len(prompt) + 12
    assert generate(model, PROMPT.encode(), 12, temperature=0, tokenizer=tok) == tok.decode_bytes(ids)


@pytest.mark.slow  # importing torch and transformers takes most of it
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_autotokenizer_and_automodel_generate_what_minidist_generates(arch, trained, tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok_file, shards, checkpoints = trained
    out = tmp_path / "hf"
    r = _cli("export", checkpoints[arch], "-o", str(out), "--tokenizer", shards)  # the shard directory holds it
    assert r.returncode == 0, r.stderr
    assert {"tokenizer.json", "tokenizer_config.json", "config.json", "model.safetensors"} <= {
        p.name for p in out.iterdir()}
    assert (out / "tokenizer.json").read_text() == open(tok_file).read()
    config = json.loads((out / "config.json").read_text())
    hf_tok = AutoTokenizer.from_pretrained(str(out))
    assert len(hf_tok) == config["vocab_size"] == VOCAB
    assert hf_tok.bos_token_id is None and hf_tok.eos_token_id is None  # no special tokens, as config.json says
    assert config["bos_token_id"] is None and config["eos_token_id"] is None
    ids = hf_tok(PROMPT, return_tensors="pt").input_ids
    assert ids[0].tolist() == tk.BPETokenizer(tok_file).encode(PROMPT).tolist()
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float64)
    with torch.no_grad():
        got = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False)
    want = _cli("generate", checkpoints[arch], "--tokenizer", tok_file, "--prompt", PROMPT, "--tokens", "16",
                "--temperature", "0")
    assert want.returncode == 0, want.stderr
    text = hf_tok.decode(got[0])
    assert text.startswith(PROMPT) and len(text) > len(PROMPT) + 8, text
    assert want.stdout == text + "\n", (want.stdout, text)


def test_a_missing_or_foreign_tokenizer_is_one_line_exit_2(trained, tmp_path):
    tok_file, _, checkpoints = trained
    other = tmp_path / "other.json"
    replace_atomically(str(other), tk.train(b"abc abd abe " * 50, 260).to_str())
    h = tk.BPETokenizer(tok_file).hash
    missing, foreign = (f"the checkpoint was trained with tokenizer {h}: give its file with --tokenizer",
                        f"but the checkpoint was trained with tokenizer {h}")
    for module, args, needle in (("generate", [], missing), ("export", [], missing),
                                 ("generate", ["--tokenizer", str(other)], foreign),
                                 ("export", ["--tokenizer", str(tmp_path / "none.json")], "cannot be read")):
        extra = ["--tokens", "2"] if module == "generate" else ["-o", str(tmp_path / "x")]
        r = _cli(module, checkpoints["gpt2"], *extra, *args)
        assert r.returncode == 2 and needle in r.stderr and len(r.stderr.splitlines()) == 1, (module, r.stderr)
    assert not (tmp_path / "x").exists()  # refused before anything was written
