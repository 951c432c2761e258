"""One Llama training step, minidist vs PyTorch on the CPU, same weights, same thread count.

Model: the GPT benchmark's shape (benchmarks/bench_model.py: d_model 256, 4 layers, 4 heads,
seq 128, batch 16, float32) as a Llama (``GPTConfig(arch="llama")``): RMSNorm, rotary
positions, SwiGLU of width 704 (8/3 d rounded up to 32), 2 key/value heads (grouped-query
attention), no biases, an untied head; a step is forward, backward and an AdamW update.

The PyTorch side is a plain Llama written here with PyTorch's own ops (``F.rms_norm``, the
rotary half-split of Hugging Face's Llama, ``F.scaled_dot_product_attention`` with
``enable_gqa``, ``F.silu``), loaded with minidist's weights; the first step's losses of the two
are compared before any timing (the run stops if they differ).  As in bench_model.py, each
thread count runs in its own process and the two frameworks alternate step by step; the
ratio is minidist / PyTorch tokens per second, from wall time and from CPU time.

    python benchmarks/bench_llama.py [--threads 1 2] [--reps 10] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

SHAPE = dict(n_layer=4, n_head=4, n_kv_head=2, d_model=256, seq_len=128, batch=16)


def torch_llama(state: dict, n_head: int, n_kv_head: int, theta: float, dtype):
    """A plain PyTorch Llama on minidist's state_dict (weights stored ``(in, out)``)."""
    import torch
    import torch.nn.functional as F

    class TorchLlama(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.params = torch.nn.ParameterDict(
                {k.replace(".", "__"): torch.nn.Parameter(torch.tensor(v, dtype=dtype)) for k, v in state.items()})
            self.n_layer = 1 + max(int(k.split(".")[1]) for k in state if k.startswith("h."))

        def p(self, name):
            return self.params[name.replace(".", "__")]

        def rotate(self, x, cos, sin):
            """Rotary positions, the half-split layout (y1 = x1 cos - x2 sin, y2 = x2 cos + x1 sin)."""
            x1, x2 = x.chunk(2, dim=-1)
            return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

        def forward(self, ids, targets):
            B, T = ids.shape
            x = F.embedding(ids, self.p("wte.weight"))
            C = x.shape[-1]
            D = C // n_head
            inv = theta ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
            angles = torch.arange(T, dtype=torch.float64)[:, None] * inv[None, :]
            cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
            for i in range(self.n_layer):
                h = f"h.{i}."
                a = F.rms_norm(x, (C,), self.p(h + "ln_1.weight"), eps=1e-5)
                q = (a @ self.p(h + "attn.q_proj.weight")).view(B, T, n_head, D).transpose(1, 2)
                k = (a @ self.p(h + "attn.k_proj.weight")).view(B, T, n_kv_head, D).transpose(1, 2)
                v = (a @ self.p(h + "attn.v_proj.weight")).view(B, T, n_kv_head, D).transpose(1, 2)
                q, k = self.rotate(q, cos, sin), self.rotate(k, cos, sin)
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
                x = x + y.transpose(1, 2).reshape(B, T, C) @ self.p(h + "attn.o_proj.weight")
                m = F.rms_norm(x, (C,), self.p(h + "ln_2.weight"), eps=1e-5)
                gate, up = (m @ self.p(h + "mlp.gate_up_proj.weight")).chunk(2, dim=-1)
                x = x + (F.silu(gate) * up) @ self.p(h + "mlp.down_proj.weight")
            x = F.rms_norm(x, (C,), self.p("ln_f.weight"), eps=1e-5)
            logits = x @ self.p("lm_head.weight")
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    return TorchLlama()


def measure(threads: int, reps: int) -> dict:
    import numpy as np
    import torch

    from minidist.layout.settings import ModelConfig
    from minidist.model.nn import GPT, GPTConfig
    from minidist.model.optim import AdamW
    from minidist.observe.profile import flops_per_token, measure_peak_gflops
    from minidist.parallel.data import OneReplica
    from minidist.parallel.strategy import Strategy

    torch.set_num_threads(threads)
    s = SHAPE
    cfg = GPTConfig(arch="llama", seq_len=s["seq_len"], n_layer=s["n_layer"], n_head=s["n_head"],
                    n_kv_head=s["n_kv_head"], d_model=s["d_model"], dtype="float32")
    model = GPT(cfg)
    ref = torch_llama(model.state_dict(), s["n_head"], s["n_kv_head"], cfg.rope_theta, torch.float32)
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
            raise SystemExit(f"the two Llamas disagree: first loss {losses['minidist']} (minidist) vs "
                             f"{losses['torch']} (PyTorch)")
    tokens = s["batch"] * s["seq_len"]
    run_model = ModelConfig(layers=s["n_layer"], d_model=s["d_model"], heads=s["n_head"], arch="llama",
                            kv_heads=s["n_kv_head"])
    flops = flops_per_token(run_model, s["seq_len"]) * tokens
    peak = measure_peak_gflops(s["d_model"], tokens, "float32", seconds=1.0)
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
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", default=None, help="directory for llama_step.json")
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        print(json.dumps(measure(args.child, args.reps)))
        return
    try:
        import torch  # noqa: F401  (checked here so that a missing PyTorch is one clear line)
    except ImportError:
        sys.exit("bench_llama.py compares with PyTorch, which is not installed: pip install -e '.[torch]'")
    from minidist.host.blas_env import blas_threads

    results = []
    for n in args.threads:
        env = dict(os.environ, **blas_threads(n))
        child = subprocess.run([sys.executable, __file__, "--child", str(n), "--reps", str(args.reps)],
                               env=env, capture_output=True, text=True)
        if child.returncode:  # show the child's own error, not just its exit status
            sys.stderr.write(child.stderr[-4000:])
            sys.exit(f"bench_llama.py: the {n}-thread measurement failed with exit status {child.returncode}")
        results.append(json.loads(child.stdout.strip().splitlines()[-1]))
    print(f"Llama training step ({SHAPE}), float32, median of {args.reps} interleaved reps")
    print("ratio: minidist / torch tokens per wall second; cpu ratio: the same from CPU time per step")
    print(f"{'threads':>7} {'minidist tok/s':>15} {'torch tok/s':>12} {'ratio':>6} {'cpu ratio':>9} "
          f"{'MFU md':>7} {'MFU pt':>7} {'load avg':>10}")
    for r in results:
        print(f"{r['threads']:>7} {r['minidist']['tokens_per_s']:>15,.0f} {r['torch']['tokens_per_s']:>12,.0f} "
              f"{r['ratio']:>6.2f} {r['cpu_ratio']:>9.2f} {100 * r['minidist']['mfu']:>6.1f}% "
              f"{100 * r['torch']['mfu']:>6.1f}% {r['load_avg'][0]:>4.1f}-{r['load_avg'][1]:<4.1f}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "llama_step.json"), "w") as f:
            json.dump({"shape": SHAPE, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
