"""One training step of the GPT and of its Llama form, minidist vs PyTorch on the CPU, same
weights, same thread count.

Model: d_model 256, 4 layers, 4 heads, seq 128, batch 16, float32; a step is forward,
backward and an AdamW update.  The Llama form (``--arch llama``) has the same shape with
RMSNorm, rotary positions, SwiGLU of width 704, 2 key/value heads and an untied head; its
PyTorch twin (``torch_reference.TorchLlama``) uses ``F.rms_norm``, ``F.silu`` and
``scaled_dot_product_attention(enable_gqa=True)``, and the two first losses are compared
before any timing.  Each thread count runs in its own process (BLAS reads its
thread count at start-up), and inside it the two frameworks alternate step by step so that
both see the same machine load.  Reports tokens/s, MFU (against a GEMM peak measured in the
same process) and the ratio minidist / PyTorch, from wall time and from CPU time
(``time.process_time``, all threads of the process).  On a shared machine the CPU-time ratio
of the 1-thread run is the robust one: time spent descheduled does not count in it.  The
load average before and after each run is reported next to the numbers.

    python benchmarks/bench_model.py [--arch gpt2 llama] [--threads 1 2] [--reps 10] [--quick] [--out DIR]

``--quick`` (for the tests: the same code, in seconds): QUICK's smaller model (2 layers,
d_model 128, 256 tokens a step) and a 0.25 s GEMM peak measurement.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time

SHAPE = dict(n_layer=4, n_head=4, d_model=256, seq_len=128, batch=16)
QUICK = dict(n_layer=2, n_head=4, d_model=128, seq_len=64, batch=4)
KV_HEADS = 2  # the Llama form's key/value heads
OUTPUT = {"gpt2": "model_step.json", "llama": "llama_step.json"}


def models(arch: str, s: dict):
    """minidist's model of shape ``s`` and its PyTorch twin on the same weights."""
    import torch

    from minidist.layout.model import ModelConfig
    from minidist.model.nn import GPT
    from minidist.model.torch_reference import TorchGPT, TorchLlama

    llama = arch == "llama"
    model = GPT(ModelConfig(block_size=s["seq_len"], layers=s["n_layer"], heads=s["n_head"], d_model=s["d_model"],
                            dtype="float32", arch=arch, kv_heads=KV_HEADS if llama else None))
    if llama:
        return model, TorchLlama(model.state_dict(), s["n_head"], KV_HEADS, model.config.rope_theta, torch.float32)
    return model, TorchGPT(model.state_dict(), s["n_head"], torch.float32)


