"""The GPT as a whole: gradients vs finite differences and PyTorch, and the per-device
techniques (gradient accumulation, activation checkpointing, mixed precision)."""

import numpy as np
import pytest

from minidist.model import ops
from minidist.model.backend import dtype
from minidist.layout.model import ModelConfig
from minidist.model.nn import GPT
from minidist.model.optim import AdamW, DynamicLossScaler
from minidist.parallel.data import OneReplica
from minidist.parallel.strategy import Strategy


def forward_backward(model, x, y, grad_accum=1, low_dtype=None, loss_scale=1.0):
    """One process's forward and backward of the batch's mean loss (what minidist.train.loop runs)."""
    return Strategy(model, OneReplica(model, None)).forward_backward(x, y, grad_accum, low_dtype, loss_scale)


def tiny(seed=0, dt="float64", **kw):
    cfg = dict(vocab_size=256, block_size=8, layers=2, heads=2, d_model=16, dtype=dt, seed=seed)
    cfg.update(kw)
    return GPT(ModelConfig(**cfg))


def batch(b=3, t=8, seed=1):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 256, size=(b, t + 1))
    return x[:, :-1], x[:, 1:]


def grads_of(model, x, y, k=1):
    model.zero_grad()
    loss = forward_backward(model, x, y, grad_accum=k)
    return loss, {n: p.grad.copy() for n, p in model.named_parameters()}


def test_state_dict_names_and_init_are_deterministic():
    a, b = tiny(seed=3), tiny(seed=3)
    names = list(a.state_dict())
    assert names[:2] == ["wte.weight", "wpe.weight"]
    assert "h.1.attn.c_attn.weight" in names and "ln_f.bias" in names
    for n in names:
        np.testing.assert_array_equal(a.state_dict()[n], b.state_dict()[n])
    c = tiny(seed=4)
    assert not np.array_equal(a.state_dict()["wte.weight"], c.state_dict()["wte.weight"])
    # float32 and float64 models draw the same numbers (up to rounding)
    f32 = tiny(seed=3, dt="float32")
    np.testing.assert_allclose(f32.state_dict()["h.0.mlp.c_fc.weight"], a.state_dict()["h.0.mlp.c_fc.weight"],
                               rtol=1e-6)


def test_load_state_dict_round_trip_and_errors():
    a, b = tiny(seed=1), tiny(seed=2)
    b.load_state_dict(a.state_dict())
    x, y = batch()
    assert a(x, y).item() == b(x, y).item()
    with pytest.raises(KeyError, match="missing"):
        b.load_state_dict({"wte.weight": a.state_dict()["wte.weight"]})


LLAMA = dict(arch="llama", heads=4, kv_heads=2, ffn_hidden=24)


@pytest.mark.parametrize("kw", [{}, LLAMA, dict(LLAMA, kv_heads=1)], ids=["gpt2", "llama-gqa", "llama-mqa"])
def test_whole_model_gradient_matches_finite_differences(kw):
    """Every parameter's gradient against float64 central differences of the loss f: six
    elements per parameter (its largest and smallest gradient and four at random) and one
    random unit direction d through all of its elements (the derivative along d is g . d).

    Each check is |fd - g| <= rtol * max(|fd|, |g|) + atol, relative however small the
    gradient, down to what the step allows.  Step h = 5e-6: the truncation error h^2 f'''/6
    measures <= 1e-8 of the gradient, rtol = 1e-7; the round-off of (f(+h) - f(-h)) / 2h is
    about u |f| / h (u = 2**-53, float64's unit round-off), atol = 8 u |f| / h, 1e-9 here."""
    model = tiny(seed=0, **kw)
    x, y = batch(b=2)
    loss, grads = grads_of(model, x, y)
    rng = np.random.default_rng(0)
    h, rtol = 5e-6, 1e-7
    atol = 8 * 2.0**-53 * abs(loss) / h

    def central(p, direction):
        old = p.data.copy()
        p.data[...] = old + h * direction
        up = model(x, y).item()
        p.data[...] = old - h * direction
        down = model(x, y).item()
        p.data[...] = old
        return (up - down) / (2 * h)

    for name, p in model.named_parameters():
        g = grads[name]
        flat = np.abs(g).reshape(-1)
        others = np.setdiff1d(np.arange(flat.size), [flat.argmax(), flat.argmin()])
        picks = [flat.argmax(), flat.argmin(), *rng.choice(others, size=min(4, others.size), replace=False)]
        directions = []
        for i in picks:
            d = np.zeros(g.shape)
            d.reshape(-1)[i] = 1.0
            directions.append((f"element {i}", d))
        d = rng.standard_normal(g.shape)
        directions.append(("a random direction", d / np.linalg.norm(d)))
        for what, d in directions:
            numeric, analytic = central(p, d), float((g * d).sum())
            allowed = rtol * max(abs(numeric), abs(analytic)) + atol
            assert abs(numeric - analytic) <= allowed, (name, what, numeric, analytic, allowed)


def test_llama_shape_and_attention_paths():
    """Llama's parameters (no biases, no position table, untied head, K/V projections of K
    heads, one fused gate|up), and blockwise attention equal to plain attention with GQA."""
    model = tiny(**LLAMA)
    names = dict(model.named_parameters())
    assert "wpe.weight" not in names and "lm_head.weight" in names and not any(n.endswith(".bias") for n in names)
    assert names["h.0.attn.k_proj.weight"].shape == (16, 2 * 4) and names["h.0.mlp.gate_up_proj.weight"].shape == (16, 48)
    x, y = batch()
    block = tiny(**LLAMA, attention="blockwise", attention_block=3)
    _, plain_grads = grads_of(model, x, y)
    _, block_grads = grads_of(block, x, y)
    for name, g in plain_grads.items():
        np.testing.assert_allclose(block_grads[name], g, rtol=1e-10, atol=1e-14, err_msg=name)
    # rotary positions: the same tokens at other places give other logits (GPT-2's table does too)
    ids = x[:1]
    assert not np.allclose(model(ids).data[0, 3], model(np.roll(ids, 1, axis=1)).data[0, 4])


