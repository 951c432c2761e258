"""``python -m minidist.train``: train a GPT on bytes, on one process or on a 4D mesh.

The whole run, as :func:`train` does it::

    cfg = validate(flags)                       # a RunConfig, checked on every rank
    mesh = build_mesh(cfg.parallel)             # dp x pp x cp x tp ranks, tp innermost
    model, strategy = build(cfg, mesh)          # parallel/compose.py: tp -> cp -> pp -> dp
    for step in range(steps):
        x, y = sampler.batch(step)              # the global batch, the same on every rank
        loss = strategy.forward_backward(x, y, grad_accum)
        update(strategy, scaler, clip)          # overflow check, clip, step, zero_grad
        reporter.add(...)                       # progress line, metrics (minidist/train/report.py)

The strategy (parallel/strategy.py) does all the communication inside these calls; the
loop is the same for every mesh.  Every per-device technique of the lecture seeds is a flag:
gradient accumulation, activation checkpointing, mixed precision (bf16/fp16 compute, fp32
master weights).

Bad input (a number out of range, a missing or unreadable ``--data``, an output that cannot
be written or would overwrite ``--data``, a mesh that does not fit the world, a model an axis
cannot split, a model too large for memory) is refused before any work with one line and exit
code 2 (:mod:`minidist.train.flags`).  A run ends with a summary table (:mod:`minidist.train.report`).
"""

from __future__ import annotations

import math
import os
import sys
import time
import warnings

from minidist.host.cli_checks import available_memory_bytes
from minidist.train.config import RunConfig
from minidist.train.estimate import memory_estimate
from minidist.train.flags import build_parser, validate, world_rank, world_size
from minidist.parallel.compose import build, build_mesh


def load_data(cfg: RunConfig):
    """The training sampler and the fixed validation batches (raises ValueError on bad data)."""
    from minidist.state.data import Sampler, load_corpus, split_corpus

    d = cfg.data
    if d.data is not None and os.path.isdir(d.data):  # token shards, memory-mapped; split by prepare
        from minidist.state.shards import open_shards

        _, splits = open_shards(d.data)
        train_data, val_data = splits["train"], splits["val"]
        name = f"the token shards {d.data}"
    else:
        train_data, val_data = split_corpus(load_corpus(d.data), d.val_fraction)
        name = d.data or "the standard library corpus"
    sampler = Sampler(train_data, d.seq_len, d.batch_size, cfg.model.seed, source=f"training split of {name}")
    if not cfg.report.eval_every:
        return sampler, []
    val = Sampler(val_data, d.seq_len, d.batch_size, cfg.model.seed, source=f"validation split of {name}")
    return sampler, val.val_batches(cfg.report.eval_batches)


