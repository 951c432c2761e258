"""Bodies run on every rank by tests/test_context.py (float64 throughout).

``train_all`` runs, in ONE launch of 4 ranks, every context-parallel configuration against the
single-process run that each rank also computes by itself: 5 AdamW steps, the same losses and
parameters to 1e-9 relative.  ``memory_and_work`` measures the traced peak bytes of one
attention forward + backward and counts each rank's attention scores.
"""

import numpy as np
from mpi4py import MPI

from minidist import comm
from minidist.model.backend import from_host, to_host
from minidist.model.autograd import Tensor
from minidist.comm.group import Group
from minidist.layout.model import ModelConfig
from minidist.model.nn import GPT
from minidist.model.optim import AdamW
from minidist.parallel import context as ctx
from minidist.parallel.data import allreduce_gradients
from minidist.train.testing import traced_peak_bytes

STEPS, BATCH, SEQ = 5, 4, 16
CFG = dict(block_size=SEQ, layers=2, heads=4, d_model=16, dtype="float64", seed=7)


def _batches():
    rng = np.random.default_rng(11)
    out = []
    for _ in range(STEPS):
        seq = rng.integers(0, 256, size=(BATCH, SEQ + 1))
        out.append((seq[:, :-1], seq[:, 1:]))
    return out


def _serial(checkpoint=False):
    model = GPT(ModelConfig(**CFG))
    model.checkpoint_activations = checkpoint
    opt = AdamW(model.parameters(), lr=1e-2)
    losses = []
    for x, y in _batches():
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, model.state_dict()


def _parallel(mesh, impl, attention="plain", block=None, checkpoint=False, grad_accum=1):
    """Train on ``mesh`` (dp x cp): batch rows split over dp, sequences over cp, gradients and
    the reported loss summed over the ("dp", "cp") group."""
    cp = ctx.ContextParallel(mesh.group("cp"), impl=impl, attention=attention, block=block)
    model = GPT(ModelConfig(**CFG))
    model.checkpoint_activations = checkpoint
    cp.install(model)
    opt = AdamW(model.parameters(), lr=1e-2)
    dp, dp_rank, both = mesh.size("dp"), mesh.coord("dp"), mesh.group(("dp", "cp"))
    losses = []
    for x, y in _batches():
        rows = BATCH // dp
        xs, ys = x[dp_rank * rows:(dp_rank + 1) * rows], y[dp_rank * rows:(dp_rank + 1) * rows]
        total = 0.0
        for k in range(grad_accum):
            m = rows // grad_accum
            loss = cp.loss(model, xs[k * m:(k + 1) * m], ys[k * m:(k + 1) * m]) * (m / BATCH)
            loss.backward()
            total += loss.item()
        allreduce_gradients(model.parameters(), both)
        opt.step()
        opt.zero_grad()
        losses.append(float(comm.all_reduce(np.array([total]), both)[0]))
    return losses, model.state_dict(), cp


def _compare(name, got, ref, rank):
    (losses, params), (ref_losses, ref_params) = got, ref
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-9, atol=0, err_msg=name)
    for key, value in ref_params.items():
        np.testing.assert_allclose(to_host(params[key]), to_host(value), rtol=1e-9, atol=1e-12, err_msg=f"{name}: {key}")
    print(f"rank {rank}: cp ok: {name}", flush=True)


