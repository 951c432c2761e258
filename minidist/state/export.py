"""Export a checkpoint to the Hugging Face ecosystem: ``model.safetensors`` + ``config.json``.

    python -m minidist.state.export DIR -o OUTDIR [--dtype float32|float64|float16|bfloat16] [--tokenizer FILE]

``DIR`` is a checkpoint saved on any mesh (a ``step-NNNNNN`` directory, or a ``--save`` directory:
its ``latest``); :func:`minidist.state.checkpoint.load_full` gathers every parameter whole on this one
process.  ``OUTDIR`` then holds what ``transformers.GPT2LMHeadModel.from_pretrained(OUTDIR)``
loads (a Llama checkpoint: ``transformers.LlamaForCausalLM``'s, below):

* ``model.safetensors``: the parameters under GPT-2's names (``transformer.wte.weight``,
  ``transformer.h.0.attn.c_attn.weight``, ...).  minidist's layout already is GPT-2's: Linear
  weights are stored ``(in, out)`` like GPT-2's Conv1D, and the fused q|k|v columns of
  ``c_attn`` are in GPT-2's order.  The one transposed tensor is an untied ``lm_head.weight``
  (a ``torch.nn.Linear`` in GPT-2, stored ``(out, in)``); a tied model writes none and says
  ``tie_word_embeddings: true``.  A model built without biases (``bias=False``) gets zero
  biases, which GPT-2 always has.  GPT-2's ``attn.bias`` / ``masked_bias`` causal-mask buffers
  are not parameters and are not written (transformers builds them).
* ``config.json``: a ``GPT2Config`` with vocabulary 256 (bytes), ``n_positions`` = the
  position table, ``gelu_new`` (the tanh GELU minidist uses), LayerNorm eps 1e-5, no dropout.

A checkpoint trained on token shards records its tokenizer's hash; ``--tokenizer`` (the
tokenizer file, or the shard directory holding it) must be that one, and ``OUTDIR`` then also
holds ``tokenizer.json`` (the file itself) and ``tokenizer_config.json``, which
``transformers.AutoTokenizer.from_pretrained(OUTDIR)`` loads (tokenizer.hf_files; no special
tokens, as config.json says).  A model of bytes needs none.

A Llama checkpoint (``arch: llama``) becomes Hugging Face's Llama (with experts: Mixtral,
export_mixtral.py):

* ``model.safetensors``: ``model.embed_tokens.weight``, per layer ``model.layers.i.``
  ``input_layernorm``, ``self_attn.{q,k,v,o}_proj``, ``post_attention_layernorm``,
  ``mlp.{gate,up,down}_proj`` (each ``.weight``), ``model.norm.weight`` and an untied
  ``lm_head.weight``.  Every projection is a ``torch.nn.Linear``, stored ``(out, in)``: each is
  minidist's ``(in, out)`` weight transposed, and the fused ``gate_up_proj`` (columns
  [gate | up], F each) is split in two.  The rotary layout already is Hugging Face's (the
  half-split ``rotate_half``), so q and k need no permutation of their rows.
* ``config.json``: a ``LlamaConfig`` (``silu``, the K key/value heads, the feed-forward width,
  the rotary base both as ``rope_theta`` and in ``rope_parameters``, the RMSNorm epsilon, no
  biases, ``max_position_embeddings`` = the model's longest sequence).

safetensors is written here with the standard library and NumPy (no dependency): an 8-byte
little-endian header length, a JSON header ``{name: {dtype, shape, data_offsets}}`` (plus
``__metadata__``), padded with spaces to a multiple of 8 bytes, then the raw little-endian
bytes of each tensor, end to end.  :func:`read_safetensors` reads such a file back.  The host's
NumPy (``backend.host``), not the backend's ``xp``, on purpose: export only moves bytes between
files on the host (the arrays come from ``checkpoint.load_full``, read from disk), whatever
array library trains.

Each output file is written to a temporary file in ``OUTDIR`` and renamed over the old one,
so an existing export is replaced whole or not at all; nothing is written outside ``OUTDIR``
(an ``OUTDIR`` that is a symbolic link is refused, links inside it are replaced, not followed).
Bad input (a ``DIR`` that is not a checkpoint, a damaged or untrustworthy one: see
``minidist/state/checkpoint_meta.py``; an ``OUTDIR`` that is a file) stops with one line and exit code 2.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import struct
import sys

from minidist.host.cli_checks import OneLineParser
from minidist.host.files import replace_atomically, write_synced
from minidist.model.backend import bfloat16, host

SAFETENSORS = "model.safetensors"
CONFIG = "config.json"
#: numpy dtype name -> safetensors dtype code
_CODES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
          "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL"}
EXPORT_DTYPES = ("float32", "float64", "float16", "bfloat16")
LAYER_NORM_EPS = 1e-5  # minidist.model.nn.LayerNorm's


def _np_dtype(name: str) -> host.dtype:
    return bfloat16 if name == "bfloat16" else host.dtype(name)


def _code(dt) -> str:
    dt = host.dtype(dt)
    name = "bfloat16" if bfloat16 is not None and dt == bfloat16 else dt.name
    if name not in _CODES:
        raise ValueError(f"safetensors: no dtype code for {name}")
    return _CODES[name]


# ------------------------------------------------------------------------------------------------
# safetensors
# ------------------------------------------------------------------------------------------------
def write_safetensors(file: str, tensors: dict, metadata: dict | None = None) -> None:
    """Write ``{name: array}`` to ``file`` in the safetensors format, in the given order."""
    write_synced(file, _safetensors_chunks(tensors, metadata))


def _safetensors_chunks(tensors: dict, metadata: dict | None):
    """The bytes of a safetensors file: the header (made here, so a bad dtype stops before any
    file is opened), then each tensor's bytes, made one at a time as they are written."""
    header, offset, arrays = {}, 0, []
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    for name, array in tensors.items():
        a = host.ascontiguousarray(array)
        if a.dtype.byteorder == ">":
            a = a.astype(a.dtype.newbyteorder("<"))
        header[name] = {"dtype": _code(a.dtype), "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
        arrays.append(a)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the tensors start 8-byte aligned, as the reference writer does
    return itertools.chain([struct.pack("<Q", len(text)), text], (a.tobytes() for a in arrays))


def read_safetensors(file: str) -> tuple[dict, dict]:
    """``(metadata, {name: array})`` of a safetensors file (checks the header's offsets)."""
    codes = {code: name for name, code in _CODES.items()}
    with open(file, "rb") as f:
        raw = f.read()
    if len(raw) < 8:
        raise ValueError(f"{file}: too short for a safetensors file")
    (n,) = struct.unpack("<Q", raw[:8])
    if 8 + n > len(raw):
        raise ValueError(f"{file}: header length {n} runs past the end of the file")
    header = json.loads(raw[8:8 + n])
    metadata = header.pop("__metadata__", {})
    data, tensors, reach = raw[8 + n:], {}, 0
    for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        start, stop = info["data_offsets"]
        if start != reach or stop > len(data):
            raise ValueError(f"{file}: {name}'s bytes {start}..{stop} do not follow the previous tensor's")
        dt = _np_dtype(codes[info["dtype"]]).newbyteorder("<")
        tensors[name] = host.frombuffer(data[start:stop], dtype=dt).reshape(info["shape"])
        reach = stop
    if reach != len(data):
        raise ValueError(f"{file}: {len(data) - reach} bytes after the last tensor")
    return metadata, tensors


# ------------------------------------------------------------------------------------------------
# minidist -> Hugging Face: the family's names and layout
# ------------------------------------------------------------------------------------------------
def hf_config(model: dict, dtype: str) -> dict:
    """The Hugging Face config (as a dict for config.json) of a minidist model config dict."""
    if model.get("experts"):
        from minidist.state.export_mixtral import mixtral_config
        return mixtral_config(model, llama_config(model, dtype))
    return llama_config(model, dtype) if model.get("arch") == "llama" else gpt2_config(model, dtype)


def hf_state_dict(model: dict, params: dict, dtype: str | None = None) -> dict:
    """``{Hugging Face name: array}`` of minidist's ``{name: array}`` (``load_full``'s), in the
    reference's order, cast to ``dtype`` (default: the parameters' own)."""
    if model.get("arch") == "llama" or model.get("experts"):  # with experts: Mixtral's (export_mixtral.py)
        return llama_state_dict(model, params, dtype)
    return gpt2_state_dict(model, params, dtype)


def _putter(out: dict, dtype: str | None):
    """``put(name, array)``: store ``array`` in ``out`` contiguous, cast to ``dtype`` if given."""
    target = _np_dtype(dtype) if dtype is not None else None

    def put(name, array):
        a = host.asarray(array)
        out[name] = host.ascontiguousarray(a if target is None else a.astype(target))

    return put


# ------------------------------------------------------------------------------------------------
# minidist -> GPT-2
# ------------------------------------------------------------------------------------------------
def gpt2_config(model: dict, dtype: str) -> dict:
    """The ``GPT2Config`` (as a dict for config.json) of a minidist GPT-2 config dict."""
    d = model["d_model"]
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": model["vocab_size"],
        "n_positions": model["block_size"],
        "n_embd": d,
        "n_layer": model["layers"],
        "n_head": model["heads"],
        "n_inner": 4 * d,
        "activation_function": "gelu_new",  # 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
        "layer_norm_epsilon": LAYER_NORM_EPS,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "summary_first_dropout": 0.0,
        "initializer_range": 0.02,
        "scale_attn_weights": True,  # scores / sqrt(d_head), as minidist
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "use_cache": True,
        "tie_word_embeddings": bool(model["tied"]),
        "bos_token_id": None,  # bytes: no special tokens (GPT-2's 50256 is outside this vocabulary)
        "eos_token_id": None,
        "dtype": dtype,
        "torch_dtype": dtype,
    }


