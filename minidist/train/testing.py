"""Running code under a real ``mpiexec`` without ever hanging.

Distributed programs fail in two nasty ways: one rank raises while the others wait for it
forever, or every rank waits for a message nobody sends.  This module turns both into fast,
readable failures:

* ``minidist.comm.abort.abort_on_exception`` (which ``comm.world()`` installs) makes an uncaught exception on any rank (main thread or a
  helper thread) print that rank's traceback and abort the whole MPI job.
* :func:`run_mpi` launches ``mpiexec -n N python -m minidist.train.testing TARGET`` with a timeout.
  Every rank arms :mod:`faulthandler` to dump its stack to a per-rank file shortly before the
  timeout, so a hang is reported with where *each* rank was stuck.

``TARGET`` is a script path, or ``path.py::function`` to call one function on every rank
(how the tests run their multi-process bodies).
"""

from __future__ import annotations

import dataclasses
import faulthandler
import os
import shutil
import subprocess
import sys
import tempfile

from minidist.host.blas_env import blas_thread_env, blas_threads
from minidist.host import launcher
from minidist.host.launcher import mpiexec_command

_HANG_DIR = "MINIDIST_HANG_DIR"
_HANG_AFTER = "MINIDIST_HANG_AFTER_S"


class MPIJobFailed(AssertionError):
    """An mpiexec job exited non-zero or timed out; the message holds every rank's output."""


def run_train(nprocs: int | None, args: list, timeout: float = 120, env: dict | None = None):
    """``python -m minidist.train ARGS`` on ``nprocs`` ranks under mpiexec (None: without mpiexec),
    one BLAS thread per rank, with the variables of ``env`` added to this process's environment;
    the CompletedProcess, whatever its exit code (tests check it)."""
    env = {**os.environ, **(env or {}), **blas_threads(1)}
    cmd = (mpiexec_command(nprocs) if nprocs else []) + [sys.executable, "-m", "minidist.train", *args]
    return launcher.run(cmd, timeout, env, tries=launcher.START_TRIES if nprocs else 1)


def train_steps(cfg, steps: int, corpus=None):
    """``steps`` optimizer steps of the resolved run configuration ``cfg`` as ``minidist.train.loop``
    runs them (on every rank of its mesh, or one process), on a fixed random corpus.

    Returns ``(losses, params, sharding)``: the step losses followed by one validation loss,
    ``{name: array}`` of every parameter this rank holds (its tensor-parallel slices of its
    pipeline stage, whole again under ZeRO-3), and ``{name: Shard or None}`` saying which slice.
    """
    run = train_run(cfg, steps, corpus)
    return run.losses, run.params, run.sharding


@dataclasses.dataclass
class TrainRun:
    """What :func:`train_run` saw: besides :func:`train_steps`'s results, the parameters
    before the first step (``initial``), the bytes of parameters, gradients and optimizer
    state this rank held at the last update (``state_bytes``, from the arrays), the bytes it
    sent on each group over the run (``sent``, comm.stats.bytes_by_group), what each update
    did (``updates``: train.update's results, e.g. ``skipped`` and ``loss_scale``) and the strategy."""

    losses: list
    params: dict
    sharding: dict
    initial: dict
    state_bytes: dict
    sent: dict
    updates: list
    strategy: object


def train_run(cfg, steps: int, corpus=None) -> TrainRun:
    """:func:`train_steps` with what a test needs to check that the ranks split the work."""
    from minidist.model.backend import host, to_host
    from minidist.comm.stats import bytes_by_group
    from minidist.state.data import Sampler
    from minidist.model.optim import lr_at
    from minidist.parallel.compose import build, build_mesh
    from minidist.train.loop import precision, update

    if corpus is None:
        corpus = host.random.default_rng(1).integers(0, 256, 4000).astype(host.uint8)
    model, strategy = build(cfg, build_mesh(cfg.parallel))
    sent0 = bytes_by_group()
    initial = {k: host.array(to_host(v)) for k, v in strategy.parameters().items()}
    sampler = Sampler(corpus, cfg.data.seq_len, cfg.data.batch_size, cfg.model.seed)
    low, scaler = precision(cfg.device.mixed_precision)
    o, losses, updates = cfg.optim, [], [{}]
    for step in range(steps):
        strategy.optimizer.lr = lr_at(step, o.lr, o.warmup, o.steps, o.min_lr)
        x, y = sampler.batch(step)
        losses.append(strategy.forward_backward(x, y, cfg.device.grad_accum, low, scaler.scale if scaler else 1.0))
        updates.append(update(strategy, scaler, o.clip_grad))
        strategy.metrics()
    losses.append(strategy.evaluate([sampler.batch(steps)], low))
    sent = {g: n - sent0.get(g, 0) for g, n in bytes_by_group().items() if n != sent0.get(g, 0)}
    return TrainRun(losses=losses, params={k: host.array(to_host(v)) for k, v in strategy.parameters().items()},
                    sharding={p.name: p.sharding for p in model.parameters()}, initial=initial,
                    state_bytes={k: round(v * 2**20) for k, v in updates[-1].get("state_mb", {}).items()},
                    sent=sent, updates=updates[1:], strategy=strategy)


