"""A mixture-of-experts step beside a dense step with the same active parameters.

    python benchmarks/bench_moe.py [--out DIR] [--quick] [--reps 10]

One process, the benchmark GPT's shape (``bench_model.SHAPE``; ``QUICK`` with ``--quick``) as
a Llama (SwiGLU feed-forward of width h = llama_ffn_hidden(d), as Mixtral's experts):

* **dense**: every block's feed-forward 2h wide, so a token meets as many weights as in
* **MoE**: every block a mixture of 8 experts of width h, top-2 (Mixtral's routing), dropless,
  and the same with a capacity factor of 1.25 (Switch's dropping).

Per token both run the same MLP FLOPs; the mixture adds the router, the sort of tokens by
expert, the gather and the scatter-add back, 8 smaller products instead of one large, and
the auxiliary losses.  The steps alternate rep by rep (forward, backward and AdamW), and the
ratio of median step times is the price of routing.  Writes DIR/moe.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

EXPERTS, TOP_K = 8, 2


def arms(s: dict) -> dict:
    """name -> the ModelConfig keyword arguments of each arm (same active MLP parameters)."""
    from minidist.layout.model import llama_ffn_hidden

    base = dict(block_size=s["seq_len"], layers=s["n_layer"], heads=s["n_head"], d_model=s["d_model"],
                dtype="float32", arch="llama")
    return {"dense (feed-forward 2h)": dict(base, ffn_hidden=TOP_K * llama_ffn_hidden(s["d_model"])),
            "MoE 8 experts top-2, dropless": dict(base, experts=EXPERTS, top_k=TOP_K),
            "MoE 8 experts top-2, capacity 1.25": dict(base, experts=EXPERTS, top_k=TOP_K, capacity_factor=1.25)}


def measure(reps: int, quick: bool) -> dict:
    import numpy as np

    from bench_model import QUICK, SHAPE
    from minidist.layout.model import ModelConfig
    from minidist.model.nn import GPT
    from minidist.model.optim import AdamW
    from minidist.parallel.data import OneReplica
    from minidist.parallel.strategy import Strategy

    s = QUICK if quick else SHAPE
    runs = {}
    for name, kw in arms(s).items():
        model = GPT(ModelConfig(**kw))
        strategy = Strategy(model, OneReplica(model, AdamW(model.parameters(), lr=1e-4)))
        runs[name] = (model, strategy)
    rng = np.random.default_rng(0)
    seq = rng.integers(0, 256, size=(s["batch"], s["seq_len"] + 1))
    x, y = seq[:, :-1], seq[:, 1:]
    times = {name: [] for name in runs}
    for rep in range(reps + 2):  # two warm-up reps
        order = list(runs.items()) if rep % 2 else list(reversed(runs.items()))
        for name, (_, strategy) in order:
            t0 = time.perf_counter()
            strategy.forward_backward(x, y)
            strategy.step()
            strategy.zero_grad()
            if rep >= 2:
                times[name].append(time.perf_counter() - t0)
    tokens = s["batch"] * s["seq_len"]
    dense = statistics.median(times["dense (feed-forward 2h)"])
    out = {}
    for name, (model, _) in runs.items():
        step = statistics.median(times[name])
        total = sum(p.data.size for p in model.parameters())
        out[name] = {"step_s": step, "tokens_per_s": tokens / step, "over_dense": step / dense, "parameters": total}
    return {"shape": s, "experts": EXPERTS, "top_k": TOP_K, "reps": reps, "arms": out, "load_avg": os.getloadavg()[0]}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench-results")
    ap.add_argument("--quick", action="store_true", help="the small model, 3 reps (for tests)")
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args(argv)
    result = measure(3 if args.quick else args.reps, args.quick)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "moe.json"), "w") as f:
        json.dump(result, f, indent=1)
    for name, r in result["arms"].items():
        print(f"{name:<36} {r['step_s'] * 1e3:8.1f} ms  {r['tokens_per_s']:>9,.0f} tokens/s  "
              f"{r['over_dense']:.2f}x dense  ({r['parameters']:,} parameters)")


if __name__ == "__main__":
    main()
