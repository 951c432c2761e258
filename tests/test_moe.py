"""The mixture-of-experts layer (minidist/model/moe.py) on one process: its forward against a
token-by-token reference (routing, weights, capacity and its dropping order, both auxiliary
losses), its gradients and the whole MoE model's against float64 finite differences, names,
initialisation and the config's one-line errors.  Under ``MINIDIST_BACKEND=cupy`` the layer's
arrays live on the GPU: inputs go there with ``dev`` and results come back with ``host``
(``backend.from_host``/``to_host``), the reference computes on the host."""
import math

import numpy as np
import pytest

from minidist.model import backend, moe
from minidist.model.autograd import Tensor
from minidist.layout.model import ModelConfig
from minidist.model.nn import GPT, MLP
from minidist.parallel.data import OneReplica
from minidist.parallel.strategy import Strategy

CASES = {
    "gpt2-top2-dropless": dict(experts=4, top_k=2),
    "gpt2-top1-capacity": dict(experts=4, top_k=1, capacity_factor=1.0),
    "gpt2-top2-capacity": dict(experts=3, top_k=2, capacity_factor=0.5),
    "llama-top2-capacity": dict(arch="llama", heads=4, kv_heads=2, ffn_hidden=24, experts=4, top_k=2,
                                capacity_factor=0.75),
    "llama-top1-dropless": dict(arch="llama", heads=4, kv_heads=2, ffn_hidden=24, experts=2, top_k=1),
}


def host(a):
    """A minidist array (on the device under CuPy) as a NumPy array."""
    return np.asarray(backend.to_host(a))


def dev(a):
    """A host array on the backend's device (the same array under NumPy)."""
    return backend.from_host(np.asarray(a))


def tiny(**kw):
    cfg = dict(vocab_size=256, block_size=8, layers=2, heads=2, d_model=16, dtype="float64", seed=0)
    cfg.update(kw)
    return GPT(ModelConfig(**cfg))


def batch(b=2, t=8, seed=1):
    x = np.random.default_rng(seed).integers(0, 256, size=(b, t + 1))
    return x[:, :-1], x[:, 1:]


def reference(layer, x):
    """The layer's output and auxiliary loss computed token by token, as moe.py's docstring
    states the rules (no sorting, no buffers)."""
    cfg = layer.cfg
    B, T, d = x.shape
    E, k = cfg.experts, cfg.top_k
    C = math.ceil(cfg.capacity_factor * T * k / E) if cfg.capacity_factor else T * k
    W = host(layer.router.weight.data)
    out, aux, z = np.zeros_like(x), 0.0, 0.0
    for b in range(B):
        taken, f, P = [0] * E, np.zeros(E), np.zeros(E)
        for t in range(T):
            logits = x[b, t] @ W
            p = np.exp(logits - logits.max())
            p /= p.sum()
            z += np.log(np.exp(logits).sum()) ** 2 / (B * T)
            chosen = sorted(range(E), key=lambda e: (-p[e], e))[:k]
            w = p[chosen] / (p[chosen].sum() if k > 1 else 1.0)
            P += p / T
            for e, we in zip(chosen, w):
                f[e] += 1 / (T * k)
                if taken[e] < C:
                    taken[e] += 1
                    out[b, t] += we * host(layer.experts[e](Tensor(dev(x[b, t][None]))).data)[0]
        aux += E * (f * P).sum() / B
    return out, cfg.aux_loss_coef * aux + cfg.z_loss_coef * z


@pytest.mark.parametrize("kw", CASES.values(), ids=CASES.keys())
def test_layer_forward_matches_the_token_by_token_reference(kw):
    model = tiny(**kw)
    layer = model.h[0].mlp
    x = np.random.default_rng(3).standard_normal((3, 8, 16))
    y = layer(Tensor(dev(x)))
    want, want_aux = reference(layer, x)
    np.testing.assert_allclose(host(y.data), want, rtol=0, atol=1e-13)
    np.testing.assert_allclose(layer.aux_loss.item(), want_aux, rtol=1e-12)
    cap = moe.capacity(layer.cfg, 8)
    assert layer.last_counts.sum() <= 3 * 8 * layer.cfg.top_k
    if cap is not None:
        assert layer.last_counts.max() <= 3 * cap


