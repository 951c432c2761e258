"""``python -m minidist.train``: train a GPT on bytes, printing progress and writing metrics.

One optimizer step (:func:`forward_backward`, then :func:`update`):

1. take the step's *global* batch from the deterministic sampler;
2. take this rank's rows of it (data parallelism), split them into ``--grad-accum``
   micro-batches and run forward + backward on each, weighting each micro-batch's mean loss
   by its share of the global batch's rows, so the gradients summed over ranks and
   micro-batches are exactly the gradient of the global batch's mean loss;
3. with fp16, unscale the gradients and skip the step if any rank found an inf/NaN;
4. clip the global gradient norm, set the scheduled learning rate, update.

The parallel strategy (parallel/strategy.py and the pipeline, tensor and context ones) does
the communication inside these calls; the loop is the same for every mesh.

Every per-device technique of the lecture seeds is a flag: gradient accumulation,
activation checkpointing, mixed precision (bf16/fp16 compute, fp32 master weights).

Bad input (a number out of range, a missing or unreadable ``--data``, an output that cannot
be written or would overwrite ``--data``, a model too large for memory) is refused before any
work with one line and exit code 2 (:mod:`minidist.flags`, :mod:`minidist.cli_checks`).  A run ends with a summary
table: steps, final losses, tokens/s, MFU, peak memory and wall time.
"""

from __future__ import annotations

import json
import math
import time

from .cli_checks import available_memory_bytes
from .flags import (_validate_mesh, _validate_pipeline, build_parser, memory_estimate,  # noqa: F401 (re-exported)
                    validate, world_rank, world_size)


def make_model(args, layers=None):
    """The GPT these flags describe; ``layers`` (nn.Layers) builds its layers, e.g. tensor-parallel."""
    from .nn import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=256, seq_len=args.block_size, n_layer=args.layers, n_head=args.heads,
                    d_model=args.d_model, tie_embeddings=not args.untied, dtype=args.dtype, seed=args.seed,
                    attention=getattr(args, "attention", "plain"), attention_block=getattr(args, "attention_block", None) or 128)
    model = GPT(cfg, layers)
    model.checkpoint_activations = args.checkpoint_activations
    return model


def make_optimizer(args, params):
    from .optim import SGD, AdamW, no_decay_below_2d

    # Biases and LayerNorm gains are not decayed (GPT-2 / nanoGPT practice).
    if args.optimizer == "sgd":
        return SGD(params, lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay,
                   no_decay=no_decay_below_2d)
    return AdamW(params, lr=args.lr, weight_decay=args.weight_decay, no_decay=no_decay_below_2d)


def micro_batches(x, y, k):
    """Split a global batch row-wise into k micro-batches with their share of the tokens."""
    from .data import shard

    total = x.shape[0]
    for i in range(k):
        xs, ys = shard(x, i, k), shard(y, i, k)
        yield xs, ys, xs.shape[0] / total


def forward_backward(model, x, y, grad_accum=1, low_dtype=None, loss_scale=1.0, strategy=None) -> float:
    """Accumulate into the gradients the gradient of the global batch's mean loss; return that loss.

    Each rank runs its rows of the batch (``strategy.micro_batches``), each micro-batch's mean
    loss weighted by its share of the global rows; the strategy reduces the gradients.
    """
    from . import ops
    from .backend import from_host
    from .parallel.strategy import Strategy

    strategy = strategy or Strategy(model, None)
    if hasattr(strategy, "forward_backward"):  # a pipeline runs its own schedule of microbatches
        return strategy.forward_backward(x, y, grad_accum, low_dtype, loss_scale)
    total = 0.0
    for xs, ys, share, last in strategy.micro_batches(x, y, grad_accum):
        with strategy.micro_step(last):
            with ops.autocast(low_dtype):
                loss = model(from_host(xs), from_host(ys))
            (loss * (share * loss_scale)).backward()
        total += share * loss.item()
    return strategy.reduce_loss(total)


def evaluate(model, batches, low_dtype=None, strategy=None) -> float:
    """Mean validation loss; under data parallelism each rank evaluates its rows of each batch."""
    from . import ops
    from .autograd import no_grad
    from .backend import from_host
    from .parallel.strategy import Strategy

    strategy = strategy or Strategy(model, None)
    if hasattr(strategy, "evaluate"):  # a pipeline passes each batch through its stages
        return strategy.evaluate(batches, low_dtype)
    total = 0.0
    with no_grad(), ops.autocast(low_dtype), strategy.evaluating():
        for x, y in batches:
            for xs, ys, share, _ in strategy.micro_batches(x, y, 1):
                total += share * model(from_host(xs), from_host(ys)).item()
    return strategy.reduce_loss(total) / len(batches)


