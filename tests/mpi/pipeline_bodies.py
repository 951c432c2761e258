"""Bodies run on every rank by tests/test_pipeline.py.

Each configuration trains a tiny GPT for 5 optimizer steps with a pipeline over all ranks
and compares every step's loss and, at the end, every parameter this rank holds with the
single-process run of the same seed and data (computed on each rank: the model is tiny).
Many configurations share one launch (mpiexec start-up costs more than they do).
"""
import numpy as np

from minidist import comm
from minidist.model import ops
from minidist.layout.model import ModelConfig
from minidist.model.nn import GPT
from minidist.model.optim import AdamW, clip_grad_norm, no_decay_below_2d
from minidist.parallel.pipeline.runtime import PipelineRuntime
from minidist.layout.schedules import ORDERS, ZERO_BUBBLE, make_schedule, schedule_problem
from minidist.layout.simulate import simulate

STEPS, BATCH, SEQ = 5, 8, 8


def _batches(seed=0):
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, 256, (BATCH, SEQ)), rng.integers(0, 256, (BATCH, SEQ))) for _ in range(STEPS)]


def _config(layers, untied, dtype="float64"):
    return ModelConfig(vocab_size=256, block_size=SEQ, layers=layers, heads=2, d_model=16,
                       tied=not untied, dtype=dtype, seed=3)


def _optimizer(params):
    return AdamW(params, lr=3e-3, weight_decay=0.1, no_decay=no_decay_below_2d)


def serial_run(layers, ckpt=False, untied=False, accum=1, clip=0.0, low=None, dtype="float64"):
    model = GPT(_config(layers, untied, dtype))
    model.checkpoint_activations = ckpt
    opt = _optimizer(model.parameters())
    losses = []
    for x, y in _batches():
        total = 0.0
        for k in range(accum):
            xs, ys = np.array_split(x, accum)[k], np.array_split(y, accum)[k]
            with ops.autocast(low):
                loss = model(xs, ys)
            (loss * (len(xs) / len(x))).backward()
            total += len(xs) / len(x) * loss.item()
        if clip:
            clip_grad_norm(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, model.state_dict()


_MESHES = {}


def _pp_mesh(group):
    """A pipeline-only mesh over ``group`` (None for one rank: no MPI), built once per group."""
    if group.size == 1:
        return None
    if id(group) not in _MESHES:
        _MESHES[id(group)] = comm.Mesh(pp=group.size, world=group)
    return _MESHES[id(group)]


def pipeline_run(group, schedule, M, V=1, layers=4, ckpt=False, untied=False, accum=1, clip=0.0, low=None,
                 dtype="float64"):
    """The training loop's calls on a pipeline over ``group`` (every rank the whole batch): the
    schedule's passes, the tied-embedding sum, the whole model's gradient norm (clipping)."""
    from minidist.parallel.data import OneReplica
    from minidist.parallel.strategy import Strategy
    from minidist.train.loop import update

    model = GPT(_config(layers, untied, dtype))
    model.checkpoint_activations = ckpt
    mesh = _pp_mesh(group)
    pipe = PipelineRuntime(model, group if mesh is None else mesh.group("pp"), schedule, M, V)
    strategy = Strategy(model, OneReplica(model, _optimizer(model.parameters())), mesh, pipeline=pipe)
    losses = []
    for x, y in _batches():
        losses.append(strategy.forward_backward(x, y, accum, low))
        update(strategy, None, clip)
    return losses, model.state_dict(), pipe


def _rel(a, b):
    from minidist.model.backend import to_host  # device arrays under CuPy

    a, b = np.asarray(to_host(a), np.float64), np.asarray(to_host(b), np.float64)
    return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-30))


def _simulated_peak_in_flight(group, schedule, M, V=1) -> int:
    """The most (microbatch, chunk) forwards awaiting their backward on this rank, from the
    schedule simulator (simulate.py: the schedule played with no model and no runtime)."""
    return simulate(make_schedule(schedule, group.size, M, V)).peak_in_flight[group.rank]


def _check(label, group, run_kwargs, tol=1e-9):
    """Losses and parameters against the serial run, and the runtime's measured peak of
    activations in flight against the simulator's for the same schedule."""
    ref_losses, ref_state = serial_run(**{k: v for k, v in run_kwargs.items() if k not in ("schedule", "M", "V")})
    losses, state, pipe = pipeline_run(group, **run_kwargs)
    assert len(losses) == len(ref_losses) == STEPS, f"{label}: {len(losses)} losses, serial {len(ref_losses)}"
    worst = _rel(losses, ref_losses)
    assert worst <= tol, f"{label}: losses {losses} vs serial {ref_losses} (rel {worst:.2e})"
    assert state, f"{label}: rank {group.rank} holds no parameters"
    for name, value in state.items():
        err = _rel(value, ref_state[name])
        assert err <= tol, f"{label}: parameter {name} differs from serial by {err:.2e} (rel)"
        worst = max(worst, err)
    peak = _simulated_peak_in_flight(group, run_kwargs["schedule"], run_kwargs["M"], run_kwargs.get("V", 1))
    assert pipe.stats["peak_in_flight"] == peak, \
        f"{label}: rank {group.rank} held {pipe.stats['peak_in_flight']} microbatches in flight, the schedule {peak}"
    return worst, pipe


