"""The Llama family against Hugging Face's ``LlamaForCausalLM`` in float64: logits, loss, every
gradient, and three AdamW steps, on a model with grouped-query attention (4 query heads, 2
key/value heads).

The reference is built from the same config (eager attention, no biases, untied head) and
given minidist's weights: every projection transposed from minidist's ``(in, out)`` to
``nn.Linear``'s ``(out, in)``, the fused SwiGLU ``gate_up_proj`` split into ``gate_proj`` and
``up_proj``.  Rotary positions need no permutation: minidist uses Hugging Face's half-split
layout (``rotate_half``).

Hugging Face computes three things in float32 even in a float64 model: RMSNorm (it casts the
activations to float32), the rotary tables (inverse frequencies and cos/sin) and the eager
attention's softmax.  For a 1e-9 comparison the test patches these three to compute at the
model's float64 -- the reference's own math, at the reference's float64 -- and checks that
without the patch the two models agree to float32's level, so the patch is the only
difference.  Under ``MINIDIST_BACKEND=cupy`` minidist's arrays live on the GPU: the test moves
them to the host (``backend.to_host``) before handing them to torch or comparing, and the
perturbation of the weights to the device (``backend.from_host``).  Comparisons are normwise relative
(max |mine - reference| / max |reference| per tensor).  Measured: patched, logits 1.1e-15, loss
3e-16, gradients 1.4e-15; unpatched, logits 1.6e-7 (with only RMSNorm and the rotary tables
patched, 7.4e-8: the float32 softmax alone is float32-sized).
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers", reason="transformers is not installed: no Llama reference")

from transformers.models.llama import modeling_llama  # noqa: E402

from minidist.model import backend  # noqa: E402
from minidist.layout.model import ModelConfig  # noqa: E402
from minidist.model.nn import GPT  # noqa: E402
from minidist.model.optim import AdamW, no_decay_below_2d  # noqa: E402

TOL = 1e-9
H, K, D_MODEL, LAYERS, T, THETA = 4, 2, 32, 2, 8, 10000.0


def host(a):
    """A minidist array (on the device under CuPy) as a NumPy array."""
    return np.asarray(backend.to_host(a))


def rel_err(a, b):
    a, b = host(a), host(b)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-300))


def _minidist():
    """A float64 Llama whose weights are moved off their init (norm gains not all ones)."""
    model = GPT(ModelConfig(arch="llama", layers=LAYERS, d_model=D_MODEL, heads=H, kv_heads=K, block_size=T,
                            rope_theta=THETA, dtype="float64", seed=7))
    rng = np.random.default_rng(0)
    for _, p in model.named_parameters():
        p.data = p.data + backend.from_host(rng.normal(0.0, 0.1, size=p.shape))
    return model


def _reference(cfg):
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=cfg.d_model, intermediate_size=cfg.ffn, num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads, num_key_value_heads=cfg.kv, max_position_embeddings=cfg.block_size,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta}, rms_norm_eps=cfg.norm_eps,
        attention_bias=False, mlp_bias=False, tie_word_embeddings=False, attn_implementation="eager")
    return transformers.LlamaForCausalLM(config).to(torch.float64)


def _hf_names(name: str, F: int):
    """``[(Hugging Face name, how to get its (out, in) tensor from minidist's array)]`` of one
    minidist parameter (gate_up_proj gives two)."""
    fixed = {"wte.weight": "model.embed_tokens.weight", "ln_f.weight": "model.norm.weight"}
    if name in fixed:
        return [(fixed[name], lambda a: a)]
    if name == "lm_head.weight":
        return [(name, lambda a: a.T)]
    _, i, rest = name.split(".", 2)
    at = f"model.layers.{i}."
    if rest == "ln_1.weight":
        return [(at + "input_layernorm.weight", lambda a: a)]
    if rest == "ln_2.weight":
        return [(at + "post_attention_layernorm.weight", lambda a: a)]
    if rest == "mlp.gate_up_proj.weight":
        return [(at + "mlp.gate_proj.weight", lambda a: a[:, :F].T), (at + "mlp.up_proj.weight", lambda a: a[:, F:].T)]
    if rest == "mlp.down_proj.weight":
        return [(at + rest, lambda a: a.T)]
    return [(at + rest.replace("attn.", "self_attn."), lambda a: a.T)]  # q, k, v, o


def _as_hf(model, arrays: dict) -> dict:
    """minidist's ``{name: array}`` (parameters or gradients) in Hugging Face's names and layout."""
    F = model.config.ffn
    return {hf: to(host(arrays[name])) for name in arrays for hf, to in _hf_names(name, F)}


@pytest.fixture
def pair():
    model = _minidist()
    ref = _reference(model.config)
    weights = _as_hf(model, {n: p.data for n, p in model.named_parameters()})
    assert sorted(weights) == sorted(n for n, _ in ref.named_parameters())
    ref.load_state_dict({n: torch.tensor(np.ascontiguousarray(a)) for n, a in weights.items()}, strict=True)
    seq = np.random.default_rng(1).integers(0, 256, size=(3, T + 1))
    return model, ref, seq[:, :-1], seq[:, 1:]


def _rms_norm_at_the_models_dtype(self, hidden_states):
    """LlamaRMSNorm.forward without its float32 cast."""
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


def _rotary_at_the_models_dtype(self, x, position_ids):
    """LlamaRotaryEmbedding.forward (the default rope type) with the inverse frequencies and
    the angles in float64 instead of float32."""
    dim = self.config.head_dim
    base = self.config.rope_parameters["rope_theta"]
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    freqs = position_ids[..., None].to(torch.float64) * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)


def _eager_attention_at_the_models_dtype(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """modeling_llama.eager_attention_forward with the softmax in the queries' dtype, not float32."""
    key_states = modeling_llama.repeat_kv(key, module.num_key_value_groups)
    value_states = modeling_llama.repeat_kv(value, module.num_key_value_groups)
    attn_weights = torch.matmul(query, key_states.transpose(2, 3)) * scaling
    if attention_mask is not None:
        attn_weights = attn_weights + attention_mask
    attn_weights = torch.nn.functional.softmax(attn_weights, dim=-1, dtype=query.dtype)
    attn_weights = torch.nn.functional.dropout(attn_weights, p=dropout, training=module.training)
    return torch.matmul(attn_weights, value_states).transpose(1, 2).contiguous(), attn_weights


@pytest.fixture
def float64_reference(monkeypatch):
    """The reference's float32 steps at float64 (module docstring): RMSNorm, the rotary tables
    and the eager attention's softmax (looked up by its module's name at each call)."""
    monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "forward", _rms_norm_at_the_models_dtype)
    monkeypatch.setattr(modeling_llama.LlamaRotaryEmbedding, "forward", _rotary_at_the_models_dtype)
    monkeypatch.setattr(modeling_llama, "eager_attention_forward", _eager_attention_at_the_models_dtype)


def _ref_loss(ref, x, y):
    logits = ref(torch.tensor(x)).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, 256), torch.tensor(y).reshape(-1))


