"""``python -m minidist.train.launch`` (or ``minidist-launch``): the training command under
mpiexec, started again from its latest checkpoint when the job fails.

    minidist-launch -n 4 --max-restarts 3 --min-ranks 2 -- --dp 2 --tp 2 --save ckpt/ --steps 1000

What torchrun's elastic agent does for PyTorch (``--max-restarts``): when a rank dies, MPI ends
the whole job (a rank's sentinel names it: comm/sentinel.py); the launcher starts it again
with ``--resume`` on the ``--save`` directory, so at most ``--save-every`` steps are lost.

**Fewer ranks.**  When ranks are reported lost, the job restarts on the ranks left, which
checkpoints allow because they reshard onto any mesh.  The mesh is chosen so that the run
goes on as if nothing happened: the model axes (``--pp``, ``--tp``, ``--cp``) are kept, since
they decide how each rank's memory is cut, and data parallelism shrinks to the largest divisor
of ``--dp`` that fits, with ``--grad-accum`` raised by the same factor.  Each rank's
micro-batch keeps its size (and so its memory), the global batch is unchanged, and the loss
curve is the one of the uninterrupted run (float64: to round-off; the invariant of
docs/testing.md).  Under one mpiexec the launcher cannot see a lost node by itself; the
``MINIDIST_TEST_LOST_RANKS`` hook pretends one (a cluster's scheduler would tell it).

**When not to restart.**  Exit code 2 (bad input, or a damaged checkpoint: restarting cannot
help), 130 (Ctrl-C) and 143 (SIGTERM: a preemption, where every rank saved already) end the
launcher with the job's code.  SIGINT and SIGTERM sent to the launcher go to mpiexec, which
forwards them to the ranks (minidist/train/interrupt.py); the launcher then ends with 130 or
143 whatever the job's code (Open MPI's mpirun exits 1 after the ranks' MPI_Abort).

Each restart is one line on stderr: what failed, the step it resumes from, the mesh.  Exit
code: 0 when the training finished, else the last attempt's.  The job sees
``MINIDIST_RESTART`` (0 for the first attempt, then 1, 2, ...), as torchrun's
``TORCHELASTIC_RESTART_COUNT``.  The ``--metrics-jsonl`` file holds every step once: a
restarted job rewrites it, so the launcher puts back the records of the steps before the
checkpoint it resumed from.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys

from minidist.host.cli_checks import OneLineParser, int_in
from minidist.host.launcher import mpiexec_command

PROG = "minidist-launch"
NO_RESTART = {0: "finished", 2: "bad input", 130: "interrupted (Ctrl-C)", 143: "stopped by SIGTERM"}


def build_parser():
    p = OneLineParser(prog=PROG, description="Run minidist-train under mpiexec, restarting it from its "
                      "latest checkpoint when it fails (on fewer ranks when ranks are lost).",
                      epilog="Everything after -- is passed to minidist-train; it must include --save DIR.")
    p.add_argument("-n", "--nprocs", type=int_in(lo=1), required=True, metavar="N", help="ranks to start")
    p.add_argument("--max-restarts", type=int_in(lo=0), default=3, metavar="K",
                   help="restarts allowed after a failure (default 3)")
    p.add_argument("--min-ranks", type=int_in(lo=1), default=None, metavar="M",
                   help="the fewest ranks to go on with when ranks are lost (default: N, never shrink)")
    p.add_argument("train", nargs=argparse.REMAINDER, metavar="-- TRAINING FLAGS")
    return p


def shrink(mesh: dict, grad_accum: int, ranks: int):
    """The mesh and gradient accumulation for ``ranks`` ranks: dp shrunk to its largest divisor
    that fits (the model axes kept), accumulation raised by the same factor; None if even
    dp = 1 does not fit."""
    model_ranks = mesh["pp"] * mesh["tp"] * mesh["cp"]
    for dp in range(mesh["dp"], 0, -1):
        if mesh["dp"] % dp == 0 and dp * model_ranks <= ranks:
            return {**mesh, "dp": dp}, grad_accum * (mesh["dp"] // dp)
    return None


def latest_step(save: str) -> int | None:
    """The step of ``save``'s latest checkpoint, or None before the first one."""
    from minidist.state import checkpoint_meta

    try:
        return int(os.path.basename(checkpoint_meta.latest(save)).rsplit("-", 1)[-1])
    except (OSError, ValueError, checkpoint_meta.CheckpointError):
        return None