def train(cfg: RunConfig, log=print, data=None) -> list:
    """Run the whole training of the resolved ``cfg``; return the per-step metrics records
    (rank 0 prints and writes them).  Collective: every rank of the mesh calls it."""
    from minidist.train import interrupt
    from minidist.state.checkpoint import step_dir
    from minidist.observe import trace
    from minidist.observe.profile import PeakMemory
    from minidist.train.report import Reporter, start_line

    sampler, val_batches = data if data is not None else load_data(cfg)
    mesh = build_mesh(cfg.parallel)
    if mesh is not None:  # which ranks share a node (collective); warn of tp or cp groups across nodes
        from minidist.comm.nodes import layout_warnings

        for line in layout_warnings(mesh):
            if world_rank() == 0:
                print(line, file=sys.stderr, flush=True)
    model, strategy = build(cfg, mesh)
    dev, o, world = cfg.device, cfg.optim, world_size()
    low, scaler = precision(dev.mixed_precision)
    peak = cfg.report.peak_gflops or _measured_peak(cfg, low)
    report = Reporter(cfg, strategy, world, world_rank() == 0, log, peak)
    if not cfg.report.quiet:
        line = start_line(cfg, len(sampler.data), peak, strategy)
        if mesh is not None:  # more ranks than cores: what MPI's waits do (minidist/host/oversubscribed.py)
            from mpi4py import MPI

            from minidist.comm.nodes import ranks_sharing_this_node
            from minidist.host.oversubscribed import note

            if words := note(ranks_sharing_this_node(), MPI.Get_library_version()):
                line += f"; {words}"
        report.log(line)
    memory, tracer = PeakMemory(), None
    if cfg.report.trace:  # spans on every rank, clocks aligned with rank 0 (minidist/observe/trace.py)
        from minidist import comm

        tracer = trace.Tracer(world_rank(), trace.rank_label(cfg.parallel.mesh_sizes(), world_rank()))
        p = cfg.parallel  # what minidist.observe.plot needs to simulate the run's pipeline schedule
        tracer.meta = {"mesh": p.mesh_sizes(), "schedule": p.schedule, "microbatches": p.microbatches,
                       "virtual_stages": p.virtual_stages, "steps": cfg.optim.steps}
        trace.start(tracer, comm.world() if world > 1 else None)
        tracer.wrap(strategy)
    start = resume(cfg, strategy, scaler, report)
    step = saved = start
    if cfg.checkpoint.save:
        interrupt.defer(world_rank() == 0)
    saver = None
    if cfg.checkpoint.save_async:
        from minidist.state.checkpoint import AsyncSaver
        saver = AsyncSaver()
    try:
        # Steps count 1..N everywhere (progress line, metrics, messages); the sampler and the
        # learning-rate schedule take the 0-based index.  A diverging run's overflow warnings
        # are not printed: the loss check below says what happened, once.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            for step in range(start + 1, o.steps + 1):
                r = _one_step(step, step == start + 1, cfg, strategy, sampler, val_batches, report, memory, tracer,
                              low, scaler)
                if not math.isfinite(r["loss"]) and scaler is None:
                    raise FloatingPointError(f"loss became {r['loss']} at step {step}")
                c = cfg.checkpoint
                if c.save and (step == o.steps or (c.save_every and step % c.save_every == 0)):
                    save(cfg, strategy, step, scaler, saver)
                    saved = step
                if c.save and interrupt.requested(strategy.world):  # Ctrl-C or SIGTERM with --save: stop here
                    if saver is not None:
                        saver.wait()
                    if saved != step:
                        save(cfg, strategy, step, scaler)
                    _save_trace(tracer, cfg, world)  # every rank stops here together: the spans so far
                    raise Interrupted(step + 1, report.metrics, step_dir(c.save, step))
        _save_trace(tracer, cfg, world)
        if saver is not None:
            saver.wait()  # the last checkpoint in place before the run ends
            if not cfg.report.quiet:
                hidden = 1 - saver.blocking_s / max(saver.blocking_s + saver.writing_s, 1e-12)
                report.log(f"asynchronous saving: {saver.writing_s:.2f}s written in the background, "
                           f"{saver.blocking_s:.2f}s blocking the loop ({100 * hidden:.0f}% of the save time hidden)")
    except KeyboardInterrupt:
        if world == 1:  # one process: keep the spans of the finished steps (under mpiexec rank 0 aborts the job)
            _save_trace(tracer, cfg, world)
        # the first step not finished (Ctrl-C may land after a step's record, before the next)
        raise Interrupted(report.metrics[-1]["step"] + 1 if report.metrics else start + 1, report.metrics) from None
    finally:
        report.close()
        trace.stop()
    return report.metrics


def _save_trace(tracer, cfg, world: int) -> None:
    """Every rank sends its spans to rank 0, which writes the one file (minidist/observe/trace.py)."""
    from minidist.observe import trace

    if tracer is not None:
        trace.stop()
        if world > 1:
            from minidist import comm

            tracer.save(cfg.report.trace, comm.world())
        else:
            tracer.save(cfg.report.trace, None)


def save(cfg, strategy, step: int, scaler=None, saver=None):
    """Checkpoint ``step`` into ``--save`` (every rank writes its part; minidist/state/checkpoint.py),
    now or, with ``saver`` (--save-async), in the background."""
    from minidist.state import checkpoint
    from minidist.state.shards import describe

    extra = {"loss_scale": scaler.scale, "loss_scale_clean_steps": scaler.clean_steps} if scaler else {}
    extra.update(data_position(describe(cfg.data.data)))
    if saver is not None:
        return saver.save(cfg.checkpoint.save, step, strategy, cfg.model, extra)
    return checkpoint.save(cfg.checkpoint.save, step, strategy, cfg.model, extra)


