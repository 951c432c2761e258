"""`make bench`: every benchmark, each writing JSON into --out and printing a short table.

Benchmarks report ratios measured in one run (minidist vs MPI's built-ins, vs PyTorch),
never absolute targets: the machines they run on are shared and noisy.

    python benchmarks/run_all.py [--out DIR] [--quick] [--only collectives model]

Before it starts it prints what it will run and how long each part should take; while a
part runs, its own output comes through indented, with a progress line every
--progress-every seconds; a part that fails is named at the end with the last lines of its
output, and the exit status is 1.  A part whose requirement is missing (PyTorch for the
model comparison, an mpiexec for the collectives) is skipped with a one-line reason.
Each part's duration is written to DIR/run_all.json and is the expectation printed by the
next run into the same DIR.  At the end, benchmarks/report.py gathers every part's headline
ratios, with the machine they were measured on, into DIR/REPORT.md (and DIR/report.png).
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

HERE = os.path.dirname(os.path.abspath(__file__))


@dataclass
class Part:
    name: str
    script: str
    what: str
    full_args: list
    quick_args: list
    # Seconds measured on the 2-core development machine with no other load (one run of each
    # form); a busy machine takes longer.
    full_s: float
    quick_s: float


PARTS = [
    Part("collectives", "bench_collectives.py",
         "minidist's all_reduce, all_gather, reduce_scatter, all_to_all_v vs MPI's",
         [], ["--quick", "--ranks", "2", "--launches", "1"], full_s=335, quick_s=7),
    Part("model", "bench_model.py", "a GPT and a Llama training step, minidist vs PyTorch on the CPU",
         [], ["--quick", "--reps", "1", "--threads", "1"], full_s=100, quick_s=16),
    Part("ddp", "bench_ddp.py", "weak scaling 1 -> 2 ranks: minidist DDP and ZeRO vs PyTorch DDP (gloo)",
         [], ["--quick"], full_s=290, quick_s=23),
    Part("tensor", "bench_tensor.py", "tensor parallelism on 2 ranks: collective matmuls vs sync "
         "(simulated 1 Gbit/s link), tp=2 vs 1 rank", [], ["--quick"], full_s=30, quick_s=1),
    Part("context", "bench_context.py", "long sequences: blockwise vs plain attention, ring vs Ulysses vs one rank",
         [], ["--quick"], full_s=80, quick_s=5),
    Part("pipeline", "bench_pipeline.py", "pipeline schedules (zero-bubble ones too): measured bubble vs formula, "
         "tokens/s vs one rank",
         [], ["--quick"], full_s=185, quick_s=3),
    Part("compose", "bench_compose.py", "4D composition on 4 ranks: dp4, dp2·tp2, pp2·tp2, tp2·cp2 vs one rank; "
         "bytes per axis vs the formulas", [], ["--quick"], full_s=65, quick_s=10),
    Part("tracing", "bench_trace.py", "tracing overhead: a traced vs an untraced step on dp2, pp2, tp2",
         [], ["--quick"], full_s=20, quick_s=1),
    Part("oversubscribed", "bench_oversubscribed.py", "more ranks than cores: the README's 8-rank command vs one "
         "process on the same model and batch", [], ["--quick"], full_s=90, quick_s=9),
    Part("plan", "bench_plan.py", "the planner: predicted vs measured step time and peak memory here, and the "
         "Llama 3 405B rows", [], ["--quick"], full_s=200, quick_s=36),
    # Where there is no GPU (or no CuPy) it writes gpu.json with the reason and stops in a second.
    Part("gpu", "bench_gpu.py", "a GPT step on one GPU: minidist (CuPy) vs PyTorch, fp32 and mixed precision, "
         "then 2 ranks sharing the GPU per parallel mode", [], ["--quick", "--no-parallel"], full_s=240, quick_s=60),
    Part("moe", "bench_moe.py", "a mixture-of-experts step (8 experts, top-2) beside a dense step with the same "
         "active parameters", [], ["--quick"], full_s=50, quick_s=2),
    Part("data", "bench_data.py", "token data: prepare's MB/s per core, and what memory-mapped shards add to a step",
         [], ["--quick"], full_s=40, quick_s=4),
    Part("checkpoint", "bench_checkpoint.py", "checkpoints at dp2·tp2: sharded vs gathered save and load, "
         "--save-async's hidden share", [], ["--quick"], full_s=15, quick_s=2),
    # Counted, not timed: minidist's CuPy path under the emulator (tests/emulated_gpu), PyTorch
    # under its profiler on the CPU (its row is left out where PyTorch is not installed).
    Part("launches", "bench_launches.py", "device operations per GPT training step (the GPU's launch floor), "
         "minidist under the CuPy emulator vs PyTorch eager", [], ["--quick"], full_s=460, quick_s=11),
]


def missing_requirement(part: Part) -> str | None:
    """Why ``part`` cannot run here (one line), or None."""
    if part.name == "model" and importlib.util.find_spec("torch") is None:
        return "PyTorch is not installed (pip install -e '.[torch]'; `make bench` tries that first)"
    if part.name in ("collectives", "ddp", "tensor", "context", "pipeline", "tracing", "plan", "oversubscribed"):
        if importlib.util.find_spec("mpi4py") is None:
            return "mpi4py is not installed (make install)"
        local = os.path.join(os.path.dirname(sys.executable), "mpiexec")
        if not os.path.exists(local) and shutil.which("mpiexec") is None:
            return "no mpiexec found (make install puts the mpich wheel's next to this Python)"
    return None


def _short(path: str) -> str:
    """``path`` relative to the current directory when it lies below it."""
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel


def duration(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds}s" if seconds < 60 else f"{seconds // 60}m{seconds % 60:02d}s"


def run_part(cmd: list, label: str, expected: float, progress_every: float, tail: int = 20):
    """Run ``cmd``, echoing its output indented and a progress line every ``progress_every``
    seconds; return (exit status, seconds, its last ``tail`` lines)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            errors="replace")
    last = collections.deque(maxlen=tail)

    def pump():
        for line in proc.stdout:
            last.append(line.rstrip("\n"))
            print("    " + line, end="", flush=True)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    while True:
        try:
            proc.wait(timeout=progress_every)
            break
        except subprocess.TimeoutExpired:
            print(f"  {label}: still running, {duration(time.perf_counter() - t0)} of ~{duration(expected)}",
                  flush=True)
    reader.join()
    return proc.returncode, time.perf_counter() - t0, list(last)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench-results", help="directory for the JSON results")
    ap.add_argument("--quick", action="store_true", help="each benchmark in its smallest form (seconds, for tests)")
    ap.add_argument("--only", nargs="*", default=None, metavar="PART",
                    help=f"run only these parts ({', '.join(p.name for p in PARTS)}; script names work too)")
    ap.add_argument("--progress-every", type=float, default=30.0, metavar="S",
                    help="seconds between progress lines while a part runs")
    args = ap.parse_args(argv)

    parts = PARTS
    if args.only:
        known = {p.name: p for p in PARTS} | {p.script: p for p in PARTS}
        unknown = [name for name in args.only if name not in known]
        if unknown:
            ap.error(f"unknown part(s) {', '.join(unknown)}; choose from {', '.join(p.name for p in PARTS)}")
        parts = [known[name] for name in args.only]

    mode = "quick" if args.quick else "full"
    record_path = os.path.join(args.out, "run_all.json")
    try:
        with open(record_path) as f:
            last_run = json.load(f).get(mode, {})
    except (OSError, ValueError):
        last_run = {}

    plan = []
    for i, part in enumerate(parts, 1):
        cmd = [sys.executable, os.path.join(HERE, part.script),
               *(part.quick_args if args.quick else part.full_args), "--out", args.out]
        if part.name in last_run:
            expected, source = last_run[part.name], "last run here"
        else:
            expected, source = (part.quick_s if args.quick else part.full_s), "measured on an idle 2-core machine"
        plan.append((f"[{i}/{len(parts)}] {part.name}", part, cmd, expected, source, missing_requirement(part)))

    total = sum(p[3] for p in plan if p[5] is None)
    print(f"benchmarks ({mode}): {len(plan)} part(s), results in {args.out}/, expected ~{duration(total)} in all",
          flush=True)
    for label, part, cmd, expected, source, skip in plan:
        print(f"  {label}: {part.what}", flush=True)
        if skip:
            print(f"      skipped: {skip}", flush=True)
        else:
            shown = " ".join([_short(cmd[0]), _short(cmd[1])] + cmd[2:])
            print(f"      ~{duration(expected)} ({source}): {shown}", flush=True)

    durations, failed, skipped = dict(last_run), [], []
    started = time.time()  # the report names older result files instead of showing them
    for label, part, cmd, expected, _, skip in plan:
        if skip:
            print(f"{label}: skipped: {skip}", flush=True)
            skipped.append(part.name)
            continue
        print(f"{label}: running, expected ~{duration(expected)}", flush=True)
        rc, seconds, tail = run_part(cmd, label, expected, args.progress_every)
        if rc:
            print(f"{label}: FAILED (exit status {rc}) after {duration(seconds)}", flush=True)
            failed.append((part, rc, tail))
        else:
            print(f"{label}: done in {duration(seconds)}", flush=True)
            durations[part.name] = round(seconds, 1)

    os.makedirs(args.out, exist_ok=True)
    try:
        with open(record_path) as f:
            record = json.load(f)
    except (OSError, ValueError):
        record = {}
    record[mode] = durations
    with open(record_path, "w") as f:
        json.dump(record, f, indent=1)

    ran = len(plan) - len(skipped) - len(failed)
    print(f"benchmarks: {ran} done, {len(skipped)} skipped, {len(failed)} failed", flush=True)
    for part, rc, tail in failed:
        print(f"failed: {part.name} ({part.script}, exit status {rc}); the last lines of its output:", flush=True)
        for line in tail:
            print("    " + line, flush=True)
    sys.path.insert(0, HERE)
    import report  # benchmarks/report.py: the machine and every part's ratios in one page

    for path in report.write(args.out, since=started):
        print(f"report: {_short(path)}", flush=True)
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