@pytest.mark.parametrize("kw, message", [
    (dict(arch="llama", heads=4, kv_heads=3), "kv_heads 3 does not divide heads 4"),
    (dict(kv_heads=1), r"kv_heads is 1: GPT-2 has kv_heads = heads \(2\)"),
    (dict(arch="llama", rope_theta=0.0), "rope_theta must be a positive finite number"),
    (dict(arch="llama", rope_theta=10**400), "rope_theta must be a positive finite number"),
    (dict(arch="llama", norm_eps=-1.0), "norm_eps must be a positive finite number"),
    (dict(arch="llama", heads=8, d_model=8), "d_model 8 / heads 8 = 1: rotary positions need an even head dimension"),
    (dict(arch="bert"), "unknown arch 'bert'"),
])
def test_llama_config_errors_name_the_value(kw, message):
    cfg = dict(vocab_size=256, block_size=8, layers=1, heads=2, d_model=16)
    cfg.update(kw)
    with pytest.raises(ValueError, match=message):
        GPT(ModelConfig(**cfg))


def test_sequence_longer_than_position_table_is_rejected():
    model = tiny()
    with pytest.raises(ValueError, match="exceeds the position table"):
        model(np.zeros((1, 9), dtype=np.int64))


def test_heads_must_divide_width():
    with pytest.raises(ValueError, match="not divisible"):
        GPT(ModelConfig(d_model=10, heads=4, block_size=8))


def test_grad_accumulation_equals_one_batch():
    model = tiny(seed=5)
    x, y = batch(b=6)
    loss1, g1 = grads_of(model, x, y, k=1)
    for k in (2, 3, 4):  # 4 does not divide 6: uneven micro-batches are weighted by their share
        lossk, gk = grads_of(model, x, y, k=k)
        assert abs(lossk - loss1) < 1e-12
        for n in g1:
            np.testing.assert_allclose(gk[n], g1[n], rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("low", [None, "bfloat16", "float16"])
def test_checkpointing_gives_identical_gradients(low):
    # Under mixed precision the recomputation runs in backward, outside the forward's
    # autocast region: it must enter the forward's precision again.
    model = tiny(seed=6, dt="float32" if low else "float64")
    x, y = batch()

    def grads():
        model.zero_grad()
        forward_backward(model, x, y, low_dtype=low and dtype(low))
        return {n: p.grad.copy() for n, p in model.named_parameters()}

    plain = grads()
    model.checkpoint_activations = True
    ckpt = grads()
    for n in plain:
        np.testing.assert_array_equal(ckpt[n], plain[n], err_msg=n)


def test_checkpointing_lowers_peak_memory():
    import tracemalloc

    model = GPT(ModelConfig(block_size=64, layers=4, heads=4, d_model=64, dtype="float32"))
    x, y = batch(b=8, t=64)

    def peak(ckpt):
        model.checkpoint_activations = ckpt
        model.zero_grad()
        tracemalloc.start()
        forward_backward(model, x, y)
        p = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        return p

    plain, ckpt = peak(False), peak(True)
    assert ckpt < 0.7 * plain, (plain, ckpt)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_trains(precision):
    model = tiny(seed=0, dt="float32", block_size=32, d_model=32)
    low = dtype("bfloat16" if precision == "bf16" else "float16")
    opt = AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    scaler = DynamicLossScaler(init_scale=2.0**10) if precision == "fp16" else None
    rng = np.random.default_rng(0)
    # a learnable stream: repeated short pattern with noise
    pattern = rng.integers(0, 256, size=7)
    losses = []
    for step in range(50):
        start = rng.integers(0, 7, size=8)
        seq = np.stack([np.resize(np.roll(pattern, -s), 33) for s in start])
        x, y = seq[:, :-1], seq[:, 1:]
        loss = forward_backward(model, x, y, low_dtype=low, loss_scale=scaler.scale if scaler else 1.0)
        skip = scaler.unscale_(model.parameters()) if scaler else False
        if scaler:
            scaler.update(skip)
        if not skip:
            opt.step()
        opt.zero_grad()
        losses.append(loss)
        assert all(p.data.dtype == np.float32 for p in model.parameters())  # fp32 master weights
    assert all(np.isfinite(losses))
    assert np.mean(losses[-5:]) < 0.5 * np.mean(losses[:5]), losses


def test_activations_are_low_precision_under_autocast():
    model = tiny(dt="float32")
    x, _ = batch()
    with ops.autocast(dtype("bfloat16")):
        h = model.run_blocks(model.embed(x))
        assert h.dtype == dtype("bfloat16")
        assert model.head(h).dtype == dtype("bfloat16")


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the overflow is the point
def test_fp16_overflow_skips_step_and_lowers_scale():
    model = tiny(dt="float32")
    x, y = batch()
    scaler = DynamicLossScaler(init_scale=2.0**40)  # far beyond fp16's range: gradients overflow
    before = {n: p.data.copy() for n, p in model.named_parameters()}
    opt = AdamW(model.parameters(), lr=1e-2)
    forward_backward(model, x, y, low_dtype=dtype("float16"), loss_scale=scaler.scale)
    found_inf = scaler.unscale_(model.parameters())
    assert found_inf
    scaler.update(found_inf)
    assert scaler.scale == 2.0**39
    if not found_inf:
        opt.step()
    for n, p in model.named_parameters():
        np.testing.assert_array_equal(p.data, before[n])
