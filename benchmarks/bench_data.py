"""Token data: how fast ``prepare`` tokenizes, and what memory-mapped shards add to a step.

    python benchmarks/bench_data.py [--out DIR] [--quick] [--reps 20]

* **prepare**: the default corpus (the standard library's source, 8 MiB; 1 MiB with
  ``--quick``) encoded by a byte-level BPE of 2,048 tokens trained on it, through
  ``minidist.state.prepare.prepare`` (shards written to a temporary directory), in MB of text
  per CPU-second of the process (all its threads, so per core), with the tokenizers library
  on one thread (``RAYON_NUM_THREADS=1``, a child process) and on its default pool.  Target:
  at least 1 MB/s per core.
* **loading**: the benchmark GPT (``bench_model.SHAPE`` with the tokenizer's 2,048 tokens)
  on one process; its training step's time, and the time ``Sampler.batch`` takes to draw a
  step's batch from the memory-mapped shards and from the same tokens held in memory,
  interleaved rep by rep.  The overhead is (memory-mapped - in memory) / step.  Target: at
  most 2 % of the step.

Writes DIR/data.json and prints a short table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

VOCAB = 2048
TARGET_MB_S, TARGET_OVERHEAD = 1.0, 0.02


def tokenizer_and_corpus(folder: str, quick: bool):
    from minidist.state import tokenizer as tok
    from minidist.state.data import load_corpus

    corpus = load_corpus(None, max_bytes=(1 << 20) if quick else 8 << 20).tobytes()
    path = os.path.join(folder, "tok.json")
    if not os.path.exists(path):
        with open(path, "w", encoding="utf-8") as f:
            f.write(tok.train(corpus, VOCAB).to_str())
    return tok.BPETokenizer(path), corpus


def prepare_rate(folder: str, quick: bool) -> dict:
    """MB of text per CPU-second (and per wall second) of one ``prepare``, in this process."""
    from minidist.state.prepare import prepare

    t, corpus = tokenizer_and_corpus(folder, quick)
    out = tempfile.mkdtemp(dir=folder)
    os.rmdir(out)
    c0, w0 = time.process_time(), time.perf_counter()
    prepare(t, corpus, out, log=lambda *a, **k: None)
    cpu, wall = time.process_time() - c0, time.perf_counter() - w0
    mb = len(corpus) / 1e6
    return {"bytes": len(corpus), "cpu_s": cpu, "wall_s": wall, "mb_per_cpu_s": mb / cpu, "mb_per_s": mb / wall}


def loading(folder: str, reps: int, quick: bool) -> dict:
    """A training step of the benchmark GPT against drawing its batch from shards and from memory."""
    import numpy as np

    from bench_model import QUICK, SHAPE
    from minidist.layout.model import ModelConfig
    from minidist.model.nn import GPT
    from minidist.model.optim import AdamW
    from minidist.parallel.data import OneReplica
    from minidist.parallel.strategy import Strategy
    from minidist.state.data import Sampler
    from minidist.state.shards import open_shards

    shards = os.path.join(folder, "shards")
    if not os.path.exists(shards):
        from minidist.state.prepare import prepare

        t, corpus = tokenizer_and_corpus(folder, quick)
        prepare(t, corpus, shards, log=lambda *a, **k: None)
    s = QUICK if quick else SHAPE
    tokens = open_shards(shards)[1]["train"]
    mapped = Sampler(tokens, s["seq_len"], s["batch"])
    held = Sampler(tokens.gather(np.arange(len(tokens))), s["seq_len"], s["batch"])
    model = GPT(ModelConfig(vocab_size=VOCAB, block_size=s["seq_len"], layers=s["n_layer"], heads=s["n_head"],
                            d_model=s["d_model"], dtype="float32"))
    strategy = Strategy(model, OneReplica(model, AdamW(model.parameters(), lr=1e-4)))
    times = {"step": [], "shards": [], "memory": []}
    for rep in range(reps + 2):  # two warm-up reps
        for name, sampler in (("shards", mapped), ("memory", held)) if rep % 2 else (("memory", held), ("shards", mapped)):
            t0 = time.perf_counter()
            x, y = sampler.batch(rep)
            if rep >= 2:
                times[name].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        strategy.forward_backward(x, y)
        strategy.step()
        strategy.zero_grad()
        if rep >= 2:
            times["step"].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"shape": s, "step_s": med["step"], "batch_from_shards_s": med["shards"],
            "batch_from_memory_s": med["memory"], "overhead": (med["shards"] - med["memory"]) / med["step"],
            "shards_share_of_step": med["shards"] / med["step"]}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench-results")
    ap.add_argument("--quick", action="store_true", help="1 MiB of text and the small model (for tests)")
    ap.add_argument("--reps", type=int, default=20, help="timed steps (after two warm-up steps)")
    ap.add_argument("--child", help=argparse.SUPPRESS)  # prepare's rate in a child process (its thread pool)
    args = ap.parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps(prepare_rate(args.child, args.quick)), flush=True)
        return
    with tempfile.TemporaryDirectory() as folder:
        tokenizer_and_corpus(folder, args.quick)
        rates = {}
        for label, threads in (("1 thread", "1"), ("default threads", None)):
            env = dict(os.environ)
            env.pop("RAYON_NUM_THREADS", None)
            if threads:
                env["RAYON_NUM_THREADS"] = threads
            r = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", folder]
                               + (["--quick"] if args.quick else []), env=env, capture_output=True, text=True,
                               timeout=600)
            line = next((l for l in r.stdout.splitlines() if l.startswith("RESULT ")), None)
            if r.returncode or line is None:
                raise SystemExit(f"prepare ({label}) failed (exit {r.returncode}):\n{r.stderr[-2000:]}")
            rates[label] = json.loads(line[len("RESULT "):])
        load = loading(folder, 4 if args.quick else args.reps, args.quick)
    result = {"prepare": rates, "loading": load, "targets": {"prepare_mb_per_cpu_s": TARGET_MB_S,
                                                            "loading_overhead": TARGET_OVERHEAD},
              "load_avg": os.getloadavg()[0], "quick": args.quick}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "data.json"), "w") as f:
        json.dump(result, f, indent=1)
    for label, r in rates.items():
        print(f"prepare, {label:<16}: {r['mb_per_cpu_s']:.2f} MB/s per core ({r['mb_per_s']:.2f} MB/s wall, "
              f"{r['bytes'] / 1e6:.1f} MB)  target >= {TARGET_MB_S} MB/s per core")
    print(f"loading: step {load['step_s'] * 1e3:.1f} ms; batch from shards {load['batch_from_shards_s'] * 1e6:.0f} us, "
          f"from memory {load['batch_from_memory_s'] * 1e6:.0f} us: overhead {100 * load['overhead']:.2f} % of the "
          f"step (target <= {100 * TARGET_OVERHEAD:.0f} %)")


if __name__ == "__main__":
    main()
