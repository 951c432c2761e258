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
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="minidist-train", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    m = p.add_argument_group("model")
    m.add_argument("--layers", type=int, default=4, help="number of transformer blocks")
    m.add_argument("--d-model", type=int, default=128, help="width of the residual stream")
    m.add_argument("--heads", type=int, default=4, help="attention heads (must divide --d-model)")
    m.add_argument("--block-size", type=int, default=None,
                   help="size of the position table (longest sequence the model accepts); default: --seq-len")
    m.add_argument("--untied", action="store_true", help="separate LM head instead of tying it to the embedding")
    d = p.add_argument_group("data")
    d.add_argument("--data", default=None, help="text file to train on (default: the Python standard library's source)")
    d.add_argument("--seq-len", type=int, default=128, help="tokens (bytes) per training sequence")
    d.add_argument("--batch-size", type=int, default=16, help="sequences per optimizer step (the global batch)")
    d.add_argument("--val-fraction", type=float, default=0.05, help="share of the corpus held out for validation")
    o = p.add_argument_group("optimization")
    o.add_argument("--steps", type=int, default=300, help="optimizer steps")
    o.add_argument("--optimizer", choices=["adamw", "sgd"], default="adamw")
    o.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    o.add_argument("--min-lr", type=float, default=None, help="final learning rate of the cosine decay (default lr/10)")
    o.add_argument("--warmup", type=int, default=20, help="linear warm-up steps")
    o.add_argument("--weight-decay", type=float, default=0.1, help="decoupled weight decay (matrices only)")
    o.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
    o.add_argument("--clip-grad", type=float, default=1.0, help="max global gradient norm (0: off)")
    o.add_argument("--seed", type=int, default=0, help="seed of the weights and of the data order")
    t = p.add_argument_group("per-device techniques")
    t.add_argument("--grad-accum", type=int, default=1,
                   help="split each global batch into K sequential micro-batches (same update, less memory)")
    t.add_argument("--checkpoint-activations", action="store_true",
                   help="recompute each block's activations in backward instead of storing them")
    t.add_argument("--mixed-precision", choices=["none", "bf16", "fp16"], default="none",
                   help="low-precision activations and matmuls, fp32 master weights (fp16 adds loss scaling)")
    t.add_argument("--dtype", choices=["float32", "float64"], default="float32",
                   help="dtype of the weights (float64 for exactness checks)")
    t.add_argument("--backend", choices=["numpy", "cupy"], default=None,
                   help="array backend (default: $MINIDIST_BACKEND or numpy)")
    r = p.add_argument_group("reporting")
    r.add_argument("--eval-every", type=int, default=50, help="validation loss every N steps (0: never)")
    r.add_argument("--eval-batches", type=int, default=4, help="validation batches per evaluation")
    r.add_argument("--log-every", type=int, default=10, help="progress line every N steps")
    r.add_argument("--metrics-jsonl", default=None, help="write one JSON object per step to this file")
    r.add_argument("--peak-gflops", type=float, default=None,
                   help="peak FLOP rate for MFU (default: measured from a GEMM of the model's size)")
    r.add_argument("--trace", default=None, help="write a Chrome/Perfetto trace of the steps to this file")
    r.add_argument("--quiet", action="store_true", help="no progress lines")
    return p


def validate(args, parser):
    """Reject bad input with one message naming the value (argparse exits with code 2)."""
    for name in ("layers", "d_model", "heads", "seq_len", "batch_size", "steps", "grad_accum", "eval_batches",
                 "log_every"):
        value = getattr(args, name)
        if value <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive, got {value}")
    if args.d_model % args.heads:
        parser.error(f"--d-model {args.d_model} is not divisible by --heads {args.heads}")
    if args.block_size is None:
        args.block_size = args.seq_len
    if args.seq_len > args.block_size:
        parser.error(f"--seq-len {args.seq_len} is larger than the position table (--block-size {args.block_size})")
    if args.grad_accum > args.batch_size:
        parser.error(f"--grad-accum {args.grad_accum} exceeds --batch-size {args.batch_size}: "
                     "every micro-batch needs at least one sequence")
    if not 0 < args.val_fraction < 1:
        parser.error(f"--val-fraction must be in (0, 1), got {args.val_fraction}")
    if args.eval_every < 0 or args.warmup < 0 or args.clip_grad < 0 or args.lr <= 0:
        parser.error("--eval-every, --warmup and --clip-grad must be >= 0 and --lr > 0")
    if args.data is not None:
        if not os.path.isfile(args.data):
            parser.error(f"--data {args.data}: no such file")
        if os.path.getsize(args.data) == 0:
            parser.error(f"--data {args.data}: the file is empty")
    if args.mixed_precision != "none" and args.dtype == "float64":
        parser.error("--mixed-precision needs --dtype float32 master weights")
    if args.backend:
        os.environ["MINIDIST_BACKEND"] = args.backend  # read when minidist.backend is first imported
    if os.environ.get("MINIDIST_BACKEND", "numpy") == "cupy":
        try:
            import cupy  # noqa: F401
        except ImportError:
            parser.error("--backend cupy needs the cupy package (pip install cupy-cuda12x)")
    if args.min_lr is None:
        args.min_lr = args.lr / 10