def data_position(info) -> dict:
    """The loader's position as a checkpoint records it: batches are a function of the step
    (Sampler), so the step plus which data, named by its tokenizer's hash and its shard set's
    identity (minidist/state/shards.py).  --resume refuses another tokenizer (flags.py)."""
    out = {"data_tokenizer": info.tokenizer}
    if info.shards is not None:
        out["data_shards"] = info.shards
    return out


def resume(cfg, strategy, scaler, report) -> int:
    """Load ``--resume``'s checkpoint into this run's layout (any mesh); the step it ends (0 without)."""
    if cfg.checkpoint.resume is None:
        return 0
    from minidist.state import checkpoint

    try:
        meta, failed = checkpoint.load(cfg.checkpoint.resume, strategy), None
    except checkpoint.CheckpointError as exc:  # a damaged piece (its CRC), found by the rank reading it
        meta, failed = None, exc
    if strategy.world is not None:  # every rank stops if any found damage: nobody waits in a collective
        from minidist.parallel.data import any_rank

        if any_rank(failed is not None, strategy.world) and failed is None:
            failed = checkpoint.CheckpointError("")  # another rank says why
    if failed is not None:
        raise failed
    if scaler is not None and "loss_scale" in meta["scalars"]:
        scaler.scale = float(meta["scalars"]["loss_scale"])
        scaler.clean_steps = int(meta["scalars"]["loss_scale_clean_steps"])
    if not cfg.report.quiet:
        saved = " x ".join(f"{a}={n}" for a, n in meta["mesh"].items() if n > 1) or "one process"
        report.log(f"resumed from {cfg.checkpoint.resume} (step {meta['step']}, saved on {saved})")
        if (other := other_shards(meta["scalars"], cfg.data.data)) is not None:
            report.log(other)
    return int(meta["step"])


def other_shards(scalars: dict, data: str | None) -> str | None:
    """A note when the checkpoint was trained on another shard set of the same tokenizer (the
    batches from here on are not the ones the saved run would have drawn); None otherwise."""
    from minidist.state.shards import describe

    saved, now = scalars.get("data_shards"), describe(data).shards
    if saved == now:
        return None
    name = lambda shards: f"shard set {shards}" if shards else "text"  # noqa: E731
    return (f"note: the checkpoint was trained on {name(saved)}, this run reads {name(now)}: the batches "
            "from here on are not the ones the saved run would have drawn")


class Interrupted(Exception):
    """Ctrl-C (SIGINT) or SIGTERM during step ``step``; ``metrics`` holds the finished steps'
    records; ``saved``: the final checkpoint written before stopping (with --save); ``code``:
    the exit code (130, or 143 for SIGTERM: minidist/train/interrupt.py)."""

    def __init__(self, step: int, metrics: list, saved: str | None = None):
        from minidist.train.interrupt import received

        what, self.code = received()
        where = f"after step {step - 1}, saved in {saved}" if saved else f"at step {step}"
        super().__init__(f"{what} {where}")
        self.step, self.metrics = step, metrics


