"""``python -m minidist.train``: train a GPT on bytes, printing progress and writing metrics.

One optimizer step (see :func:`train_step`):

1. take the step's *global* batch from the deterministic sampler;
2. split it into ``--grad-accum`` micro-batches and run forward + backward on each, weighting
   each micro-batch's mean loss by its share of the tokens, so the accumulated gradient is
   exactly the gradient of the global batch's mean loss (gradient accumulation);
3. with fp16, unscale the gradients and skip the step if any is inf/NaN (dynamic loss scaling);
4. clip the global gradient norm, set the scheduled learning rate, update.

Every per-device technique of the lecture seeds is a flag: gradient accumulation,
activation checkpointing, mixed precision (bf16/fp16 compute, fp32 master weights).

Bad input (a number out of range, a missing or unreadable ``--data``, an output that cannot
be written or would overwrite ``--data``, a model too large for memory) is refused before any
work with one line and exit code 2 (:mod:`minidist.cli_checks`).  A run ends with a summary
table: steps, final losses, tokens/s, MFU, peak memory and wall time.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

from .cli_checks import (InputError, available_memory_bytes, check_input_file, check_memory, check_output_files,
                         float_in, int_in, training_memory_bytes)


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Adds "(default: X)" only where the help does not already say it and X means something."""

    def _get_help_string(self, action):
        text = action.help or ""
        meaningless = action.default is None or action.default is False or action.default == argparse.SUPPRESS
        if meaningless or "default" in text or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)" if text else "default: %(default)s"


class _Parser(argparse.ArgumentParser):
    """Errors as one line (argparse's usage block would bury the message); exit code 2."""

    def error(self, message):
        # Under mpiexec every rank finds the same error and exits 2; rank 0 says it once.
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n" if world_rank() == 0 else None)


POSITIVE, NON_NEGATIVE = int_in(lo=1), int_in(lo=0)