def equal_to_serial():
    """Every schedule and microbatch count on all ranks (P = world size), plus, on 2 ranks,
    virtual stages, checkpointing, untied head, grad accumulation, clipping."""
    g = comm.world()
    P = g.size
    configs = []
    for schedule in ORDERS:
        for M in (1, 2, 4, 8):
            if schedule in ZERO_BUBBLE and M == 8:
                continue  # M = P and 2P cover their warm-up and drain; keep the launch short
            if schedule_problem(schedule, P, M, 1) is None:
                configs.append(dict(schedule=schedule, M=M, layers=P))
    for schedule in ("interleaved", "looping"):
        M = max(P, 2)
        configs.append(dict(schedule=schedule, M=M, V=2, layers=2 * P))
    # ZB-V: both ends on rank 0 (tied: one copy), its fewest microbatches 2P-1 and 2P, untied
    configs += [dict(schedule="zbv", M=2 * P - 1, V=2, layers=2 * P),
                dict(schedule="zbv", M=2 * P, V=2, layers=2 * P, untied=True)]
    if P == 2:
        configs += [
            dict(schedule="1f1b", M=4, layers=4, ckpt=True),
            dict(schedule="gpipe", M=2, layers=2, ckpt=True, untied=True),
            dict(schedule="interleaved", M=4, V=2, layers=4, ckpt=True),
            dict(schedule="1f1b", M=2, layers=2, accum=2, clip=0.05),
            dict(schedule="looping", M=2, V=2, layers=4, untied=True, clip=0.05),
            dict(schedule="looping", M=4, V=2, layers=8),
            dict(schedule="zb-h1", M=2, layers=4, ckpt=True, untied=True, accum=2, clip=0.05),
            dict(schedule="zb-h2", M=4, layers=4, ckpt=True),
            dict(schedule="zbv", M=3, V=2, layers=4, accum=2, clip=0.05),
            dict(schedule="zbv", M=4, V=2, layers=8, ckpt=True, untied=True, accum=2),
        ]
    worst = 0.0
    for cfg in configs:
        label = " ".join(f"{k}={v}" for k, v in cfg.items())
        err, pipe = _check(label, g, cfg)
        worst = max(worst, err)
        if g.rank == 0:
            print(f"pipeline ok: {label} (rel {err:.1e}, bubble {pipe.stats['bubble']:.2f})", flush=True)
    if g.rank == 0:
        print(f"pipeline configs: {len(configs)} worst rel {worst:.2e}", flush=True)


def accounting():
    """GPipe holds all M microbatches' activations, 1F1B at most P: measured peaks agree, with
    the formulas and with the schedule simulator."""
    g = comm.world()
    P, M = g.size, 8
    peaks = {}
    for schedule in ("gpipe", "1f1b"):
        _, _, pipe = pipeline_run(g, schedule, M, layers=P)
        peaks[schedule] = pipe.stats
        assert pipe.stats["peak_in_flight"] == _simulated_peak_in_flight(g, schedule, M), (schedule, pipe.stats)
        assert 0.0 <= pipe.stats["bubble"] < 1.0 and pipe.stats["span_s"] > 0
    assert peaks["gpipe"]["peak_in_flight"] == M
    assert peaks["1f1b"]["peak_in_flight"] == min(P - g.rank, M)
    assert peaks["1f1b"]["peak_activation_bytes"] < peaks["gpipe"]["peak_activation_bytes"]
    # checkpointing keeps only each block's input (the last stage still keeps its logits)
    _, _, ck = pipeline_run(g, "gpipe", M, layers=P, ckpt=True)
    assert ck.stats["peak_activation_bytes"] < peaks["gpipe"]["peak_activation_bytes"] / (1.2 if g.rank == P - 1 else 2)
    print(f"pipeline accounting ok rank {g.rank}: gpipe {peaks['gpipe']['peak_activation_bytes']} B, "
          f"1f1b {peaks['1f1b']['peak_activation_bytes']} B, checkpointed {ck.stats['peak_activation_bytes']} B",
          flush=True)




# -- through the training loop's functions, composed with data parallelism --------------------------
_CORPUS = np.random.default_rng(1).integers(0, 256, 4000).astype(np.uint8)