def _one_step(step, first, cfg, strategy, sampler, val_batches, report, memory, tracer, low, scaler) -> dict:
    """Step ``step`` (1-based; ``first``: the first of this run, resumed or not) of the loop;
    its metrics record (kept and printed by ``report``)."""
    from minidist.model.backend import host_reads
    from minidist.model.optim import lr_at

    dev, o, world = cfg.device, cfg.optim, report.world
    # Memory is traced on the first step and on each step before a printed one, so the
    # printed step's own tokens/s and MFU do not pay for the tracing.
    traced = first or report.logged(step + 1)
    clock = tracer.clock if tracer is not None else time.perf_counter
    held = strategy.memory_bytes() if traced else None  # params and optimizer state, before the step's arrays
    first_event = len(tracer.events) if tracer is not None else 0
    t0, comm0, sent0, reads0 = clock(), _comm_seconds(world), _bytes_sent(world), host_reads()
    strategy.optimizer.lr = lr = lr_at(step - 1, o.lr, o.warmup, o.steps, o.min_lr)
    x, y = sampler.batch(step - 1)
    t1 = clock()
    with memory.measure(traced):
        loss = strategy.forward_backward(x, y, dev.grad_accum, low, scaler.scale if scaler else 1.0)
    t2 = clock()
    done = update(strategy, scaler, o.clip_grad)
    t3 = clock()
    if tracer is not None:
        tracer.add("compute", "forward_backward", "step", t1, t2, {"step": step})
        tracer.add("compute", "optimizer", "optimizer", t2, t3, {"step": step})
        tracer.add("compute", f"step {step}", "step", t0, t3, {"step": step})
    sent = {g: n - sent0.get(g, 0) for g, n in _bytes_sent(world).items() if n != sent0.get(g, 0)}
    r = report.record(step, loss, lr, done, t3 - t0, _comm_seconds(world) - comm0,
                      memory.last_bytes, traced, sent, held=held)
    # The values this step brought to the host (each one a synchronisation on a GPU)
    r["host_reads"] = {k: n - reads0.get(k, 0) for k, n in host_reads().items() if n != reads0.get(k, 0)}
    if tracer is not None:  # the step's time by parts, from the main thread's spans
        from minidist.observe.breakdown import breakdown

        r["time_s"] = breakdown(tracer.events, t0, t3, first_event)
        tracer.step_done(first_event)  # a long run keeps its first and latest steps (trace.MAX_EVENTS)
    if cfg.report.eval_every and (step % cfg.report.eval_every == 0 or step == o.steps):
        t4 = clock()
        r["val_loss"] = strategy.evaluate(val_batches, low)
        r["val_bpb"] = report.bits_per_byte(r["val_loss"], "val")
        if tracer is not None:
            tracer.add("compute", "evaluate", "eval", t4, clock(), {"step": step})
    report.add(r, memory.last_bytes)
    return r


def precision(mixed_precision: str):
    """``(low dtype, loss scaler)`` of ``--mixed-precision``: (None, None) for none; bf16
    computes in bfloat16; fp16 in float16 with dynamic loss scaling (its 5 exponent bits)."""
    from minidist.model.backend import dtype
    from minidist.model.optim import DynamicLossScaler

    low = {"none": None, "bf16": dtype("bfloat16"), "fp16": dtype("float16")}[mixed_precision]
    return low, DynamicLossScaler() if mixed_precision == "fp16" else None


def update(strategy, scaler, clip_grad) -> dict:
    """The optimizer half of a step: fp16 overflow check, clipping, update, zero_grad.

    Returns what it did (``loss_scale``, ``grad_norm``, ``skipped``) and ``state_mb``, the
    MiB of parameters, gradients and optimizer state held just before the gradients are dropped.
    """
    done, skipped = {}, False
    if scaler is not None:
        skipped = strategy.found_inf(scaler)  # agreed by every rank: one skips, all skip
        scaler.update(skipped)
        done["loss_scale"] = scaler.scale
    if not skipped:
        if clip_grad:
            done["grad_norm"] = strategy.clip_grad_norm(clip_grad)
        strategy.step()
    done["skipped"] = skipped
    done["state_mb"] = {k: v / 2**20 for k, v in strategy.memory_bytes().items()}
    strategy.zero_grad()
    return done


def _measured_peak(cfg, low) -> float:
    """The peak GFLOP/s for MFU: a known GPU's datasheet rate for the matmul dtype, else this
    machine's GEMM rate at the model's size (profile.peak_gflops).  A shared machine's load
    lowers the measured rate (and so raises MFU): pass --peak-gflops for comparable numbers.
    A quarter second of GEMMs: every rank of every run pays it, and the best of that many
    repeats read the same rate here as a whole second's did (docs/testing.md)."""
    from minidist.observe.profile import peak_gflops

    tokens = cfg.data.batch_size * cfg.data.seq_len // cfg.device.grad_accum // cfg.parallel.dp
    return peak_gflops(cfg.model.d_model, tokens, cfg.model.dtype, low, seconds=0.25)[0]


def _comm_seconds(world: int) -> float:
    """This rank's total time in collectives so far (0 without a communicator)."""
    if world == 1:
        return 0.0
    from minidist.comm.stats import stats

    return sum(v["time_s"] for v in stats().values())