def test_capacity_drops_the_later_tokens_of_each_sequence_and_they_pass_on_the_residual():
    """A router that sends every token to expert 0: with capacity C = ceil(0.5 * 8 * 1 / 2) = 2
    only the first two tokens of each sequence get the expert's output; the others get 0 from
    the layer, so the block adds nothing to them."""
    model = tiny(experts=2, top_k=1, capacity_factor=0.5)
    layer = model.h[0].mlp
    layer.router.weight.data[...] = 0.0
    layer.router.weight.data[0, 0] = 50.0  # x[..., 0] > 0: expert 0, surely
    x = np.random.default_rng(0).standard_normal((2, 8, 16))
    x[..., 0] = 1.0
    y = host(layer(Tensor(dev(x))).data)
    assert layer.last_counts.tolist() == [4, 0]
    assert np.all(y[:, 2:] == 0) and np.all(np.abs(y[:, :2]).sum(axis=-1) > 0)


def test_low_precision_rows_add_up_in_float32_and_are_rounded_once():
    """The MoE's scatter-adds under mixed precision: combining the experts' outputs (forward)
    and the dispatch's gather (backward).  1 + 2**-8 + 2**-8 is 1 added up in bfloat16 (each
    2**-8 is half a bfloat16 step at 1 and rounds away) but 1 + 2**-7 added up in float32, which
    bfloat16 holds exactly.  CuPy's scatter-add has no bfloat16: on CuPy this runs only because
    the sum is in float32."""
    bf16 = backend.dtype("bfloat16")
    values = dev(np.array([[1.0], [2.0**-8], [2.0**-8]])).astype(bf16)
    out = moe.combine_rows(Tensor(values), dev(np.array([0, 0, 0])), 2)
    assert out.dtype == bf16
    assert host(out.data.astype(np.float32)).tolist() == [[1 + 2**-7], [0.0]]
    x = Tensor(dev(np.zeros((2, 1))).astype(bf16), requires_grad=True)
    moe.gather_rows(x, np.array([0, 0, 0])).backward(values)
    assert x.grad.dtype == bf16
    assert host(x.grad.astype(np.float32)).tolist() == [[1 + 2**-7], [0.0]]


@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16"])
def test_permute_rows_equals_gather_rows_forward_and_backward(dtype):
    """The expert-parallel dispatch's regrouping: a permutation's backward is the inverse
    permutation, the same rows, bit for bit, as gather_rows' scatter-add; anything but a
    permutation is refused."""
    rng = np.random.default_rng(0)
    dt = backend.dtype(dtype)
    data = dev(rng.standard_normal((7, 3, 2))).astype(dt)
    grad = dev(rng.standard_normal((7, 3, 2))).astype(dt)
    perm = rng.permutation(7)
    a, b = (Tensor(data.copy(), requires_grad=True) for _ in range(2))
    ya, yb = moe.permute_rows(a, perm), moe.gather_rows(b, perm)
    assert np.array_equal(host(ya.data), host(yb.data)) and np.array_equal(host(ya.data), host(data)[perm])
    ya.backward(grad)
    yb.backward(grad)
    assert a.grad.dtype == dt and np.array_equal(host(a.grad), host(b.grad))
    for bad in ([0, 1, 2, 3, 4, 5, 5], [0, 1, 2], [], [[0, 1, 2, 3, 4, 5, 6]]):
        with pytest.raises(ValueError, match="not a permutation of 7 rows"):
            moe.permute_rows(a, np.array(bad, dtype=np.int64))
    with pytest.raises(IndexError, match="permute_rows perm value 7 out of range"):
        moe.permute_rows(a, np.array([0, 1, 2, 3, 4, 5, 7]))
    with pytest.raises(TypeError, match="permute_rows perm must be an integer array"):
        moe.permute_rows(a, np.arange(7.0))


@pytest.mark.parametrize("low", ["bfloat16", "float16"])
def test_the_router_runs_in_float32_under_mixed_precision(low):
    """Selective precision (Switch Transformer): the router's logits and probabilities are
    float32 products of the low-precision activations and the float32 weight, so the choices
    are the float32 run's for the same activations; its input gets its gradient in its dtype."""
    from minidist.model import ops

    layer = tiny(dtype="float32", experts=8, top_k=2).h[0].mlp
    dt = backend.dtype(low)
    x = Tensor(dev(np.random.default_rng(4).standard_normal((2, 8, 16))).astype(dt), requires_grad=True)
    with ops.autocast(low):
        logits = layer.router(ops.reshape(x, (16, 16)))
    assert logits.dtype == np.float32
    exact = host(x.data).astype(np.float64).reshape(16, 16) @ host(layer.router.weight.data).astype(np.float64)
    np.testing.assert_allclose(host(logits.data), exact, rtol=1e-5, atol=1e-7)
    logits.backward(dev(np.ones((16, 8), dtype=np.float32)))
    assert x.grad.dtype == dt and layer.router.weight.grad.dtype == np.float32


