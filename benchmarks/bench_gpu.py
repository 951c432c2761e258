"""A GPT training step on one GPU: minidist (CuPy) vs PyTorch, fp32 and mixed precision.

Model (the issue's, nanoGPT's GPT-2 small shapes with minidist's byte vocabulary): d_model 768,
12 layers, 12 heads, seq 1024, batch 8, AdamW; a step is forward, backward and the update.
Both frameworks run in this one process on the same GPU with the same weights, alternating
step by step, each step timed to the end of its GPU work.  Reports tokens/s, the ratio
minidist / PyTorch and MFU against the GPU's datasheet peak for the matmul dtype
(minidist.observe.profile.GPU_PEAK_TFLOPS): float32 (no TF32 unless --tf32, as PyTorch's default)
and bfloat16 (minidist --mixed-precision bf16 vs PyTorch's bf16 autocast).  Then one line per
parallel mode on 2 ranks sharing the GPU (mpiexec, a smaller model): tokens/s of each.

Targets (checked by reading the table, not by a test): minidist fp32 >= 1.0x PyTorch fp32,
mixed precision >= 0.8x PyTorch bf16 autocast, TF32 off for both.

Where there is no GPU (or no CuPy, or no PyTorch with CUDA) it prints the reason and writes
{"skipped": reason} to DIR/gpu.json.  ``--cpu-smoke`` runs the same code on the CPU with a
tiny model (NumPy and PyTorch on the CPU), to check the script itself; its numbers mean nothing.

    python benchmarks/bench_gpu.py [--steps 10] [--warmup 3] [--quick] [--no-parallel] [--out DIR]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPE = dict(n_layer=12, n_head=12, d_model=768, seq_len=1024, batch=8)
QUICK = dict(n_layer=4, n_head=8, d_model=512, seq_len=512, batch=8)
SMOKE = dict(n_layer=2, n_head=2, d_model=32, seq_len=32, batch=2)
PARALLEL_SHAPE = dict(layers=4, d_model=256, heads=4, seq_len=256, batch=8)
PARALLEL_MODES = [
    ("dp 2 (DDP)", ["--dp", "2"]),
    ("dp 2, ZeRO-1", ["--dp", "2", "--zero", "1"]),
    ("dp 2, ZeRO-2", ["--dp", "2", "--zero", "2"]),
    ("dp 2, ZeRO-3 (FSDP)", ["--dp", "2", "--zero", "3"]),
    ("tp 2", ["--tp", "2"]),
    ("tp 2, sequence parallel", ["--tp", "2", "--sequence-parallel"]),
    ("pp 2, 1F1B", ["--pp", "2"]),
    ("cp 2, ring", ["--cp", "2", "--cp-impl", "ring"]),
    ("cp 2, Ulysses", ["--cp", "2", "--cp-impl", "ulysses"]),
]


def skip_reason(smoke: bool) -> str | None:
    """Why this benchmark cannot run here, or None.  PyTorch is imported (seconds) only once
    a GPU is found: its presence is enough to decide until then."""
    if importlib.util.find_spec("torch") is None:
        return "PyTorch is not installed (pip install -e '.[torch]')"
    if smoke:
        return None
    from minidist.model.backend import gpu_unavailable_reason

    reason = gpu_unavailable_reason()
    if reason:
        return reason
    import torch

    if not torch.cuda.is_available():
        return "PyTorch has no CUDA here (a CPU-only build?), so there is nothing to compare with"
    return None


# (mode, --mixed-precision, minidist's attention, environment): the plain attention (on 16-bit
# operands the tensor-core FlashAttention-2 kernels of minidist/model/ops/cuda/flash_mma.py, or
# with MINIDIST_FLASH_MMA=off the T x T probabilities and batched products; in float32 the
# products cut into 4 causal blocks, or whole with MINIDIST_CAUSAL_BLOCKS=1), and the blockwise
# one (the CUDA-core kernels of minidist/model/ops/cuda/flash.py).  PyTorch runs its own fused
# attention in every mode.
MODES = (("fp32", "none", "plain", {}), ("bf16", "bf16", "plain", {}),
         ("bf16 batched", "bf16", "plain", {"MINIDIST_FLASH_MMA": "off"}),
         ("fp32 whole", "none", "plain", {"MINIDIST_CAUSAL_BLOCKS": "1"}),
         ("fp32 flash", "none", "blockwise", {}), ("bf16 flash", "bf16", "blockwise", {}))
TARGETS = {"float32": 1.0, "bfloat16": 0.8}  # minidist / PyTorch tokens/s (TF32 off for both)


def kernel_table(fn, dev: str, rows: int = 15) -> dict:
    """What one call of ``fn`` runs on the device, by time: CUPTI's kernel records through
    torch.profiler (CuPy's kernels and cuBLAS's as well as PyTorch's), as the total kernel
    time, the number of launches and the ``rows`` longest kernels (name, launches, ms).  On the
    CPU smoke run: PyTorch's CPU ops instead (the plumbing, not a measurement)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = dev == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        fn()

    def self_us(e):
        return e.self_device_time_total if cuda else e.self_cpu_time_total

    events = sorted((e for e in prof.key_averages() if self_us(e) > 0), key=self_us, reverse=True)
    return {"kernel_ms": sum(self_us(e) for e in events) / 1e3, "launches": sum(e.count for e in events),
            "top": [{"name": e.key[:120], "launches": e.count, "ms": round(self_us(e) / 1e3, 3)}
                    for e in events[:rows]]}


def host_and_wait(step) -> dict:
    """Is minidist's step bound by the host?  One call of ``step``, timed at its first read of a
    device value (the loss, after backward): how long the host took to issue forward and
    backward, and how long it then waited for the device to finish them.  A wait near zero
    means the device ran out of work while the host was still issuing it."""
    from minidist.parallel import strategy

    read, times = strategy.host_read, []

    def timed_read(x, why):
        times.append(time.perf_counter())
        value = read(x, why)
        times.append(time.perf_counter())
        return value

    strategy.host_read = timed_read
    try:
        t0 = time.perf_counter()
        step()
    finally:
        strategy.host_read = read
    return {"issue_ms": (times[0] - t0) * 1e3, "wait_ms": (times[1] - times[0]) * 1e3}


def measure(shape: dict, steps: int, warmup: int, smoke: bool, on_mode=None, profile: bool = False,
            modes=MODES) -> dict:
    """Tokens/s and MFU of both frameworks, fp32 and bf16, alternating step by step."""
    import numpy as np
    import torch

    from minidist.model import backend
    from minidist.observe.profile import model_flops_per_token

    dev = "cpu" if smoke else "cuda"
    s = shape
    tokens = s["batch"] * s["seq_len"]
    flops = model_flops_per_token(s["n_layer"], s["d_model"], s["seq_len"], 256) * tokens
    info = backend.device_memory() or {"name": "CPU", "total_bytes": None}
    tf32 = os.environ.get("CUPY_TF32") == "1"
    rng = np.random.default_rng(0)
    seq = rng.integers(0, 256, size=(s["batch"], s["seq_len"] + 1))
    x, y = seq[:, :-1], seq[:, 1:]
    tx, ty = torch.tensor(x, device=dev), torch.tensor(y, device=dev)
    out = {"device": info["name"], "device_total_bytes": info["total_bytes"], "shape": s, "tf32": tf32,
           "modes": {}}
    for mode, low_name, attention, variables in modes:
        saved = {k: os.environ.get(k) for k in variables}
        os.environ.update(variables)  # minidist reads these switches at each call
        try:
            out["modes"][mode] = _measure_mode(s, low_name, attention, x, y, tx, ty, dev, flops, info,
                                               tf32, steps, warmup, smoke, profile)
        except Exception as e:  # one mode's failure (a kernel, a dtype) must not hide the others
            out["modes"][mode] = {"error": f"{type(e).__name__}: {e}"[:500]}
        finally:
            for k, v in saved.items():
                os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
        if on_mode:
            on_mode(out)
    return out


def _measure_mode(s, low_name, attention, x, y, tx, ty, dev, flops, info, tf32, steps, warmup, smoke, profile):
    """One mode: both frameworks from the same weights, alternating step by step."""
    import numpy as np
    import torch

    from minidist.model.backend import synchronize, to_host
    from minidist.layout.model import ModelConfig
    from minidist.model.nn import GPT
    from minidist.model.optim import AdamW
    from minidist.parallel.data import OneReplica
    from minidist.parallel.strategy import Strategy
    from minidist.observe.profile import gpu_peak_gflops, measure_peak_gflops
    from minidist.model.torch_reference import TorchGPT
    from minidist.train.loop import precision, update

    tokens = s["batch"] * s["seq_len"]
    model = GPT(ModelConfig(block_size=s["seq_len"], layers=s["n_layer"], heads=s["n_head"],
                            d_model=s["d_model"], dtype="float32", attention=attention))
    strategy = Strategy(model, OneReplica(model, AdamW(model.parameters(), lr=1e-4, weight_decay=0.1,
                                                       betas=(0.9, 0.95), eps=1e-8)))
    low, scaler = precision(low_name)
    state = {k: to_host(v) for k, v in model.state_dict().items()}
    ref = TorchGPT(state, s["n_head"], torch.float32).to(dev)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)

    def step_minidist():
        loss = strategy.forward_backward(x, y, 1, low, scaler.scale if scaler else 1.0)
        update(strategy, scaler, 1.0)
        synchronize()
        return loss

    def step_torch():
        ref_opt.zero_grad(set_to_none=True)
        with torch.autocast(dev, dtype=torch.bfloat16, enabled=low is not None):
            loss = ref(tx, ty)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)  # as minidist's update clips at 1.0
        ref_opt.step()
        if dev == "cuda":
            torch.cuda.synchronize()
        return float(loss.detach())

    times, losses = {"minidist": [], "torch": []}, {"minidist": [], "torch": []}
    for rep in range(warmup + steps):
        for name, fn in (("minidist", step_minidist), ("torch", step_torch)):
            t0 = time.perf_counter()
            losses[name].append(float(fn()))
            if rep >= warmup:
                times[name].append(time.perf_counter() - t0)
    mm_dtype = "bfloat16" if low is not None else "float32"
    peak = gpu_peak_gflops(info["name"], mm_dtype, tf32) if not smoke else None
    if peak is None:  # unknown GPU or the CPU smoke run: a measured GEMM (float32)
        peak = measure_peak_gflops(s["d_model"], tokens, "float32", seconds=0.5)
    r = {"peak_gflops": peak, "matmul_dtype": mm_dtype, "attention": attention}
    for name, ts in times.items():
        med = float(np.median(ts))
        r[name] = {"step_s": med, "tokens_per_s": tokens / med, "mfu": flops / med / (peak * 1e9),
                   "first_loss": losses[name][0], "last_loss": losses[name][-1]}
    r["ratio"] = r["minidist"]["tokens_per_s"] / r["torch"]["tokens_per_s"]
    r["target"] = TARGETS[mm_dtype]
    if profile:  # after the timing: the profiler's own cost stays out of the figures
        for name, fn in (("minidist", step_minidist), ("torch", step_torch)):
            r[name]["kernels"] = kernel_table(fn, dev)
        r["minidist"]["forward_backward"] = host_and_wait(step_minidist)
    return r