def train_all():
    world = comm.world()
    rank = world.rank
    ref = _serial()
    halves = Group(MPI.COMM_WORLD.Split(rank // 2, rank), name="half")  # two independent 2-rank worlds
    runs = [
        ("ring cp=4", dict(mesh=comm.Mesh(cp=4), impl="ring")),
        ("ring cp=4 blocks of 2, checkpointing, 2 micro-batches",
         dict(mesh=comm.Mesh(cp=4), impl="ring", block=2, checkpoint=True, grad_accum=2)),
        ("ulysses cp=4", dict(mesh=comm.Mesh(cp=4), impl="ulysses")),
        ("ulysses cp=4 blockwise inside", dict(mesh=comm.Mesh(cp=4), impl="ulysses", attention="blockwise", block=3)),
        ("ring cp=2 blocks of 3 (chunks of 4)", dict(mesh=comm.Mesh(cp=2, world=halves), impl="ring", block=3)),
        ("ulysses cp=2", dict(mesh=comm.Mesh(cp=2, world=halves), impl="ulysses")),
        ("ring dp=2 x cp=2", dict(mesh=comm.Mesh(dp=2, cp=2), impl="ring")),
        ("ulysses dp=2 x cp=2", dict(mesh=comm.Mesh(dp=2, cp=2), impl="ulysses")),
    ]
    for name, kw in runs:
        losses, params, _ = _parallel(**kw)
        _compare(name, (losses, params), ref, rank)
    # Mixed precision, ring and Ulysses: tests/test_compose.py's mixed entries (real text,
    # losses and parameters at bars from bf16's round-off).
    print(f"rank {rank}: context done", flush=True)


# ------------------------------------------------------------------ memory and work




def memory_and_work():
    """Peak traced bytes of one attention forward + backward per rank below B*H*T*T*8, and
    the per-rank score counts: equal with zig-zag, growing with the rank without it."""
    world = comm.world()
    rank, n = world.rank, world.size
    B, T, H, D = 2, 256, 4, 4
    footprint = B * H * T * T * 8
    rng = np.random.default_rng(5)
    qkv_full = rng.standard_normal((B, T, 3 * H * D))
    g_full = rng.standard_normal((B, T, H * D))
    # Ulysses runs a single-rank attention on its H/C heads over the whole sequence: blockwise
    # here (plain would hold (H/C) x T x T probabilities, below the footprint only for C > 2).
    for impl in ("ring", "ulysses"):
        cp = ctx.ContextParallel(world, impl=impl, attention="blockwise", block=32)
        pos = cp.positions(T)
        attend = cp.attention_function()

        def step():
            x = Tensor(from_host(qkv_full[:, pos]), requires_grad=True)
            attend(x, H).backward(from_host(g_full[:, pos]))

        peak = traced_peak_bytes(step)
        assert peak < footprint, (impl, peak, footprint)
        world_peak = comm.all_reduce(np.array([peak]), world, op="max")[0]
        if rank == 0:
            print(f"cp memory ok: {impl} cp={n} peak {world_peak} bytes < T x T footprint {footprint}", flush=True)
    for zigzag in (True, False):
        cp = ctx.ContextParallel(world, impl="ring", zigzag=zigzag)
        pos = cp.positions(T)
        cp.attention_function()(Tensor(from_host(qkv_full[:, pos])), H)
        counts = [int(c) for c in comm.all_gather(np.array([cp.work["scores"]]), world)]
        expected = ctx.ring_work(n, T, zigzag)
        assert counts == expected, (zigzag, counts, expected)
        if zigzag:
            assert len(set(counts)) == 1, counts
        else:
            assert counts == sorted(counts) and counts[-1] > counts[0], counts
        if rank == 0:
            print(f"cp work ok: zigzag={zigzag} {counts}", flush=True)


# ------------------------------------------------------------------ the training command's strategy


def strategy_matrix():
    """The training command's run for --cp (with --dp): compose.build's strategy (DDP buckets
    over the ("dp", "cp") group) through the training loop's own calls (testing.train_steps),
    against the one-process run."""
    from minidist.train.config import from_args
    from minidist.train.flags import build_parser
    from minidist.parallel.compose import problems
    from minidist.train.testing import train_steps

    world = comm.world()

    def config(*flags):
        given = from_args(build_parser().parse_args(
            ["--layers", "2", "--d-model", "16", "--heads", "4", "--seq-len", "16", "--batch-size", "6",
             "--dtype", "float64", "--lr", "1e-2", "--warmup", "1", "--clip-grad", "0", "--steps", str(STEPS),
             *flags]))
        world_size = given.parallel.world_size
        assert problems(given, world_size) == [], (flags, problems(given, world_size))
        return given.resolved(world_size)

    configs = [
        ["--dp", "1", "--cp", "4", "--cp-impl", "ring", "--bucket-mb", "0.002"],
        ["--dp", "1", "--cp", "4", "--cp-impl", "ulysses", "--attention", "blockwise", "--attention-block", "5"],
        ["--dp", "2", "--cp", "2", "--cp-impl", "ring", "--grad-accum", "3", "--checkpoint-activations",
         "--bucket-mb", "0.002"],
        ["--dp", "2", "--cp", "2", "--cp-impl", "ulysses", "--attention-block", "3", "--attention", "blockwise"],
    ]
    for flags in configs:
        cfg = config(*flags)
        assert cfg.parallel.world_size == world.size
        ref = train_steps(config("--grad-accum", str(cfg.device.grad_accum)), STEPS)
        got = train_steps(cfg, STEPS)
        _compare(" ".join(flags), got[:2], ref[:2], world.rank)
    print(f"rank {world.rank}: strategy done", flush=True)
