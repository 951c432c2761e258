"""Weak scaling of data parallelism: 1 rank vs 2 ranks, minidist DDP vs PyTorch DDP (gloo).

    python benchmarks/bench_ddp.py [--launches 3] [--steps 5] [--quick] [--out DIR]

The benchmark GPT of bench_model.py (d_model 256, 4 layers, 4 heads, seq 128, float32) with
16 sequences *per rank* (weak scaling: 2 ranks process twice the tokens per step), one BLAS
thread per rank.  Configurations, each its own mpiexec launch, launched in turn and the whole
round repeated ``--launches`` times (the machine's speed drifts over minutes: interleaving
keeps the compared runs side by side):

* minidist on 1 rank (no communication) and DDP on 2 ranks (default 25 MB buckets, overlap);
* the same 2-rank DDP with ``--no-overlap``, and both with 1 MB buckets, on shared memory and
  on a simulated 1 Gbit/s link (``MINIDIST_LINK_GBPS=1``): the share of the communication
  that overlap hides is 1 - exposed(overlap) / exposed(no overlap);
* ZeRO-1, 2 and 3 on 2 ranks (step time relative to DDP);
* PyTorch (when installed) on 1 rank and with DistributedDataParallel (gloo) on 2 ranks,
  started by the same mpiexec (ranks read from the launcher's environment).

Reported: tokens/s of each (median over launches of each launch's median step), the scaling
ratios 2 ranks / 1 rank, minidist's 2-rank tokens/s over PyTorch's, and the hidden share.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

SHAPE = dict(n_layer=4, n_head=4, d_model=256, seq_len=128, rows=16)
QUICK = dict(n_layer=2, n_head=2, d_model=64, seq_len=32, rows=4)


def _rank_and_size():
    for r, s in (("PMI_RANK", "PMI_SIZE"), ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE")):
        if r in os.environ:
            return int(os.environ[r]), int(os.environ[s])
    return 0, 1


def _batches(shape, rank, steps):
    import numpy as np

    rng = np.random.default_rng(rank)
    data = rng.integers(0, 256, (steps, shape["rows"], shape["seq_len"] + 1))
    return [(d[:, :-1], d[:, 1:]) for d in data]


def worker_minidist(shape, steps, zero, overlap, bucket_mb):
    from minidist.train.config import RunConfig
    from minidist.parallel.compose import build, build_mesh
    from minidist.train.flags import world_rank, world_size

    n, rank = world_size(), world_rank()
    cfg = RunConfig().replace(
        model=dict(layers=shape["n_layer"], heads=shape["n_head"], d_model=shape["d_model"]),
        data=dict(seq_len=shape["seq_len"], batch_size=shape["rows"] * n), optim=dict(lr=1e-4),
        parallel=dict(dp=n, zero=zero, overlap=overlap, bucket_mb=bucket_mb)).resolved(n)
    model, strategy = build(cfg, build_mesh(cfg.parallel))  # AdamW; DDP or ZeRO-1/2/3 over the n ranks
    data = strategy.data  # the data-parallel part: gradient reduction around each micro-step
    times, exposed = [], []
    for x, y in _batches(shape, rank, steps + 1):
        t0 = time.perf_counter()
        with data.micro_step(True):  # weak scaling: each rank its own batch, the mean over ranks
            (model(x, y) * (1.0 / n)).backward()
        strategy.step()
        strategy.zero_grad()
        times.append(time.perf_counter() - t0)
        exposed.append(strategy.comm_wait_s)
    return rank, n, times[1:], exposed[1:]


def worker_torch(shape, steps):
    import torch
    import torch.distributed as dist

    from minidist.layout.model import ModelConfig
    from minidist.model.nn import GPT
    from minidist.model.torch_reference import TorchGPT

    torch.set_num_threads(1)
    rank, n = _rank_and_size()
    model = GPT(ModelConfig(block_size=shape["seq_len"], layers=shape["n_layer"], heads=shape["n_head"],
                            d_model=shape["d_model"]))
    net = TorchGPT(model.state_dict(), shape["n_head"], dtype=torch.float32)
    if n > 1:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        dist.init_process_group("gloo", rank=rank, world_size=n)
        net = torch.nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4)
    times = []
    for x, y in _batches(shape, rank, steps + 1):
        t0 = time.perf_counter()
        loss = net(torch.from_numpy(x), torch.from_numpy(y))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    if n > 1:
        dist.destroy_process_group()
    return rank, n, times[1:], [0.0] * steps


def worker(args):
    shape = QUICK if args.quick else SHAPE
    if args.worker == "torch":
        rank, n, times, exposed = worker_torch(shape, args.steps)
    else:
        rank, n, times, exposed = worker_minidist(shape, args.steps, args.zero, not args.no_overlap, args.bucket_mb)
    if rank == 0:
        print("RESULT " + json.dumps({"times": times, "exposed": exposed, "ranks": n}), flush=True)
    if args.worker == "torch":
        # PyTorch's gloo threads sometimes abort the interpreter's teardown ("terminate called
        # without an active exception", exit 6) after the result is out: leave without it.
        sys.stdout.flush()
        os._exit(0)


CONFIGS = [  # name, ranks, worker args, extra environment
    ("minidist 1 rank", 1, ["--worker", "minidist"], {}),
    ("minidist DDP 2 ranks", 2, ["--worker", "minidist"], {}),
    ("minidist DDP 2 ranks, no overlap", 2, ["--worker", "minidist", "--no-overlap"], {}),
    # 1 MB buckets: the model's 12.8 MB of gradients fit one default 25 MB bucket, which can
    # only start when backward is done; smaller buckets give the overlap something to hide.
    ("minidist DDP 2 ranks, 1 MB buckets", 2, ["--worker", "minidist", "--bucket-mb", "1"], {}),
    ("minidist DDP 2 ranks, 1 MB buckets, no overlap", 2,
     ["--worker", "minidist", "--bucket-mb", "1", "--no-overlap"], {}),
    ("minidist DDP 2 ranks, 1 MB buckets, 1 Gbit/s link", 2, ["--worker", "minidist", "--bucket-mb", "1"],
     {"MINIDIST_LINK_GBPS": "1"}),
    ("minidist DDP 2 ranks, 1 MB buckets, 1 Gbit/s link, no overlap", 2,
     ["--worker", "minidist", "--bucket-mb", "1", "--no-overlap"], {"MINIDIST_LINK_GBPS": "1"}),
    ("minidist ZeRO-1 2 ranks", 2, ["--worker", "minidist", "--zero", "1"], {}),
    ("minidist ZeRO-2 2 ranks", 2, ["--worker", "minidist", "--zero", "2"], {}),
    ("minidist ZeRO-3 2 ranks", 2, ["--worker", "minidist", "--zero", "3"], {}),
    ("PyTorch 1 rank", 1, ["--worker", "torch"], {}),
    ("PyTorch DDP 2 ranks", 2, ["--worker", "torch"], {}),
]


def launch(name, ranks, wargs, env_extra, args, port):
    from minidist.host.launcher import mpiexec_command

    from minidist.host.blas_env import blas_threads
    env = dict(os.environ, **blas_threads(1),
               MASTER_PORT=str(port), **env_extra)
    cmd = mpiexec_command(ranks) + [sys.executable, os.path.abspath(__file__), *wargs, "--steps", str(args.steps)]
    if args.quick:
        cmd.append("--quick")
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    line = next((l for l in r.stdout.splitlines() if l.startswith("RESULT ")), None)
    if r.returncode or line is None:
        raise RuntimeError(f"{name} failed (exit {r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    return json.loads(line[len("RESULT "):])


def median(values):
    v = sorted(values)
    return v[len(v) // 2] if len(v) % 2 else 0.5 * (v[len(v) // 2 - 1] + v[len(v) // 2])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", choices=["minidist", "torch"], default=None, help=argparse.SUPPRESS)
    ap.add_argument("--zero", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--no-overlap", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--bucket-mb", type=float, default=25.0, help=argparse.SUPPRESS)
    ap.add_argument("--launches", type=int, default=3, help="rounds of launches (each config once per round)")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per launch (after one warm-up step)")
    ap.add_argument("--quick", action="store_true", help="a tiny model, one round (for tests)")
    ap.add_argument("--out", default="bench-results")
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    try:
        import torch  # noqa: F401
        configs = CONFIGS
    except ImportError:
        print("PyTorch is not installed: the PyTorch DDP comparison is skipped")
        configs = [c for c in CONFIGS if "PyTorch" not in c[0]]
    launches = 1 if args.quick else args.launches
    shape = QUICK if args.quick else SHAPE
    per = {c[0]: [] for c in configs}
    exposed = {c[0]: [] for c in configs}
    port = 29500 + os.getpid() % 1000
    for rnd in range(launches):
        for name, ranks, wargs, env in configs:
            port += 1
            res = launch(name, ranks, wargs, env, args, port)
            step = median(res["times"])
            per[name].append(shape["rows"] * shape["seq_len"] * ranks / step)
            exposed[name].append(median(res["exposed"]))
            print(f"round {rnd + 1}/{launches}: {name:<50} {per[name][-1]:>9,.0f} tokens/s", flush=True)
    tok = {k: median(v) for k, v in per.items()}
    exp = {k: median(v) for k, v in exposed.items()}
    result = {"shape": shape, "launches": launches, "steps": args.steps, "tokens_per_s": tok,
              "tokens_per_s_each_launch": per, "exposed_comm_s": exp}
    md1, md2 = tok["minidist 1 rank"], tok["minidist DDP 2 ranks"]
    result["minidist_scaling_2_over_1"] = md2 / md1
    result["hidden_share"] = {}
    for setting in ("", ", 1 MB buckets", ", 1 MB buckets, 1 Gbit/s link"):
        on, off = exp[f"minidist DDP 2 ranks{setting}"], exp[f"minidist DDP 2 ranks{setting}, no overlap"]
        result["hidden_share"][setting.lstrip(", ") or "25 MB buckets"] = 1 - on / off if off else None
    for z in (1, 2, 3):
        result[f"zero{z}_step_time_over_ddp"] = md2 / tok[f"minidist ZeRO-{z} 2 ranks"]
    if "PyTorch 1 rank" in tok:
        result["torch_scaling_2_over_1"] = tok["PyTorch DDP 2 ranks"] / tok["PyTorch 1 rank"]
        result["minidist_2_over_torch_2"] = md2 / tok["PyTorch DDP 2 ranks"]
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "ddp.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(f"\nweak scaling, {shape['rows']} x {shape['seq_len']} tokens per rank per step, "
          f"median of {launches} launch(es) x {args.steps} steps")
    print(f"{'configuration':<50} | {'tokens/s':>9} | exposed comm")
    for name in tok:
        print(f"{name:<50} | {tok[name]:>9,.0f} | {1e3 * exp[name]:7.1f} ms")
    print(f"minidist 2 ranks / 1 rank: {result['minidist_scaling_2_over_1']:.2f}x (target >= 1.85)")
    if "torch_scaling_2_over_1" in result:
        print(f"PyTorch 2 ranks / 1 rank: {result['torch_scaling_2_over_1']:.2f}x; "
              f"minidist 2 ranks / PyTorch 2 ranks: {result['minidist_2_over_torch_2']:.2f} (target >= 0.9)")
    for setting, value in result["hidden_share"].items():
        print(f"communication hidden by overlap, {setting}: {'n/a' if value is None else f'{100 * value:.0f}%'} "
              "(1 - exposed with overlap / exposed without)")
    print("ZeRO step time / DDP: " + ", ".join(f"stage {z} {result[f'zero{z}_step_time_over_ddp']:.2f}x"
                                              for z in (1, 2, 3)))


if __name__ == "__main__":
    main()
