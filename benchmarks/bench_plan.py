"""The planner checked against the world: its predictions beside real runs here and beside
the published Llama 3 405B table.

    python benchmarks/bench_plan.py [--out DIR] [--quick]

1. This machine: ``--calibrate`` (GEMM rates, minidist's element-wise rate and fixed costs,
   point-to-point, sync and ring-attention costs; about 40 s), then ``--validate``: 18 small
   configurations spanning dp (ZeRO 0-3), tp, pp, cp, their pairs and expert parallelism
   (ep2, with its all-to-all bytes) run for real (8 steps each, two launches of each in
   rounds, the faster counting, the element-wise rate re-measured by a probe step before
   every launch), predicted vs measured step time and peak memory, and the median
   |predicted - measured| / measured (targets: <= 10 % for both).  --quick (for the tests):
   2 configurations, one process and dp2 (one launch of each), 6 steps, and each of the
   calibration's repeated probes launched once.  The calibration is written to
   DIR/plan-machine.json (not the user's own).
2. Llama 3 405B on H100s (Dubey et al. 2024, table 4): the predicted MFU of each published
   mesh beside the published one, and the mesh's place in the planner's ranking for its
   device count and sequence length (target: within 5 points, among the top 5).
3. Mixtral 8x7B on H100s (Jiang et al. 2024: 46.7B parameters, 12.9B active): the counts,
   and the planner's best mesh for 64 GPUs and 4M-token batches of 4,096 tokens beside the
   best one without expert parallelism (ep = 1).

Writes DIR/plan.json.  A shared machine's load is measured during each run and priced (see
minidist/plan/validate.py), but a busy neighbour still adds noise: say which machine and when.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from dataclasses import replace

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

LLAMA_ROWS = [(8192, 8192, (8, 1, 16, 64), 0.43), (16384, 8192, (8, 1, 16, 128), 0.41),
              (16384, 131072, (8, 16, 16, 8), 0.38)]


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def llama_rows() -> list:
    from minidist.plan.machine import PRESETS as MACHINES
    from minidist.plan.model import PRESETS
    from minidist.plan.search import rank_of, search

    rows = []
    for devices, seq, mesh, published in LLAMA_ROWS:
        model = replace(PRESETS["llama3-405b"], block_size=seq)
        ranked, _ = search(model, MACHINES["h100-nvlink-ib"], devices, 16 * 2**20)
        place = rank_of(ranked, *mesh)
        e = ranked[place - 1] if place else None
        rows.append({"devices": devices, "seq_len": seq, "mesh": dict(zip(("tp", "cp", "pp", "dp"), mesh)),
                     "published_mfu": published, "predicted_mfu": e.mfu if e else None,
                     "settings": e.plan.label() if e else None, "rank": place, "meshes_ranked": len(ranked),
                     "best": ranked[0].plan.label(), "best_mfu": ranked[0].mfu})
    return rows


def mixtral_row(devices: int = 64, seq: int = 4096, tokens: int = 4 * 2**20) -> dict:
    from minidist.plan.machine import PRESETS as MACHINES
    from minidist.plan.model import PRESETS, active_params, num_params
    from minidist.plan.search import search

    m = replace(PRESETS["mixtral-8x7b"], block_size=seq)
    ranked, _ = search(m, MACHINES["h100-nvlink-ib"], devices, tokens)
    best, no_ep = ranked[0], next(e for e in ranked if e.plan.ep == 1)
    return {"params": num_params(m), "active_params": active_params(m), "devices": devices, "seq_len": seq,
            "global_batch_tokens": tokens, "best": best.as_dict(), "best_label": best.plan.label(),
            "best_ep1": no_ep.as_dict(), "best_ep1_label": no_ep.plan.label(), "meshes_ranked": len(ranked)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 configurations, 6 steps, a quicker calibration")
    ap.add_argument("--out", default=None, help="directory for plan.json (and the calibration)")
    args = ap.parse_args()
    from minidist.plan.validate import CONFIGS, calibrate, validate

    import tempfile

    t0 = time.perf_counter()
    out = args.out or tempfile.mkdtemp(prefix="bench-plan-")  # the calibration lands beside plan.json, or nowhere
    os.makedirs(out, exist_ok=True)
    print(f"this machine: {cpu_name()}, {os.cpu_count()} cores; calibrating:")
    machine = calibrate(os.path.join(out, "plan-machine.json"), quick=args.quick)
    result = validate(machine, steps=6 if args.quick else 8, configs=CONFIGS[:2] if args.quick else None,
                      repeats=1 if args.quick else 2)
    rows = llama_rows()
    print("Llama 3 405B on H100s, 16M-token batches: predicted vs published MFU, the published mesh's place")
    print(f"{'GPUs':>6} {'seq':>7} {'mesh':<22} {'published':>9} {'predicted':>9} {'place':>6}   planner's best")
    for r in rows:
        m = r["mesh"]
        mesh = f"tp{m['tp']} cp{m['cp']} pp{m['pp']} dp{m['dp']}"
        print(f"{r['devices']:>6} {r['seq_len']:>7} {mesh:<22} {100 * r['published_mfu']:>8.0f}% "
              f"{100 * r['predicted_mfu']:>8.1f}% {r['rank']:>3}/{r['meshes_ranked']:<3}  "
              f"{r['best']} ({100 * r['best_mfu']:.1f}%)")
    mix = mixtral_row()
    print(f"Mixtral 8x7B: {mix['params'] / 1e9:.2f}B parameters, {mix['active_params'] / 1e9:.2f}B active; on "
          f"{mix['devices']} H100s: {mix['best_label']} {mix['best']['step_s']:.2f} s "
          f"({100 * mix['best']['mfu']:.1f}% MFU, {mix['best']['mem_gb']:.1f} GB); without ep: "
          f"{mix['best_ep1_label']} {mix['best_ep1']['step_s']:.2f} s ({100 * mix['best_ep1']['mfu']:.1f}%)")
    record = {"machine": {"cpu": cpu_name(), "cores": os.cpu_count(), "python": platform.python_version()},
              "quick": args.quick, "validation": result, "llama3_405b": rows, "mixtral_8x7b": mix,
              "wall_s": time.perf_counter() - t0}
    if args.out:
        with open(os.path.join(args.out, "plan.json"), "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
