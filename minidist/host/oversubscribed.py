"""More ranks on a node than cores: MPI's waits give the core away instead of spinning.

An MPI rank waiting for a message polls in a loop (MPICH and Open MPI alike): the lowest
latency when every rank has a core of its own.  With more ranks than cores (the README's 8
ranks on a 2-core laptop) the spinning ranks take the time slices of the ranks they wait
for.  Both MPIs have a setting that makes the wait loop yield the processor, read from the
environment when MPI is initialised:

* MPICH: ``MPIR_CVAR_ENABLE_HEAVY_YIELD=1`` (``mpivars`` lists it: "use nanosleep to ensure
  other threads have a chance to grab the lock"; the loop yields every
  ``MPIR_CVAR_POLLS_BEFORE_YIELD`` polls, 1000 by default);
* Open MPI: ``OMPI_MCA_mpi_yield_when_idle=1`` (the MCA parameter ``mpi_yield_when_idle``,
  which Open MPI also turns on by itself when it knows the node is oversubscribed).

:func:`prepare` sets both, before MPI starts, when the launcher says this node runs more
ranks than this process may use cores, and never overrides a value the user set (``=0``
keeps the spinning).  The launcher's word is the only one there is before ``MPI_Init``;
after it, the training command counts the ranks that share memory
(``MPI_COMM_TYPE_SHARED``, comm/nodes.py) and says in its start-up line what was set
(:func:`note`).  Measured on 2 cores (docs/perf-notes.md): the yield is worth 5-10% at
8 ranks; the 16x the README's command had lost came from each rank's BLAS starting a
spinning thread per core.

minidist's own threads do not spin: a progress thread (comm/progress.py) sleeps in its
queue's blocking ``get`` (a futex) until work arrives, and the watchdog sleeps between checks.
This module imports nothing heavy (no NumPy, no MPI).
"""

from __future__ import annotations

import os

YIELD = {"MPICH": ("MPIR_CVAR_ENABLE_HEAVY_YIELD", "1"), "Open MPI": ("OMPI_MCA_mpi_yield_when_idle", "1")}


def cores() -> int:
    """The cores this process may run on (its affinity mask, which a launcher or a container
    may narrow: what the ranks of this node share)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def local_ranks(environ=None) -> int | None:
    """Ranks on this node, as the launcher tells them before MPI starts (Hydra:
    ``MPI_LOCALNRANKS``; Open MPI: ``OMPI_COMM_WORLD_LOCAL_SIZE``; MVAPICH, Slurm's srun,
    torchrun-style launchers), or None (no launcher, or one that does not say)."""
    environ = os.environ if environ is None else environ
    for var in ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "MV2_COMM_WORLD_LOCAL_SIZE", "SLURM_NTASKS_PER_NODE",
                "LOCAL_WORLD_SIZE"):
        if environ.get(var, "").isdigit():
            return int(environ[var])
    return None


def prepare(environ=None) -> None:
    """Before MPI is initialised: when the launcher runs more ranks on this node than there
    are cores, let MPI's waits yield (the variables of :data:`YIELD` not already set)."""
    environ = os.environ if environ is None else environ
    n = local_ranks(environ)
    if n is not None and n > cores():
        for var, value in YIELD.values():
            environ.setdefault(var, value)


def note(node_ranks: int, library: str) -> str | None:
    """The start-up line's words when ``node_ranks`` (the ranks sharing this node's memory)
    exceed the cores, for the MPI ``library`` (``MPI.Get_library_version()``); None otherwise."""
    n = cores()
    if node_ranks <= n:
        return None
    var, on = YIELD["Open MPI" if "Open MPI" in library else "MPICH"]
    value = os.environ.get(var)
    if value == on:
        how = f"MPI's waits yield ({var}={value})"
    elif value is None:
        how = f"MPI's waits spin: the launcher did not say the ranks per node before MPI started; set {var}={on}"
    else:
        how = f"MPI's waits spin ({var}={value} was set)"
    return f"oversubscribed: {node_ranks} ranks on this node's {n} cores, {how}"
