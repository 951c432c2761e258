"""Optimizers, clipping, schedule and loss scaling, checked against PyTorch and hand math."""
import math

import numpy as np
import pytest

from minidist.model.autograd import Parameter
from minidist.model.optim import (
    SGD, AdamW, DynamicLossScaler, adamw_update, clip_grad_norm, grad_norm_sq, lr_at,
    no_decay_below_2d, sgd_update,
)

SHAPES = {"w1": (4, 3), "b1": (3,), "w2": (3, 5), "g": (5,)}


def make_params(seed=0, dtype=np.float64):
    rng = np.random.default_rng(seed)
    return [Parameter(rng.standard_normal(s).astype(dtype), name=n) for n, s in SHAPES.items()]


def grads_for(step, skip=None):
    """Deterministic random grads per step; the parameter named ``skip`` gets None."""
    rng = np.random.default_rng(100 + step)
    return {n: (None if n == skip else rng.standard_normal(s)) for n, s in SHAPES.items()}


def run_ours(opt, params, steps, lrs, skip_at=None):
    for k in range(steps):
        opt.lr = lrs[k]
        for p in params:
            g = grads_for(k, "b1" if k == skip_at else None)[p.name]
            p.grad = None if g is None else g.copy()
        opt.step()


def run_torch(torch, topt, tparams, steps, lrs, skip_at=None):
    for k in range(steps):
        for group in topt.param_groups:
            group["lr"] = lrs[k]
        for name, t in tparams.items():
            g = grads_for(k, "b1" if k == skip_at else None)[name]
            t.grad = None if g is None else torch.tensor(g)
        topt.step()


def torch_copy(torch, params):
    return {p.name: torch.tensor(p.data.copy(), requires_grad=True) for p in params}


LRS = [1e-2, 3e-2, 2e-2, 5e-3, 1e-2]


def test_adamw_matches_torch_with_no_decay_groups_and_skipped_grads():
    torch = pytest.importorskip("torch")
    params = make_params()
    tparams = torch_copy(torch, params)
    opt = AdamW(params, lr=LRS[0], betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, no_decay=no_decay_below_2d)
    decay = [tparams[n] for n, s in SHAPES.items() if len(s) >= 2]
    rest = [tparams[n] for n, s in SHAPES.items() if len(s) < 2]
    topt = torch.optim.AdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0}],
                             lr=LRS[0], betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    run_ours(opt, params, 5, LRS, skip_at=2)
    run_torch(torch, topt, tparams, 5, LRS, skip_at=2)
    for p in params:
        np.testing.assert_allclose(p.data, tparams[p.name].detach().numpy(), rtol=1e-12, atol=1e-14)
    assert opt.state["b1"]["step"] == 4 and opt.state["w1"]["step"] == 5  # b1 skipped once


@pytest.mark.parametrize("momentum,nesterov,wd", [(0.0, False, 0.0), (0.9, False, 0.0), (0.9, True, 0.0),
                                                  (0.8, True, 0.05), (0.0, False, 0.05)])
def test_sgd_matches_torch(momentum, nesterov, wd):
    torch = pytest.importorskip("torch")
    params = make_params()
    tparams = torch_copy(torch, params)
    opt = SGD(params, lr=LRS[0], momentum=momentum, weight_decay=wd, nesterov=nesterov)
    topt = torch.optim.SGD(list(tparams.values()), lr=LRS[0], momentum=momentum, weight_decay=wd,
                           nesterov=nesterov)
    run_ours(opt, params, 5, LRS, skip_at=1)
    run_torch(torch, topt, tparams, 5, LRS, skip_at=1)
    for p in params:
        np.testing.assert_allclose(p.data, tparams[p.name].detach().numpy(), rtol=1e-12, atol=1e-14)