def _records(path: str | None) -> list[dict]:
    if not path or not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _mesh_text(mesh: dict, accum: int, ranks: int) -> str:
    axes = " x ".join(f"{a}{n}" for a, n in mesh.items() if n > 1) or "one rank"
    return f"{axes} (--grad-accum {accum}), {ranks} rank{'s' * (ranks > 1)}"


def _run(nprocs: int, argv: list[str], attempt: int) -> tuple[int, int | None]:
    """One attempt under mpiexec: (its exit code, the signal the launcher forwarded or None).
    SIGINT and SIGTERM to the launcher go to mpiexec."""
    env = {**os.environ, "MINIDIST_RESTART": str(attempt)}
    proc = subprocess.Popen(mpiexec_command(nprocs) + [sys.executable, "-m", "minidist.train", *argv], env=env)
    got = []

    def forward(signum, frame):
        got.append(signum)
        proc.send_signal(signum)

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return proc.wait(), (got[0] if got else None)
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


def main(argv=None) -> int:
    from minidist.host import env
    from minidist.train.flags import build_parser as train_parser

    parser = build_parser()
    args = parser.parse_args(argv)
    flags = args.train[1:] if args.train[:1] == ["--"] else args.train
    tp = train_parser()
    tp.prog = f"{PROG} -- (training flags)"
    given = tp.parse_args(flags)
    if not given.save:
        parser.error("the training flags need --save DIR: a restart resumes from its latest checkpoint")
    if args.min_ranks is not None and args.min_ranks > args.nprocs:
        parser.error(f"--min-ranks {args.min_ranks} is above -n {args.nprocs}")
    mesh = {"dp": given.dp or args.nprocs // (given.pp * given.tp * given.cp),
            "pp": given.pp, "tp": given.tp, "cp": given.cp}
    if shrink(mesh, given.grad_accum, args.nprocs) is None or mesh["dp"] * given.pp * given.tp * given.cp != args.nprocs:
        parser.error(f"-n {args.nprocs} does not fit the training flags' mesh "
                     f"(--dp x --pp x --tp x --cp = {mesh['dp'] * given.pp * given.tp * given.cp})")
    ranks, accum, lost = args.nprocs, given.grad_accum, env.get("MINIDIST_TEST_LOST_RANKS")
    attempt, kept, resumed = 0, [], None
    while True:
        extra = ["--dp", str(mesh["dp"]), "--grad-accum", str(accum)]
        code, stopped = _run(ranks, flags + extra + (["--resume", given.save] if resumed is not None else []),
                             attempt)
        if kept:  # the restarted job rewrote the metrics file from the step it resumed
            records = _records(given.metrics_jsonl)
            with open(given.metrics_jsonl, "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in kept + records)
        if stopped is not None:  # the launcher was told to stop (Open MPI's mpirun then exits 1, not 130/143)
            return 128 + stopped
        if code in NO_RESTART:
            return code
        if attempt >= args.max_restarts:
            print(f"{PROG}: the job failed (exit code {code}) and no restart is left (--max-restarts "
                  f"{args.max_restarts})", file=sys.stderr, flush=True)
            return code
        if lost:  # the test hook: this many ranks are gone after the first failure
            ranks, lost = ranks - lost, None
            fit = shrink(mesh, accum, ranks) if ranks >= (args.min_ranks or args.nprocs) else None
            if fit is None:
                print(f"{PROG}: the job failed (exit code {code}) and the {ranks} rank(s) left cannot go on "
                      f"(--min-ranks {args.min_ranks or args.nprocs}; the model axes need "
                      f"{given.pp * given.tp * given.cp})", file=sys.stderr, flush=True)
                return code
            mesh, accum = fit
            ranks = mesh["dp"] * given.pp * given.tp * given.cp
        attempt += 1
        resumed = latest_step(given.save)
        kept = [r for r in _records(given.metrics_jsonl) if resumed is not None and r.get("step", 0) <= resumed]
        where = f"from step {resumed}" if resumed is not None else "from the start (no checkpoint yet)"
        print(f"{PROG}: the job failed (exit code {code}); restart {attempt}/{args.max_restarts} {where} on "
              f"{_mesh_text(mesh, accum, ranks)}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
