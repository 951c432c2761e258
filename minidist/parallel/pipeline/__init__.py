"""Pipeline parallelism: the model's blocks cut into stages over the mesh's ``pp`` axis.

Start reading at ``schedules.py``:

* :mod:`.schedules` - schedules as pure data (naive, GPipe, 1F1B, interleaved, looping), a
  simulator that checks them and a text / matplotlib chart, the pipeline flags' checks; no MPI.
* :mod:`.runtime` - one runtime that executes any schedule for this rank's stage(s).

The training loop reaches the runtime through ``parallel/strategy.py`` (one pass of the
schedule per micro-batch, the stage's data-parallel reduction around it).
"""
