"""Pipeline parallelism: the model's blocks cut into stages over the mesh's ``pp`` axis.

Start reading at ``schedules.py``:

* :mod:`.schedules` - schedules as pure data (naive, GPipe, 1F1B, interleaved, looping), a
  simulator that checks them and a text / matplotlib chart; no MPI.
* :mod:`.runtime` - one runtime that executes any schedule for this rank's stage(s).
* :mod:`.strategy` - the training loop's calls, with the stage's data parallelism inside.
* :mod:`.cli` - the training CLI's flags and their checks.
"""
