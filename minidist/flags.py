"""The training command's flags, and the checks of everything that involves several of them.

``build_parser()`` defines every flag (each number's own range is checked while parsing, see
:mod:`minidist.cli_checks`); ``validate(args, parser)`` then checks the combinations, the
files, the backend, the mesh against the world size and the memory a step needs, on every
rank before any message is sent: bad input is one line on stderr (rank 0) and exit code 2.
"""

from __future__ import annotations

import argparse
import os
import sys

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
    share_cores_between_ranks()
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
    if args.zero and args.dp == 1:  # after the axes' own checks, whose messages are more specific
        flag = f"--hsdp-shard {args.hsdp_shard}" if args.hsdp_shard else f"--zero {args.zero}"
        raise InputError(f"{flag} shards over the data-parallel ranks, but there is one (--dp 1): "
                         "run under mpiexec with more ranks, or leave it out")
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


def share_cores_between_ranks():
    """Under mpiexec, give each rank's BLAS its share of the cores (unless the user set it).

    Each rank would otherwise start one BLAS thread per core: with N ranks on a machine the
    threads outnumber the cores N to 1 and spin-wait for each other (steps 10-50x slower on 2
    cores).  Runs before NumPy is imported, which is when the BLAS reads these variables.
    """
    world = world_size()
    if world == 1:
        return
    local = int(os.environ.get("MPI_LOCALNRANKS") or os.environ.get("OMPI_COMM_WORLD_LOCAL_SIZE") or world)
    threads = str(max(1, (os.cpu_count() or 1) // local))
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(var, threads)


def _validate_mesh(args):
    """The data-parallel settings against the world size and the batch (every rank runs this
    on the same flags, so every rank refuses bad input before any message is sent)."""
    world = world_size()
    others = getattr(args, "pp", 1) * getattr(args, "tp", 1) * getattr(args, "cp", 1)
    if args.dp is None:
        if world % others:
            axes = " x ".join(f"--{a} {getattr(args, a, 1)}" for a in ("pp", "tp", "cp") if getattr(args, a, 1) > 1)
            hint = f": run under mpiexec -n {others} or a multiple of it" if world == 1 else ""
            raise InputError(f"the world size {world} is not divisible by {axes} = {others}{hint}")
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