EXAMPLES = """examples:
  minidist-train --steps 300                                  the demo
  minidist-train --dtype float64 --steps 20                   exact arithmetic, for checks
  minidist-train --grad-accum 4 --checkpoint-activations --mixed-precision bf16
  minidist-train --data my.txt --metrics-jsonl run.jsonl --trace trace.json
  mpiexec -n 4 minidist-train --zero 2                        data parallel, ZeRO-2, on 4 ranks
  mpiexec -n 4 minidist-train --hsdp-shard 2                  HSDP: ZeRO-3 in pairs, 2 replicas
  mpiexec -n 4 minidist-train --pp 2 --dp 2 --schedule 1f1b   pipeline of 2 stages x 2 replicas
  mpiexec -n 4 minidist-train --tp 2 --tp-async                dp=2 x tp=2, collective matmuls

Bad input (a value out of range, a missing file, an output that would overwrite --data, a
model too large for memory) stops the run before any work with one message and exit code 2.
"""


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="minidist-train", formatter_class=_HelpFormatter, epilog=EXAMPLES,
                description="Train a small GPT on bytes, printing progress and writing metrics.")
    m = p.add_argument_group("model")
    m.add_argument("--layers", type=POSITIVE, default=4, metavar="N", help="number of transformer blocks")
    m.add_argument("--d-model", type=POSITIVE, default=128, metavar="N", help="width of the residual stream")
    m.add_argument("--heads", type=POSITIVE, default=4, metavar="N", help="attention heads, a divisor of --d-model")
    m.add_argument("--block-size", type=POSITIVE, default=None, metavar="N",
                   help="size of the position table, the longest sequence the model accepts (default: --seq-len)")
    m.add_argument("--untied", action="store_true", help="separate LM head instead of tying it to the embedding")
    d = p.add_argument_group("data")
    d.add_argument("--data", default=None, metavar="FILE",
                   help="text file to train on (default: the installed Python's standard library source, "
                        "read at start-up)")
    d.add_argument("--seq-len", type=POSITIVE, default=128, metavar="N", help="tokens (bytes) per training sequence")
    d.add_argument("--batch-size", type=POSITIVE, default=16, metavar="N",
                   help="sequences per optimizer step: the global batch")
    d.add_argument("--val-fraction", type=float_in(0, 1, lo_open=True, hi_open=True), default=0.05, metavar="X",
                   help="share of the corpus held out for validation")
    o = p.add_argument_group("optimization")
    o.add_argument("--steps", type=POSITIVE, default=300, metavar="N", help="optimizer steps")
    o.add_argument("--optimizer", choices=["adamw", "sgd"], default="adamw", help="update rule")
    o.add_argument("--lr", type=float_in(0, lo_open=True), default=3e-3, metavar="X", help="peak learning rate")
    o.add_argument("--min-lr", type=float_in(0), default=None, metavar="X",
                   help="final learning rate of the cosine decay, at most --lr (default: --lr / 10)")
    o.add_argument("--warmup", type=NON_NEGATIVE, default=20, metavar="N", help="linear warm-up steps")
    o.add_argument("--weight-decay", type=float_in(0), default=0.1, metavar="X",
                   help="decoupled weight decay, of matrices only")
    o.add_argument("--momentum", type=float_in(0, 1, hi_open=True), default=0.9, metavar="X",
                   help="SGD momentum, in [0, 1)")
    o.add_argument("--clip-grad", type=float_in(0), default=1.0, metavar="X",
                   help="max global gradient norm, 0 for none")
    o.add_argument("--seed", type=NON_NEGATIVE, default=0, metavar="N",
                   help="seed of the weights and of the data order")
    t = p.add_argument_group("per-device techniques")
    t.add_argument("--grad-accum", type=POSITIVE, default=1, metavar="K",
                   help="split each global batch into K sequential micro-batches: same update, less memory")
    t.add_argument("--checkpoint-activations", action="store_true",
                   help="recompute each block's activations in backward instead of storing them")
    t.add_argument("--mixed-precision", choices=["none", "bf16", "fp16"], default="none",
                   help="low-precision activations and matmuls, fp32 master weights; fp16 adds loss scaling")
    t.add_argument("--dtype", choices=["float32", "float64"], default="float32",
                   help="dtype of the weights; float64 for exactness checks")
    t.add_argument("--backend", choices=["numpy", "cupy"], default=None,
                   help="array backend (default: $MINIDIST_BACKEND, else numpy)")
    dp = p.add_argument_group("data parallelism (run under mpiexec -n N)")
    dp.add_argument("--dp", type=POSITIVE, default=None, metavar="N",
                    help="data-parallel ranks (default: the world size over the other mesh axes)")
    dp.add_argument("--zero", type=int, choices=[0, 1, 2, 3], default=None,
                    help="ZeRO stage: 0 DDP, 1 shard the optimizer state, 2 also the gradients, 3 also the "
                         "parameters (FSDP) (default: 0, or 3 with --hsdp-shard)")
    dp.add_argument("--hsdp-shard", type=POSITIVE, default=None, metavar="K",
                    help="HSDP: ZeRO-3 inside groups of K ranks, gradients all-reduced across the groups")
    dp.add_argument("--bucket-mb", type=float_in(0), default=25.0, metavar="X",
                    help="gradient bucket size in MB, 0 for one bucket per parameter")
    dp.add_argument("--no-overlap", action="store_true",
                    help="reduce gradients after the backward pass instead of during it (for comparison)")
    tp = p.add_argument_group("tensor parallelism (run under mpiexec; tp is the innermost mesh axis)")
    tp.add_argument("--tp", type=POSITIVE, default=1, metavar="T",
                    help="split every weight matrix over T ranks (Megatron-LM); the other ranks are data parallel")
    tp.add_argument("--sequence-parallel", action="store_true",
                    help="also split the LayerNorm and residual activations over the sequence (Korthikanti et al.)")
    tp.add_argument("--tp-async", nargs="?", const="ring", choices=["ring", "bidirectional"], default=None,
                    metavar="ring|bidirectional",
                    help="hide the all-gathers and reduce-scatters behind the matmuls as ring steps (collective "
                         "matmul, Wang et al.; implies --sequence-parallel); 'bidirectional' sends half each way "
                         "(default when given: ring)")

    from .parallel.context_cli import add_arguments as add_context_arguments

    add_context_arguments(p, POSITIVE)  # --attention, --attention-block, --cp, --cp-impl

    from .parallel.pipeline import cli as pipeline_cli

    pipeline_cli.add_arguments(p)
    r = p.add_argument_group("reporting")
    r.add_argument("--eval-every", type=NON_NEGATIVE, default=50, metavar="N",
                   help="validation loss every N steps, 0 for never")
    r.add_argument("--eval-batches", type=POSITIVE, default=4, metavar="N", help="validation batches per evaluation")
    r.add_argument("--log-every", type=POSITIVE, default=10, metavar="N", help="progress line every N steps")
    r.add_argument("--metrics-jsonl", default=None, metavar="FILE", help="write one JSON object per step to FILE")
    r.add_argument("--peak-gflops", type=float_in(0, lo_open=True), default=None, metavar="X",
                   help="peak FLOP rate for MFU (default: measured from a GEMM of the model's size)")
    r.add_argument("--trace", default=None, metavar="FILE", help="write a Chrome/Perfetto trace of the steps to FILE")
    r.add_argument("--quiet", action="store_true",
                   help="no start-up and progress lines; the summary at the end still prints")
    r.add_argument("--timeout-s", type=float_in(0), default=None, metavar="X",
                   help="abort the job when a communication wait makes no progress for X seconds, 0 for never "
                        "(default: $MINIDIST_TIMEOUT_S, else 300)")
    return p


