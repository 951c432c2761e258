"""The whole GPT against PyTorch in float64: logits, loss, every gradient, and AdamW steps;
GPT-2 tied and untied, and the Llama form against ``TorchLlama`` (the benchmark's yardstick;
the parity with transformers' own Llama is tests/test_llama_parity.py).

Every comparison is normwise relative -- max |mine - torch| / max |torch| per tensor -- at
1e-12: float64's unit round-off is 1.1e-16, and the measured worst is 1.1e-15 (gradients),
5e-16 (logits), 0 (loss), 3e-14 (AdamW updates).  Normwise, not per element, because some gradient elements are
exactly 0 in exact arithmetic (the key bias: a constant added to one row's scores) and hold
only round-off in both programs.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from minidist.layout.model import ModelConfig  # noqa: E402
from minidist.model.nn import GPT  # noqa: E402
from minidist.model.optim import AdamW, no_decay_below_2d  # noqa: E402
from minidist.model.torch_reference import TorchGPT, TorchLlama  # noqa: E402

TOL = 1e-12  # float64 round-off is 1.1e-16 per operation; the worst measured error is 3e-14


def rel_err(a, b):
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-300))


@pytest.fixture(params=["tied", "untied", "llama"])
def pair(request):
    llama = request.param == "llama"
    cfg = ModelConfig(block_size=16, layers=2, heads=4, d_model=32, dtype="float64", seed=7,
                      tied=request.param == "tied", arch="llama" if llama else "gpt2",
                      kv_heads=2 if llama else None)
    model = GPT(cfg)
    if llama:
        ref = TorchLlama(model.state_dict(), cfg.heads, cfg.kv, cfg.rope_theta, torch.float64)
    else:
        ref = TorchGPT(model.state_dict(), cfg.heads, torch.float64, tie_embeddings=not cfg.untied)
    rng = np.random.default_rng(0)
    seq = rng.integers(0, 256, size=(4, 17))
    return model, ref, seq[:, :-1], seq[:, 1:]


def check_gradients(model, ref):
    grads = {n: p.grad for n, p in model.named_parameters()}
    names = [name for name, _ in ref.named_minidist_parameters()]
    assert sorted(names) == sorted(grads)
    for name, p in ref.named_minidist_parameters():
        err = rel_err(grads[name], p.grad.numpy())
        assert err <= TOL, (name, err)


def test_logits_loss_and_every_gradient_match(pair):
    """Logits, loss and every parameter's gradient to 1e-12 relative (measured <= 1.1e-15)."""
    model, ref, x, y = pair
    logits = model(x).data
    ref_logits = ref(torch.tensor(x)).detach().numpy()
    assert rel_err(logits, ref_logits) <= TOL
    loss = model(x, y)
    loss.backward()
    ref_loss = ref(torch.tensor(x), torch.tensor(y))
    ref_loss.backward()
    assert abs(loss.item() - ref_loss.item()) <= TOL * abs(ref_loss.item())
    check_gradients(model, ref)


def test_five_adamw_steps_match(pair):
    """Five AdamW steps: each step's gradients to 1e-12, then torch.optim.AdamW is handed
    minidist's gradients bit for bit and each step's update (new minus old parameter) must
    agree to 1e-12 relative (measured <= 3e-14: the round-off of subtracting parameters of size
    ~1 to get updates of ~1e-2), and so must the parameters after five steps (measured 5e-16).

    Handing over the gradients keeps the comparison at round-off: two independently computed
    gradients differ by ~1e-16 of the largest, and where a gradient is itself ~1e-16 (the key
    bias, 0 in exact arithmetic) AdamW's m / (sqrt(v) + eps) turns that difference into
    ~5e-12 of the update -- a property of AdamW, not of either program."""
    model, ref, x, y = pair
    lr, betas, eps, wd = 1e-2, (0.9, 0.95), 1e-8, 0.1
    opt = AdamW(model.parameters(), lr=lr, betas=betas, eps=eps, weight_decay=wd, no_decay=no_decay_below_2d)
    decayed = {n for n, p in model.named_parameters() if opt.decay_of(p) > 0}
    ref_params = dict(ref.named_minidist_parameters())
    ref_opt = torch.optim.AdamW([
        {"params": [p for n, p in ref_params.items() if n in decayed], "weight_decay": wd},
        {"params": [p for n, p in ref_params.items() if n not in decayed], "weight_decay": 0.0},
    ], lr=lr, betas=betas, eps=eps)
    for step in range(5):
        xs, ys = np.roll(x, step, axis=1), np.roll(y, step, axis=1)
        model.zero_grad()
        model(xs, ys).backward()
        ref_opt.zero_grad()
        ref(torch.tensor(xs), torch.tensor(ys)).backward()
        check_gradients(model, ref)
        before = {n: p.data.copy() for n, p in model.named_parameters()}
        ref_before = {n: p.detach().numpy().copy() for n, p in ref_params.items()}
        for name, p in model.named_parameters():
            ref_params[name].grad = torch.tensor(p.grad)
        opt.step()
        ref_opt.step()
        for name, p in model.named_parameters():
            err = rel_err(p.data - before[name], ref_params[name].detach().numpy() - ref_before[name])
            assert err <= TOL, (step, name, err)
    for name, p in model.named_parameters():
        err = rel_err(p.data, ref_params[name].detach().numpy())
        assert err <= TOL, (name, err)