def test_adamw_single_step_by_hand():
    p0 = np.array([1.0, -2.0, 0.5, 3.0])
    g = np.array([0.1, -0.3, 0.0, 2.0])
    p = Parameter(p0.copy(), name="p")
    p.grad = g.copy()
    lr, wd, eps = 0.01, 0.1, 1e-8
    opt = AdamW([p], lr=lr, betas=(0.9, 0.95), eps=eps, weight_decay=wd)
    opt.step()
    # step 1: m_hat = g and v_hat = g^2 exactly, so the step is lr * g / (|g| + eps)
    want = p0 * (1 - lr * wd) - lr * g / (np.abs(g) + eps)
    np.testing.assert_allclose(p.data, want, rtol=1e-12)
    np.testing.assert_allclose(opt.state["p"]["exp_avg"], 0.1 * g)
    np.testing.assert_allclose(opt.state["p"]["exp_avg_sq"], 0.05 * g * g)
    np.testing.assert_array_equal(p.grad, g)  # the gradient is not modified
    # step 2 by the formula, with a new gradient
    g2 = np.array([-0.2, 0.1, 0.4, 1.0])
    p1 = p.data.copy()
    p.grad = g2.copy()
    opt.step()
    m = 0.9 * 0.1 * g + 0.1 * g2
    v = 0.95 * 0.05 * g * g + 0.05 * g2 * g2
    want2 = p1 * (1 - lr * wd) - lr * (m / (1 - 0.9**2)) / (np.sqrt(v / (1 - 0.95**2)) + eps)
    np.testing.assert_allclose(p.data, want2, rtol=1e-12)


def test_sgd_nesterov_two_steps_by_hand():
    p = Parameter(np.array([1.0, 2.0]), name="p")
    opt = SGD([p], lr=0.1, momentum=0.5, weight_decay=0.2, nesterov=True)
    p.grad = np.array([1.0, -1.0])
    opt.step()
    d1 = np.array([1.0, -1.0]) + 0.2 * np.array([1.0, 2.0])  # buf = d1
    p1 = np.array([1.0, 2.0]) - 0.1 * (d1 + 0.5 * d1)
    np.testing.assert_allclose(p.data, p1)
    p.grad = np.array([0.5, 0.5])
    opt.step()
    d2 = np.array([0.5, 0.5]) + 0.2 * p1
    buf = 0.5 * d1 + d2
    np.testing.assert_allclose(p.data, p1 - 0.1 * (d2 + 0.5 * buf))


def test_weight_decay_only_on_decayed_params():
    # zero gradients: Adam's step is 0 / (0 + eps) = 0, so only the decoupled decay moves weights
    params = make_params()
    before = {p.name: p.data.copy() for p in params}
    for p in params:
        p.grad = np.zeros_like(p.data)
    AdamW(params, lr=0.1, weight_decay=0.5, no_decay=no_decay_below_2d).step()
    for p in params:
        factor = 1 - 0.1 * 0.5 if p.data.ndim >= 2 else 1.0
        np.testing.assert_allclose(p.data, before[p.name] * factor, rtol=1e-15)


def test_update_functions_work_on_a_flat_shard():
    """ZeRO applies the rule to a slice of one flat buffer: must equal the per-parameter update."""
    params = make_params()
    flat_p = np.concatenate([p.data.ravel() for p in params])
    flat_m, flat_v, flat_b = np.zeros_like(flat_p), np.zeros_like(flat_p), np.zeros_like(flat_p)
    adam, sgd = AdamW(params, lr=0.01), SGD(make_params(), lr=0.01, momentum=0.9, nesterov=True)
    flat_p2 = flat_p.copy()
    lo, hi = 5, 23  # a shard cutting through parameters
    for k in range(3):
        grads = grads_for(k)
        for opt in (adam, sgd):
            for p in opt.params:
                p.grad = grads[p.name].copy()
            opt.step()
        flat_g = np.concatenate([grads[n].ravel() for n in SHAPES])
        adamw_update(flat_p[lo:hi], flat_g[lo:hi], flat_m[lo:hi], flat_v[lo:hi], k + 1, 0.01, 0.9, 0.95, 1e-8, 0.1)
        sgd_update(flat_p2[lo:hi], flat_g[lo:hi], flat_b[lo:hi], 0.01, 0.9, 0.0, True)
    np.testing.assert_allclose(flat_p[lo:hi], np.concatenate([p.data.ravel() for p in adam.params])[lo:hi],
                               rtol=1e-14)
    np.testing.assert_allclose(flat_p2[lo:hi], np.concatenate([p.data.ravel() for p in sgd.params])[lo:hi],
                               rtol=1e-14)