def make_model(args):
    from .nn import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=256, seq_len=args.block_size, n_layer=args.layers, n_head=args.heads,
                    d_model=args.d_model, tie_embeddings=not args.untied, dtype=args.dtype, seed=args.seed)
    model = GPT(cfg)
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


def forward_backward(model, x, y, grad_accum=1, low_dtype=None, loss_scale=1.0) -> float:
    """Accumulate into ``.grad`` the gradient of the mean loss over the batch; return that loss."""
    from . import ops
    from .backend import from_host

    total = 0.0
    for xs, ys, share in micro_batches(x, y, grad_accum):
        with ops.autocast(low_dtype):
            loss = model(from_host(xs), from_host(ys))
        (loss * (share * loss_scale)).backward()
        total += share * loss.item()
    return total


def evaluate(model, batches, low_dtype=None) -> float:
    from . import ops
    from .autograd import no_grad
    from .backend import from_host

    with no_grad(), ops.autocast(low_dtype):
        losses = [model(from_host(x), from_host(y)).item() for x, y in batches]
    return sum(losses) / len(losses)


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


def train(args, log=print, data=None):
    """Run the whole training; return the list of per-step metrics dicts."""
    from .backend import dtype
    from .optim import DynamicLossScaler, clip_grad_norm, lr_at
    from .profile import PeakMemory, Tracer, measure_peak_gflops, model_flops_per_token

    sampler, val_batches = data if data is not None else load_data(args)

    model = make_model(args)
    params = model.parameters()
    opt = make_optimizer(args, params)
    low = {"none": None, "bf16": dtype("bfloat16"), "fp16": dtype("float16")}[args.mixed_precision]
    scaler = DynamicLossScaler() if args.mixed_precision == "fp16" else None

    tokens_per_step = args.batch_size * args.seq_len
    flops_per_step = model_flops_per_token(args.layers, args.d_model, args.seq_len, 256) * tokens_per_step
    # A shared machine's load lowers the measured peak (and so raises MFU): pass --peak-gflops
    # for numbers comparable across runs.
    peak = args.peak_gflops or measure_peak_gflops(args.d_model, tokens_per_step // args.grad_accum,
                                                   "float32" if low is not None else args.dtype, seconds=1.0)
    if not args.quiet:
        log(f"minidist: GPT {args.layers}x{args.d_model} ({model.num_parameters():,} parameters), "
            f"{len(sampler.data):,} training bytes, batch {args.batch_size}x{args.seq_len}, "
            f"peak {peak:.1f} GFLOP/s for MFU")

    memory, tracer = PeakMemory(), Tracer(enabled=bool(args.trace))

    def logged(step):
        return step < args.steps and (step % args.log_every == 0 or step + 1 == args.steps)

    metrics, metrics_file = [], open(args.metrics_jsonl, "w") if args.metrics_jsonl else None
    try:
        for step in range(args.steps):
            # Memory is traced on the first step and on each step before a printed one, so the
            # printed step's own tokens/s and MFU do not pay for the tracing.
            traced = step == 0 or logged(step + 1)
            t0 = time.perf_counter()
            opt.lr = lr_at(step, args.lr, args.warmup, args.steps, args.min_lr)
            x, y = sampler.batch(step)
            with tracer.span("forward_backward", step=step), memory.measure(traced):
                loss = forward_backward(model, x, y, args.grad_accum, low, scaler.scale if scaler else 1.0)
            record = {"step": step, "loss": loss, "lr": opt.lr}
            with tracer.span("optimizer", step=step):
                skipped = False
                if scaler is not None:
                    skipped = scaler.unscale_(params)
                    scaler.update(skipped)
                    record["loss_scale"] = scaler.scale
                if not skipped:
                    if args.clip_grad:
                        record["grad_norm"] = clip_grad_norm(params, args.clip_grad)
                    opt.step()
                record["skipped"] = skipped
                opt.zero_grad()
            step_time = time.perf_counter() - t0
            record.update(step_time_s=step_time, tokens_per_s=tokens_per_step / step_time,
                          mfu=flops_per_step / step_time / (peak * 1e9))
            if traced:
                record["peak_mem_mb"] = memory.last_bytes / 2**20
            if args.eval_every and ((step + 1) % args.eval_every == 0 or step + 1 == args.steps):
                record["val_loss"] = evaluate(model, val_batches, low)
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
        if args.trace:
            tracer.save(args.trace)
    return metrics


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
    return line


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    validate(args, parser)
    try:
        data = load_data(args)
    except (ValueError, OSError) as exc:  # bad input found while loading: no traceback
        parser.error(str(exc))
    train(args, log=lambda s: print(s, flush=True), data=data)


if __name__ == "__main__":
    main()