def validate(args, parser):
    """Reject bad input before any work, with one message naming the value (exit code 2).

    Each number's own range is checked while parsing (``type=``); here come the checks
    that involve several flags, the files, the backend and the memory a step needs.
    """
    try:
        _validate(args)
    except InputError as exc:
        parser.error(str(exc))


def _validate(args):
    if args.d_model % args.heads:
        raise InputError(f"--d-model {args.d_model} is not divisible by --heads {args.heads}")
    if args.block_size is None:
        args.block_size = args.seq_len
    if args.seq_len > args.block_size:
        raise InputError(f"--seq-len {args.seq_len} is larger than the position table (--block-size {args.block_size})")
    if args.grad_accum > args.batch_size:
        raise InputError(f"--grad-accum {args.grad_accum} exceeds --batch-size {args.batch_size}: "
                         "every micro-batch needs at least one sequence")
    _validate_mesh(args)
    _validate_context(args)
    _validate_pipeline(args)
    if args.min_lr is None:
        args.min_lr = args.lr / 10
    if args.min_lr > args.lr:
        raise InputError(f"--min-lr {args.min_lr:g} exceeds --lr {args.lr:g}")
    if args.mixed_precision != "none" and args.dtype == "float64":
        raise InputError("--mixed-precision needs --dtype float32 master weights")
    if args.data is not None:
        check_input_file("--data", args.data)
    check_output_files({"--metrics-jsonl": args.metrics_jsonl, "--trace": args.trace}, {"--data": args.data})
    if args.timeout_s is not None:  # the communication watchdog's timeout, read when minidist.comm is imported
        os.environ["MINIDIST_TIMEOUT_S"] = repr(args.timeout_s)
        if "minidist.comm.watchdog" in sys.modules:  # already imported (train used as a library)
            sys.modules["minidist.comm.watchdog"].set_timeout(args.timeout_s)
    if args.backend:
        os.environ["MINIDIST_BACKEND"] = args.backend  # read when minidist.backend is first imported
    try:
        from . import backend  # noqa: F401  (checks MINIDIST_BACKEND, imports cupy if asked)
    except ImportError:
        raise InputError("the cupy backend needs the cupy package (pip install cupy-cuda12x)") from None
    except ValueError as exc:
        raise InputError(str(exc)) from None
    _validate_tensor(args)  # after the backend check: parallel/tensor.py imports the backend
    check_memory(memory_estimate(args), available_memory_bytes())


