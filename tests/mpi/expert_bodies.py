"""Rank bodies for tests/test_expert_parallel.py: expert parallelism equals one process.

Every rank builds the same float64 MoE GPT from the seed, computes one process's loss and
gradients of the whole batch (the reference), then the data-parallel x expert-parallel run:
its rows of the batch, its experts, tokens dispatched with all_to_all_v, the loss weighted
by its share; dense gradients summed over the data-parallel group, the experts' over the
ranks holding the same experts.  Loss and every gradient must agree to 1e-9 (compared on
the host: under CuPy the gradients live on the GPU).
"""
import numpy as np

from minidist import comm
from minidist.model.backend import to_host
from minidist.layout.model import ModelConfig
from minidist.model.nn import GPT
from minidist.parallel import expert

CASES = {
    "top1-dropless": dict(top_k=1),
    "top2-dropless": dict(top_k=2),
    "top1-capacity": dict(top_k=1, capacity_factor=1.0),
    "top2-capacity": dict(top_k=2, capacity_factor=0.5),
}


def _model(**kw):
    cfg = dict(vocab_size=256, block_size=8, layers=2, heads=2, d_model=16, dtype="float64", seed=0,
               experts=4, moe_every=1, z_loss_coef=0.01)
    cfg.update(kw)
    return GPT(ModelConfig(**cfg))


def _reference(kw, x, y):
    model = _model(**kw)
    loss = model(x, y)
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}


def equal_to_one_process(ep):
    world = comm.world()
    ep = int(ep)
    D, d = world.size, world.rank
    ep_group, edp_group = expert.expert_groups(world, ep)
    rng = np.random.default_rng(7)
    tokens = rng.integers(0, 256, size=(2 * D, 9))
    x, y = tokens[:, :-1], tokens[:, 1:]
    rows = slice(2 * d, 2 * d + 2)
    for name, kw in CASES.items():
        want_loss, want = _reference(kw, x, y)
        model = _model(**kw)
        expert.split_experts(model, ep_group)
        names = dict(model.named_parameters())
        local = model(x[rows], y[rows])
        (local * (1.0 / D)).backward()
        mine = {id(p) for p in expert.expert_parameters(model)}
        for n, p in names.items():
            if id(p) not in mine:  # dense: summed over the data-parallel group
                p.grad = comm.all_reduce(p.grad, world, op="sum")
        expert.reduce_expert_gradients(model, edp_group)
        loss = comm.all_reduce(np.array([local.item() / D]), world, op="sum")[0]
        assert abs(loss - want_loss) <= 1e-9 * abs(want_loss), (name, loss, want_loss)
        assert len(mine) and all(".experts." in n for n, p in names.items() if id(p) in mine)
        held = [n for n in names if ".experts." in n]
        assert len(held) == len([n for n in want if ".experts." in n]) // ep, (name, held)
        for n, p in names.items():
            np.testing.assert_allclose(to_host(p.grad), to_host(want[n]), rtol=1e-9, atol=1e-12, err_msg=f"{name}: {n}")
        if d == 0:
            print(f"expert parallel ok: {name} dp{D} ep{ep}", flush=True)
    print(f"rank {d}: expert parallelism equals one process", flush=True)
