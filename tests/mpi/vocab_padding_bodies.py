"""Bodies run on every rank by tests/test_vocab_padding.py (float64 throughout): a vocabulary of
301 tokens, which neither tp 2 nor tp 4 divides, padded (parallel/tensor/vocab_parallel.py)."""
import numpy as np
from mpi4py import MPI

from minidist import comm
from minidist.comm.group import Group
from minidist.comm.mesh import Mesh
from minidist.model import ops
from minidist.model.autograd import Tensor
from minidist.model.backend import from_host, to_host
from minidist.parallel import compose
from minidist.parallel import tensor as tpm
from minidist.train.config import RunConfig
from minidist.train.loop import update

V = 301  # 7 x 43: padded to 302 on tp 2, 303 on tp 3, 304 on tp 4


def _subgroup(size):
    w = MPI.COMM_WORLD
    return Group(w.Split(w.Get_rank() // size, w.Get_rank()), name=f"tp{size}")


def _config(tp=1, dp=1, pp=1, sp=False, overlap="none", untied=False, arch="gpt2", zero=None):
    llama = dict(kv_heads=2) if arch == "llama" else {}
    return RunConfig().replace(
        model=dict(layers=2, heads=4, d_model=16, tied=False if untied else None, dtype="float64", seed=7,
                   vocab_size=V, arch=arch, **llama),
        data=dict(seq_len=8, batch_size=4), optim=dict(lr=1e-2, weight_decay=0.1),
        parallel=dict(dp=dp, tp=tp, pp=pp, zero=zero, microbatches=2 if pp > 1 else None, sequence_parallel=sp,
                      tp_async=None if overlap == "none" else overlap),
    ).resolved(dp * tp * pp)


def _train(strategy, batches):
    """The training loop's calls, the gradient norm clipped to 0.5 (it must be the whole
    model's, padding excluded, to clip alike); the losses and the norms."""
    out = []
    for x, y in batches:
        out.append(strategy.forward_backward(x, y, 1, None))
        out.append(update(strategy, None, 0.5)["grad_norm"])
    return out


def _loss_matches_the_unpadded_softmax(group):
    """The loss of padded logits, whatever the padding's values, is the V-way softmax's; so is
    its gradient on the real columns, and on the padding it is exactly zero."""
    N, rng = group.size, np.random.default_rng(3)
    Vl = -(-V // N)
    z = rng.standard_normal((6, N * Vl)) * 3  # the padding's columns hold garbage, not zeros
    t = rng.integers(0, V, 6)
    zs = Tensor(from_host(z[:, :V]), requires_grad=True)
    want = ops.cross_entropy(zs, t)
    want.backward()
    cols = slice(group.rank * Vl, (group.rank + 1) * Vl)
    zp = Tensor(from_host(np.ascontiguousarray(z[:, cols])), requires_grad=True)
    got = tpm.vocab_parallel_cross_entropy(zp, t, group, V)
    got.backward()
    np.testing.assert_allclose(to_host(got.data), to_host(want.data), rtol=1e-12)
    real = tpm.real_columns(V, Vl, group.rank)
    grad = to_host(zp.grad)
    np.testing.assert_allclose(grad[:, :real], to_host(zs.grad)[:, cols][:, :real], rtol=1e-12, atol=1e-15)
    assert real < Vl or group.rank < N - 1
    assert not grad[:, real:].any(), "the padding's logits got a gradient"


def _check(model, losses, serial, label):
    np.testing.assert_allclose(losses, serial[0], rtol=1e-9, atol=0, err_msg=label)
    for name, p in model.named_parameters():
        want = serial[1][name] if p.sharding is None else p.sharding.take(serial[1][name])
        got = to_host(p.data)
        np.testing.assert_allclose(got, to_host(want), rtol=1e-9, atol=1e-12, err_msg=f"{label}: {name}")
        if p.sharding is not None and p.global_shape[p.sharding.dim] == V:
            assert p.shape[p.sharding.dim] * p.sharding.parts > V, (name, p.shape)  # it is padded
            pad = to_host(p.sharding.indices(V)) >= V
            assert not np.take(got, np.nonzero(pad)[0], axis=p.sharding.dim).any(), f"{label}: {name} padding moved"
    if comm.world().rank == 0:
        print(f"padded ok: {label}", flush=True)


def training_matches_serial():
    """On 4 ranks: tp 4 (GPT-2 tied, and untied with sequence parallelism; Llama), tp 2 with the
    ring collective matmul, dp 2 x tp 2 (DDP, ZeRO-1) and pp 2 x tp 2, each 4 clipped AdamW steps on a 301-token
    vocabulary, equal the one-process run in losses, gradient norms and every parameter."""
    world = comm.world()
    _loss_matches_the_unpadded_softmax(world)
    _loss_matches_the_unpadded_softmax(_subgroup(2))
    rng = np.random.default_rng(5)
    batches = [(rng.integers(0, V, (4, 8)), rng.integers(0, V, (4, 8))) for _ in range(4)]
    serial = {}
    for kind, config in (("tied", {}), ("untied", dict(untied=True)), ("llama", dict(arch="llama"))):
        model, strategy = compose.build(_config(**config), None)
        serial[kind] = (_train(strategy, batches), {n: p.data.copy() for n, p in model.named_parameters()})
    runs = [("tp=4 tied", Mesh(tp=4), dict(tp=4), "tied"),
            ("tp=4 untied, sequence parallel", Mesh(tp=4), dict(tp=4, sp=True, untied=True), "untied"),
            ("tp=4 llama (untied head, 2 key/value heads)", Mesh(tp=4), dict(tp=4, arch="llama"), "llama"),
            ("tp=2 ring", Mesh(tp=2, world=_subgroup(2)), dict(tp=2, sp=True, overlap="ring"), "tied")]
    for label, mesh, config, kind in runs:
        model, strategy = compose.build(_config(**config), mesh)
        _check(model, _train(strategy, batches), serial[kind], label)
    for label, config in (("dp=2 x tp=2", dict(tp=2, dp=2)), ("dp=2 x tp=2 ZeRO-1", dict(tp=2, dp=2, zero=1)),
                          ("pp=2 x tp=2, the tied head on the last stage", dict(tp=2, pp=2))):
        cfg = _config(**config)
        model, strategy = compose.build(cfg, compose.build_mesh(cfg.parallel))
        _check(model, _train(strategy, batches), serial["tied"], label)
    print(f"padded done on rank {world.rank}", flush=True)