def gpt2_state_dict(model: dict, params: dict, dtype: str | None = None) -> dict:
    """``{GPT-2 name: array}`` of minidist's ``{name: array}`` (``load_full``'s), in GPT-2's
    order, cast to ``dtype`` (default: the parameters' own)."""
    d, out = model["d_model"], {}
    put = _putter(out, dtype)

    def param(name, zeros_shape=None):
        if name in params:
            return params[name]
        if zeros_shape is None:
            raise KeyError(f"the checkpoint has no parameter {name}")
        return host.zeros(zeros_shape, dtype=params["wte.weight"].dtype)  # bias=False: GPT-2 has one

    put("transformer.wte.weight", param("wte.weight"))
    put("transformer.wpe.weight", param("wpe.weight"))
    for i in range(model["layers"]):
        h = f"h.{i}."
        for part, width in (("ln_1", None), ("attn.c_attn", 3 * d), ("attn.c_proj", d), ("ln_2", None),
                            ("mlp.c_fc", 4 * d), ("mlp.c_proj", d)):
            put(f"transformer.{h}{part}.weight", param(f"{h}{part}.weight"))  # Linear: (in, out), Conv1D's
            put(f"transformer.{h}{part}.bias", param(f"{h}{part}.bias", (width,) if width else None))
    put("transformer.ln_f.weight", param("ln_f.weight"))
    put("transformer.ln_f.bias", param("ln_f.bias"))
    if not model["tied"]:
        put("lm_head.weight", param("lm_head.weight").T)  # nn.Linear stores (out, in)
    return out


