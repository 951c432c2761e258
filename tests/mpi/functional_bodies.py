"""Bodies run on every rank by tests/test_functional.py.

Each differentiable collective is checked two ways, in float64:

* forward against NumPy applied to every rank's input (gathered with MPI's built-in
  allgather: an oracle, allowed in tests only);
* backward against central finite differences of ONE global scalar function of all ranks'
  inputs.  Following Megatron's conventions (see minidist/comm/functional.py):
  - a replicated input is one tensor: every rank perturbs the same element together;
    otherwise one rank at a time perturbs its own input;
  - a replicated output is followed by a replicated computation, so the global function is
    <c, y> counted once (same c on every rank); otherwise it is sum over ranks of <c_r, y_r>.
  Every collective is linear, so central differences are exact up to rounding.
"""
import numpy as np
from mpi4py import MPI

from minidist import comm
from minidist.model.autograd import Tensor
from minidist.comm import functional as F

EPS = 1e-3  # the maps are linear: a large step costs no truncation error and less rounding


def _split(a, n, axis):
    return np.array_split(a, n, axis=axis)


def _cases(n):
    """(name, op(x, g), input shape for rank r, replicated input?, replicated output?, numpy ref)."""
    ring = [(i, (i + 1) % n) for i in range(n)]
    one_pair = [(0, n - 1)]
    uneven = [len(p) for p in _split(np.zeros(n + 1), n, 0)]

    def ppermute_ref(perm):
        def ref(xs, r):
            src = [s for s, d in perm if d == r]
            return xs[src[0]] if src else np.zeros_like(xs[r])
        return ref

    def v_counts(r):  # rank r's rows for each destination: uneven, some zero, its own too
        return [(r + 2 * j) % 3 for j in range(n)]

    def v_ref(xs, r):
        parts = [np.split(xj, np.cumsum(v_counts(j))[:-1])[r] for j, xj in enumerate(xs)]
        return np.concatenate(parts, 0)

    return [
        ("all_to_all_v uneven", lambda x, g: F.all_to_all_v(x, v_counts(g.rank), g)[0],
         lambda r: (sum(v_counts(r)), 2), False, False, v_ref),
        ("copy_to_group", F.copy_to_group, lambda r: (3, 2), True, False, lambda xs, r: xs[r]),
        ("copy_to_tp", F.copy_to_tp, lambda r: (2,), True, False, lambda xs, r: xs[r]),
        ("reduce_from_group", F.reduce_from_group, lambda r: (3, 2), False, True, lambda xs, r: sum(xs)),
        ("all_gather axis 0", F.all_gather, lambda r: (2, 3), False, False,
         lambda xs, r: np.concatenate(xs, 0)),
        ("all_gather axis 1", lambda x, g: F.all_gather(x, g, axis=1), lambda r: (2, 2, 3), False, False,
         lambda xs, r: np.concatenate(xs, 1)),
        ("all_gather uneven", F.all_gather, lambda r: (uneven[r], 2), False, False,
         lambda xs, r: np.concatenate(xs, 0)),
        ("reduce_scatter uneven", F.reduce_scatter, lambda r: (n + 1, 2), False, False,
         lambda xs, r: _split(sum(xs), n, 0)[r]),
        ("reduce_scatter axis -1", lambda x, g: F.reduce_scatter(x, g, axis=-1), lambda r: (2, 2 * n), False,
         False, lambda xs, r: _split(sum(xs), n, 1)[r]),
        ("scatter_to_group axis 1", lambda x, g: F.scatter_to_group(x, g, 1), lambda r: (2, n + 1), True,
         False, lambda xs, r: _split(xs[r], n, 1)[r]),
        ("scatter_to_sp", F.scatter_to_sp, lambda r: (2 * n, 2), True, False, lambda xs, r: _split(xs[r], n, 0)[r]),
        ("gather_from_group axis -1", lambda x, g: F.gather_from_group(x, g, -1), lambda r: (2, 2), False,
         True, lambda xs, r: np.concatenate(xs, -1)),
        ("ppermute ring", lambda x, g: F.ppermute(x, g, ring), lambda r: (2, 3), False, False,
         ppermute_ref(ring)),
        ("ppermute one pair", lambda x, g: F.ppermute(x, g, one_pair), lambda r: (3,), False, False,
         ppermute_ref(one_pair)),
        ("all_to_all 0->1", lambda x, g: F.all_to_all(x, g, 0, 1), lambda r: (2 * n, 3), False, False,
         lambda xs, r: np.concatenate([_split(xj, n, 0)[r] for xj in xs], 1)),
        ("all_to_all 1->0 (3-D)", lambda x, g: F.all_to_all(x, g, split_axis=1, concat_axis=0),
         lambda r: (2, n, 3), False, False,
         lambda xs, r: np.concatenate([_split(xj, n, 1)[r] for xj in xs], 0)),
        ("all_to_all 2->2", lambda x, g: F.all_to_all(x, g, 2, 2), lambda r: (1, 2, 2 * n), False, False,
         lambda xs, r: np.concatenate([_split(xj, n, 2)[r] for xj in xs], 2)),
    ]