def traced_peak_bytes(fn) -> int:
    """Peak bytes allocated while ``fn()`` ran, above what was live before: Python's
    allocator as tracemalloc sees it on NumPy, CuPy's memory pool on a GPU (profile.PeakMemory)."""
    from minidist.observe.profile import PeakMemory

    memory = PeakMemory()
    with memory.measure():
        fn()
    return memory.last_bytes


def run_mpi(nprocs: int, target: str, *args: str, timeout: float = 120, env: dict | None = None):
    """Run ``target`` on ``nprocs`` ranks; return the CompletedProcess or raise MPIJobFailed."""
    dump_dir = tempfile.mkdtemp(prefix="minidist-hang-")
    full_env = dict(os.environ)
    full_env.update(env or {})
    full_env[_HANG_DIR] = dump_dir
    full_env[_HANG_AFTER] = str(max(1.0, timeout - min(10.0, 0.2 * timeout)))
    full_env.setdefault("PYTHONUNBUFFERED", "1")
    full_env = blas_thread_env(1, full_env)  # ranks oversubscribe the cores already
    cmd = mpiexec_command(nprocs) + [sys.executable, "-m", "minidist.train.testing", target, *args]
    try:
        done = launcher.run(cmd, timeout, full_env, merge=True)
        out, why = done.stdout, None if done.returncode == 0 else f"exited with code {done.returncode}"
    except subprocess.TimeoutExpired as e:
        out, why = e.stdout or "", f"timed out after {timeout:.0f} s"
    dumps = _collect_dumps(dump_dir)
    if why:
        raise MPIJobFailed(f"`{' '.join(cmd[-2 - len(args):])}` on {nprocs} ranks {why}\n"
                           f"----- output -----\n{out}{dumps}")
    return done


def _collect_dumps(dump_dir: str) -> str:
    parts = []
    for name in sorted(os.listdir(dump_dir)):
        with open(os.path.join(dump_dir, name)) as f:
            text = f.read().strip()
        if text:
            parts.append(f"----- {name}: stacks when the hang timer fired -----\n{text}\n")
    shutil.rmtree(dump_dir, ignore_errors=True)
    return "".join(parts)


def _arm_hang_dump():
    from minidist.host import env

    dump_dir, after = env.get(_HANG_DIR), env.get(_HANG_AFTER)
    if not (dump_dir and after):
        return None
    from mpi4py import MPI

    f = open(os.path.join(dump_dir, f"rank{MPI.COMM_WORLD.Get_rank()}"), "w")
    # exit=False: a rank that exited first would make mpiexec kill the others before they dump.
    faulthandler.dump_traceback_later(after, exit=False, file=f)
    return f


def _main(argv):
    if not argv:
        sys.exit("usage: python -m minidist.train.testing SCRIPT.py[::FUNCTION] [ARGS...]")
    from minidist.comm.abort import abort_on_exception  # here: the test runner's own process needs no MPI

    abort_on_exception()
    _keep = _arm_hang_dump()  # noqa: F841  (the file must stay open)
    target, sys.argv = argv[0], argv
    path, _, func = target.partition("::")
    import runpy

    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))  # as `python SCRIPT` does: its siblings import
    if not func:
        runpy.run_path(path, run_name="__main__")
        return
    namespace = runpy.run_path(path, run_name="__mpi_body__")
    if func not in namespace:
        raise SystemExit(f"{path} has no function {func!r}")
    namespace[func](*argv[1:])


if __name__ == "__main__":
    _main(sys.argv[1:])
