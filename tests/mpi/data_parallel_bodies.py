"""Bodies run on every rank by tests/test_data_parallel.py.

Every rank first trains the single-process reference itself (the Strategy of one process on
the whole global batch: no communication), then the parallel configuration, and compares
losses and parameters after 5 steps in float64.
"""
import os
import sys

import numpy as np

from minidist.model.backend import to_host
from mpi4py import MPI

from minidist import comm
from minidist.train.config import RunConfig
from minidist.state.data import Sampler
from minidist.model.nn import GPT
from minidist.model.optim import lr_at
from minidist.parallel.compose import build, build_mesh
from minidist.parallel.data import DistributedDataParallel, allreduce_gradients
from minidist.layout.memory import memory_formula
from minidist.train.testing import train_run, train_steps
from minidist.train.loop import update

TOL = 1e-9
STEPS = 5

_BASE = RunConfig().replace(
    model=dict(layers=2, d_model=16, heads=2, dtype="float64"),
    data=dict(seq_len=8, batch_size=11),
    optim=dict(lr=1e-2, warmup=1, clip_grad=0.0, steps=STEPS))  # no clipping: it would hide a 2x gradient


def _cfg(model=None, device=None, optim=None, **parallel):
    """The tiny float64 run, with ``parallel`` settings (dp=1 by default: one process)."""
    return _BASE.replace(model=model or {}, device=device or {}, optim=optim or {},
                         parallel={"dp": 1, **parallel}).resolved()


_CORPUS = np.random.default_rng(1).integers(0, 256, 4000).astype(np.uint8)


def run(cfg):
    """``testing.train_steps`` as (losses, {name: full parameter}), the losses ending with a validation loss."""
    losses, params, _ = train_steps(cfg, STEPS, _CORPUS)
    return losses, params


def run_keeping(cfg):
    """The same steps, keeping the strategy and the bytes the last update held:
    (losses, params, strategy, {params, grads, optimizer: bytes})."""
    r = train_run(cfg, STEPS, _CORPUS)
    return r.losses, r.params, r.strategy, r.state_bytes


def _rel(a, b):
    a, b = to_host(a), to_host(b)  # device arrays under CuPy
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b))) / max(1e-30, float(np.max(np.abs(b)))))


def compare(label, ref, got):
    (l0, p0), (l1, p1) = ref[:2], got[:2]
    assert set(p0) == set(p1), (label, set(p0) ^ set(p1))
    err = max([_rel(l1, l0)] + [_rel(p1[k], p0[k]) for k in p0])
    assert err <= TOL, f"{label}: relative difference {err:.3e} from the single process"
    # every rank must end with the same parameters
    assert all(_rel(p1[k], comm.broadcast(p1[k], comm.world())) == 0 for k in p1), label
    return err


VARIANTS = [("plain", {}), ("grad-accum 2", {"device": {"grad_accum": 2}}),
            ("checkpointing", {"device": {"checkpoint_activations": True}}),
            ("clipped", {"optim": {"clip_grad": 0.05}})]  # always active: norms 0.5-1.4


def matrix():
    """dp = world size: zero 0-3 x {plain, grad-accum 2, checkpointing}, batch 11 (no dp divides it)."""
    n = MPI.COMM_WORLD.Get_size()
    for variant, over in VARIANTS:
        ref = run(_cfg(**over))
        for zero in (0, 1, 2, 3):
            got = run(_cfg(**over, dp=n, zero=zero, bucket_mb=0.002))
            err = compare(f"dp={n} zero={zero} {variant}", ref, got)
            if MPI.COMM_WORLD.rank == 0:
                print(f"dp ok: dp={n} zero={zero} {variant} rel {err:.1e}", flush=True)
    print("matrix done", flush=True)


def buckets_and_overlap():
    """DDP and ZeRO-2 bucketed, one bucket per parameter, one big bucket, and without overlap."""
    n = MPI.COMM_WORLD.Get_size()
    ref = run(_cfg())
    for zero in (0, 2):
        for bucket_mb, overlap in [(0, True), (0.002, True), (25, True), (0.002, False)]:
            got = run(_cfg(dp=n, zero=zero, bucket_mb=bucket_mb, overlap=overlap))
            compare(f"zero={zero} bucket_mb={bucket_mb} overlap={overlap}", ref, got)
            if MPI.COMM_WORLD.rank == 0:
                print(f"bucket ok: zero={zero} bucket_mb={bucket_mb} overlap={overlap}", flush=True)


def hsdp():
    """dp=4 as 2 shard groups of 2 (ZeRO-3 inside, all-reduce across): equal to one process."""
    for variant, over in VARIANTS:
        ref = run(_cfg(**over))
        got = run_keeping(_cfg(**over, dp=4, hsdp_shard=2))
        compare(f"hsdp {variant}", ref, got)
        f = got[2].data
        assert f.group.size == 4 and f.shard_group.size == 2 and f.replicate_group.size == 2
        if MPI.COMM_WORLD.rank == 0:
            print(f"hsdp ok: {variant}", flush=True)