def _random(shape, seed):
    return np.random.default_rng(seed).standard_normal(shape)


def _global_value(op, x, c, g, out_replicated):
    """The global scalar: <c, y> once for a replicated y, else the sum over ranks of <c_r, y_r>."""
    local = float(np.sum(c * op(Tensor(x), g).data))
    if out_replicated:
        return local
    return g.comm.allreduce(local, op=MPI.SUM)


def _finite_differences(op, x, c, g, in_replicated, out_replicated):
    """d(global value)/d(x of this rank), element by element, by central differences."""
    grad = np.zeros_like(x)
    sizes = g.comm.allgather(x.size)
    perturbers = [None] if in_replicated else range(g.size)  # None: all ranks move together
    for who in perturbers:
        for i in range(sizes[who] if who is not None else x.size):
            values = []
            for step in (EPS, -EPS):
                xp_ = x.copy()
                if who is None or who == g.rank:
                    xp_.reshape(-1)[i] += step
                values.append(_global_value(op, xp_, c, g, out_replicated))
            if who is None or who == g.rank:
                grad.reshape(-1)[i] = (values[0] - values[1]) / (2 * EPS)
    return grad


def _check_case(case, g, seed):
    name, op, shape_of, in_replicated, out_replicated, ref = case
    r = g.rank
    x = _random(shape_of(r), seed if in_replicated else seed + 1 + r)
    x_before = x.copy()
    xs = g.comm.allgather(x)
    t = Tensor(x, requires_grad=True)
    y = op(t, g)
    want = ref(xs, r)
    assert y.data.shape == want.shape, (name, y.data.shape, want.shape)
    np.testing.assert_allclose(y.data, want, rtol=0, atol=1e-12, err_msg=f"{name}: forward")
    c = _random(y.data.shape, seed + 100 if out_replicated else seed + 101 + r)
    y.backward(c)
    assert np.array_equal(x, x_before), f"{name}: the input was modified"
    assert t.grad is not None and t.grad.shape == x.shape, (name, None if t.grad is None else t.grad.shape)
    fd = _finite_differences(op, x, c, g, in_replicated, out_replicated)
    np.testing.assert_allclose(t.grad, fd, rtol=1e-7, atol=1e-9, err_msg=f"{name}: backward vs finite differences")


def _check_bad_input(g):
    n = g.size
    bad = [
        ("all_to_all not divisible", lambda: F.all_to_all(Tensor(np.zeros((n + 1, 2))), g, 0, 1), f"length {n + 1}"),
        ("axis out of range", lambda: F.all_gather(Tensor(np.zeros((2, 2))), g, axis=2), "axis=2"),
        ("split_axis out of range", lambda: F.all_to_all(Tensor(np.zeros((n, 2))), g, -3, 0), "split_axis=-3"),
    ]
    for name, call, words in bad:
        try:
            call()
        except ValueError as e:
            assert words in str(e), (name, str(e))
        else:
            raise AssertionError(f"{name}: no ValueError")


