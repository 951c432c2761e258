"""Pipeline parallelism: the model's blocks cut into stages over the mesh's ``pp`` axis.

* :mod:`.schedules` - schedules as pure data (naive, GPipe, 1F1B, interleaved, looping), a
  simulator and a chart; no MPI.
* :mod:`.runtime` - one runtime that executes any schedule for this rank's stage(s).
"""
