"""minidist.layout: the pure arithmetic of the parallel layout (no MPI, no arrays).

What every rank computes the same way without sending a message, written once and shared by
the runtime (comm/, parallel/, the training command) and the planner (plan/):

  mesh.py   the mesh's axes in one order (dp outermost ... tp innermost) and the rank <->
            coordinate arithmetic of a dp x pp x cp x tp grid (MeshLayout)
  split.py  the one split rule: n rows in np.array_split's pieces (split_bounds, shard_bounds)
  thresholds.py  the collectives' size thresholds (where each changes algorithm)

Importing any module here never starts MPI (tests/test_layout_no_mpi.py checks it): they
import nothing from minidist outside this folder, except minidist.config where a module
needs the run's settings.
"""
