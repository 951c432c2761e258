"""Optimizer offload on one GPU: the GPU memory it saves and what it costs a step.

ZeRO-Offload (Ren et al. 2021) keeps AdamW's state in host memory and steps it on the CPU
(``--offload optimizer``, minidist/model/optim/offload.py).  For bench_gpu.py's GPT (d_model
768, 12 layers, 12 heads, seq 1024, batch 8, AdamW with clipping at 1.0), fp32 and bf16, each
with AdamW on the GPU, offloaded with the overlap (the blocks' host steps run while the next
forward does) and offloaded without it, this measures:

* the CuPy pool's bytes held between steps (weights and optimizer state) and its high-water
  mark during a step (plus gradients and activations), and the pinned host bytes offload uses;
* the step time: the median period of the training loop over the timed steps, each step
  ended by waiting for the GPU (the background host step of one step overlaps the next);
* the host step's seconds (copies and AdamW) and how long the forward waited for it;
* the last loss of each variant: they start from the same weights on the same batches and
  should agree to round-off.

Where there is no GPU it writes ``{"skipped": reason}``.  ``--cpu-smoke`` runs the script on
NumPy with a tiny model (its numbers mean nothing; a test runs it).  About 30 s on an H100.

    python benchmarks/bench_offload.py [--steps 3] [--warmup 2] [--cpu-smoke] [--out DIR]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time

SHAPE = dict(layers=12, d_model=768, heads=12, seq_len=1024, batch=8)
SMOKE = dict(layers=2, d_model=32, heads=2, seq_len=32, batch=2)
VARIANTS = [("on the GPU", "none", True), ("offload", "optimizer", True), ("offload, no overlap", "optimizer", False)]


def run_variant(shape, mixed, offload, overlap, steps, warmup, x, y) -> dict:
    """One variant: build, ``warmup`` + ``steps`` training steps, memory and times."""
    from minidist.model import backend
    from minidist.observe.profile import PeakMemory
    from minidist.parallel.compose import build
    from minidist.train.config import RunConfig
    from minidist.train.loop import precision, update

    cfg = RunConfig().replace(
        model=dict(layers=shape["layers"], d_model=shape["d_model"], heads=shape["heads"], dtype="float32"),
        data=dict(seq_len=shape["seq_len"], batch_size=shape["batch"]),
        optim=dict(lr=1e-4, clip_grad=1.0),
        device=dict(mixed_precision=mixed, offload=offload, offload_overlap=overlap),
        parallel=dict(dp=1)).resolved()
    model, strategy = build(cfg)
    low, scaler = precision(mixed)
    opt, pool = strategy.optimizer, _pool()
    ends, losses, memory, held, peak = [], [], PeakMemory(), None, None
    for i in range(warmup + steps):
        measured = i == warmup  # the first timed step's memory (the shapes repeat)
        if measured:
            backend.synchronize()
            held = pool.used_bytes() if pool is not None else None
        with memory.measure(measured):
            losses.append(strategy.forward_backward(x, y, 1, low, scaler.scale if scaler else 1.0))
            update(strategy, scaler, cfg.optim.clip_grad)
            backend.synchronize()
        if measured:
            peak = memory.last_bytes + (held or 0)
        ends.append(time.perf_counter())
    opt.wait()
    periods = [b - a for a, b in zip(ends[warmup - 1:], ends[warmup:])] if warmup else [ends[0]]
    totals = getattr(opt, "totals", None)
    out = {"step_s": statistics.median(periods), "held_bytes": held, "peak_bytes": peak, "last_loss": losses[-1],
           "params": sum(p.data.size for p in model.parameters())}
    if totals and totals["steps"]:
        out.update(host_step_s=totals["host_s"] / totals["steps"], forward_wait_s=totals["wait_s"] / totals["steps"],
                   host_bytes=opt.host_nbytes())
    del model, strategy, opt
    gc.collect()
    if pool is not None:
        pool.free_all_blocks()
    return out


def _pool():
    from minidist.model.backend import xp, host

    return None if xp is host else xp.get_default_memory_pool()


def measure(shape, steps, warmup) -> dict:
    from minidist.model.backend import device_memory, host

    rng = host.random.default_rng(0)
    seq = rng.integers(0, 256, size=(shape["batch"], shape["seq_len"] + 1))
    x, y = seq[:, :-1], seq[:, 1:]
    info = device_memory() or {"name": "CPU (NumPy)", "total_bytes": None}
    out = {"device": info["name"], "shape": shape, "steps": steps, "warmup": warmup, "modes": {}}
    for mixed, mode in (("none", "fp32"), ("bf16", "bf16")):
        rows = out["modes"][mode] = {}
        for name, offload, overlap in VARIANTS:
            try:
                rows[name] = run_variant(shape, mixed, offload, overlap, steps, warmup, x, y)
            except Exception as e:  # one variant's failure must not hide the others
                rows[name] = {"error": f"{type(e).__name__}: {e}"[:500]}
    return out


def table(result) -> list[str]:
    mib = lambda b: "-" if b is None else f"{b / 2**20:,.0f}"  # noqa: E731
    lines = [f"{'mode':<5} {'variant':<20} {'step ms':>8} {'held MiB':>9} {'peak MiB':>9} {'host ms':>8} "
             f"{'waited ms':>9} {'host MiB':>9} {'last loss':>10}"]
    for mode, rows in result["modes"].items():
        for name, r in rows.items():
            if "error" in r:
                lines.append(f"{mode:<5} {name:<20} failed: {r['error']}")
                continue
            host_ms = f"{1e3 * r['host_step_s']:.1f}" if "host_step_s" in r else "-"
            wait_ms = f"{1e3 * r['forward_wait_s']:.1f}" if "forward_wait_s" in r else "-"
            lines.append(f"{mode:<5} {name:<20} {1e3 * r['step_s']:>8.1f} {mib(r['held_bytes']):>9} "
                         f"{mib(r['peak_bytes']):>9} {host_ms:>8} {wait_ms:>9} {mib(r.get('host_bytes')):>9} "
                         f"{r['last_loss']:>10.6f}")
    return lines


def summarise(result) -> None:
    """Per mode (``result["summary"]``): the GPU bytes offload saves and its step time against
    AdamW on the GPU."""
    result["summary"] = {}
    for mode, rows in result["modes"].items():
        base, off = rows.get("on the GPU", {}), rows.get("offload", {})
        if "step_s" not in base or "step_s" not in off:
            continue
        s = {"step_time_ratio": off["step_s"] / base["step_s"],
             "loss_rel_diff": abs(off["last_loss"] - base["last_loss"]) / abs(base["last_loss"])}
        if base["held_bytes"] is not None:
            s.update(held_saved_bytes=base["held_bytes"] - off["held_bytes"],
                     peak_saved_bytes=base["peak_bytes"] - off["peak_bytes"])
        result["summary"][mode] = s


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=3, help="timed steps per variant")
    ap.add_argument("--warmup", type=int, default=2, help="untimed first steps (CuPy compiles kernels then)")
    ap.add_argument("--cpu-smoke", action="store_true", help="check the script on NumPy with a tiny model")
    ap.add_argument("--out", default=None, help="directory for offload.json")
    args = ap.parse_args()
    title = "optimizer offload on one GPU: memory and step time"

    def write(result):
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "offload.json"), "w") as f:
                json.dump(result, f, indent=2)

    os.environ["MINIDIST_BACKEND"] = "numpy" if args.cpu_smoke else "cupy"  # before minidist's backend loads
    try:
        from minidist.model import backend  # noqa: F401  (imports CuPy and picks the GPU)
    except ImportError as exc:
        print(f"bench_offload.py: skipped: {exc}")
        return write({"title": title, "skipped": str(exc)})
    shape = SMOKE if args.cpu_smoke else SHAPE
    t0 = time.perf_counter()
    result = measure(shape, 2 if args.cpu_smoke else args.steps, 1 if args.cpu_smoke else args.warmup)
    summarise(result)
    result.update(title=title, seconds=time.perf_counter() - t0)
    print(f"{title}: {result['device']}, {shape}, median of {result['steps']} steps")
    print("\n".join(table(result)))
    for mode, s in result["summary"].items():
        if "held_saved_bytes" in s:
            print(f"{mode}: offload frees {s['held_saved_bytes'] / 2**20:,.0f} MiB held between steps and "
                  f"{s['peak_saved_bytes'] / 2**20:,.0f} MiB of the peak; step time x{s['step_time_ratio']:.2f}")
    write(result)


if __name__ == "__main__":
    main()