# ------------------------------------------------------------------------------------------------
# minidist -> Llama
# ------------------------------------------------------------------------------------------------
def llama_config(model: dict, dtype: str) -> dict:
    """The ``LlamaConfig`` (as a dict for config.json) of a minidist Llama config dict."""
    d, H = model["d_model"], model["heads"]
    theta = float(model["rope_theta"])
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": model["vocab_size"],
        "hidden_size": d,
        "intermediate_size": model["ffn_hidden"],
        "num_hidden_layers": model["layers"],
        "num_attention_heads": H,
        "num_key_value_heads": model["kv_heads"],
        "head_dim": d // H,
        "hidden_act": "silu",  # SwiGLU: silu(x W_gate) * (x W_up)
        "max_position_embeddings": model["block_size"],
        "rms_norm_eps": float(model["norm_eps"]),
        "rope_theta": theta,  # transformers before 5 reads it here, 5 in rope_parameters
        "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "initializer_range": 0.02,
        "use_cache": True,
        "tie_word_embeddings": bool(model["tied"]),
        "bos_token_id": None,  # bytes: no special tokens
        "eos_token_id": None,
        "dtype": dtype,
        "torch_dtype": dtype,
    }


def llama_state_dict(model: dict, params: dict, dtype: str | None = None) -> dict:
    """``{Llama name: array}`` of minidist's Llama ``{name: array}``: every projection
    transposed to ``torch.nn.Linear``'s ``(out, in)``, the fused gate|up split in two; the
    mixtures of a model with experts under Mixtral's names (export_mixtral.py)."""
    from minidist.state.export_mixtral import check, put_mixture

    out, F = {}, model["ffn_hidden"]
    put = _putter(out, dtype)
    if model.get("experts"):
        check(model)

    def param(name):
        if name not in params:
            raise KeyError(f"the checkpoint has no parameter {name}")
        return params[name]

    put("model.embed_tokens.weight", param("wte.weight"))  # an embedding: (vocab, d) in both
    for i in range(model["layers"]):
        h, at = f"h.{i}.", f"model.layers.{i}."
        put(f"{at}input_layernorm.weight", param(f"{h}ln_1.weight"))
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            put(f"{at}self_attn.{proj}.weight", param(f"{h}attn.{proj}.weight").T)
        put(f"{at}post_attention_layernorm.weight", param(f"{h}ln_2.weight"))
        if model.get("experts"):
            put_mixture(put, param, h, at, model)
            continue
        gate_up = param(f"{h}mlp.gate_up_proj.weight")                      # (d, 2F): [gate | up]
        put(f"{at}mlp.gate_proj.weight", gate_up[:, :F].T)
        put(f"{at}mlp.up_proj.weight", gate_up[:, F:].T)
        put(f"{at}mlp.down_proj.weight", param(f"{h}mlp.down_proj.weight").T)
    put("model.norm.weight", param("ln_f.weight"))
    if not model["tied"]:
        put("lm_head.weight", param("lm_head.weight").T)
    return out