def load_data(args):
    """The training sampler and the fixed validation batches (raises ValueError on bad data)."""
    from .data import Sampler, load_corpus, split_corpus

    corpus = load_corpus(args.data)
    train_data, val_data = split_corpus(corpus, args.val_fraction)
    name = args.data or "the standard library corpus"
    sampler = Sampler(train_data, args.seq_len, args.batch_size, args.seed, source=f"training split of {name}")
    if not args.eval_every:
        return sampler, []
    val = Sampler(val_data, args.seq_len, args.batch_size, args.seed, source=f"validation split of {name}")
    return sampler, val.val_batches(args.eval_batches)


def build_mesh(args):
    """The run's one ``Mesh(dp, pp, tp, cp)`` (tp innermost), or None for a single process."""
    axes = {a: getattr(args, a, 1) for a in ("dp", "pp", "tp", "cp")}
    if math.prod(axes.values()) == 1:
        return None  # one process: no communicator (a run without mpiexec never initialises MPI)
    from .comm import Mesh

    return Mesh(**axes)


def mesh_label(args) -> str:
    """The mesh as the metrics name it, e.g. ``dp=2 zero=1 tp=2``."""
    label = f"dp={args.dp}"
    if args.hsdp_shard:
        label += f" (shard {args.hsdp_shard} x replicate {args.dp // args.hsdp_shard})"
    if args.zero:
        label += f" zero={args.zero}"
    for axis in ("tp", "cp", "pp"):
        if getattr(args, axis, 1) > 1:
            label += f" {axis}={getattr(args, axis)}" + (f" ({args.cp_impl})" if axis == "cp" else "")
    return label


def tensor_parallel_layers(args, mesh):
    """The layer set that splits every weight over the tp group (--tp > 1), else None (plain layers)."""
    if getattr(args, "tp", 1) == 1:
        return None
    from .parallel.tensor import TensorParallelLayers

    return TensorParallelLayers(mesh.group("tp"), args.sequence_parallel, args.tp_async or "none")


def build_strategy(args, model, opt, mesh=None):
    """The parallel strategy these flags ask for (one process when the world has one rank)."""
    from .parallel.strategy import make_strategy

    if getattr(args, "cp", 1) > 1:  # the sequence split over cp ranks (and the batch over dp)
        from .parallel.context import ContextParallelStrategy

        return ContextParallelStrategy(model, opt, mesh, args.cp_impl, args.attention,
                                       args.attention_block, bucket_mb=args.bucket_mb, overlap=not args.no_overlap)
    strategy = make_strategy(model, opt, dp=args.dp, zero=args.zero, bucket_mb=args.bucket_mb,
                             overlap=not args.no_overlap, hsdp_shard=args.hsdp_shard,
                             mesh=mesh if args.dp > 1 else None)
    if getattr(args, "tp", 1) > 1:
        from .parallel.tensor import TensorParallelStrategy

        strategy = TensorParallelStrategy(strategy, mesh.group("tp"))
    return strategy


