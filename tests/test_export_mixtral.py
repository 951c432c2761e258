"""A Llama with a top-2 mixture of experts in every block exports as Hugging Face's Mixtral
(minidist/state/export_mixtral.py): transformers loads every weight and gives minidist's logits."""
import json
import subprocess
import sys

import numpy as np
import pytest

from minidist.state.export import read_safetensors
from minidist.state.export_mixtral import problems
from minidist.train.testing import run_train

pytestmark = pytest.mark.xdist_group(name="export_mixtral")  # its module fixture runs once, in one worker

ARGS = ["--arch", "llama", "--experts", "4", "--top-k", "2", "--layers", "2", "--d-model", "32", "--heads", "4",
        "--kv-heads", "2", "--ffn-hidden", "48", "--seq-len", "16", "--batch-size", "4", "--steps", "3",
        "--lr", "1e-2", "--warmup", "0", "--eval-every", "0", "--quiet"]


def _train(tmp_path_factory, name, extra=()):
    d = tmp_path_factory.mktemp(name)
    r = run_train(None, ARGS + list(extra) + ["--save", str(d)], timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    return str(d)


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    """A float32 checkpoint of a Llama with 4 experts, top 2, in both blocks, trained 3 steps."""
    return _train(tmp_path_factory, "mixtral")


def _export(*args):
    return subprocess.run([sys.executable, "-m", "minidist.state.export", *args], capture_output=True, text=True,
                          timeout=120)


def test_the_names_and_shapes_are_mixtrals(mixtral, tmp_path):
    from minidist.state.checkpoint import load_full

    r = _export(mixtral, "-o", str(tmp_path / "hf"))
    assert r.returncode == 0, r.stderr
    _, tensors = read_safetensors(str(tmp_path / "hf" / "model.safetensors"))
    _, params = load_full(mixtral)
    at = "model.layers.1.block_sparse_moe."
    assert tensors[f"{at}gate.weight"].shape == (4, 32)
    np.testing.assert_array_equal(tensors[f"{at}gate.weight"], params["h.1.mlp.router.weight"].T)
    gate_up = params["h.1.mlp.experts.3.gate_up_proj.weight"]  # (d, 2F): [gate | up]
    np.testing.assert_array_equal(tensors[f"{at}experts.3.w1.weight"], gate_up[:, :48].T)
    np.testing.assert_array_equal(tensors[f"{at}experts.3.w3.weight"], gate_up[:, 48:].T)
    np.testing.assert_array_equal(tensors[f"{at}experts.3.w2.weight"], params["h.1.mlp.experts.3.down_proj.weight"].T)
    assert not [k for k in tensors if ".mlp." in k]  # no dense feed-forward
    assert len(tensors) == 1 + 2 * (2 + 4 + 1 + 3 * 4) + 2
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    want = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "num_local_experts": 4,
            "num_experts_per_tok": 2, "intermediate_size": 48, "num_key_value_heads": 2, "sliding_window": None,
            "router_jitter_noise": 0.0, "tie_word_embeddings": False}
    assert {k: config[k] for k in want} == want


@pytest.mark.slow  # importing torch and transformers takes most of it
def test_transformers_loads_the_mixtral_export_and_gives_minidists_logits(mixtral, tmp_path):
    """MixtralForCausalLM.from_pretrained(OUTDIR): no missing, unexpected or mismatched weights,
    and minidist's logits in float32 to 1e-5 normwise (softmax over all experts, top 2,
    renormalised, in both)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import torch
    from transformers import MixtralForCausalLM

    from minidist.state.generate import load_model

    assert _export(mixtral, "-o", str(tmp_path / "hf")).returncode == 0
    model, info = MixtralForCausalLM.from_pretrained(str(tmp_path / "hf"), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert model.dtype == torch.float32
    model.eval()
    ids = np.random.default_rng(1).integers(0, 256, size=(3, 16))
    mine = load_model(mixtral)
    want = np.asarray(mine(ids).data)
    counts = [block.mlp.last_counts for block in mine.h]
    assert all((c > 0).sum() >= 3 for c in counts), counts  # the tokens spread over the experts
    with torch.no_grad():
        got = model(torch.from_numpy(ids)).logits.numpy()
    assert got.shape == want.shape == (3, 16, 256)
    err = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
    assert err <= 1e-5, err


@pytest.mark.slow  # importing torch and transformers takes most of it
def test_mixtral_generates_greedily_what_minidist_generates(mixtral, tmp_path):
    """The float64 export and minidist's KV-cache generation (the mixture routed per token, as
    moe.py routes it) continue a prompt with the same 20 greedy tokens."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import torch
    from transformers import AutoModelForCausalLM

    from minidist.layout.model import ModelConfig
    from minidist.model.nn import GPT
    from minidist.state.checkpoint import load_full
    from minidist.state.generate import generate_ids

    assert _export(mixtral, "-o", str(tmp_path / "hf"), "--dtype", "float64").returncode == 0
    # eager: the loop over experts of the reference (the grouped matmul kernel takes no float64)
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float64, experts_implementation="eager")
    assert type(hf).__name__ == "MixtralForCausalLM"
    config, params = load_full(mixtral)
    mine = GPT(ModelConfig.from_record({**config, "dtype": "float64"}))
    mine.load_state_dict(params)  # its float32 values widened exactly
    prompt = list(b"import os\n")
    want = generate_ids(mine, prompt, 20, temperature=0)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        got = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False)
    assert got[0].tolist() == want


@pytest.mark.parametrize("change, needle", [
    (dict(capacity_factor=1.25), "capacity factor is 1.25 (0 is dropless)"),
    (dict(top_k=1), "this model's top-1 weighs it by its probability"),
    (dict(moe_every=2), "this model has one every 2"),
    (dict(arch="gpt2"), "this model is gpt2"),
])
def test_what_mixtral_cannot_hold_is_named(change, needle):
    model = {"arch": "llama", "experts": 4, "top_k": 2, "moe_every": 1, "capacity_factor": 0.0}
    assert problems(model) == []
    found = problems({**model, **change})
    assert len(found) == 1 and needle in found[0], found


def test_a_dropping_mixture_is_refused_in_one_line_exit_2(tmp_path_factory, tmp_path):
    ck = _train(tmp_path_factory, "capacity", ["--capacity-factor", "1.0", "--steps", "1"])
    r = _export(ck, "-o", str(tmp_path / "hf"))
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1, r.stderr
    assert "cannot export as Mixtral: Mixtral drops no token: this model's capacity factor is 1.0" in r.stderr
    assert not (tmp_path / "hf").exists()