def test_float32_master_weights_stay_float32():
    params = make_params(dtype=np.float32)
    opt = AdamW(params, lr=1e-3)
    run_ours(opt, params, 2, LRS)
    assert all(p.data.dtype == np.float32 for p in params)
    assert all(st["exp_avg"].dtype == np.float32 for st in opt.state.values())


@pytest.mark.parametrize("make_opt", [lambda ps: AdamW(ps, lr=1e-2, no_decay=no_decay_below_2d),
                                      lambda ps: SGD(ps, lr=1e-2, momentum=0.9, nesterov=True)])
def test_state_dict_round_trip_continues_identically(make_opt):
    params = make_params()
    opt = make_opt(params)
    run_ours(opt, params, 3, LRS, skip_at=0)
    saved_params = {p.name: p.data.copy() for p in params}
    sd = opt.state_dict()
    run_ours(opt, params, 2, LRS)  # continue the original; must not change the saved dict
    resumed = make_params(seed=7)
    for p in resumed:
        p.data[...] = saved_params[p.name]
    opt2 = make_opt(resumed)
    opt2.load_state_dict(sd)
    assert opt2.step_count == 3
    run_ours(opt2, resumed, 2, LRS)
    for p, q in zip(params, resumed):
        np.testing.assert_array_equal(p.data, q.data)


def test_load_state_dict_rejects_mismatches():
    params = make_params()
    opt = AdamW(params, lr=1e-2)
    run_ours(opt, params, 1, LRS)
    sd = opt.state_dict()
    sd["state"]["w1"]["exp_avg"] = np.zeros((2, 2))
    with pytest.raises(ValueError, match="exp_avg.*w1"):
        AdamW(make_params(), lr=1e-2).load_state_dict(sd)
    sd = opt.state_dict()
    sd["state"]["nope"] = sd["state"].pop("w1")
    with pytest.raises(ValueError, match="nope"):
        AdamW(make_params(), lr=1e-2).load_state_dict(sd)


def test_bad_hyperparameters_are_named():
    params = make_params()
    with pytest.raises(ValueError, match="lr"):
        AdamW(params, lr=-1.0)
    with pytest.raises(ValueError, match="beta2"):
        AdamW(params, lr=1e-3, betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="nesterov"):
        SGD(params, lr=1e-3, nesterov=True)
    with pytest.raises(ValueError, match="unique"):
        SGD([Parameter(np.zeros(2), name="x"), Parameter(np.zeros(2), name="x")], lr=1e-3)


def test_clip_grad_norm_matches_torch():
    torch = pytest.importorskip("torch")
    for max_norm in (0.5, 1e3):  # clipped, and left alone
        params = make_params()
        tparams = torch_copy(torch, params)
        grads = grads_for(0, skip="g")
        for p in params:
            p.grad = None if grads[p.name] is None else grads[p.name].copy()
            tparams[p.name].grad = None if grads[p.name] is None else torch.tensor(grads[p.name])
        total = clip_grad_norm(params, max_norm)
        want = torch.nn.utils.clip_grad_norm_(list(tparams.values()), max_norm)
        assert total == pytest.approx(float(want), rel=1e-12)
        for p in params:
            if p.grad is not None:
                np.testing.assert_allclose(p.grad, tparams[p.name].grad.numpy(), rtol=1e-12)
        assert math.sqrt(grad_norm_sq(params)) == pytest.approx(min(total, max_norm), rel=1e-5)


def test_grad_norm_accumulates_in_float64():
    p = Parameter(np.zeros(1000, dtype=np.float16), name="p")
    p.grad = np.full(1000, 300.0, dtype=np.float16)  # 300^2 overflows float16
    assert grad_norm_sq([p]) == pytest.approx(1000 * 300.0**2)
    p.grad[3] = np.inf
    before = p.grad.copy()
    assert math.isinf(clip_grad_norm([p], 1.0))
    np.testing.assert_array_equal(p.grad, before)  # not turned into nan by scaling
    with pytest.raises(ValueError, match="max_norm"):
        clip_grad_norm([p], 0.0)


