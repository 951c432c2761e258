"""The training command's flags, and the checks of everything that involves several of them.

``build_parser()`` defines every flag (each number's own range is checked while parsing, see
:mod:`minidist.host.cli_checks`); ``validate(args, parser)`` then checks the combinations, the
files, the backend, the mesh against the world size and the memory a step needs, on every
rank before any message is sent: bad input is one line on stderr (rank 0) and exit code 2.
"""

from __future__ import annotations

import argparse
import os
import sys

from minidist.host.cli_checks import (InputError, OneLineParser, available_memory_bytes, check_input_file, check_memory,
                                      check_output_files, float_in, int_in)
from minidist.host import env
from minidist.host.blas_env import pin_blas_threads
from minidist.host.oversubscribed import prepare as prepare_yield
from minidist.layout.model import ARCHS, ATTENTIONS, FFN_MULTIPLE, ROPE_THETA
from minidist.layout.settings import CP_IMPLEMENTATIONS, TP_OVERLAPS
from minidist.train.config import RunConfig, from_args
from minidist.train.estimate import memory_estimate
from minidist.layout.schedules import ORDERS


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Adds "(default: X)" only where the help does not already say it and X means something."""

    def _get_help_string(self, action):
        text = action.help or ""
        meaningless = action.default is None or action.default is False or action.default == argparse.SUPPRESS
        if meaningless or "default" in text or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)" if text else "default: %(default)s"


POSITIVE, NON_NEGATIVE, POSITIVE_FLOAT = int_in(lo=1), int_in(lo=0), float_in(lo=0, lo_open=True)

EXAMPLES = """examples (after make install, with .venv/bin first on PATH: it holds mpiexec and minidist-train):
  minidist-train --steps 300                                  the demo
  minidist-train --dtype float64 --steps 20                   exact arithmetic, for checks
  minidist-train --grad-accum 4 --checkpoint-activations --mixed-precision bf16
  minidist-train --data my.txt --metrics-jsonl run.jsonl --trace trace.json
  mpiexec -n 8 minidist-train --dp 2 --pp 2 --tp 2            3D parallelism: the main job
  mpiexec -n 16 minidist-train --dp 2 --pp 2 --tp 2 --cp 2 --zero 1 --sequence-parallel
  mpiexec -n 4 minidist-train --zero 2                        data parallel, ZeRO-2, on 4 ranks
  mpiexec -n 4 minidist-train --hsdp-shard 2                  HSDP: ZeRO-3 in pairs, 2 replicas
  mpiexec -n 4 minidist-train --pp 2 --dp 2 --schedule 1f1b   pipeline of 2 stages x 2 replicas
  mpiexec -n 4 minidist-train --tp 2 --cp 2 --cp-impl ulysses tensor x context parallelism
  mpiexec -n 4 minidist-train --experts 8 --ep 2 --zero 1     8 experts, 4 per rank, over 4 data-parallel ranks

