"""Pipeline parallelism: the model's blocks cut into stages over the mesh's ``pp`` axis.

Start reading at ``minidist/layout/schedules.py``:

* :mod:`minidist.layout.schedules` - schedules as pure data (naive, GPipe, 1F1B, interleaved,
  looping) and the pipeline flags' checks; no MPI.
* :mod:`minidist.layout.simulate` - a schedule run on a clock, which checks it, and its text /
  matplotlib chart (``python -m minidist.layout.simulate``); no MPI.
* :mod:`.runtime` - one runtime that executes any schedule for this rank's stage(s).

The training loop reaches the runtime through ``parallel/strategy.py`` (one pass of the
schedule per micro-batch, the stage's data-parallel reduction around it).
"""