@pytest.mark.parametrize("low", ["bfloat16", "float16"])
def test_a_mixed_precision_layer_keeps_its_activations_low_and_every_gradient(low):
    """Under autocast (the training loop's mixed precision) the layer takes and returns
    low-precision activations, and backward reaches the input, the router and every expert
    that took tokens (on CuPy: no scatter-add in the low dtype)."""
    from minidist.model import ops

    layer = tiny(dtype="float32", experts=4, top_k=2, capacity_factor=1.0).h[0].mlp
    dt = backend.dtype(low)
    x = Tensor(dev(np.random.default_rng(3).standard_normal((2, 8, 16))).astype(dt), requires_grad=True)
    with ops.autocast(low):
        y = layer(x)
        loss = ops.add(ops.sum(ops.mul(y, y)), layer.aux_loss)
    assert y.dtype == dt
    loss.backward()
    assert x.grad.dtype == dt and np.isfinite(host(x.grad.astype(np.float32))).all()
    assert np.abs(host(layer.router.weight.grad)).max() > 0
    for e, taken in enumerate(layer.last_counts):
        for name, p in layer.experts[e].named_parameters():
            assert p.grad.dtype == np.float32 and (np.abs(host(p.grad)).max() > 0) == (taken > 0), (e, name)


def _directional_check(f, params, grads, rng, h=1e-6):
    """d/dt f(p + t d) at 0 by central differences against g . d, for a random unit d and the
    largest-gradient element of every parameter."""
    f0 = abs(f())
    atol = 8 * 2.0**-53 * max(f0, 1.0) / h
    for name, p in params:
        g = host(grads[name])
        d1 = rng.standard_normal(g.shape)
        d2 = np.zeros(g.shape)
        d2.reshape(-1)[np.abs(g).argmax()] = 1.0
        for d in (d1 / np.linalg.norm(d1), d2):
            old = p.data.copy()
            p.data[...] = old + dev(h * d)
            up = f()
            p.data[...] = old - dev(h * d)
            down = f()
            p.data[...] = old
            fd, an = (up - down) / (2 * h), float((g * d).sum())
            assert abs(fd - an) <= 1e-6 * max(abs(fd), abs(an)) + atol, (name, fd, an)


@pytest.mark.parametrize("kw", CASES.values(), ids=CASES.keys())
def test_layer_gradients_match_finite_differences(kw):
    """The input's, the router's and every expert's gradient of <c, y> + the auxiliary losses."""
    layer = tiny(**kw).h[0].mlp
    rng = np.random.default_rng(5)
    x = Tensor(dev(rng.standard_normal((2, 8, 16))), requires_grad=True)
    c = dev(rng.standard_normal((2, 8, 16)))

    def f():
        return float(host((layer(x).data * c).sum())) + layer.aux_loss.item()

    y = layer(x)
    loss = (y * Tensor(c)).sum() + layer.aux_loss
    loss.backward()
    params = [("x", x)] + list(layer.named_parameters())
    grads = {"x": x.grad, **{n: p.grad for n, p in layer.named_parameters()}}
    assert np.abs(grads["router.weight"]).max() > 0
    _directional_check(f, params, grads, rng)


@pytest.mark.parametrize("kw", [CASES["gpt2-top2-capacity"], CASES["llama-top1-dropless"],
                                dict(experts=4, top_k=2, moe_every=2, capacity_factor=1.0, z_loss_coef=0.1)],
                         ids=["gpt2-top2-capacity", "llama-top1-dropless", "every-2nd"])
def test_whole_moe_model_gradient_matches_finite_differences(kw):
    model = tiny(**kw)
    x, y = batch()
    model.zero_grad()
    loss = Strategy(model, OneReplica(model, None)).forward_backward(x, y)
    assert loss > 0
    grads = {n: host(p.grad).copy() for n, p in model.named_parameters()}
    for block in model.h:
        if isinstance(block.mlp, moe.MoE):
            assert np.abs(grads[f"h.{model.h.index(block)}.mlp.router.weight"]).max() > 0
    _directional_check(lambda: model(x, y).item(), list(model.named_parameters()), grads,
                       np.random.default_rng(0), h=5e-6)