def world_size() -> int:
    """Ranks in this job, read from the launcher's environment (MPICH, Open MPI) so that a run
    without mpiexec never initialises MPI; under a launcher, MPI's own count."""
    if not any(v in os.environ for v in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK")):
        return 1
    from mpi4py import MPI

    return MPI.COMM_WORLD.Get_size()


def world_rank() -> int:
    for var in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK"):
        if var in os.environ:
            return int(os.environ[var])
    return 0


def _validate_tensor(args):
    """Sizes that --tp ranks cannot split (parallel/tensor.py names the flag and value)."""
    from .parallel.tensor import check_cli

    try:
        check_cli(args.tp, args.heads, args.d_model, args.seq_len, args.sequence_parallel, args.tp_async,
                  zero=bool(args.zero or args.hsdp_shard))
    except ValueError as exc:
        raise InputError(str(exc)) from None


def _validate_mesh(args):
    """The data-parallel settings against the world size and the batch (every rank runs this
    on the same flags, so every rank refuses bad input before any message is sent)."""
    world = world_size()
    others = getattr(args, "pp", 1) * getattr(args, "tp", 1) * getattr(args, "cp", 1)
    if args.dp is None:
        if world % others:
            raise InputError(f"the world size {world} is not divisible by the other mesh axes ({others})")
        args.dp = world // others
    elif args.dp * others != world:
        raise InputError(f"--dp {args.dp} does not match the world size {world} "
                         f"(mpiexec -n {world}{f' over {others} ranks of the other axes' if others > 1 else ''})")
    if args.batch_size < args.dp * args.grad_accum:
        raise InputError(f"--batch-size {args.batch_size} has fewer rows than --dp {args.dp} x --grad-accum "
                         f"{args.grad_accum} = {args.dp * args.grad_accum}: a rank would get an empty micro-batch")
    if args.hsdp_shard is not None:
        if args.zero not in (None, 3):
            raise InputError(f"--hsdp-shard shards with ZeRO-3, but --zero {args.zero} was given")
        if args.dp % args.hsdp_shard:
            raise InputError(f"--hsdp-shard {args.hsdp_shard} does not divide --dp {args.dp}")
        args.zero = 3
    if args.zero is None:
        args.zero = 0


def _validate_pipeline(args):
    from .parallel.pipeline import cli as pipeline_cli

    pipeline_cli.validate(args)


def _validate_context(args):
    from .parallel.context_cli import check_arguments

    try:
        check_arguments(args)
    except ValueError as exc:
        raise InputError(str(exc)) from None


def memory_estimate(args) -> dict:
    from .data import DEFAULT_MAX_BYTES

    from .parallel.context_cli import score_values

    data_bytes = os.path.getsize(args.data) if args.data else DEFAULT_MAX_BYTES
    seq_per_rank = args.seq_len // getattr(args, "cp", 1)  # context parallelism: this rank's tokens
    return training_memory_bytes(args.layers, args.d_model, args.heads, seq_per_rank, args.block_size,
                                 args.batch_size, args.grad_accum, args.dtype, args.mixed_precision,
                                 args.checkpoint_activations, args.optimizer, not args.untied,
                                 data_bytes=data_bytes, eval_batches=args.eval_batches if args.eval_every else 0,
                                 score_values=score_values(args))


def make_model(args, layers=None):
    """The GPT these flags describe; ``layers`` (nn.Layers) builds its layers, e.g. tensor-parallel."""
    from .nn import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=256, seq_len=args.block_size, n_layer=args.layers, n_head=args.heads,
                    d_model=args.d_model, tie_embeddings=not args.untied, dtype=args.dtype, seed=args.seed,
                    attention=getattr(args, "attention", "plain"), attention_block=getattr(args, "attention_block", 128))
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
    import numpy as np  # a host array for the wire

    from . import comm

    return [float(v) for v in comm.all_gather(np.array([value], dtype=np.float64), comm.world())]


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
        parser.exit(1, f"{parser.prog}: error: {exc}; try a lower --lr or --clip-grad 1\n")
    if world_rank() == 0:
        print(summary_table(metrics, time.perf_counter() - t0), flush=True)


if __name__ == "__main__":
    main()