def train(args, log=print, data=None):
    """Run the whole training; return the list of per-step metrics dicts (rank 0 logs and writes)."""
    from .backend import dtype
    from .optim import DynamicLossScaler, lr_at
    from .parallel.pipeline import cli as pipeline_cli
    from .profile import PeakMemory, Tracer, measure_peak_gflops, model_flops_per_token

    sampler, val_batches = data if data is not None else load_data(args)
    if getattr(args, "dp", None) is None or getattr(args, "zero", None) is None:
        _validate_mesh(args)  # train() called as a library function without validate()

    mesh = build_mesh(args)
    model = make_model(args, tensor_parallel_layers(args, mesh))
    num_params = sum(math.prod(p.global_shape) for p in model.parameters())  # whole model, not this rank's slices
    if getattr(args, "pp", 1) > 1 and args.schedule is None:
        _validate_pipeline(args)  # train() called as a library function without validate()
    pipeline = pipeline_cli.build(args, model, mesh)  # --pp > 1: the model keeps this rank's stage only
    opt = make_optimizer(args, model.parameters())
    strategy = pipeline_cli.wrap(pipeline, build_strategy(args, model, opt, mesh))
    world = world_size()
    rank0 = world_rank() == 0
    log = log if rank0 else (lambda *_: None)
    low = {"none": None, "bf16": dtype("bfloat16"), "fp16": dtype("float16")}[args.mixed_precision]
    scaler = DynamicLossScaler() if args.mixed_precision == "fp16" else None

    tokens_per_step = args.batch_size * args.seq_len
    flops_per_step = model_flops_per_token(args.layers, args.d_model, args.seq_len, 256) * tokens_per_step
    # A shared machine's load lowers the measured peak (and so raises MFU): pass --peak-gflops
    # for numbers comparable across runs.  MFU is against the peak of all ranks together.
    peak = args.peak_gflops
    if peak is None:
        peak = measure_peak_gflops(args.d_model, tokens_per_step // args.grad_accum // args.dp,
                                   "float32" if low is not None else args.dtype, seconds=1.0)
    if not args.quiet:
        log(f"minidist: GPT {args.layers}x{args.d_model} ({num_params:,} parameters), "
            f"{len(sampler.data):,} training bytes, batch {args.batch_size}x{args.seq_len}, "
            f"peak {peak:.1f} GFLOP/s per rank for MFU, {strategy.name}")

    memory, tracer = PeakMemory(), Tracer(rank=world_rank(), enabled=bool(args.trace))

    def logged(step):
        return step < args.steps and (step % args.log_every == 0 or step + 1 == args.steps)

    label = mesh_label(args)
    metrics, metrics_file = [], open(args.metrics_jsonl, "w") if args.metrics_jsonl and rank0 else None
    try:
        for step in range(args.steps):
            # Memory is traced on the first step and on each step before a printed one, so the
            # printed step's own tokens/s and MFU do not pay for the tracing.
            traced = step == 0 or logged(step + 1)
            t0, comm0 = time.perf_counter(), _comm_seconds(world)
            opt.lr = lr_at(step, args.lr, args.warmup, args.steps, args.min_lr)
            x, y = sampler.batch(step)
            with tracer.span("forward_backward", step=step), memory.measure(traced):
                loss = forward_backward(model, x, y, args.grad_accum, low, scaler.scale if scaler else 1.0, strategy)
            record = {"step": step, "loss": loss, "lr": opt.lr}
            with tracer.span("optimizer", step=step):
                held = update(strategy, scaler, args.clip_grad, record)
            step_time = time.perf_counter() - t0
            record.update(step_time_s=step_time, tokens_per_s=tokens_per_step / step_time,
                          mfu=flops_per_step / step_time / (peak * 1e9 * world))
            if hasattr(strategy, "metrics"):
                record.update(strategy.metrics())  # the pipeline's bubble and activation memory
            if world > 1:
                record.update(mesh=label, comm_s=_comm_seconds(world) - comm0, comm_exposed_s=strategy.comm_wait_s)
            if traced:
                record["peak_mem_mb"] = memory.last_bytes / 2**20
                record["state_mb"] = {k: v / 2**20 for k, v in held.items()}  # params, grads, optimizer
                if world > 1:
                    record["rank_peak_mem_mb"] = _per_rank(memory.last_bytes / 2**20)
            if args.eval_every and ((step + 1) % args.eval_every == 0 or step + 1 == args.steps):
                record["val_loss"] = evaluate(model, val_batches, low, strategy)
            metrics.append(record)
            if metrics_file:
                metrics_file.write(json.dumps(record) + "\n")
                metrics_file.flush()
            if not args.quiet and (logged(step) or "val_loss" in record):
                log(progress_line(record, args.steps, metrics, memory.last_bytes))
            if not math.isfinite(loss) and scaler is None:
                raise FloatingPointError(f"loss became {loss} at step {step}")
    finally:
        if metrics_file:
            metrics_file.close()
        if args.trace and rank0:
            tracer.save(args.trace)
    return metrics


def update(strategy, scaler, clip_grad, record: dict) -> dict:
    """The optimizer half of a step: fp16 overflow check, clipping, update, zero_grad.

    Fills ``record`` (loss_scale, grad_norm, skipped) and returns the bytes of parameters,
    gradients and optimizer state held just before the gradients are dropped.
    """
    skipped = False
    if scaler is not None:
        skipped = strategy.found_inf(scaler)  # agreed by every rank: one skips, all skip
        scaler.update(skipped)
        record["loss_scale"] = scaler.scale
    if not skipped:
        if clip_grad:
            record["grad_norm"] = strategy.clip_grad_norm(clip_grad)
        strategy.step()
    record["skipped"] = skipped
    held = strategy.memory_bytes()
    strategy.zero_grad()
    return held


def _comm_seconds(world: int) -> float:
    """This rank's total time in collectives so far (0 without a communicator)."""
    if world == 1:
        return 0.0
    from .comm.stats import stats

    return sum(v["time_s"] for v in stats().values())


def _per_rank(value: float) -> list:
    """``value`` of every rank, in rank order (a tiny all-gather over the world)."""
    from . import comm
    from .backend import xp

    return [float(v) for v in comm.all_gather(xp.asarray([value], dtype=xp.float64), comm.world())]


