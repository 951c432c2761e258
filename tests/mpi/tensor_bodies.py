"""Bodies run on every rank by tests/test_tensor_parallel.py (float64 throughout).

Each tensor-parallel layer is run beside the plain layer with the same (seed, name) init on
the same global input; this rank's slice of the plain layer's output, input gradient and
parameter gradients must equal the parallel layer's.  Layouts follow Megatron's
conventions (comm/functional.py): a replicated output's upstream gradient is the same on
every rank; a split output's upstream gradient is this rank's slice of the global one.

Inputs are made on the host and moved with ``from_host``; results come back with ``to_host``
before NumPy compares or slices them (both no-ops on the NumPy backend).
"""
import numpy as np
from mpi4py import MPI

from minidist import comm
from minidist.layout.model import ModelConfig
from minidist.model import nn, ops
from minidist.model.autograd import Tensor
from minidist.model.backend import from_host, to_host
from minidist.comm.group import Group
from minidist.comm.mesh import Mesh
from minidist.train.config import RunConfig
from minidist.parallel import compose
from minidist.parallel.tensor import collective_matmul
from minidist.parallel import tensor as tpm
from minidist.train.loop import update

MODES = [("tensor", False, "none"), ("sequence", True, "none"), ("ring", True, "ring"),
         ("bidirectional", True, "bidirectional")]
RTOL = 1e-10


