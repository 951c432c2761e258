"""minidist.state.export: a checkpoint as a Hugging Face GPT-2 (model.safetensors + config.json)."""
import json
import os
import struct
import subprocess
import sys

import numpy as np
import pytest

from minidist.state.export import export, read_safetensors, write_safetensors
from minidist.train.testing import run_train

pytestmark = pytest.mark.xdist_group(name="export")  # its module fixture runs once, in one worker

ARGS = ["--layers", "2", "--d-model", "32", "--heads", "4", "--seq-len", "32", "--batch-size", "4",
        "--steps", "3", "--eval-every", "0", "--quiet"]


def _gpt2_names(n_layer, tied):
    names = ["transformer.wte.weight", "transformer.wpe.weight"]
    for i in range(n_layer):
        for part in ("ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias", "attn.c_proj.weight",
                     "attn.c_proj.bias", "ln_2.weight", "ln_2.bias", "mlp.c_fc.weight", "mlp.c_fc.bias",
                     "mlp.c_proj.weight", "mlp.c_proj.bias"):
            names.append(f"transformer.h.{i}.{part}")
    names += ["transformer.ln_f.weight", "transformer.ln_f.bias"]
    return names if tied else names + ["lm_head.weight"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A tied and an untied float32 checkpoint of a tiny model, 3 steps each."""
    out = {}
    for name, extra in (("tied", []), ("untied", ["--untied"])):
        d = tmp_path_factory.mktemp(name)
        r = run_train(None, ARGS + extra + ["--save", str(d)], timeout=180)
        assert r.returncode == 0, r.stdout + r.stderr
        out[name] = str(d)
    return out


def _export_cli(*args):
    return subprocess.run([sys.executable, "-m", "minidist.state.export", *args], capture_output=True, text=True,
                          timeout=120)


def _minidist_logits(path, ids):
    from minidist.state.generate import load_model

    return np.asarray(load_model(path)(ids).data)


def _minidist_model(path, dtype):
    """Checkpoint ``path``'s model in ``dtype`` (its float32 values widened exactly)."""
    from minidist.state.checkpoint import load_full
    from minidist.layout.model import ModelConfig
    from minidist.model.nn import GPT

    config, params = load_full(path)
    model = GPT(ModelConfig.from_record({**config, "dtype": dtype}))
    model.load_state_dict(params)
    return model


def _normwise(got, want):
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


@pytest.mark.parametrize("kind", ["tied", "untied"])
def test_the_header_parses_and_names_and_shapes_are_gpt2s(kind, checkpoints, tmp_path):
    from minidist.state.checkpoint import load_full

    r = _export_cli(checkpoints[kind], "-o", str(tmp_path / "hf"))
    assert r.returncode == 0, r.stderr
    assert sorted(os.listdir(tmp_path / "hf")) == ["config.json", "model.safetensors"]  # no temporary left
    raw = (tmp_path / "hf" / "model.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    assert (8 + n) % 8 == 0 and header.pop("__metadata__")["format"] == "pt"
    assert list(header) == _gpt2_names(2, kind == "tied")
    d, reach = 32, 0
    want = {"transformer.wte.weight": [256, d], "transformer.wpe.weight": [32, d],
            "transformer.h.1.attn.c_attn.weight": [d, 3 * d], "transformer.h.1.attn.c_attn.bias": [3 * d],
            "transformer.h.0.attn.c_proj.weight": [d, d], "transformer.h.0.mlp.c_fc.weight": [d, 4 * d],
            "transformer.h.0.mlp.c_proj.weight": [4 * d, d], "transformer.ln_f.bias": [d]}
    if kind == "untied":
        want["lm_head.weight"] = [256, d]  # torch.nn.Linear's (out, in)
    for name, shape in want.items():
        assert header[name]["shape"] == shape, name
    for name, info in header.items():  # end to end, every byte accounted for
        assert info["dtype"] == "F32" and info["data_offsets"][0] == reach
        reach = info["data_offsets"][1]
        assert reach - info["data_offsets"][0] == 4 * int(np.prod(info["shape"]))
    assert 8 + n + reach == len(raw)
    # the values: minidist's own, in GPT-2's names (lm_head transposed)
    _, tensors = read_safetensors(str(tmp_path / "hf" / "model.safetensors"))
    _, params = load_full(checkpoints[kind])
    assert np.array_equal(tensors["transformer.h.1.attn.c_attn.weight"], params["h.1.attn.c_attn.weight"])
    assert np.array_equal(tensors["transformer.wte.weight"], params["wte.weight"])
    if kind == "untied":
        assert np.array_equal(tensors["lm_head.weight"], params["lm_head.weight"].T)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["model_type"] == "gpt2" and config["vocab_size"] == 256 and config["n_positions"] == 32
    assert config["activation_function"] == "gelu_new" and config["layer_norm_epsilon"] == 1e-5
    assert config["tie_word_embeddings"] is (kind == "tied")


def test_the_safetensors_package_reads_what_minidist_writes(tmp_path):
    """The reference reader (when installed) agrees with minidist's writer, bfloat16 included."""
    st = pytest.importorskip("safetensors.numpy")
    from minidist.model.backend import bfloat16

    rng = np.random.default_rng(0)
    tensors = {"b": rng.normal(size=(3, 5)).astype(np.float32), "a": rng.normal(size=(7,)),
               "c": rng.normal(size=(2, 2)).astype(np.float16), "d": np.arange(5, dtype=np.int64)}
    write_safetensors(str(tmp_path / "t.safetensors"), tensors, {"format": "pt"})
    got = st.load_file(str(tmp_path / "t.safetensors"))
    assert got.keys() == tensors.keys() and all(np.array_equal(got[k], tensors[k]) for k in tensors)
    meta, mine = read_safetensors(str(tmp_path / "t.safetensors"))
    assert meta == {"format": "pt"} and all(np.array_equal(mine[k], tensors[k]) for k in tensors)
    write_safetensors(str(tmp_path / "bf.safetensors"), {"x": tensors["b"].astype(bfloat16)})
    _, back = read_safetensors(str(tmp_path / "bf.safetensors"))
    assert back["x"].dtype == bfloat16 and np.array_equal(back["x"], tensors["b"].astype(bfloat16))


@pytest.mark.slow  # importing torch and transformers takes most of it
@pytest.mark.parametrize("kind", ["tied", "untied"])
def test_transformers_loads_the_export_and_gives_minidists_logits(kind, checkpoints, tmp_path):
    """GPT2LMHeadModel.from_pretrained(OUTDIR): no missing or unexpected weights, and the same
    logits as minidist's forward in float32, to 16 float32 eps (2**-19) normwise -- the two
    sum in different orders; measured 2 eps.  Exported in float64 (``--dtype float64``), its
    logits, loss and every parameter's gradient equal minidist's float64 model's on the same
    weights to 1e-12 normwise (max |error| / max |value| per tensor): float64's round-off is
    1.1e-16 per operation, the measured worst 9.5e-16."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import torch
    from transformers import GPT2LMHeadModel

    export(checkpoints[kind], str(tmp_path / "hf"))
    model, info = GPT2LMHeadModel.from_pretrained(str(tmp_path / "hf"), output_loading_info=True)
    buffers = {k for k in info["missing_keys"] if k.endswith((".attn.bias", ".attn.masked_bias"))}
    assert not set(info["missing_keys"]) - buffers and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert model.dtype == torch.float32
    assert (model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()) is (kind == "tied")
    model.eval()
    ids = np.random.default_rng(1).integers(0, 256, size=(3, 32))
    want = _minidist_logits(checkpoints[kind], ids)
    with torch.no_grad():
        got = model(torch.from_numpy(ids)).logits.numpy()
    assert got.shape == want.shape == (3, 32, 256)
    assert _normwise(got, want) <= 16 * 2.0**-23, _normwise(got, want)

    export(checkpoints[kind], str(tmp_path / "hf64"), dtype="float64")
    model = GPT2LMHeadModel.from_pretrained(str(tmp_path / "hf64"), dtype=torch.float64)
    assert model.dtype == torch.float64
    model.eval()
    mine = _minidist_model(checkpoints[kind], "float64")
    seq = np.random.default_rng(2).integers(0, 256, size=(3, 33))
    x, y = seq[:, :-1], seq[:, 1:]
    logits = model(torch.from_numpy(x)).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 256), torch.from_numpy(y).reshape(-1))
    loss.backward()
    assert _normwise(mine(x).data, logits.detach().numpy()) <= 1e-12
    my_loss = mine(x, y)
    my_loss.backward()
    assert abs(my_loss.item() - loss.item()) <= 1e-12 * abs(loss.item())
    grads = {n: p.grad for n, p in mine.named_parameters()}
    hf_params = list(model.named_parameters())
    assert len(hf_params) == len(grads)
    for name, p in hf_params:
        g = grads["lm_head.weight"].T if name == "lm_head.weight" else grads[name.removeprefix("transformer.")]
        err = _normwise(g, p.grad.numpy())
        assert err <= 1e-12, (name, err)


def test_a_second_export_replaces_the_files(checkpoints, tmp_path):
    out = tmp_path / "hf"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"old")
    (out / "config.json").write_text("{}")
    (out / "README").write_text("kept")
    for path in ("untied", "tied"):
        r = _export_cli(checkpoints[path], "-o", str(out))
        assert r.returncode == 0, r.stderr
    assert sorted(os.listdir(out)) == ["README", "config.json", "model.safetensors"]
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True
    assert "lm_head.weight" not in read_safetensors(str(out / "model.safetensors"))[1]


def test_dtype_option(checkpoints, tmp_path):
    r = _export_cli(checkpoints["tied"], "-o", str(tmp_path / "hf"), "--dtype", "float64")
    assert r.returncode == 0, r.stderr
    _, tensors = read_safetensors(str(tmp_path / "hf" / "model.safetensors"))
    assert all(a.dtype == np.float64 for a in tensors.values())
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == "float64"


def test_bad_input_is_one_line_and_exit_2(checkpoints, tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "file").write_text("x")
    for args in ([str(tmp_path / "missing"), "-o", str(tmp_path / "o")],
                 [str(tmp_path / "empty"), "-o", str(tmp_path / "o")],
                 [str(tmp_path / "file"), "-o", str(tmp_path / "o")],
                 [checkpoints["tied"], "-o", str(tmp_path / "file")],
                 [checkpoints["tied"]],
                 [checkpoints["tied"], "-o", str(tmp_path / "o"), "--dtype", "int8"]):
        r = _export_cli(*args)
        assert r.returncode == 2, (args, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1 and "error" in r.stderr and not r.stdout, (args, r.stderr)
    assert not (tmp_path / "o").exists()


def test_a_damaged_checkpoint_is_refused(checkpoints, tmp_path):
    import shutil

    src = os.path.join(checkpoints["tied"], "step-000003")
    dst = tmp_path / "step-000003"
    shutil.copytree(src, dst)
    data = bytearray((dst / "rank-00000.bin").read_bytes())
    data[100] ^= 0xFF
    (dst / "rank-00000.bin").write_bytes(bytes(data))
    r = _export_cli(str(dst), "-o", str(tmp_path / "o"))
    assert r.returncode == 2 and "damaged" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "o" / "model.safetensors").exists()


# ------------------------------------------------------------------------------------------------
# Llama: Hugging Face's LlamaForCausalLM
# ------------------------------------------------------------------------------------------------
LLAMA = ["--arch", "llama", "--heads", "4"]
LLAMA_RUNS = {"llama": (None, ["--kv-heads", "2"]),  # one process, grouped-query attention
              "llama-tp2-kv1": (2, ["--kv-heads", "1", "--tp", "2"])}  # one key/value head shared by 2 ranks


@pytest.fixture(scope="module")
def llama_checkpoints(tmp_path_factory):
    """Float32 Llama checkpoints of 3 steps: one process with 2 key/value heads, and tp2 with one
    (each rank holds the head; copy 0 writes it)."""
    out = {}
    for name, (ranks, extra) in LLAMA_RUNS.items():
        d = tmp_path_factory.mktemp(name)
        r = run_train(ranks, ARGS + LLAMA + extra + ["--save", str(d)], timeout=180)
        assert r.returncode == 0, r.stdout + r.stderr
        out[name] = str(d)
    return out


def _llama_names(n_layer):
    names = ["model.embed_tokens.weight"]
    for i in range(n_layer):
        names += [f"model.layers.{i}.{part}.weight" for part in (
            "input_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
            "post_attention_layernorm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]
    return names + ["model.norm.weight", "lm_head.weight"]


def test_a_llama_export_has_llamas_names_layout_and_config(llama_checkpoints, tmp_path):
    """Hugging Face's names in its order, every projection transposed to nn.Linear's (out, in),
    the fused gate|up split into gate_proj and up_proj, and a LlamaConfig of the model."""
    from minidist.state.checkpoint import load_full

    r = _export_cli(llama_checkpoints["llama"], "-o", str(tmp_path / "hf"))
    assert r.returncode == 0, r.stderr
    _, tensors = read_safetensors(str(tmp_path / "hf" / "model.safetensors"))
    model, params = load_full(llama_checkpoints["llama"])
    assert list(tensors) == _llama_names(2)
    d, F, kv = 32, model["ffn_hidden"], 2 * 8
    shapes = {"model.embed_tokens.weight": (256, d), "model.layers.1.self_attn.q_proj.weight": (d, d),
              "model.layers.1.self_attn.k_proj.weight": (kv, d), "model.layers.0.self_attn.v_proj.weight": (kv, d),
              "model.layers.0.mlp.gate_proj.weight": (F, d), "model.layers.0.mlp.up_proj.weight": (F, d),
              "model.layers.0.mlp.down_proj.weight": (d, F), "model.norm.weight": (d,), "lm_head.weight": (256, d)}
    for name, shape in shapes.items():
        assert tensors[name].shape == shape and tensors[name].dtype == np.float32, name
    gate_up = params["h.0.mlp.gate_up_proj.weight"]
    assert np.array_equal(tensors["model.layers.0.mlp.gate_proj.weight"], gate_up[:, :F].T)
    assert np.array_equal(tensors["model.layers.0.mlp.up_proj.weight"], gate_up[:, F:].T)
    assert np.array_equal(tensors["model.layers.1.self_attn.k_proj.weight"], params["h.1.attn.k_proj.weight"].T)
    assert np.array_equal(tensors["model.layers.1.input_layernorm.weight"], params["h.1.ln_1.weight"])
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    want = {"vocab_size": 256, "hidden_size": d, "intermediate_size": F, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "hidden_act": "silu",
            "max_position_embeddings": 32, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "attention_bias": False,
            "mlp_bias": False, "tie_word_embeddings": False, "torch_dtype": "float32"}
    assert {k: config[k] for k in want} == want


@pytest.mark.slow  # importing torch and transformers takes most of it
@pytest.mark.parametrize("kind", [pytest.param("llama"), pytest.param("llama-tp2-kv1", marks=pytest.mark.mpi)])
def test_transformers_loads_a_llama_export_and_gives_minidists_logits(kind, llama_checkpoints, tmp_path):
    """LlamaForCausalLM.from_pretrained(OUTDIR): no missing, unexpected or mismatched weights,
    and minidist's logits in float32 to 1e-5 normwise (Hugging Face's RMSNorm and rotary
    tables compute in float32 as minidist does; the two sum in different orders)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import torch
    from transformers import LlamaForCausalLM

    export(llama_checkpoints[kind], str(tmp_path / "hf"))
    model, info = LlamaForCausalLM.from_pretrained(str(tmp_path / "hf"), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert model.dtype == torch.float32 and model.config.num_key_value_heads == (1 if "kv1" in kind else 2)
    model.eval()
    ids = np.random.default_rng(1).integers(0, 256, size=(3, 32))
    want = _minidist_logits(llama_checkpoints[kind], ids)
    with torch.no_grad():
        got = model(torch.from_numpy(ids)).logits.numpy()
    assert got.shape == want.shape == (3, 32, 256)
    assert _normwise(got, want) <= 1e-5, _normwise(got, want)