def not_text_warning(path, corpus) -> str | None:
    """A warning when ``--data`` does not look like text (many NUL bytes, as in a binary file):
    minidist trains on its bytes all the same, but the user probably named the wrong file."""
    if path is None or os.path.isdir(path) or len(corpus) == 0:  # shards: token ids, not text
        return None
    head = corpus[:1 << 20]
    nul = float((head == 0).mean())
    if nul < 0.01:
        return None
    return (f"--data {path} does not look like text ({100 * nul:.0f}% of its first "
            f"{len(head):,} bytes are NUL); training on its bytes anyway")


def _bytes_sent(world: int) -> dict:
    """Bytes this rank has sent so far on each group of the mesh ({} without a communicator)."""
    if world == 1:
        return {}
    from minidist.comm.stats import bytes_by_group

    return bytes_by_group()


def main(argv=None):
    from minidist.train import interrupt
    from minidist.train.report import expected_step_bytes, grid_text, summary_table

    t0 = time.perf_counter()
    parser = build_parser()
    cfg = validate(parser.parse_args(argv), parser)  # sets each rank's BLAS threads: before NumPy loads
    from minidist.state.checkpoint import CheckpointError  # imports NumPy
    # Ctrl-C and SIGTERM: rank 0 acts, the others follow (minidist/train/interrupt.py)
    interrupt.install(cfg.parallel.world_size)
    try:
        data = load_data(cfg)
    except (ValueError, OSError) as exc:  # bad input found while loading: no traceback
        parser.error(str(exc))
    except KeyboardInterrupt:
        what, code = interrupt.received()
        parser.exit(code, f"{parser.prog}: {what} before the first step\n" if world_rank() == 0 else None)
    if world_rank() == 0 and (warning := not_text_warning(cfg.data.data, data[0].data)):
        print(f"{parser.prog}: warning: {warning}", file=sys.stderr, flush=True)
    try:
        metrics = train(cfg, log=lambda s: print(s, flush=True), data=data)
    except MemoryError:  # the estimate checked up front was too low for this machine
        need = memory_estimate(cfg)["total"]
        parser.error(f"out of memory during training (estimated need {need / 2**30:.1f} GiB, {need:,} bytes; "
                     f"{(available_memory_bytes() or 0) / 2**30:.1f} GiB available now); "
                     "use a smaller model or batch, or --grad-accum / --checkpoint-activations")
    except FloatingPointError as exc:  # diverged: say so in one line, keep what was written
        # every rank stops at the same step (the loss is global); rank 0 says why, once
        parser.exit(1, f"{parser.prog}: error: {exc}; try a lower --lr or --clip-grad 1\n" if world_rank() == 0 else None)
    except CheckpointError as exc:  # damage found while loading: the rank that found it says where
        if str(exc):
            print(f"{parser.prog}: error: {exc}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        from minidist.comm import sentinel

        sentinel.before_abort()  # an exit on purpose, not a crash: the ranks the launcher ends are not blamed
        os._exit(2)
    except Interrupted as stop:  # Ctrl-C or SIGTERM: one line, the summary of the finished steps, exit 130 or 143
        if world_rank() != 0:  # rank 0 ends the job (MPI_Abort): leaving first would read as a crash
            time.sleep(60)
        if world_rank() == 0:
            print(f"{parser.prog}: {stop} ({len(stop.metrics)} step(s) finished; "
                  f"the metrics file holds them)", file=sys.stderr, flush=True)
            if stop.metrics:
                print(summary_table(stop.metrics, time.perf_counter() - t0), flush=True)
        if cfg.parallel.world_size > 1:
            interrupt.stop_everyone(stop.code)  # rank 0 ends every rank with MPI_Abort(130 or 143)
        sys.stdout.flush()
        os._exit(stop.code)  # without MPI's finalisation: collectives were left half-way
    if world_rank() == 0 and not metrics:  # resumed at (or past) the last step
        print(f"nothing to train: the checkpoint already ends at or after step {cfg.optim.steps} (--steps)",
              flush=True)
    elif world_rank() == 0:
        formula = expected_step_bytes(cfg) if cfg.parallel.world_size > 1 else {}
        print(summary_table(metrics, time.perf_counter() - t0, formula), flush=True)
        if cfg.parallel.world_size > 1:
            from minidist.comm.nodes import layout_text

            print(grid_text(cfg.parallel), flush=True)
            print(layout_text(), flush=True)
