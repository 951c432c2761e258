"""The whole GPT against PyTorch in float64: logits, loss, every gradient, and AdamW steps."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from minidist.nn import GPT, GPTConfig  # noqa: E402
from minidist.optim import AdamW, no_decay_below_2d  # noqa: E402
from minidist.torch_reference import TorchGPT  # noqa: E402


def rel_err(a, b):
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


@pytest.fixture(params=[True, False], ids=["tied", "untied"])
def pair(request):
    cfg = GPTConfig(seq_len=16, n_layer=2, n_head=4, d_model=32, dtype="float64", seed=7,
                    tie_embeddings=request.param)
    model = GPT(cfg)
    ref = TorchGPT(model.state_dict(), cfg.n_head, torch.float64, tie_embeddings=request.param)
    rng = np.random.default_rng(0)
    seq = rng.integers(0, 256, size=(4, 17))
    return model, ref, seq[:, :-1], seq[:, 1:]


def test_logits_loss_and_every_gradient_match(pair):
    model, ref, x, y = pair
    logits = model(x).data
    ref_logits = ref(torch.tensor(x)).detach().numpy()
    assert rel_err(logits, ref_logits) < 1e-10
    loss = model(x, y)
    loss.backward()
    ref_loss = ref(torch.tensor(x), torch.tensor(y))
    ref_loss.backward()
    assert abs(loss.item() - ref_loss.item()) < 1e-12
    grads = {n: p.grad for n, p in model.named_parameters()}
    for name, p in ref.named_minidist_parameters():
        assert rel_err(grads[name], p.grad.numpy()) < 1e-6, name


def test_five_adamw_steps_match(pair):
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
        opt.step()
        ref_opt.zero_grad()
        ref(torch.tensor(xs), torch.tensor(ys)).backward()
        ref_opt.step()
    for name, p in model.named_parameters():
        assert rel_err(p.data, ref_params[name].detach().numpy()) < 1e-6, name
