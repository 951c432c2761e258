"""``python -m minidist.plan``: which mesh for a model on a cluster, and why (see minidist.plan)."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

from minidist.host.cli_checks import OneLineParser, int_in
from minidist.plan.cost import CHUNKED, PRECISIONS, SCHEDULES, estimate, problems
from minidist.layout.settings import CP_IMPLEMENTATIONS
from minidist.plan.machine import PRESETS as MACHINES, calibration_path, load
from minidist.plan.model import PRESETS as MODELS, Preset, active_params, as_dict, num_params
from minidist.plan.search import search, settings
from minidist.plan.validate import calibrate, main as validate_main

# The global batch each preset was trained with (Llama 3: 16M tokens; GPT-3 175B: 3.2M).
DEFAULT_BATCH = {"llama3-405b": 16 * 2**20, "llama3-70b": 16 * 2**20, "gpt3-175b": 1536 * 2048,
                 "minidist-gpt": 64 * 1024, "minidist-bench": 16 * 128}
POS = int_in(lo=1)


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m minidist.plan", description="Predict a training step's time, memory and MFU on a "
                "mesh, or find the best meshes, from first principles (docs/planner.md).")
    m = p.add_argument_group("model (a preset, or the shape; shape flags override a preset's)")
    m.add_argument("--preset", choices=list(MODELS), default=None)
    m.add_argument("--layers", type=POS, default=None)
    m.add_argument("--d-model", type=POS, default=None)
    m.add_argument("--heads", type=POS, default=None)
    m.add_argument("--kv-heads", type=POS, default=None, help="grouped-query attention's key/value heads")
    m.add_argument("--ffn", type=POS, default=None,
                   help="MLP hidden width (default 4 x d-model; with --gated 8/3 x d-model rounded up to 32)")
    m.add_argument("--vocab", type=POS, default=None)
    m.add_argument("--seq-len", type=POS, default=None)
    m.add_argument("--gated", action="store_true", default=None, help="SwiGLU MLP (three matrices), RMSNorm, no biases")
    m.add_argument("--experts", type=int_in(lo=0), default=None, metavar="E",
                   help="a mixture of E experts in the MLP of every --moe-every-th block (0: dense)")
    m.add_argument("--top-k", type=POS, default=None, metavar="K", help="experts per token (default 2)")
    m.add_argument("--moe-every", type=POS, default=None, metavar="N", help="every N-th block a mixture (default 1)")
    m.add_argument("--capacity-factor", type=float, default=None, metavar="C",
                   help="an expert takes at most C x T x K / E tokens of a sequence (default 0: dropless)")
    r = p.add_argument_group("run")
    r.add_argument("--machine", default="h100-nvlink-ib",
                   help=f"{', '.join(MACHINES)}, this-machine (after --calibrate), or a machine JSON file")
    r.add_argument("--calibration", default=None, metavar="FILE",
                   help=f"this machine's calibration file, written by --calibrate, read by --machine this-machine "
                        f"(default: {calibration_path()})")
    r.add_argument("--gpus", type=POS, default=None, metavar="N", help="devices (ranks)")
    r.add_argument("--global-batch-tokens", type=POS, default=None, metavar="N",
                   help="tokens per optimizer step (default: the preset's published batch)")
    r.add_argument("--precision", choices=list(PRECISIONS), default=None,
                   help="bf16 mixed precision (default on GPUs) or float32/float64 (default float32 on this machine)")
    r.add_argument("--impl", choices=["fused", "minidist"], default=None,
                   help="price fused GPU kernels or minidist's NumPy arrays (default: minidist on this machine)")
    s = p.add_argument_group("one mesh (else every mesh is searched)")
    s.add_argument("--mesh", default=None, metavar="tp=T,cp=C,pp=P,dp=D[,ep=N]",
                   help="ep: each mixture's experts split over N ranks of the data-parallel group")
    s.add_argument("--zero", type=int, choices=[0, 1, 2, 3], default=None)
    s.add_argument("--microbatches", type=POS, default=None, metavar="M")
    s.add_argument("--schedule", choices=SCHEDULES, default=None)
    s.add_argument("--virtual-stages", type=POS, default=None, metavar="V")
    s.add_argument("--checkpoint-activations", choices=["on", "off"], default=None)
    s.add_argument("--cp-impl", choices=list(CP_IMPLEMENTATIONS), default=None,
                   help="how cp ranks share the attention: ring attention or DeepSpeed-Ulysses' all-to-alls "
                        "(as the run's --cp-impl; default ring)")
    s.add_argument("--sequence-parallel", choices=["on", "off"], default="on",
                   help="Korthikanti et al.'s sequence parallelism with tp (priced for fused kernels only)")
    s.add_argument("--top", type=POS, default=5, metavar="K", help="meshes to print when searching")
    s.add_argument("--json", action="store_true", help="print JSON instead of a table")
    v = p.add_argument_group("this machine")
    v.add_argument("--calibrate", action="store_true", help="measure this machine and write its calibration file")
    v.add_argument("--validate", action="store_true",
                   help="run small configurations for real and compare with the predictions")
    v.add_argument("--out", default=None, metavar="FILE", help="--validate: write the comparison as JSON")
    v.add_argument("--quick", action="store_true", help="--validate: fewer steps, configurations and launches")
    v.add_argument("--repeats", type=POS, default=2, metavar="R",
                   help="--validate: launches of each configuration, the fastest counting (default 2)")
    return p


def parse_mesh(text: str) -> dict:
    out = {"tp": 1, "cp": 1, "pp": 1, "dp": 1, "ep": 1}
    for part in text.split(","):
        key, _, value = part.partition("=")
        key = key.strip()
        if key not in out or not value.strip().isdigit() or int(value) < 1:
            raise ValueError(f"--mesh {text!r}: expected tp=T,cp=C,pp=P,dp=D[,ep=N] with positive integers "
                             f"(bad {part!r})")
        out[key] = int(value)
    return out


def model_of(args) -> Preset:
    shape = dict(layers=args.layers, d_model=args.d_model, heads=args.heads, vocab_size=args.vocab,
                 block_size=args.seq_len, ffn_hidden=args.ffn, kv_heads=args.kv_heads, experts=args.experts,
                 top_k=args.top_k, moe_every=args.moe_every, capacity_factor=args.capacity_factor)
    if args.preset is None:
        flags = {"layers": "--layers", "d_model": "--d-model", "heads": "--heads", "vocab_size": "--vocab",
                 "block_size": "--seq-len"}
        missing = [flag for k, flag in flags.items() if shape[k] is None]
        if missing:
            raise ValueError(f"give --preset or the model's shape (missing {', '.join(missing)})")
        base = Preset(arch="llama" if args.gated else "gpt2", causal_skip=bool(args.gated))
    else:
        base = MODELS[args.preset]
    model = replace(base, **{k: v for k, v in shape.items() if v is not None})  # the flags given override
    flag = {"vocab_size": "--vocab", "block_size": "--seq-len", "ffn_hidden": "--ffn"}
    model.check(name=lambda field: flag.get(field, "--" + field.replace("_", "-")), built=False)
    return model


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.calibrate and not args.validate:
            print("calibrating this machine:")
            calibrate(args.calibration)
            return 0
        if args.validate:
            return validate_main(args)
        model = model_of(args)
        machine = load(args.machine, args.calibration)
        if args.gpus is None:
            raise ValueError("--gpus N is required")
        tokens = args.global_batch_tokens or DEFAULT_BATCH.get(args.preset or "", None)
        if tokens is None:
            raise ValueError("--global-batch-tokens N is required for a model given by its shape "
                             "or a preset without a published batch (llama3-8b, mixtral-8x7b)")
        cpu = bool(machine.cores)
        precision = PRECISIONS[args.precision or ("float32" if cpu else "bf16")]
        minidist = (args.impl or ("minidist" if cpu else "fused")) == "minidist"
        if not args.preset:  # a model given by its shape runs FlashAttention-like kernels unless it is minidist's
            model = replace(model, causal_skip=not minidist)
        if minidist:  # as minidist.train builds it: ring attention folds a whole chunk per tile
            model = replace(model, attention_block=None)
        if args.mesh:
            return _one_mesh(args, model, machine, tokens, precision, minidist)
        return _search(args, model, machine, tokens, precision, minidist)
    except ValueError as exc:
        parser.error(str(exc))


def _wanted(args, plan) -> bool:
    return ((args.zero is None or plan.zero == args.zero)
            and (args.microbatches is None or plan.microbatches == args.microbatches)
            and (args.schedule is None or plan.schedule == args.schedule or (plan.pp == 1 and args.schedule != "interleaved"))
            and (args.virtual_stages is None or plan.virtual_stages == args.virtual_stages
                 or plan.schedule not in CHUNKED)
            and (args.checkpoint_activations is None
                 or plan.checkpoint_activations == (args.checkpoint_activations == "on")))


def _one_mesh(args, model, machine, tokens, precision, minidist) -> int:
    from minidist.plan.cost import Plan

    mesh = parse_mesh(args.mesh)
    ep = mesh.pop("ep")
    if args.cp_impl is not None and mesh["cp"] == 1:  # as the run refuses it
        raise ValueError(f"--cp-impl {args.cp_impl} needs cp greater than 1 in --mesh (got {args.mesh})")
    cp_impl = args.cp_impl or "ring"
    devices = mesh["tp"] * mesh["cp"] * mesh["pp"] * mesh["dp"]
    # The settings the user fixed, the rest chosen: the fastest combination that fits.
    given = Plan(**mesh, zero=1 if args.zero is None else args.zero,
                 microbatches=args.microbatches or 1, schedule=args.schedule or "1f1b",
                 virtual_stages=args.virtual_stages or (2 if args.schedule in CHUNKED else 1),
                 sequence_parallel=args.sequence_parallel == "on", ep=ep, cp_impl=cp_impl)
    checks = [x for x in problems(model, given, args.gpus, tokens, minidist)
              if args.microbatches is not None or "microbatches" not in x]
    checks = [x for x in checks if args.schedule == "interleaved" or "interleaved" not in x]
    if checks:
        raise ValueError(f"mesh {args.mesh} is infeasible: {checks[0]}")
    if args.schedule == "interleaved" and mesh["pp"] == 1:
        raise ValueError(f"mesh {args.mesh} is infeasible: the interleaved schedule needs pp > 1")
    candidates = [p for p in settings(model, mesh["tp"], mesh["cp"], mesh["pp"], mesh["dp"], tokens,
                                      zero_bubble=args.schedule in ("zb-h1", "zb-h2", "zbv"), ep=ep,
                                      cp_impl=cp_impl)
                  if _wanted(args, p) and not problems(model, p, devices, tokens, minidist)]
    if args.microbatches is not None or args.schedule == "gpipe":
        candidates += [replace(p, ep=ep) for p in _explicit(args, mesh, model, tokens)
                       if not problems(model, replace(p, ep=ep), devices, tokens, minidist)]
    candidates = [replace(p, sequence_parallel=args.sequence_parallel == "on") for p in candidates]
    if not candidates:
        raise ValueError(f"mesh {args.mesh} is infeasible: no setting matches the flags given")
    ests = [estimate(model, machine, p, tokens, precision, minidist) for p in candidates]
    fitting = [e for e in ests if e.fits]
    if not fitting:
        lean = min(ests, key=lambda e: e.mem_bytes)
        raise ValueError(f"mesh {args.mesh} is infeasible: it needs {lean.mem_bytes / 1e9:.1f} GB per device at least "
                         f"({lean.plan.label()}), more than the {machine.mem_bytes * machine.mem_usable / 1e9:.1f} GB "
                         f"usable of {machine.name}")
    best = min(fitting, key=lambda e: e.step_s)
    if args.json:
        print(json.dumps(best.as_dict()))
    else:
        print(_describe(model, machine, tokens, best, args.gpus))
    return 0


def _explicit(args, mesh, model, tokens):
    from minidist.plan.cost import Plan

    for z in ([args.zero] if args.zero is not None else [0, 1, 2, 3]):
        for ck in ([args.checkpoint_activations == "on"] if args.checkpoint_activations else [False, True]):
            sched = args.schedule or "1f1b"
            v = args.virtual_stages or (2 if sched in CHUNKED else 1)
            yield Plan(**mesh, zero=z, microbatches=args.microbatches or 1, schedule=sched, virtual_stages=v,
                       checkpoint_activations=ck, cp_impl=args.cp_impl or "ring")


def _describe(model, machine, tokens, e, devices) -> str:
    lines = [f"{model.name}: {_params(model)}, seq {model.block_size}, "
             f"{tokens:,} tokens per step, on {devices} x {machine.name}",
             f"plan: {e.plan.label()}",
             f"step {e.step_s:.3f} s   MFU {100 * e.mfu:.1f}%   HFU {100 * e.hfu:.1f}%   memory {e.mem_bytes / 1e9:.1f} GB "
             f"of {machine.mem_bytes * machine.mem_usable / 1e9:.1f} usable   limited by {e.limit}",
             "time by part (s):  " + "  ".join(f"{k} {v:.3g}" for k, v in e.time.items()),
             "memory by part (GB): " + "  ".join(f"{k} {v / 1e9:.3g}" for k, v in e.memory.items())]
    return "\n".join(lines)


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def _params(model) -> str:
    total = f"{_count(num_params(model))} parameters"
    return total + (f" ({_count(active_params(model))} active per token)" if model.experts else "")


def _search(args, model, machine, tokens, precision, minidist) -> int:
    ranked, infeasible = search(model, machine, args.gpus, tokens, precision, minidist, args.cp_impl or "ring")
    top = ranked[:args.top]
    if args.json:
        print(json.dumps({"model": as_dict(model), "machine": machine.name, "gpus": args.gpus,
                          "global_batch_tokens": tokens, "meshes_feasible": len(ranked),
                          "meshes_infeasible": len(infeasible), "top": [e.as_dict() for e in top]}))
        return 0
    print(f"{model.name}: {_params(model)}, seq {model.block_size}, {tokens:,} tokens per step, "
          f"on {args.gpus} x {machine.name}: {len(ranked)} meshes fit, {len(infeasible)} do not"
          + ("; cp as DeepSpeed-Ulysses" if args.cp_impl == "ulysses" else ""))
    if not top:
        print("no mesh fits in memory")
        return 1
    print(f"{'#':>2}  {'mesh':<27} {'settings':<32} {'step s':>9} {'MFU':>6} {'mem GB':>7}  limited by")
    for i, e in enumerate(top, 1):
        p = e.plan
        rest = p.label().split("ZeRO", 1)[1]
        print(f"{i:>2}  {p.mesh():<27} {'ZeRO' + rest:<32} {e.step_s:>9.3f} {100 * e.mfu:>5.1f}% "
              f"{e.mem_bytes / 1e9:>7.1f}  "
              f"{e.limit} ({e.time[e.limit]:.3g} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