def _train_config(**over):
    """The resolved RunConfig of the training command's flags below, with ``over`` (field names
    of any section: pp, dp, schedule, layers, grad_accum, ...) changed; checked like the CLI."""
    import dataclasses

    from minidist.train.config import from_args
    from minidist.train.flags import build_parser
    from minidist.parallel.compose import problems

    argv = ["--layers", "2", "--d-model", "16", "--heads", "2", "--seq-len", "8", "--batch-size", "11",
            "--dtype", "float64", "--lr", "1e-2", "--warmup", "1", "--clip-grad", "0", "--steps", str(STEPS)]
    given = from_args(build_parser().parse_args(argv))
    if "no_overlap" in over:
        over["overlap"] = not over.pop("no_overlap")
    sections = {}
    for key, value in over.items():
        (section,) = [n for n in ("model", "data", "optim", "device", "parallel")
                      if key in {f.name for f in dataclasses.fields(getattr(given, n))}]
        sections.setdefault(section, {})[key] = value
    given = given.replace(**sections)
    world = given.parallel.world_size
    assert problems(given, world) == [], (over, problems(given, world))
    return given.resolved(world)


def _check_overlap(cfg):
    """One bucket per parameter: the first chunk-final backward launches reductions before
    the schedule ends (the data-parallel hooks open inside the pipeline's passes)."""
    from minidist.state.data import Sampler
    from minidist.parallel.compose import build, build_mesh

    _, strategy = build(cfg, build_mesh(cfg.parallel))
    reducer = getattr(strategy.data, "reducer", None)
    if reducer is None:  # one data-parallel replica: nothing to reduce
        return
    x, y = Sampler(_CORPUS, cfg.data.seq_len, cfg.data.batch_size, cfg.model.seed).batch(0)
    strategy.forward_backward(x, y, cfg.device.grad_accum)
    assert reducer.launch_times and min(reducer.launch_times) < reducer.backward_end, "no overlap"
    strategy.zero_grad()


def train_path_matrix():
    """pp = 2 alone (2 ranks) or dp = 2 x pp = 2 (4 ranks) through the training loop's functions
    (testing.train_steps on compose.build), with DDP and ZeRO-1, overlap on and off, grad
    accumulation, checkpointing, clipping."""
    from minidist.train.testing import train_steps

    n = comm.world().size
    dp = n // 2
    configs = [
        dict(schedule="1f1b", microbatches=2, bucket_mb=0),
        dict(schedule="interleaved", microbatches=2, virtual_stages=2, layers=4, zero=1),
        dict(schedule="gpipe", microbatches=2, grad_accum=2, checkpoint_activations=True),
        dict(schedule="looping", microbatches=2, virtual_stages=2, layers=4, tied=False, no_overlap=True),
        dict(schedule="naive", microbatches=2, zero=1, grad_accum=2),
        dict(schedule="zb-h1", microbatches=2, bucket_mb=0),
        dict(schedule="zb-h2", microbatches=2, zero=2, grad_accum=2, tied=False),
        dict(schedule="zbv", microbatches=3, layers=4, zero=1, bucket_mb=0),
        dict(schedule="zbv", microbatches=4, layers=4, tied=False, grad_accum=2 if dp == 1 else 1),
    ]
    worst = 0.0
    for cfg in configs:
        if dp == 1:  # ZeRO and the buckets' settings need data-parallel ranks: refused with one
            for key in ("zero", "bucket_mb", "no_overlap"):
                cfg.pop(key, None)
        common = {k: v for k, v in cfg.items() if k in ("layers", "grad_accum", "checkpoint_activations", "tied")}
        ref_losses, ref_params, _ = train_steps(_train_config(**common), STEPS, _CORPUS)
        run = _train_config(pp=2, dp=dp, **cfg)
        losses, params, _ = train_steps(run, STEPS, _CORPUS)
        assert len(losses) == len(ref_losses) == STEPS + 1, (len(losses), len(ref_losses))  # and a validation loss
        assert set(params) <= set(ref_params), sorted(set(params) - set(ref_params))
        if cfg.get("bucket_mb") == 0 and not cfg.get("no_overlap"):
            _check_overlap(run)
        err = max([_rel(losses, ref_losses)] + [_rel(v, ref_params[k]) for k, v in params.items()])
        label = f"dp={dp} x pp=2 " + " ".join(f"{k}={v}" for k, v in cfg.items())
        assert err <= 1e-9, f"{label}: relative difference {err:.2e} from one process"
        worst = max(worst, err)
        if comm.world().rank == 0:
            print(f"train path ok: {label} (rel {err:.1e})", flush=True)
    if comm.world().rank == 0:
        print(f"train path done: worst rel {worst:.2e}", flush=True)


def two_ranks():
    equal_to_serial()
    accounting()
    train_path_matrix()


def four_ranks():
    equal_to_serial()
    accounting()
    train_path_matrix()