def progress_line(r: dict, steps: int, history: list, mem_bytes: int) -> str:
    done = r["step"] + 1
    recent = [h["step_time_s"] for h in history[-20:]]  # recent steps: the first one pays warm-up
    eta = sum(recent) / len(recent) * (steps - done)
    line = (f"step {done:>5}/{steps} | loss {r['loss']:.4f} | lr {r['lr']:.2e} | "
            f"{r['tokens_per_s']:,.0f} tok/s | MFU {100 * r['mfu']:.1f}% | "
            f"mem {mem_bytes / 2**20:.0f} MiB | ETA {int(eta // 60)}m{int(eta % 60):02d}s")
    if "val_loss" in r:
        line += f" | val {r['val_loss']:.4f}"
    if r.get("skipped"):
        line += " | skipped (overflow)"
    from .parallel.pipeline.cli import progress_text

    return line + progress_text(r)


def summary_table(metrics: list, wall_s: float) -> str:
    """The end-of-run table (rank 0): steps, final losses, throughput, MFU, peak memory, time.

    Throughput and MFU are over the steps after the first (which pays for warm-up), as
    total tokens (FLOPs) over total step time.
    """
    last = metrics[-1]
    timed = metrics[1:] or metrics
    step_s = sum(r["step_time_s"] for r in timed)
    tokens_per_s = sum(r["tokens_per_s"] * r["step_time_s"] for r in timed) / step_s
    mfu = sum(r["mfu"] * r["step_time_s"] for r in timed) / step_s
    vals = [r for r in metrics if "val_loss" in r]
    peaks = [r["peak_mem_mb"] for r in metrics if "peak_mem_mb" in r]
    rows = [
        ("steps", f"{len(metrics)}"),
        ("final train loss", f"{last['loss']:.4f}"),
        ("final validation loss", f"{vals[-1]['val_loss']:.4f} (after step {vals[-1]['step'] + 1})" if vals
         else "not evaluated (--eval-every 0)"),
        ("tokens/s", f"{tokens_per_s:,.0f}"),
        ("MFU", f"{100 * mfu:.1f}%"),
        ("peak memory of a step", f"{max(peaks):,.0f} MiB" if peaks else "not measured"),
        ("wall time", f"{_duration(wall_s)} ({_duration(sum(r['step_time_s'] for r in metrics))} in steps)"),
    ]
    from .parallel.pipeline.cli import summary_rows

    rows[-1:-1] = summary_rows(metrics)
    if "mesh" in last:  # under mpiexec: the mesh, and rank 0's communication over the timed steps
        comm_s = sum(r["comm_s"] for r in timed)
        exposed = sum(r["comm_exposed_s"] for r in timed)
        held = next((r["state_mb"] for r in reversed(metrics) if "state_mb" in r), None)
        rows[1:1] = [("mesh", last["mesh"])]
        rows.append(("communication (rank 0)", f"{_duration(comm_s)} in collectives, {_duration(exposed)} "
                                               f"of it waited for after backward"))
        if held:
            rows.append(("rank 0 holds", f"{held['params']:.1f} MiB params, {held['grads']:.1f} MiB grads, "
                                         f"{held['optimizer']:.1f} MiB optimizer state"))
    width = max(len(name) for name, _ in rows)
    rule = "-" * (width + 3 + max(len(value) for _, value in rows))
    return "\n".join(["summary", rule] + [f"{name:<{width}} | {value}" for name, value in rows] + [rule])


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f}s"
    m, s = divmod(int(round(seconds)), 60)
    return f"{m // 60}h{m % 60:02d}m{s:02d}s" if m >= 60 else f"{m}m{s:02d}s"


def main(argv=None):
    t0 = time.perf_counter()
    parser = build_parser()
    args = parser.parse_args(argv)
    validate(args, parser)
    try:
        data = load_data(args)
    except (ValueError, OSError) as exc:  # bad input found while loading: no traceback
        parser.error(str(exc))
    try:
        metrics = train(args, log=lambda s: print(s, flush=True), data=data)
    except MemoryError:  # the estimate checked up front was too low for this machine
        need = memory_estimate(args)["total"]
        parser.error(f"out of memory during training (estimated need {need / 2**30:.1f} GiB, {need:,} bytes; "
                     f"{(available_memory_bytes() or 0) / 2**30:.1f} GiB available now); "
                     "use a smaller model or batch, or --grad-accum / --checkpoint-activations")
    except FloatingPointError as exc:  # diverged: say so in one line, keep what was written
        # every rank stops at the same step (the loss is global); rank 0 says why, once
        parser.exit(1, f"{parser.prog}: error: {exc}; try a lower --lr or --clip-grad 1\n" if world_rank() == 0 else None)
    if world_rank() == 0:
        print(summary_table(metrics, time.perf_counter() - t0), flush=True)


if __name__ == "__main__":
    main()
