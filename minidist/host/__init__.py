"""minidist.host: what a process reads from its machine and command line before anything heavy loads.

  env.py             every ``MINIDIST_*`` environment variable: read, checked and listed here
  blas_env.py        how many threads each rank's BLAS may start (set before NumPy is imported)
  oversubscribed.py  more ranks than cores: MPI's waits yield the core instead of spinning
  launcher.py        the ``mpiexec`` command line for this Python's MPI
  cli_checks.py      checks of command-line input (numbers, files, memory), made on every
                     rank before any message is exchanged
  files.py           files written whole or not at all: fsync, and a temporary file renamed
                     over the target

The bottom layer: these modules import no other part of minidist, no NumPy and no MPI, so
every entry point can read them first.
"""