def _check_gradients(model, ref):
    grads = _as_hf(model, {n: p.grad for n, p in model.named_parameters()})
    for name, p in ref.named_parameters():
        err = rel_err(grads[name], p.grad.numpy())
        assert err <= TOL, (name, err)


def test_without_the_patch_the_reference_agrees_to_float32s_level(pair):
    """Hugging Face's float32 RMSNorm and rotary tables are the only difference: unpatched,
    the logits agree to float32's round-off, not to float64's."""
    model, ref, x, _ = pair
    with torch.no_grad():
        err = rel_err(model(x).data, ref(torch.tensor(x)).logits.numpy())
    assert 1e-12 < err <= 1e-5, err


def test_logits_loss_and_every_gradient_match(pair, float64_reference):
    """Logits, the mean cross-entropy and every parameter's gradient, float64, to 1e-9."""
    model, ref, x, y = pair
    with torch.no_grad():
        assert rel_err(model(x).data, ref(torch.tensor(x)).logits.numpy()) <= TOL
    loss = model(x, y)
    loss.backward()
    ref_loss = _ref_loss(ref, x, y)
    ref_loss.backward()
    assert abs(loss.item() - ref_loss.item()) <= TOL * abs(ref_loss.item())
    _check_gradients(model, ref)


def test_three_adamw_steps_match(pair, float64_reference):
    """Three AdamW steps, minidist's AdamW against torch.optim.AdamW with the same
    hyperparameters and minidist's no-decay rule (1-d parameters, here the RMSNorm gains, are
    not decayed).  As in tests/test_torch_parity.py: each step's gradients are compared, then
    torch is handed minidist's gradients bit for bit, and each update (new minus old) and the
    final parameters must agree to 1e-9."""
    model, ref, x, y = pair
    lr, betas, eps, wd = 1e-2, (0.9, 0.95), 1e-8, 0.1
    opt = AdamW(model.parameters(), lr=lr, betas=betas, eps=eps, weight_decay=wd, no_decay=no_decay_below_2d)
    decayed = {hf for n, p in model.named_parameters() if opt.decay_of(p) > 0
               for hf, _ in _hf_names(n, model.config.ffn)}
    assert decayed and not any(n.endswith("norm.weight") for n in decayed)
    ref_params = dict(ref.named_parameters())
    ref_opt = torch.optim.AdamW([
        {"params": [p for n, p in ref_params.items() if n in decayed], "weight_decay": wd},
        {"params": [p for n, p in ref_params.items() if n not in decayed], "weight_decay": 0.0},
    ], lr=lr, betas=betas, eps=eps)
    for step in range(3):
        xs, ys = np.roll(x, step, axis=1), np.roll(y, step, axis=1)
        model.zero_grad()
        model(xs, ys).backward()
        ref_opt.zero_grad()
        _ref_loss(ref, xs, ys).backward()
        _check_gradients(model, ref)
        before = _as_hf(model, {n: p.data.copy() for n, p in model.named_parameters()})
        ref_before = {n: p.detach().numpy().copy() for n, p in ref_params.items()}
        for name, g in _as_hf(model, {n: p.grad for n, p in model.named_parameters()}).items():
            ref_params[name].grad = torch.tensor(np.ascontiguousarray(g))
        opt.step()
        ref_opt.step()
        after = _as_hf(model, {n: p.data for n, p in model.named_parameters()})
        for name, p in ref_params.items():
            err = rel_err(after[name] - before[name], p.detach().numpy() - ref_before[name])
            assert err <= TOL, (step, name, err)
    for name, p in ref_params.items():
        assert rel_err(after[name], p.detach().numpy()) <= TOL, name