def export(path: str, outdir: str, dtype: str | None = None, tokenizer: str | None = None) -> list[str]:
    """Export checkpoint ``path`` into ``outdir`` (created if missing); the files written.
    ``tokenizer``: the file (or shard directory) of the tokenizer the checkpoint records, if any."""
    from minidist.state.checkpoint import load_full
    from minidist.state.generate import checkpoint_tokenizer
    from minidist.state.tokenizer import hf_files

    tok = checkpoint_tokenizer(path, tokenizer)  # before anything is written
    model, params = load_full(path)
    dtype = dtype or model.get("dtype", "float32")
    tensors = hf_state_dict(model, params, dtype)
    config = hf_config(model, dtype)
    os.makedirs(outdir, exist_ok=True)
    contents = {SAFETENSORS: _safetensors_chunks(tensors, {"format": "pt", "source": "minidist"}),
                CONFIG: json.dumps(config, indent=2) + "\n", **(hf_files(tok, model["block_size"]) if tok else {})}
    files = [os.path.join(outdir, name) for name in contents]
    for file, data in zip(files, contents.values()):
        replace_atomically(file, data)  # a link there is replaced, not followed
    return files


# ------------------------------------------------------------------------------------------------
# CLI
# ------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m minidist.state.export",
                description="Export a minidist checkpoint (saved on any mesh) as a Hugging Face GPT-2, Llama or "
                            "Mixtral model: OUTDIR/model.safetensors and OUTDIR/config.json, for transformers."
                            "GPT2LMHeadModel (LlamaForCausalLM, MixtralForCausalLM).from_pretrained(OUTDIR).")
    p.add_argument("checkpoint", metavar="DIR", help="a step-NNNNNN checkpoint, or a --save directory (its latest)")
    p.add_argument("-o", "--out", required=True, metavar="OUTDIR",
                   help="directory to write (created if missing; existing files are replaced atomically)")
    p.add_argument("--dtype", choices=EXPORT_DTYPES, default=None,
                   help="dtype of the exported weights (default: the checkpoint's)")
    p.add_argument("--tokenizer", default=None, metavar="FILE",
                   help="the trained tokenizer the checkpoint records (its file, or the shard directory holding "
                        "it), written beside the weights for AutoTokenizer; not needed for a model of bytes")
    return p


def main(argv=None) -> int:
    from minidist.state.checkpoint import CheckpointError
    from minidist.state.export_mixtral import ExportError
    from minidist.state.tokenizer import TokenizerError

    parser = build_parser()
    args = parser.parse_args(argv)
    if os.path.islink(args.out):  # the files go inside OUTDIR itself, never where a link leads
        parser.error(f"-o {args.out}: a symbolic link (to {os.readlink(args.out)}); give the directory itself")
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        parser.error(f"-o {args.out}: exists and is not a directory")
    if not os.path.isdir(args.checkpoint):
        parser.error(f"{args.checkpoint}: no such checkpoint directory")
    try:
        files = export(args.checkpoint, args.out, args.dtype, args.tokenizer)
    except (CheckpointError, TokenizerError, ExportError) as exc:
        message = str(exc)
        message = message[len("--resume "):] if message.startswith("--resume ") else message
        parser.error(message)
    except OSError as exc:
        parser.error(f"cannot write {args.out}: {exc.strerror or exc}")
    print(f"wrote {', '.join(files)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
