"""minidist.layout: the pure arithmetic of the parallel layout (no MPI, no arrays).

What every rank computes the same way without sending a message, written once and shared by
the runtime (comm/, parallel/, the training command) and the planner (plan/):

  model.py  the model (ModelConfig): one description for nn.GPT, the training command, checkpoints,
            export and the planner; the tensors it holds (parameter_shapes)
  settings.py  the mesh's settings (ParallelConfig): one vocabulary for the training command, the
            axes and the planner
  mesh.py   the mesh's axes in one order (dp outermost ... tp innermost) and the rank <->
            coordinate arithmetic of a dp x pp x cp x tp grid (MeshLayout)
  split.py  the one split rule: n rows in np.array_split's pieces (split_bounds, shard_bounds)
  thresholds.py  the collectives' size thresholds (where each changes algorithm)
  grid.py   who holds what on the 4D grid (layers, heads, tokens, batch rows): a table, a picture
  collective_bytes.py  what one collective call sends from one rank, in closed form
  rank_params.py  what a rank holds of the parameters (tensor-parallel split, stages, experts)
  traffic.py  the bytes each rank sends per optimizer step on each mesh axis
  expert_traffic.py  the bytes of expert parallelism's dispatch and combine, from the routing
  memory.py  ZeRO's memory table: what each stage partitions of a rank's training state
  schedules.py  pipeline schedules as pure data (naive, GPipe, 1F1B, interleaved, looping),
            which stage holds which layers, and the pipeline flags' checks
  simulate.py  a schedule run on a clock, which checks it, and its chart
            (``python -m minidist.layout.simulate``)

Importing any module here never starts MPI (tests/test_layout_no_mpi.py checks it): they
import nothing from minidist outside this folder.
"""