def test_lr_schedule_values():
    base, lo, warm, total = 1e-3, 1e-4, 10, 110
    assert lr_at(0, base, warm, total, lo) == pytest.approx(base * 1 / 11)  # > 0 on the first step
    assert lr_at(9, base, warm, total, lo) == pytest.approx(base * 10 / 11)
    assert lr_at(10, base, warm, total, lo) == pytest.approx(base)  # warmup end: peak
    assert lr_at(60, base, warm, total, lo) == pytest.approx((base + lo) / 2)  # cosine midpoint
    assert lr_at(35, base, warm, total, lo) == pytest.approx(lo + 0.5 * (1 + math.cos(math.pi / 4)) * (base - lo))
    assert lr_at(110, base, warm, total, lo) == pytest.approx(lo)  # end
    assert lr_at(500, base, warm, total, lo) == pytest.approx(lo)
    lrs = [lr_at(s, base, warm, total, lo) for s in range(total)]
    assert all(a < b for a, b in zip(lrs[:warm], lrs[1:warm + 1]))  # rising warmup
    assert all(a >= b for a, b in zip(lrs[warm:], lrs[warm + 1:]))  # non-increasing decay
    assert lr_at(0, base, 0, 10) == pytest.approx(base)  # no warmup
    assert lr_at(np.int64(3), base, 0, 10) == lr_at(3, base, 0, 10)
    with pytest.raises(ValueError, match="step"):
        lr_at(-1, base, warm, total)
    assert lr_at(4, base, 10, 5) == pytest.approx(base * 5 / 11)  # run shorter than its warmup
    with pytest.raises(ValueError, match="warmup_steps"):
        lr_at(0, base, -1, 5)


def _scaled_grads(scale, bad=None):
    params = make_params()
    for p in params:
        p.grad = np.full(p.data.shape, 0.25 * scale)
    if bad is not None:
        params[1].grad[0] = bad
    return params


def test_loss_scaler_unscales_and_detects_overflow():
    scaler = DynamicLossScaler(init_scale=2.0**10)
    params = _scaled_grads(2.0**10)
    assert scaler.unscale_(params) is False
    for p in params:
        np.testing.assert_array_equal(p.grad, 0.25)
    for bad in (np.inf, -np.inf, np.nan):
        assert DynamicLossScaler().unscale_(_scaled_grads(1.0, bad)) is True
    params = _scaled_grads(1.0)
    params[0].grad = None  # absent gradients are ignored
    assert DynamicLossScaler().unscale_(params) is False


def test_loss_scaler_backs_off_skips_and_grows():
    scaler = DynamicLossScaler(init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=3)
    params = _scaled_grads(scaler.scale, bad=np.inf)
    before = [p.data.copy() for p in params]
    opt = AdamW(params, lr=0.1)
    found_inf = scaler.unscale_(params)
    if not found_inf:  # the trainer's protocol: skip the step on overflow
        opt.step()
    scaler.update(found_inf)
    assert found_inf is True and scaler.scale == 2.0**15
    assert opt.step_count == 0 and all(np.array_equal(p.data, b) for p, b in zip(params, before))
    for _ in range(2):
        scaler.update(False)
    assert scaler.scale == 2.0**15  # 2 clean steps < interval 3
    scaler.update(False)
    assert scaler.scale == 2.0**16  # grew after 3 clean steps
    scaler.update(False)
    scaler.update(False)
    scaler.update(True)  # an overflow resets the count of clean steps
    scaler.update(False)
    scaler.update(False)
    assert scaler.scale == 2.0**15
    scaler.update(False)
    assert scaler.scale == 2.0**16
    sd = scaler.state_dict()
    other = DynamicLossScaler(growth_interval=3)
    other.load_state_dict(sd)
    assert other.scale == scaler.scale and other.clean_steps == scaler.clean_steps
    with pytest.raises(ValueError, match="backoff_factor"):
        DynamicLossScaler(backoff_factor=1.5)