def _subgroup(size):
    """Consecutive groups of ``size`` ranks of the world (the last may be smaller)."""
    w = MPI.COMM_WORLD
    return Group(w.Split(w.Get_rank() // size, w.Get_rank()), name=f"tp{size}")


def _close(got, want, what):
    np.testing.assert_allclose(to_host(got), to_host(want), rtol=RTOL, atol=1e-12, err_msg=what)


def _take(a, axis, tp, shard=None):
    """This rank's slice of a global array: along ``axis`` by the shard's indices, or (for the
    sequence axis) its contiguous part, on the host."""
    a = to_host(a)
    if axis is None:
        return a
    if shard is not None:
        return np.take(a, to_host(shard.indices(a.shape[axis])), axis=axis)
    n = a.shape[axis] // tp.parts
    index = [slice(None)] * a.ndim
    index[axis] = slice(tp.rank * n, (tp.rank + 1) * n)
    return a[tuple(index)]


def _compare(make, tp, x, c, x_axis, y_axis, x_shard=None, y_shard=None, what=""):
    """Plain module vs tensor-parallel module on global input x and upstream gradient c.

    x_axis / y_axis: the axis along which this rank holds a slice of x / y (None: whole)."""
    plain, par = make(nn.Layers()), make(tp)
    nn.init_parameters(plain, 5)
    nn.init_parameters(par, 5)
    xs = Tensor(from_host(x), requires_grad=True)
    y = plain(xs)
    y.backward(from_host(c))
    x_part = Tensor(from_host(np.ascontiguousarray(_take(x, x_axis, tp, x_shard))), requires_grad=True)
    yp = par(x_part)
    _close(yp.data, _take(y.data, y_axis, tp, y_shard), f"{what}: forward")
    yp.backward(from_host(np.ascontiguousarray(_take(c, y_axis, tp, y_shard))))
    _close(x_part.grad, _take(xs.grad, x_axis, tp, x_shard), f"{what}: input gradient")
    plain_params = dict(plain.named_parameters())
    for name, p in par.named_parameters():
        want = to_host(plain_params[name].grad)
        if p.sharding is not None:
            want = np.take(want, to_host(p.sharding.indices(want.shape[p.sharding.dim])), axis=p.sharding.dim)
        _close(p.grad, want, f"{what}: gradient of {name}")


def _check_layers(group, seed):
    rng = np.random.default_rng(seed)
    N = group.size
    B, T, d, H = 2, 2 * N, 4 * N, 2 * N
    cfg = ModelConfig(vocab_size=12 * N, block_size=T, layers=2, heads=H, d_model=d, dtype="float64")
    f64 = np.float64
    x = rng.standard_normal((B, T, d))
    for mode, sp, overlap in MODES:
        tp = tpm.TensorParallelLayers(group, sequence_parallel=sp, overlap=overlap)
        seq = 1 if tp.sequence_parallel else None
        for fused in (1, 3):
            c = rng.standard_normal((B, T, 6 * N * fused))
            make = lambda L, fused=fused: L.column(d, 6 * N * fused, f64, fused=fused)  # noqa: E731
            shard = tp.shard(2, fused) if N > 1 else None
            _compare(make, tp, x, c, seq, 2, y_shard=shard, what=f"{mode} column fused={fused}")
        h = rng.standard_normal((B, T, 6 * N))
        c = rng.standard_normal((B, T, d))
        _compare(lambda L: L.row(6 * N, d, f64), tp, h, c, 2, seq, x_shard=tp.shard(2), what=f"{mode} row")
        c = rng.standard_normal((B, T, d))
        _compare(lambda L: nn.MLP(cfg, f64, L), tp, x, c, seq, seq, what=f"{mode} MLP")
        _compare(lambda L: nn.CausalSelfAttention(cfg, f64, L), tp, x, c, seq, seq, what=f"{mode} attention")
        _compare(lambda L: nn.Block(cfg, f64, L), tp, x, c, seq, seq, what=f"{mode} block")
        _compare(lambda L: L.layer_norm(d, f64), tp, x, c, seq, seq, what=f"{mode} layer norm")
        ids = rng.integers(0, cfg.vocab_size, (B, T))
        _compare_embedding(tp, cfg, ids, rng.standard_normal((B, T, d)), mode)
    if group.rank == 0:
        print(f"tensor layers ok: tp={N}", flush=True)


def _compare_embedding(tp, cfg, ids, c, mode):
    """The vocabulary-parallel embedding as a lookup, the tied head's logits, and the positions."""
    V, d = cfg.vocab_size, cfg.d_model
    plain, par = nn.Embedding(V, d, np.float64), tp.token_embedding(V, d, np.float64)
    nn.init_parameters(plain, 3)
    nn.init_parameters(par, 3)
    seq = 1 if tp.sequence_parallel else None
    y = plain(ids)
    y.backward(from_host(c))
    yp = par(ids)
    _close(yp.data, _take(y.data, seq, tp), f"{mode} embedding forward")
    yp.backward(from_host(np.ascontiguousarray(_take(c, seq, tp))))
    _close(par.weight.grad, _take(plain.weight.grad, 0, tp, tp.shard(0)), f"{mode} embedding gradient")
    # the tied head: (B, T, d) -> this rank's V/tp logits
    x = np.random.default_rng(1).standard_normal(c.shape)
    g = np.random.default_rng(2).standard_normal(c.shape[:2] + (V,))
    plain.weight.grad = par.weight.grad = None
    xs = Tensor(from_host(x), requires_grad=True)
    plain.logits(xs).backward(from_host(g))
    xt = Tensor(from_host(np.ascontiguousarray(_take(x, seq, tp))), requires_grad=True)
    logits = par.logits(xt)
    assert logits.shape[-1] == V // tp.parts, logits.shape
    _close(logits.data, _take(ops.linear(Tensor(from_host(x)), Tensor(plain.weight.data.T)).data, 2, tp, tp.shard(2)),
           f"{mode} tied logits")
    logits.backward(from_host(np.ascontiguousarray(_take(g, 2, tp, tp.shard(2)))))
    _close(xt.grad, _take(xs.grad, seq, tp), f"{mode} tied head input gradient")
    _close(par.weight.grad, _take(plain.weight.grad, 0, tp, tp.shard(0)), f"{mode} tied head weight gradient")
    # positions: replicated table; a sequence shard looks up its own positions
    table = cfg.block_size
    pos_plain, pos_par = nn.Embedding(table, d, np.float64), tp.position_embedding(table, d, np.float64)
    nn.init_parameters(pos_plain, 4)
    nn.init_parameters(pos_par, 4)
    T = ids.shape[1]
    cp_ = c[0]
    pos_plain(np.arange(T)).backward(from_host(cp_))
    out = pos_par(np.arange(T))
    _close(out.data, _take(pos_plain.weight.data[:T], 0 if seq else None, tp), f"{mode} positions")
    out.backward(from_host(np.ascontiguousarray(_take(cp_, 0 if seq else None, tp))))
    _close(pos_par.weight.grad, pos_plain.weight.grad, f"{mode} position gradient")


def layers_match_plain():
    """tp = world size (3) and tp = 2 (ranks 0-1; rank 2 alone, i.e. tp=1: plain layers)."""
    world = comm.world()
    _check_layers(world, seed=11)
    _check_layers(_subgroup(2), seed=12)
    print(f"tensor layers done on rank {world.rank}", flush=True)


# ------------------------------------------------------------------ vocabulary-parallel loss


def _graph_shapes(root):
    """Shapes of every tensor in root's graph, and a hook recording every gradient's shape."""
    shapes, seen, stack = [], set(), [root]
    while stack:
        t = stack.pop()
        if id(t) in seen or not isinstance(t, Tensor):
            continue
        seen.add(id(t))
        shapes.append(tuple(t.shape))
        if t._ctx is not None:
            parents, fn = t._ctx

            def wrapped(g, fn=fn):
                shapes.append(tuple(g.shape))
                out = fn(g)
                shapes.extend(tuple(o.shape) for o in out if o is not None)
                return out

            t._ctx = (parents, wrapped)
            stack.extend(parents)
    return shapes


def vocab_parallel_loss():
    """The vocabulary-parallel cross-entropy equals the plain one (value and gradient), and
    no array of a GPT's forward or backward has the full vocabulary dimension."""
    world = comm.world()
    N = world.size
    rng = np.random.default_rng(21)
    V = 256
    for shape in [(5, V), (2, 3, V)]:
        z = rng.standard_normal(shape) * 3
        t = rng.integers(0, V, shape[:-1])
        zs = Tensor(from_host(z), requires_grad=True)
        loss = ops.cross_entropy(zs, t)
        loss.backward()
        cols = slice(world.rank * V // N, (world.rank + 1) * V // N)
        zp = Tensor(from_host(np.ascontiguousarray(z[..., cols])), requires_grad=True)
        lp = tpm.vocab_parallel_cross_entropy(zp, t, world)
        lp.backward()
        _close(lp.data, loss.data, f"loss {shape}")
        _close(zp.grad, zs.grad[..., cols], f"loss gradient {shape}")
    # a whole GPT, tied and untied head, with and without sequence parallelism
    for sp, tied in [(False, True), (True, False)]:
        cfg = ModelConfig(vocab_size=V, block_size=8, layers=1, heads=4, d_model=16, dtype="float64",
                          tied=tied)
        model = nn.GPT(cfg, tpm.TensorParallelLayers(world, sequence_parallel=sp))
        ids, tgt = rng.integers(0, V, (2, 8)), rng.integers(0, V, (2, 8))
        loss = model(ids, tgt)
        shapes = _graph_shapes(loss)
        loss.backward()
        full = [s for s in shapes if V in s]
        assert not full, f"arrays with the full vocabulary dimension {V}: {full}"
        assert any(s[-1:] == (V // N,) for s in shapes), shapes
    print(f"vocab parallel loss ok on rank {world.rank}", flush=True)


# ------------------------------------------------------------------ training equals serial


def _config(tp=1, sp=False, overlap="none", untied=False, checkpoint=False, dtype="float64", seed=3, dp=1):
    """The run configuration of these tests (compose.build makes the model and its strategy):
    2 blocks, 4 heads, d_model 16, sequences of 8, AdamW at a fixed lr 1e-2."""
    return RunConfig().replace(
        model=dict(layers=2, heads=4, d_model=16, tied=False if untied else None, dtype=dtype, seed=seed),
        data=dict(seq_len=8, batch_size=4), optim=dict(lr=1e-2, weight_decay=0.1),
        device=dict(checkpoint_activations=checkpoint),
        parallel=dict(dp=dp, tp=tp, sequence_parallel=sp, tp_async=None if overlap == "none" else overlap),
    ).resolved(dp * tp)


def _train(strategy, batches, grad_accum=1, low=None, norms=False):
    """Steps of the training loop's calls, the global gradient norm clipped to 0.5 (small
    enough to clip: the norm must be the whole model's); the losses (and the norms)."""
    out = []
    for x, y in batches:
        out.append(strategy.forward_backward(x, y, grad_accum, low))
        done = update(strategy, None, 0.5)
        if norms:
            out.append(done["grad_norm"])
    return out


def _check_training(mesh, serial, batches, label, grad_accum=1, **config):
    model, strategy = compose.build(_config(mesh.size("tp"), **config), mesh)
    losses = _train(strategy, batches, grad_accum)
    np.testing.assert_allclose(losses, serial[0], rtol=1e-9, atol=0, err_msg=label)
    ref = serial[1]
    for name, p in model.named_parameters():
        want = ref[name] if p.sharding is None else p.sharding.take(ref[name])
        np.testing.assert_allclose(to_host(p.data), to_host(want), rtol=1e-9, atol=1e-12, err_msg=f"{label}: {name}")
    if mesh.world.rank == 0:
        print(f"training ok: {label}", flush=True)


def training_matches_serial():
    """5 AdamW steps (clipped) on tp=4 and on two tp=2 groups, every mode, equal the serial run."""
    world = comm.world()
    rng = np.random.default_rng(31)
    batches = [(rng.integers(0, 256, (4, 8)), rng.integers(0, 256, (4, 8))) for _ in range(5)]
    serial = {}
    for untied in (False, True):
        model, strategy = compose.build(_config(untied=untied), None)
        losses = _train(strategy, batches)
        serial[untied] = (losses, {n: p.data.copy() for n, p in model.named_parameters()})
    meshes = {"world": Mesh(tp=world.size), "pair": Mesh(tp=2, world=_subgroup(2))}
    for mesh in meshes.values():
        n = mesh.size("tp")
        for mode, sp, overlap in MODES:
            _check_training(mesh, serial[False], batches, f"tp={n} {mode}", sp=sp, overlap=overlap)
        _check_training(mesh, serial[True], batches, f"tp={n} untied head", sp=True, untied=True)
    pair = meshes["pair"]
    _check_training(pair, serial[False], batches, "tp=2 sequence parallel, activation checkpointing "
                    "and 2 accumulated micro-batches", sp=True, checkpoint=True, grad_accum=2)
    _check_training(pair, serial[False], batches, "tp=2 ring, activation checkpointing",
                    sp=True, overlap="ring", checkpoint=True)
    # Mixed precision: tests/test_compose.py's mixed entries (30 steps on real text, losses and
    # parameters at bars from bf16's round-off, sequence parallel and the ring matmul among them).
    print(f"training done on rank {world.rank}", flush=True)


# ------------------------------------------------------------------ the overlap is real


def overlap_timeline():
    """Under a simulated slow link, every ring step (ppermute, timed on the progress thread)
    overlaps a chunk matmul of the same collective matmul, forward and backward."""
    world = comm.world()
    assert comm.link_model()["gbps"], "run with MINIDIST_LINK_GBPS set"
    rng = np.random.default_rng(41)
    B, T, d = 2, 512, 256  # chunk matmuls of ~5-10 ms beside ~8 ms ring steps at 1 Gbit/s
    cfg = ModelConfig(vocab_size=256, block_size=T, layers=1, heads=4, d_model=d, dtype="float64")
    for overlap in ("ring", "bidirectional"):
        mlp = nn.MLP(cfg, np.float64, tpm.TensorParallelLayers(world, overlap=overlap))
        nn.init_parameters(mlp, 0)
        x = Tensor(from_host(rng.standard_normal((B, T // world.size, d))), requires_grad=True)
        with collective_matmul.record_timeline() as events:
            y = mlp(x)
            y.backward(from_host(np.ones(y.shape)))
        steps = [(a, b) for kind, a, b in events if kind == "ppermute"]
        mms = [(a, b) for kind, a, b in events if kind == "matmul"]
        streams = 2 if overlap == "bidirectional" else 1
        # forward: gather (c_fc), reduce-scatter (c_proj); backward: gather dy (c_proj), reduce-scatter dx
        # and gather x again for dw (c_fc): 5 rings of N-1 steps per direction
        assert len(steps) == 5 * (world.size - 1) * streams, (overlap, len(steps))
        hidden = [any(max(a, m0) < min(b, m1) for m0, m1 in mms) for a, b in steps]
        # A step whose progress thread got no core until the matmuls were done does not
        # overlap (2 ranks x 2-3 threads on a busy 2-core machine); most steps must.
        assert sum(hidden) >= 0.75 * len(hidden), f"{overlap}: ring steps overlapping a matmul: {hidden}"
        print(f"overlap ok: {overlap}, {sum(hidden)} of {len(steps)} ring steps overlap a matmul on rank "
              f"{world.rank}", flush=True)


# ------------------------------------------------------------------ dp x tp


def dp_tp_matches_serial():
    """dp=2 x tp=2 (tp innermost): DDP over the dp group of a tensor-parallel model, through the
    training loop's own calls, equals the serial run; gradient accumulation 2, every mode."""
    from minidist.model.optim import DynamicLossScaler

    world = comm.world()
    rng = np.random.default_rng(51)
    batches = [(rng.integers(0, 256, (4, 8)), rng.integers(0, 256, (4, 8))) for _ in range(5)]
    serial_model, serial_strategy = compose.build(_config(seed=5), None)
    serial = _train(serial_strategy, batches, 2, norms=True)
    ref = dict(serial_model.named_parameters())
    mesh = None
    for mode, sp, overlap in MODES:
        cfg = _config(world.size // 2, sp, overlap, seed=5, dp=2)
        mesh = mesh or compose.build_mesh(cfg.parallel)
        model, strategy = compose.build(cfg, mesh)
        assert "DDP over 2 ranks" in strategy.name, strategy.name
        got = _train(strategy, batches, 2, norms=True)
        np.testing.assert_allclose(got, serial, rtol=1e-9, err_msg=mode)  # losses and gradient norms
        for name, p in model.named_parameters():
            want = ref[name].data if p.sharding is None else p.sharding.take(ref[name].data)
            np.testing.assert_allclose(to_host(p.data), to_host(want), rtol=1e-9, atol=1e-12, err_msg=f"{mode}: {name}")
        if world.rank == 0:
            print(f"dp x tp ok: {mode}", flush=True)
    # fp16: an overflow in one rank's slice (tp rank 1 of dp replica 0) skips the step everywhere
    model, strategy = compose.build(_config(world.size // 2, seed=5, dp=2), mesh)
    for p in model.parameters():
        p.grad = np.zeros_like(p.data)
    if mesh.coords == {"dp": 0, "pp": 0, "cp": 0, "tp": 1}:
        model.h[0].mlp.c_fc.weight.grad[0, 0] = np.inf
    assert strategy.found_inf(DynamicLossScaler()), "an overflow on one rank must skip the step on all"
    print(f"overflow agreed on rank {world.rank}", flush=True)