def measure(arch: str, threads: int, reps: int, quick: bool = False) -> dict:
    import numpy as np
    import torch

    from minidist.layout.model import ModelConfig
    from minidist.model.optim import AdamW
    from minidist.observe.profile import flops_per_token, measure_peak_gflops
    from minidist.parallel.data import OneReplica
    from minidist.parallel.strategy import Strategy

    torch.set_num_threads(threads)
    s = QUICK if quick else SHAPE
    model, ref = models(arch, s)
    strategy = Strategy(model, OneReplica(model, AdamW(model.parameters(), lr=1e-4)))  # one process
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    rng = np.random.default_rng(0)
    seq = rng.integers(0, 256, size=(s["batch"], s["seq_len"] + 1))
    x, y = seq[:, :-1], seq[:, 1:]
    tx, ty = torch.tensor(x), torch.tensor(y)

    losses = {}

    def step_minidist():
        losses.setdefault("minidist", float(strategy.forward_backward(x, y)))
        strategy.step()
        strategy.zero_grad()

    def step_torch():
        ref_opt.zero_grad(set_to_none=True)
        loss = ref(tx, ty)
        loss.backward()
        losses.setdefault("torch", float(loss))
        ref_opt.step()

    times = {"minidist": [], "torch": []}
    cpu_times = {"minidist": [], "torch": []}
    load_before = os.getloadavg()[0]
    for rep in range(reps + 2):  # two warm-up reps
        for name, fn in (("minidist", step_minidist), ("torch", step_torch)):
            c0, t0 = time.process_time(), time.perf_counter()
            fn()
            if rep >= 2:
                times[name].append(time.perf_counter() - t0)
                cpu_times[name].append(time.process_time() - c0)
        if rep == 0 and abs(losses["minidist"] - losses["torch"]) > 1e-4 * abs(losses["torch"]):
            raise SystemExit(f"the two {arch} models disagree: first loss {losses['minidist']} (minidist) vs "
                             f"{losses['torch']} (PyTorch)")
    tokens = s["batch"] * s["seq_len"]
    spec = ModelConfig(layers=s["n_layer"], d_model=s["d_model"], heads=s["n_head"], arch=arch,
                       kv_heads=KV_HEADS if arch == "llama" else None, block_size=s["seq_len"])
    flops = flops_per_token(spec, s["seq_len"]) * tokens
    peak = measure_peak_gflops(s["d_model"], tokens, "float32", seconds=0.25 if quick else 1.0)
    result = {"threads": threads, "peak_gflops": peak, "load_avg": [load_before, os.getloadavg()[0]],
              "first_loss": losses}
    for name, ts in times.items():
        med, cpu = float(np.median(ts)), float(np.median(cpu_times[name]))
        result[name] = {"step_s": med, "cpu_s": cpu, "tokens_per_s": tokens / med, "mfu": flops / med / (peak * 1e9)}
    result["ratio"] = result["minidist"]["tokens_per_s"] / result["torch"]["tokens_per_s"]
    result["cpu_ratio"] = result["torch"]["cpu_s"] / result["minidist"]["cpu_s"]
    return result


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", choices=list(OUTPUT), nargs="+", default=list(OUTPUT))
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--quick", action="store_true", help="a smaller model (for tests)")
    ap.add_argument("--out", default=None, help="directory for model_step.json (GPT) and llama_step.json")
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        print(json.dumps(measure(args.arch[0], args.child, args.reps, args.quick)))
        return
    # A missing PyTorch is one clear line; found, it is imported only in the child (seconds each:
    # a broken build fails there, and its error is shown below).
    if importlib.util.find_spec("torch") is None:
        sys.exit("bench_model.py compares with PyTorch, which is not installed: pip install -e '.[torch]'")
    for arch in args.arch:
        report(arch, [run_child(arch, n, args.reps, args.quick) for n in args.threads], args)


def run_child(arch: str, threads: int, reps: int, quick: bool) -> dict:
    """One thread count's measurement, in a process of its own (BLAS reads its threads at start-up)."""
    from minidist.host.blas_env import blas_threads

    env = dict(os.environ, **blas_threads(threads))
    child = subprocess.run([sys.executable, __file__, "--arch", arch, "--child", str(threads), "--reps", str(reps)]
                           + (["--quick"] if quick else []), env=env, capture_output=True, text=True)
    if child.returncode:  # show the child's own error, not just its exit status
        sys.stderr.write(child.stderr[-4000:])
        sys.exit(f"bench_model.py: the {arch} {threads}-thread measurement failed with exit status {child.returncode}")
    return json.loads(child.stdout.strip().splitlines()[-1])


def report(arch: str, results: list, args) -> None:
    name = "Llama" if arch == "llama" else "GPT"
    base = QUICK if args.quick else SHAPE
    shape = dict(base, kv_heads=KV_HEADS) if arch == "llama" else base
    print(f"{name} training step ({shape}), float32, median of {args.reps} interleaved reps")
    print("ratio: minidist / torch tokens per wall second; cpu ratio: the same from CPU time per step")
    print(f"{'threads':>7} {'minidist tok/s':>15} {'torch tok/s':>12} {'ratio':>6} {'cpu ratio':>9} "
          f"{'MFU md':>7} {'MFU pt':>7} {'load avg':>10}")
    for r in results:
        print(f"{r['threads']:>7} {r['minidist']['tokens_per_s']:>15,.0f} {r['torch']['tokens_per_s']:>12,.0f} "
              f"{r['ratio']:>6.2f} {r['cpu_ratio']:>9.2f} {100 * r['minidist']['mfu']:>6.1f}% "
              f"{100 * r['torch']['mfu']:>6.1f}% {r['load_avg'][0]:>4.1f}-{r['load_avg'][1]:<4.1f}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, OUTPUT[arch]), "w") as f:
            json.dump({"shape": shape, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
