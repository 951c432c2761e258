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
from minidist.host import launcher
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


def latest_step(save: str):
    """The step of ``save``'s latest checkpoint; None before the first one; "?" when ``latest``
    is there but unreadable (the job's own checks then name the damage and exit 2, rather than
    a restart from scratch overwriting the checkpoints)."""
    from minidist.state import checkpoint_meta

    if not os.path.lexists(os.path.join(save, "latest")):
        return None
    try:
        return int(os.path.basename(checkpoint_meta.latest(save)).rsplit("-", 1)[-1])
    except (OSError, ValueError, checkpoint_meta.CheckpointError):
        return "?"


def _records(path: str | None) -> list[dict]:
    """The metrics file's records (a line torn by the failure is dropped)."""
    if not path or not os.path.exists(path):
        return []
    out = []
    with open(path) as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out


def _mesh_text(mesh: dict, accum: int, ranks: int) -> str:
    axes = " x ".join(f"{a}{n}" for a, n in mesh.items() if n > 1) or "one rank"
    return f"{axes} (--grad-accum {accum}), {ranks} rank{'s' * (ranks > 1)}"


def _run(nprocs: int, argv: list[str], attempt: int) -> tuple[int, int | None]:
    """One attempt under mpiexec: (its exit code, as a shell gives it, and the signal the
    launcher forwarded or None).  mpiexec runs in a session of its own, so that a terminal's
    Ctrl-C reaches the launcher only, which passes SIGINT or SIGTERM on exactly once (a second
    signal would stop the ranks at once, without their final checkpoint)."""
    env = {**os.environ, "MINIDIST_RESTART": str(attempt)}
    got, proc = [], None

    def forward(signum, frame):
        got.append(signum)
        if proc is not None:
            proc.send_signal(signum)

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        proc = subprocess.Popen(mpiexec_command(nprocs) + [sys.executable, "-m", "minidist.train", *argv], env=env,
                                start_new_session=True)
        if got:  # a signal came while mpiexec was starting
            proc.send_signal(got[0])
        try:
            code = launcher.wait(proc)
        except launcher.LauncherStuck as stuck:
            print(f"{PROG}: {stuck}", file=sys.stderr, flush=True)
            code = 1  # mpirun's code after an abort, which is what leaves it stuck
        return (code if code >= 0 else 128 - code), (got[0] if got else None)
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
    tp.prog, tp.speaks = f"{PROG} -- (training flags)", True
    given = tp.parse_args(flags)
    if not given.save:
        parser.error("the training flags need --save DIR: a restart resumes from its latest checkpoint")
    if args.min_ranks is not None and args.min_ranks > args.nprocs:
        parser.error(f"--min-ranks {args.min_ranks} is above -n {args.nprocs}")
    model_ranks = given.pp * given.tp * given.cp
    mesh = {"dp": given.dp or args.nprocs // model_ranks, "pp": given.pp, "tp": given.tp, "cp": given.cp}
    if mesh["dp"] * model_ranks != args.nprocs:
        parser.error(f"-n {args.nprocs} does not fit the training flags' mesh "
                     f"(--dp x --pp x --tp x --cp = {mesh['dp'] * model_ranks})")
    try:
        lost = env.get("MINIDIST_TEST_LOST_RANKS")
    except env.EnvError as exc:
        parser.error(str(exc))
    if given.save_every is None:
        print(f"{PROG}: warning: without --save-every the only checkpoint is the last step's, so a restart "
              "starts from the beginning", file=sys.stderr, flush=True)
    least = args.min_ranks or args.nprocs
    ranks, accum, attempt, kept, resumed = args.nprocs, given.grad_accum, 0, [], None
    while True:
        extra = ["--dp", str(mesh["dp"]), "--grad-accum", str(accum)]
        code, stopped = _run(ranks, flags + extra + (["--resume", given.save] if resumed is not None else []),
                             attempt)
        if kept:  # the restarted job rewrote the metrics file from the step it resumed
            new = [r for r in _records(given.metrics_jsonl) if r.get("step", 0) > kept[-1].get("step", 0)]
            with open(given.metrics_jsonl, "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in kept + new)
        if code == 0 or code in NO_RESTART and stopped is None:
            if code == 2 and attempt:
                print(f"{PROG}: the restarted job refused its input (exit code 2) on "
                      f"{_mesh_text(mesh, accum, ranks)}", file=sys.stderr, flush=True)
            return code
        if stopped is not None:  # the launcher was told to stop (Open MPI's mpirun then exits 1, not 130/143)
            return 128 + stopped
        if attempt >= args.max_restarts:
            print(f"{PROG}: the job failed (exit code {code}) and no restart is left (--max-restarts "
                  f"{args.max_restarts})", file=sys.stderr, flush=True)
            return code
        if lost:  # the test hook: this many ranks are gone after the first failure
            left, lost = ranks - lost, None
            fit = shrink(mesh, accum, left)
            if fit is None or fit[0]["dp"] * model_ranks < least:
                print(f"{PROG}: the job failed (exit code {code}) and the {left} rank(s) left cannot go on "
                      f"(--min-ranks {least}; the model axes need {model_ranks} and dp must divide --dp "
                      f"{mesh['dp']})", file=sys.stderr, flush=True)
                return code
            mesh, accum = fit
            ranks = mesh["dp"] * model_ranks
        attempt += 1
        resumed = latest_step(given.save)
        step = resumed if isinstance(resumed, int) else 0
        kept = [r for r in _records(given.metrics_jsonl) if r.get("step", 0) <= step]
        where = {None: "from the start (no checkpoint yet)", "?": f"from {given.save}'s latest checkpoint"}.get(
            resumed, f"from step {resumed}")
        print(f"{PROG}: the job failed (exit code {code}); restart {attempt}/{args.max_restarts} {where} on "
              f"{_mesh_text(mesh, accum, ranks)}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