Bad input (a value out of range, a missing file, an output that would overwrite --data, a
model too large for memory) stops the run before any work with one message and exit code 2.
"""


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="minidist-train", speaks=world_rank() == 0, formatter_class=_HelpFormatter, epilog=EXAMPLES,
                description="Train a small GPT on bytes, printing progress and writing metrics.")
    m = p.add_argument_group("model")
    m.add_argument("--layers", type=POSITIVE, default=4, metavar="N", help="number of transformer blocks")
    m.add_argument("--d-model", type=POSITIVE, default=128, metavar="N", help="width of the residual stream")
    m.add_argument("--heads", type=POSITIVE, default=4, metavar="N", help="attention heads, a divisor of --d-model")
    m.add_argument("--block-size", type=POSITIVE, default=None, metavar="N",
                   help="size of the position table, the longest sequence the model accepts (default: --seq-len)")
    m.add_argument("--untied", action="store_true", help="separate LM head instead of tying it to the embedding")
    m.add_argument("--arch", choices=ARCHS, default="gpt2",
                   help="gpt2: LayerNorm, learned positions, GELU MLP, tied head; llama: RMSNorm, rotary positions, "
                        "SwiGLU, grouped-query attention, no biases, untied head")
    m.add_argument("--kv-heads", type=POSITIVE, default=None, metavar="K",
                   help="Llama: key/value heads, a divisor of --heads (K = heads: multi-head; 1: multi-query) "
                        "(default: --heads)")
    m.add_argument("--ffn-hidden", type=POSITIVE, default=None, metavar="N",
                   help=f"Llama: the SwiGLU width (default: 8/3 x --d-model rounded up to a multiple of {FFN_MULTIPLE})")
    m.add_argument("--rope-theta", type=POSITIVE_FLOAT, default=None, metavar="X",
                   help=f"Llama: the rotary positions' base (default: {ROPE_THETA:g}, Llama 3's)")
    e = p.add_argument_group("mixture of experts (model/moe.py)")
    e.add_argument("--experts", type=NON_NEGATIVE, default=0, metavar="E",
                   help="experts in each mixture; 0: the dense model")
    e.add_argument("--top-k", type=POSITIVE, default=None, metavar="K",
                   help="experts per token, at most --experts (default: 2, or 1 with one expert)")
    e.add_argument("--moe-every", type=POSITIVE, default=None, metavar="N",
                   help="every N-th block's feed-forward is a mixture (default: 1, every block)")
    e.add_argument("--capacity-factor", type=float_in(0), default=None, metavar="X",
                   help="an expert takes at most ceil(X * seq-len * top-k / experts) tokens of a sequence; "
                        "0: dropless (default: 0)")
    e.add_argument("--aux-loss-coef", type=float_in(0), default=None, metavar="X",
                   help="weight of the load-balancing loss (default: 0.01)")
    e.add_argument("--z-loss-coef", type=float_in(0), default=None, metavar="X",
                   help="weight of the router z-loss (default: 0.001)")
    e.add_argument("--ep", type=POSITIVE, default=1, metavar="N",
                   help="expert parallelism (run under mpiexec): each mixture's experts split over N ranks of the "
                        "data-parallel group, tokens sent to their experts and back (all-to-all); N divides "
                        "--experts and the data-parallel ranks")
    d = p.add_argument_group("data")
    d.add_argument("--data", default=None, metavar="FILE|DIR",
                   help="text file to train on as bytes, or a directory of token shards (python -m "
                        "minidist.state.prepare; memory-mapped, split as prepared) (default: the installed "
                        "Python's standard library source, read at start-up)")
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
                   help="array backend (default: $MINIDIST_BACKEND, else numpy); cupy: docs/gpu.md")
    t.add_argument("--tf32", action="store_true",
                   help="CuPy: float32 matmuls on TF32 tensor cores (10-bit mantissa inputs, fp32 accumulation; "
                        "off by default, as in PyTorch); no effect on NumPy")
    t.add_argument("--offload", choices=["none", "optimizer"], default="none",
                   help="optimizer: AdamW's master weights and moments in (pinned) host memory, stepped by the "
                        "CPU while the next forward runs (ZeRO-Offload); docs/gpu.md")
    t.add_argument("--no-offload-overlap", dest="offload_overlap", action="store_false",
                   help="--offload optimizer: finish the host step before the next forward starts (by default "
                        "the blocks' host steps overlap it; for comparison)")
    dp = p.add_argument_group("data parallelism (run under mpiexec -n N)")
    dp.add_argument("--dp", type=POSITIVE, default=None, metavar="N",
                    help="data-parallel ranks (default: the world size over the other mesh axes)")
    dp.add_argument("--zero", type=int, choices=[0, 1, 2, 3], default=None,
                    help="ZeRO stage: 0 DDP, 1 shard the optimizer state, 2 also the gradients, 3 also the "
                         "parameters (FSDP) (default: 0, or 3 with --hsdp-shard)")
    dp.add_argument("--hsdp-shard", type=POSITIVE, default=None, metavar="K",
                    help="HSDP: ZeRO-3 inside groups of K ranks, gradients all-reduced across the groups")
    dp.add_argument("--bucket-mb", type=float_in(0), default=None, metavar="X",
                    help="gradient bucket size in MB, 0 for one bucket per parameter (default: 25; DDP, ZeRO-1/2)")
    dp.add_argument("--no-overlap", action="store_true",
                    help="reduce gradients after the backward pass instead of during it (for comparison)")
    tp = p.add_argument_group("tensor parallelism (run under mpiexec; tp is the innermost mesh axis)")
    tp.add_argument("--tp", type=POSITIVE, default=1, metavar="T",
                    help="split every weight matrix over T ranks (Megatron-LM); tp is the innermost mesh axis")
    tp.add_argument("--sequence-parallel", action="store_true",
                    help="also split the LayerNorm and residual activations over the sequence (Korthikanti et al.)")
    tp.add_argument("--tp-async", nargs="?", const="ring", choices=TP_OVERLAPS, default=None,
                    metavar="ring|bidirectional",
                    help="hide the all-gathers and reduce-scatters behind the matmuls as ring steps (collective "
                         "matmul, Wang et al.; implies --sequence-parallel); 'bidirectional' sends half each way "
                         "(default when given: ring)")

    a = p.add_argument_group("long sequences: context parallelism (run under mpiexec; cp is next to tp)")
    a.add_argument("--attention", choices=ATTENTIONS, default="plain",
                   help="plain keeps the T x T probabilities; blockwise (FlashAttention's online softmax) "
                        "holds one block x block tile at a time")
    a.add_argument("--attention-block", type=POSITIVE, default=None, metavar="B",
                   help="query/key block of blockwise attention, of ring attention's tiles and of Ulysses' "
                        "blockwise attention (default: 128)")
    a.add_argument("--cp", type=POSITIVE, default=1, metavar="C",
                   help="context parallelism: split every sequence over C ranks")
    a.add_argument("--cp-impl", choices=CP_IMPLEMENTATIONS, default=None,
                   help="ring: K/V blocks circulate (zig-zag layout, --seq-len divisible by 2C); "
                        "ulysses: all-to-all to head-sharded attention (heads / --tp divisible by C) (default: ring)")
    g = p.add_argument_group("pipeline parallelism (run under mpiexec; pp is outside cp and tp)")
    g.add_argument("--pp", type=POSITIVE, default=1, metavar="P",
                   help="pipeline stages: the blocks are cut into P consecutive stages, one per rank")
    g.add_argument("--microbatches", type=POSITIVE, default=None, metavar="M",
                   help="microbatches per pipeline pass (default: 2 x --pp)")
    g.add_argument("--schedule", choices=list(ORDERS), default=None, help="pipeline schedule (default: 1f1b)")
    g.add_argument("--virtual-stages", type=POSITIVE, default=None, metavar="V",
                   help="model chunks per rank, for the interleaved, looping and zbv schedules "
                        "(default: 2 for them; zbv runs exactly 2)")
    c = p.add_argument_group("checkpoints (sharded: each rank writes what it owns; any mesh resumes)")
    c.add_argument("--save", default=None, metavar="DIR",
                   help="save checkpoints into DIR (an existing directory): DIR/step-NNNNNN, DIR/latest")
    c.add_argument("--save-every", type=POSITIVE, default=None, metavar="K",
                   help="save every K steps (default: only at the end); always at the end")
    c.add_argument("--save-async", action="store_true",
                   help="copy the arrays to host memory at the step and write them in a background thread "
                        "while training goes on (the next save, or the end, waits for it)")
    c.add_argument("--resume", default=None, metavar="PATH",
                   help="continue from a checkpoint: a step-NNNNNN directory, or a --save DIR (its latest); "
                        "the mesh may differ from the one that saved it")
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


def validate(args, parser) -> RunConfig:
    """The run configuration of these flags, or one message naming the bad value (exit code 2).

    Each number's own range is checked while parsing (``type=``); here come the checks that
    involve several flags, the files, the backend, each parallel axis's settings (each in its
    own module, gathered by ``parallel.compose.problems``) and the memory a step needs.
    Every rank runs them on the same flags, so every rank stops before any message is sent.
    """
    try:
        return _validate(args)
    except InputError as exc:
        parser.error(str(exc))


def _validate(args) -> RunConfig:
    if args.arch != "llama":
        for flag in ("kv_heads", "ffn_hidden", "rope_theta"):
            if vars(args)[flag] is not None:
                raise InputError(f"--{flag.replace('_', '-')} is a Llama setting: it needs --arch llama "
                                 f"(got --arch {args.arch})")
    _check_experts(args)
    _check_offload(args)
    try:  # the model's own rules (layout/model.py), spelled as flags
        from_args(args).resolved().model.check(name=lambda field: "--" + field.replace("_", "-"))
    except ValueError as exc:
        raise InputError(str(exc)) from None
    if args.block_size is not None and args.seq_len > args.block_size:
        raise InputError(f"--seq-len {args.seq_len} is larger than the position table (--block-size {args.block_size})")
    if args.grad_accum > args.batch_size:
        raise InputError(f"--grad-accum {args.grad_accum} exceeds --batch-size {args.batch_size}: "
                         "every micro-batch needs at least one sequence")
    if args.min_lr is not None and args.min_lr > args.lr:
        raise InputError(f"--min-lr {args.min_lr:g} exceeds --lr {args.lr:g}")
    if args.mixed_precision != "none" and args.dtype == "float64":
        raise InputError("--mixed-precision needs --dtype float32 master weights")
    if args.data is not None and not os.path.isdir(args.data):  # a shard directory: checked below
        check_input_file("--data", args.data)
    check_output_files({"--metrics-jsonl": args.metrics_jsonl, "--trace": args.trace}, {"--data": args.data})
    pin_blas_threads()  # under mpiexec each rank's BLAS gets its share of the cores; before NumPy loads
    prepare_yield()  # more ranks than cores: MPI's waits yield (minidist/host/oversubscribed.py); before MPI starts
    if args.timeout_s is not None:  # the communication watchdog's timeout, read when minidist.comm is imported
        os.environ["MINIDIST_TIMEOUT_S"] = repr(args.timeout_s)
        if "minidist.comm.watchdog" in sys.modules:  # already imported (train used as a library)
            sys.modules["minidist.comm.watchdog"].set_timeout(args.timeout_s)
    if args.backend:
        os.environ["MINIDIST_BACKEND"] = args.backend  # read when minidist.model.backend is first imported
    if args.tf32:
        os.environ["CUPY_TF32"] = "1"  # CuPy reads it when it is imported (by minidist.model.backend, next)
    env.check_all(InputError)  # every MINIDIST_* variable (minidist/host/env.py; the flags above win), before any is read
    try:
        from minidist.model import backend  # noqa: F401  (checks MINIDIST_BACKEND, imports cupy if asked)
    except ImportError as exc:  # one line naming both CuPy wheels (backend.missing_cupy_message)
        raise InputError(str(exc)) from None
    except ValueError as exc:
        raise InputError(str(exc)) from None
    if args.tf32 and backend.BACKEND == "numpy" and world_rank() == 0:
        print("note: --tf32 has no effect on the numpy backend (TF32 is a GPU tensor-core format)",
              file=sys.stderr)
    from minidist.parallel.compose import problems

    given, world = from_args(args), world_size()
    given = given.replace(model=dict(vocab_size=_vocabulary(args.data)))  # before the axes' checks, which read it
    found = problems(given, world)
    if found:
        raise InputError(found[0])
    cfg = given.resolved(world)
    _check_checkpoints(cfg)
    if backend.BACKEND == "numpy":  # on a GPU the arrays live in device memory (CuPy's pool reports it)
        check_memory(memory_estimate(cfg), available_memory_bytes())
    return cfg


def _check_experts(args) -> None:
    """The mixture-of-experts flags need --experts (a mixture runs with every axis and
    technique: docs/moe.md; --top-k at most --experts is the model's own rule)."""
    if args.experts:
        return
    for flag in ("top_k", "moe_every", "capacity_factor", "aux_loss_coef", "z_loss_coef"):
        if vars(args)[flag] is not None:
            raise InputError(f"--{flag.replace('_', '-')} {vars(args)[flag]} is a mixture-of-experts setting: "
                             "it needs --experts E")


def _check_offload(args) -> None:
    """--offload optimizer steps AdamW on the host (model/optim/offload.py), for a replica's
    whole parameters: not SGD, nor the sharded optimizers of ZeRO and HSDP, nor experts' two parts."""
    if args.offload == "none":
        if not args.offload_overlap:
            raise InputError("--no-offload-overlap needs --offload optimizer")
        return
    if args.optimizer != "adamw":
        raise InputError(f"--offload {args.offload} steps AdamW on the host; --optimizer {args.optimizer} "
                         "is not supported (use --optimizer adamw)")
    if args.zero or args.hsdp_shard:
        given = f"--zero {args.zero}" if args.zero else f"--hsdp-shard {args.hsdp_shard}"
        raise InputError(f"--offload {args.offload} does not run with {given} yet (ZeRO shards the optimizer "
                         "itself); use DDP (--zero 0)")
    if args.ep > 1:
        raise InputError(f"--offload {args.offload} does not run with --ep {args.ep} yet")


def _vocabulary(data: str | None) -> int:
    """The model's vocabulary: the tokenizer's of ``--data`` (256 for text, read as bytes; a shard
    directory's, every shard checked: minidist/state/shards.py)."""
    from minidist.state.shards import ShardError, describe

    try:
        info = describe(data)
    except ShardError as exc:
        raise InputError(f"--data {exc}") from None
    return info.vocab_size


def _check_checkpoints(cfg: RunConfig) -> None:
    """--save must name a writable directory, --save-every needs --save, and --resume a
    checkpoint of this model (every rank reads the same files: the same verdict everywhere)."""
    from minidist.state.checkpoint import CheckpointError, metadata, model_differences, resolve

    c = cfg.checkpoint
    if c.save_every is not None and c.save is None:
        raise InputError(f"--save-every {c.save_every} needs --save DIR")
    if c.save_async and c.save is None:
        raise InputError("--save-async needs --save DIR")
    if c.save is not None:
        if not os.path.isdir(c.save):
            raise InputError(f"--save {c.save}: no such directory (create it first)")
        if not os.access(c.save, os.W_OK | os.X_OK):
            raise InputError(f"--save {c.save}: the directory is not writable")
    if c.resume is not None:
        try:
            path = resolve(c.resume)
            meta = metadata(path)
        except CheckpointError as exc:
            raise InputError(str(exc)) from None
        _check_tokenizer(c.resume, meta["scalars"], cfg.data.data)
        differ = model_differences(meta, cfg.model)
        if differ:
            raise InputError(f"--resume {c.resume}: the checkpoint is of another model ({', '.join(differ)})")
        c.resume = path


def _check_tokenizer(resume: str, scalars: dict, data: str | None) -> None:
    """A checkpoint continues only on data of the tokenizer it was trained with (checkpoints
    from before tokenizers were recorded were trained on bytes)."""
    from minidist.state.shards import describe

    saved, now = scalars.get("data_tokenizer", "bytes"), describe(data).tokenizer
    if saved != now:
        raise InputError(f"--resume {resume}: the checkpoint was trained with tokenizer {saved}, --data "
                         f"{data or '(the standard library corpus)'} is of tokenizer {now}")


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