def gradcheck_all():
    g = comm.world()
    for k, case in enumerate(_cases(g.size)):
        _check_case(case, g, seed=1000 * k)
        if g.rank == 0:
            print(f"gradcheck ok: {case[0]} on {g.size} ranks", flush=True)
    _check_bad_input(g)
    # Subgroups: the same ops on the two halves of the world (a tp-like group).
    if g.size >= 4:
        half = comm.Group(g.comm.Split(g.rank // (g.size // 2), g.rank), name="half")
        for k, case in enumerate(_cases(half.size)):
            _check_case(case, half, seed=77 + 1000 * k)
        if g.rank == 0:
            print(f"gradcheck ok: all cases on sub-groups of {half.size}", flush=True)
    print(f"functional done on rank {g.rank}", flush=True)


def _mlp_serial(x, a, b, c):
    """y = tanh(x @ a) @ b and the gradients of <c, y>, on one process (the reference)."""
    from minidist.model import ops

    xt, at, bt = (Tensor(v, requires_grad=True) for v in (x, a, b))
    y = ops.matmul(ops.tanh(ops.matmul(xt, at)), bt)
    y.backward(c)
    return y.data, xt.grad, at.grad, bt.grad


def megatron_mlp_on_mesh():
    """Megatron's MLP on the tp axis of a dp x tp mesh equals the serial MLP, with and without
    sequence parallelism: A is split by columns, B by rows (Shoeybi et al. 2019)."""
    from minidist.model import ops
    from minidist.comm.mesh import Mesh

    world = comm.world()
    mesh = Mesh(dp=2, tp=world.size // 2)
    tp, t, n = mesh.group("tp"), mesh.coord("tp"), mesh.size("tp")
    rng = np.random.default_rng(10 + mesh.coord("dp"))  # each dp replica: its own data
    seq, d, h = 2 * n, 3, 2 * n
    x, a, b, c = (rng.standard_normal(s) for s in [(seq, d), (d, h), (h, d), (seq, d)])
    y_ref, gx_ref, ga_ref, gb_ref = _mlp_serial(x, a, b, c)
    cols = slice(t * h // n, (t + 1) * h // n)
    rows = slice(t * seq // n, (t + 1) * seq // n)
    for mode in ("tensor parallel", "sequence parallel"):
        a_t, b_t = Tensor(a[:, cols].copy(), requires_grad=True), Tensor(b[cols].copy(), requires_grad=True)
        if mode == "tensor parallel":  # x replicated over tp; f ... g
            x_t = Tensor(x, requires_grad=True)
            y = F.reduce_from_tp(ops.matmul(ops.tanh(ops.matmul(F.copy_to_tp(x_t, tp), a_t)), b_t), tp)
            y.backward(c)
            want_y, want_gx = y_ref, gx_ref
        else:  # x sharded along the sequence; all-gather ... reduce-scatter (Korthikanti et al. 2022)
            x_t = Tensor(x[rows].copy(), requires_grad=True)
            y = F.reduce_scatter_to_sp(ops.matmul(ops.tanh(ops.matmul(F.gather_from_sp(x_t, tp), a_t)), b_t), tp)
            y.backward(c[rows])
            want_y, want_gx = y_ref[rows], gx_ref[rows]
        np.testing.assert_allclose(y.data, want_y, rtol=1e-12, atol=1e-12, err_msg=mode)
        np.testing.assert_allclose(x_t.grad, want_gx, rtol=1e-12, atol=1e-12, err_msg=mode)
        np.testing.assert_allclose(a_t.grad, ga_ref[:, cols], rtol=1e-12, atol=1e-12, err_msg=mode)
        np.testing.assert_allclose(b_t.grad, gb_ref[cols], rtol=1e-12, atol=1e-12, err_msg=mode)
        print(f"megatron mlp ok: {mode} on rank {world.rank}", flush=True)
