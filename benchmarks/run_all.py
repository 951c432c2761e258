"""`make bench`: every benchmark, each writing JSON into --out and printing a short table.

Benchmarks report ratios measured in one run (minidist vs MPI's built-ins, vs PyTorch),
never absolute targets: the machines they run on are shared and noisy.
"""

import argparse
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
BENCHMARKS = ["bench_collectives.py", "bench_model.py"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench-results")
    ap.add_argument("--only", nargs="*", default=None, help="run only these scripts")
    args = ap.parse_args()
    failed = []
    for script in args.only or BENCHMARKS:
        print(f"==> {script}", flush=True)
        rc = subprocess.call([sys.executable, os.path.join(HERE, script), "--out", args.out])
        if rc:
            failed.append(script)
    if failed:
        sys.exit(f"failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