def memory_and_live_params():
    """Counted bytes equal the formulas exactly; stage 3 never holds more than root + 2 blocks."""
    n = MPI.COMM_WORLD.Get_size()
    for zero in (0, 1, 2, 3):
        losses, params, strategy, held = run_keeping(_cfg(model={"layers": 4}, dp=n, zero=zero, bucket_mb=0.002))
        numel = sum(int(v.size) for v in params.values())
        mine = strategy.data.shard_numel if zero else numel
        want = memory_formula(zero, numel, mine, 8, 2)
        assert held == want, (zero, held, want)
        if zero == 3:
            z = strategy.data
            blocks = sorted((u.numel * 8 for u in z.block_units), reverse=True)
            assert z.max_live_blocks <= 2, z.max_live_blocks
            assert z.max_live_bytes <= z.root.numel * 8 + blocks[0] + blocks[1], z.max_live_bytes
            assert z.max_live_blocks == 2  # the prefetch really overlaps the current block
        if MPI.COMM_WORLD.rank == 0:
            print(f"memory ok: zero={zero} {held}", flush=True)
    # the shards add up to the model
    total = comm.all_reduce(np.array([float(mine)]), comm.world())[0]
    assert total == numel, (total, numel)


def make_model(cfg):
    return GPT(cfg.model)


def textbook_equals_bucketed():
    """One all-reduce per gradient after backward == bucketed, overlapped DDP (same gradients)."""
    n = MPI.COMM_WORLD.Get_size()
    g = comm.world()
    cfg = _cfg(model={"layers": 3})
    grads = []
    for bucketed in (False, True):
        model = make_model(cfg)
        params = model.parameters()
        ddp = DistributedDataParallel(model, None, g, bucket_mb=0.004) if bucketed else None
        x = np.random.default_rng(g.rank).integers(0, 256, (2, 9))
        loss = model(x[:, :-1], x[:, 1:]) * 0.5
        loss.backward()
        ddp.finish() if bucketed else allreduce_gradients(params, g)
        grads.append([p.grad.copy() for p in params])
        if bucketed:
            assert len(ddp.buckets) > 1
    for a, b in zip(*grads):
        assert _rel(a, b) <= 1e-12
    print(f"textbook ok on {n} ranks", flush=True)


def overlap_timeline():
    """With a slow simulated link, the first bucket's all-reduce starts before backward ends."""
    assert os.environ.get("MINIDIST_LINK_GBPS"), "run with MINIDIST_LINK_GBPS set"
    g = comm.world()
    cfg = _cfg(model={"layers": 4, "d_model": 32})
    for overlap in (True, False):
        model = make_model(cfg)
        ddp = DistributedDataParallel(model, None, g, bucket_mb=0.01, overlap=overlap)
        x = np.random.default_rng(0).integers(0, 256, (4, 9))
        ddp.reducer.reset_timeline()
        model(x[:, :-1], x[:, 1:]).backward()
        ddp.finish()
        first, end = ddp.reducer.launch_times[0], ddp.reducer.backward_end
        assert len(ddp.buckets) >= 4
        if overlap:
            assert first < end, (first, end)
            launched_early = sum(t < end for t in ddp.reducer.launch_times)
            print(f"early launch ok: {launched_early}/{len(ddp.buckets)} buckets launched during backward", flush=True)
        else:
            assert first >= end
            print("no-overlap ok: every bucket launched after backward", flush=True)


def ring_bytes():
    """Bytes on the wire of a ring DDP step: summed over ranks, 2(N-1) x the gradient bytes."""
    from minidist.comm.stats import reset_stats, stats

    g = comm.world()
    model = make_model(_cfg())
    ddp = DistributedDataParallel(model, None, g, bucket_mb=0.004, algorithm="ring")
    x = np.random.default_rng(0).integers(0, 256, (2, 9))
    reset_stats()
    model(x[:, :-1], x[:, 1:]).backward()
    ddp.finish()
    sent = stats()["all_reduce"]["bytes_sent"]
    psi = sum(p.size for p in model.parameters())
    total = comm.all_reduce(np.array([float(sent)]), g)[0]
    assert total == 2 * (g.size - 1) * psi * 8, (total, psi)
    print(f"ring bytes ok: {sent} bytes sent on rank {g.rank}, Ψ={psi}", flush=True)


if __name__ == "__main__":
    globals()[sys.argv[1]]()


def overflow_is_agreed():
    """An inf in one rank's gradient shard makes every rank skip (ZeRO-2: shards differ)."""
    from minidist.model.optim import DynamicLossScaler

    n = MPI.COMM_WORLD.Get_size()
    for zero in (0, 2):
        cfg = _cfg(dp=n, zero=zero)
        model, strategy = build(cfg, build_mesh(cfg.parallel))
        sampler = Sampler(_CORPUS, cfg.data.seq_len, cfg.data.batch_size, cfg.model.seed)
        x, y = sampler.batch(0)
        strategy.forward_backward(x, y)
        if MPI.COMM_WORLD.rank == n - 1:
            holder = strategy.data.grad_holders[-1]
            holder.grad.reshape(-1)[0] = np.inf
        before = {p.name: p.data.copy() for p in model.parameters()} if zero == 0 else None
        record = update(strategy, DynamicLossScaler(init_scale=4.0), cfg.optim.clip_grad)
        assert record["skipped"] is True, (zero, record)
        assert record["loss_scale"] == 2.0
        if before is not None:
            assert all(np.array_equal(before[p.name], p.data) for p in model.parameters())
        print(f"overflow ok: zero={zero} rank {MPI.COMM_WORLD.rank} skipped", flush=True)
