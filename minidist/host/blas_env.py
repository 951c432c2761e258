"""How many threads each rank's BLAS may start: the one place that sets it.

NumPy's BLAS (OpenBLAS, MKL) reads its thread count from the environment when NumPy is first
imported, and by default starts one thread per core.  N ranks on one machine would then run
N times as many BLAS threads as there are cores, spin-waiting for each other (steps 10-50x
slower on 2 cores).  So every entry point that starts ranks -- the training command, the
examples, the benchmarks, the test runner -- calls :func:`pin_blas_threads` (or passes
:func:`blas_thread_env` to the processes it starts) before NumPy is imported.  A value the
user set is kept.  This module imports nothing heavy (no NumPy, no MPI).
"""

from __future__ import annotations

import os

BLAS_THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def blas_threads(threads: int) -> dict:
    """``{variable: str(threads)}`` for every BLAS thread variable: ``dict(os.environ,
    **blas_threads(1))`` is an environment whose BLAS uses one thread whatever the user set
    (a benchmark's fixed setting)."""
    return {var: str(threads) for var in BLAS_THREAD_VARS}


def blas_thread_env(threads: int, env: dict | None = None) -> dict:
    """A copy of ``env`` (default: this process's environment) where each BLAS may start
    ``threads`` threads (values already set in ``env`` are kept)."""
    out = dict(os.environ if env is None else env)
    for var in BLAS_THREAD_VARS:
        out.setdefault(var, str(threads))
    return out


def pin_blas_threads(threads: int | None = None) -> None:
    """Let this process's BLAS start ``threads`` threads (default: its share of the cores among
    the ranks of this machine under mpiexec, else leave it alone), unless the user set it."""
    if threads is None:
        from minidist.host.oversubscribed import local_ranks

        local = local_ranks()
        if local is None and not any(v in os.environ for v in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE")):
            return  # one process: its BLAS may use every core
        ranks = local or int(os.environ.get("PMI_SIZE") or os.environ.get("OMPI_COMM_WORLD_SIZE") or 1)
        threads = max(1, (os.cpu_count() or 1) // ranks)
    for var in BLAS_THREAD_VARS:
        os.environ.setdefault(var, str(threads))