def test_the_loss_is_cross_entropy_plus_every_mixtures_auxiliary_losses():
    from minidist.model import ops

    model = tiny(experts=4, top_k=2, aux_loss_coef=0.5, z_loss_coef=0.25)
    x, y = batch()
    loss = model(x, y).item()
    ce = ops.cross_entropy(model(x), y).item()
    aux = sum(b.mlp.aux_loss.item() for b in model.h)
    assert aux > 0 and loss == pytest.approx(ce + aux, rel=1e-14)
    dense = tiny(experts=4, aux_loss_coef=0.0, z_loss_coef=0.0)
    assert dense(x, y).item() == pytest.approx(ops.cross_entropy(dense(x), y).item(), rel=1e-14)
    assert dense.h[0].mlp.aux_loss is None


@pytest.mark.parametrize("low", ["bfloat16", "float16"])
def test_auxiliary_losses_are_float32_so_fp16s_first_loss_scale_does_not_overflow(low):
    """The loss scaler starts at 2**16, above float16's largest number (65504): the auxiliary
    losses' gradient is that scale times the loss's weight, so in float16 a one-process step
    (weight 1) overflowed and was skipped where accumulation (weight 1/2) was not."""
    model = tiny(dtype="float32", experts=4, top_k=2)
    x, y = batch()
    model.zero_grad()
    Strategy(model, OneReplica(model, None)).forward_backward(x, y, 1, backend.dtype(low), 2.0 ** 16)
    assert model.h[0].mlp.aux_loss.dtype == np.float32
    for n, p in model.named_parameters():
        assert np.isfinite(host(p.grad)).all(), n


def test_gradient_accumulation_equals_the_whole_batch():
    """Capacity and the balancing loss are per sequence: two micro-batches of rows give the
    batch's gradient (what data parallelism relies on too)."""
    model = tiny(experts=4, top_k=2, capacity_factor=0.5)
    x, y = batch(b=4)
    grads = []
    for k in (1, 2):
        model.zero_grad()
        loss = Strategy(model, OneReplica(model, None)).forward_backward(x, y, k)
        grads.append((loss, {n: host(p.grad).copy() for n, p in model.named_parameters()}))
    assert grads[0][0] == pytest.approx(grads[1][0], rel=1e-12)
    for n, g in grads[0][1].items():
        np.testing.assert_allclose(grads[1][1][n], g, rtol=1e-9, atol=1e-12, err_msg=n)


def test_a_step_reads_the_routing_once_per_mixture_and_microbatch(tmp_path):
    """The routing is decided on the host: each mixture's router probabilities are one counted
    read (backend.host_read, a synchronisation on a GPU) per microbatch, besides the step's
    loss, and the routers' statistics once per step (their z-loss sums, observe/router.py);
    nothing else (2 mixtures x 2 microbatches here)."""
    import json

    from minidist.train.testing import run_train

    metrics = tmp_path / "m.jsonl"
    r = run_train(None, ["--layers", "2", "--d-model", "16", "--heads", "2", "--seq-len", "16", "--batch-size", "4",
                         "--experts", "2", "--grad-accum", "2", "--steps", "2", "--eval-every", "0", "--clip-grad", "0",
                         "--quiet", "--metrics-jsonl", str(metrics)], timeout=120)
    assert r.returncode == 0, r.stderr
    rows = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert [row["host_reads"] for row in rows] == [{"loss": 1, "routing": 4, "router statistics": 1}] * 2


def test_names_and_initialisation_by_name():
    model = tiny(experts=3, moe_every=2, arch="llama", heads=4, kv_heads=2, ffn_hidden=24)
    names = list(model.state_dict())
    assert "h.0.mlp.gate_up_proj.weight" in names  # block 0: dense
    assert "h.1.mlp.router.weight" in names and "h.1.mlp.experts.2.down_proj.weight" in names
    again = tiny(experts=3, moe_every=2, arch="llama", heads=4, kv_heads=2, ffn_hidden=24)
    for n, a in model.state_dict().items():
        assert np.array_equal(host(a), host(again.state_dict()[n])), n
    experts = [host(model.state_dict()[f"h.1.mlp.experts.{e}.down_proj.weight"]) for e in range(3)]
    assert not np.array_equal(experts[0], experts[1])
    dense = tiny()
    assert list(dense.state_dict()) == list(tiny(experts=0, top_k=5).state_dict())
    assert isinstance(dense.h[0].mlp, MLP)