def parallel_lines(smoke: bool, steps: int) -> list[dict]:
    """Tokens/s of each parallel mode on 2 ranks sharing the GPU (the training command)."""
    p = PARALLEL_SHAPE if not smoke else dict(layers=2, d_model=32, heads=4, seq_len=32, batch=4)
    rows = []
    base = [sys.executable, "-m", "minidist.train", "--backend", "numpy" if smoke else "cupy",
            "--layers", str(p["layers"]), "--d-model", str(p["d_model"]), "--heads", str(p["heads"]),
            "--seq-len", str(p["seq_len"]), "--batch-size", str(p["batch"]), "--steps", str(steps),
            "--eval-every", "0", "--quiet"]
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    for label, flags in PARALLEL_MODES:
        with tempfile.TemporaryDirectory() as tmp:
            jsonl = os.path.join(tmp, "m.jsonl")
            cmd = ["mpiexec", "-n", "2", *base, *flags, "--metrics-jsonl", jsonl]
            try:
                r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
            except subprocess.TimeoutExpired:
                rows.append({"mode": label, "error": "timed out after 300 s"})
                continue
            if r.returncode:
                tail = (r.stderr or r.stdout).strip().splitlines()[-1:] or ["?"]
                rows.append({"mode": label, "error": f"exit {r.returncode}: {tail[0][:200]}"})
                continue
            with open(jsonl) as f:
                recs = [json.loads(line) for line in f if line.strip()]
        timed = [x for x in recs if x["step"] > 2] or recs
        tps = sorted(x["tokens_per_s"] for x in timed)[len(timed) // 2]
        rows.append({"mode": label, "tokens_per_s": tps, "last_loss": recs[-1]["loss"]})
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=10, help="timed steps per framework and mode")
    ap.add_argument("--warmup", type=int, default=3, help="untimed first steps (CuPy compiles kernels then)")
    ap.add_argument("--quick", action="store_true", help="a smaller GPT (4 x 512, seq 512) and 3 timed steps")
    ap.add_argument("--no-parallel", action="store_true", help="skip the 2-rank parallel modes")
    ap.add_argument("--tf32", action="store_true", help="minidist's float32 matmuls on TF32 (PyTorch's too)")
    ap.add_argument("--profile", action="store_true",
                    help="also profile one step of each framework: its kernels by time, and for minidist "
                         "how long the host issues forward and backward and then waits for the device "
                         "(in gpu.json)")
    ap.add_argument("--modes", default=",".join(m[0] for m in MODES),
                    help="the modes to measure, comma-separated (default: all: %(default)s)")
    ap.add_argument("--cpu-smoke", action="store_true", help="check the script on the CPU with a tiny model")
    ap.add_argument("--out", default=None, help="directory for gpu.json")
    args = ap.parse_args()
    names = {m[0]: m for m in MODES}
    wanted = [name.strip() for name in args.modes.split(",") if name.strip()]
    unknown = [name for name in wanted if name not in names]
    if unknown or not wanted:
        ap.error(f"--modes {args.modes!r}: {', '.join(map(repr, unknown)) or 'none'} is not a mode "
                 f"(the modes: {', '.join(names)})")

    def write(result):
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "gpu.json"), "w") as f:
                json.dump(result, f, indent=2)

    title = "GPT training step on one GPU, minidist (CuPy) vs PyTorch"
    if not args.cpu_smoke:
        # before minidist.model.backend is first imported (skip_reason imports it): the backend
        # is chosen once, at that import
        os.environ["MINIDIST_BACKEND"] = "cupy"
    try:
        reason = skip_reason(args.cpu_smoke)
    except ImportError as e:  # the cupy backend's own message: no CuPy, or no GPU
        reason = str(e)
    if reason:
        print(f"bench_gpu.py: skipped: {reason}")
        write({"title": title, "skipped": reason})
        return
    if not args.cpu_smoke:
        if args.tf32:
            os.environ["CUPY_TF32"] = "1"
            import torch

            torch.backends.cuda.matmul.allow_tf32 = True
    shape = SMOKE if args.cpu_smoke else QUICK if args.quick else SHAPE
    steps = 2 if args.cpu_smoke else 3 if args.quick else args.steps
    result = measure(shape, steps, 1 if args.cpu_smoke else args.warmup, args.cpu_smoke,
                     on_mode=lambda partial: write(dict(partial, title=title, partial=True)), profile=args.profile,
                     modes=[names[name] for name in wanted])
    result["title"] = title
    print(f"{title}: {result['device']}, {shape}, median of {steps} steps")
    print(f"{'mode':<13} {'minidist tok/s':>15} {'torch tok/s':>12} {'ratio':>6} {'target':>7} "
          f"{'MFU md':>7} {'MFU pt':>7}")
    summary = []
    for mode, r in result["modes"].items():
        if "error" in r:
            print(f"{mode:<13} failed: {r['error']}")
            summary.append({"figure": f"minidist / PyTorch tokens/s, {mode}", "value": None, "note": r["error"]})
            continue
        print(f"{mode:<13} {r['minidist']['tokens_per_s']:>15,.0f} {r['torch']['tokens_per_s']:>12,.0f} "
              f"{r['ratio']:>6.2f} {r['target']:>6.1f}x {100 * r['minidist']['mfu']:>6.1f}% "
              f"{100 * r['torch']['mfu']:>6.1f}%")
        summary.append({"figure": f"minidist / PyTorch tokens/s, {mode}", "value": r["ratio"],
                        "note": f"target >= {r['target']}; MFU {100 * r['minidist']['mfu']:.1f}% vs "
                                f"{100 * r['torch']['mfu']:.1f}%"})
        for name in ("minidist", "torch") if "kernels" in r["minidist"] else ():
            k = r[name]["kernels"]
            print(f"  {name}: {k['kernel_ms']:.1f} ms on the device in {k['launches']} launches; longest:")
            for row in k["top"][:8]:
                print(f"    {row['ms']:>8.2f} ms {row['launches']:>5}x  {row['name'][:90]}")
        if "forward_backward" in r["minidist"]:
            fb = r["minidist"]["forward_backward"]
            print(f"  minidist's forward and backward: issued by the host in {fb['issue_ms']:.1f} ms, which then "
                  f"waited {fb['wait_ms']:.1f} ms for the device at the loss (near 0: bound by the host)")
    if not args.no_parallel:
        rows = parallel_lines(args.cpu_smoke, 3 if args.cpu_smoke or args.quick else 8)
        result["parallel"] = {"shape": PARALLEL_SHAPE, "ranks": 2, "rows": rows}
        print("2 ranks sharing the GPU (the training command, "
              f"{PARALLEL_SHAPE if not args.cpu_smoke else 'tiny'}):")
        for row in rows:
            what = f"{row['tokens_per_s']:>12,.0f} tok/s" if "tokens_per_s" in row else row["error"]
            print(f"  {row['mode']:<26} {what}")
    result["summary"] = summary
    if args.cpu_smoke:
        result["note"] = "CPU smoke run of the script: not a measurement"
    write(result)


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    main()