@pytest.mark.parametrize("kw, words", [
    (dict(experts=-1), "experts must be a non-negative integer, got -1"),
    (dict(experts=4, top_k=0), "top_k must be a positive integer, got 0"),
    (dict(experts=2, top_k=3), "top_k 3 is more than the experts 2"),
    (dict(experts=2, moe_every=0), "moe_every must be a positive integer, got 0"),
    (dict(experts=2, capacity_factor=-0.5), "capacity_factor must be a non-negative finite number, got -0.5"),
    (dict(experts=2, aux_loss_coef=float("nan")), "aux_loss_coef must be a non-negative finite number, got nan"),
    (dict(experts=2, z_loss_coef="1"), "z_loss_coef must be a non-negative finite number, got '1'"),
])
def test_bad_moe_config_is_one_line_naming_the_value(kw, words):
    with pytest.raises(ValueError) as e:
        ModelConfig(block_size=8, **kw).check()
    assert str(e.value) == words


@pytest.mark.parametrize("args, words", [
    (["--top-k", "2"], "--top-k 2 is a mixture-of-experts setting: it needs --experts E"),
    (["--experts", "2", "--top-k", "3"], "--top-k 3 is more than the --experts 2"),
    (["--experts", "2", "--capacity-factor", "-1"], "--capacity-factor: expected a finite number >= 0, got -1"),
    (["--ep", "2"], "--ep 2 splits the experts of a mixture over ranks: it needs --experts E"),
    (["--experts", "3", "--ep", "2"], "--ep 2 does not divide --experts 3"),
    (["--experts", "4", "--ep", "2"], "--ep 2 does not divide the data-parallel ranks (--dp 1)"),
])
def test_bad_moe_flags_exit_2_with_one_line(args, words):
    from minidist.train.testing import run_train

    done = run_train(None, args + ["--steps", "1"], timeout=60)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and words in lines[0], (done.returncode, done.stderr)


@pytest.mark.parametrize("flat, words", [
    (dict(dp=6, experts=4, ep=3), "--ep 3 does not divide --experts 4"),
    (dict(dp=2, experts=4, ep=4), "--ep 4 does not divide the data-parallel ranks (--dp 2)"),
    (dict(dp=4, experts=4, ep=2, zero=3), None),
    (dict(dp=4, experts=4, hsdp_shard=2), None),
    (dict(dp=4, experts=4, ep=2, zero=1), None),
])
def test_expert_parallel_settings_are_refused_before_any_message(flat, words):
    """--ep's checks (parallel/expert/checks.py, gathered by compose.problems) are arithmetic
    on the settings: every rank reaches them before any message.  ZeRO-3 and HSDP run with
    experts (the recomputed blocks carry the auxiliary losses' gradient: moe.carry_aux_grad)."""
    from minidist.parallel.compose import problems
    from minidist.train.config import RunConfig

    sections = {"model": {"experts": flat.pop("experts")}, "parallel": flat}
    found = problems(RunConfig().replace(**sections), flat["dp"])
    assert (found == []) if words is None else (len(found) == 1 and words in found[0]), found


@pytest.mark.parametrize("kw", [CASES["gpt2-top2-capacity"], CASES["llama-top1-dropless"]],
                         ids=["gpt2-top2-capacity", "llama-top1-dropless"])
def test_checkpointed_blocks_backpropagate_their_auxiliary_losses_once(kw):
    """Activation checkpointing runs each block without its graph and recomputes it in
    backward: the recomputed mixture's output carries the auxiliary losses' gradient
    (moe.carry_aux_grad), so the loss and every gradient equal those of the loss written out
    with the auxiliary losses in its graph (the oracle: no gradient carried by the outputs),
    with and without checkpointing, over two micro-batches and a loss scale."""
    from minidist.model import ops

    x, y = batch(b=4)
    model = tiny(**kw, aux_loss_coef=0.5, z_loss_coef=0.1)
    loss = ops.cross_entropy(model(x), y)
    for block in model.h:
        loss = ops.add(loss, block.mlp.aux_loss)  # in the graph: nothing fed to carry_aux_grad
    ops.mul(loss, 3.0).backward()
    want = loss.item(), {n: host(p.grad).copy() for n, p in model.named_parameters()}
    assert np.abs(want[1]["h.0.mlp.router.weight"]).max() > 0
    for ckpt in (False, True):
        model = tiny(**kw, aux_loss_coef=0.5, z_loss_coef=0.1)
        model.checkpoint_activations = ckpt
        got = Strategy(model, OneReplica(model, None)).forward_backward(x, y, 2, loss_scale=3.0)
        assert got == pytest.approx(want[0], rel=1e-13)
        for n, p in model.named_parameters():
            np.testing.assert_allclose(host(p.grad), want[1][n], rtol=1e-11, atol=1e-14, err_msg=f"{ckpt} {n}")
