"""Pipeline parallelism: the model's blocks cut into stages over the mesh's ``pp`` axis.

Start reading at ``minidist/layout/schedules.py``:

* :mod:`minidist.layout.schedules` - schedules as pure data (naive, GPipe, 1F1B, interleaved,
  looping, zero-bubble zb-h1 / zb-h2 / zbv) and the pipeline flags' checks; no MPI.
* :mod:`minidist.layout.simulate` - a schedule run on a clock, which checks it, and its text /
  matplotlib chart (``python -m minidist.layout.simulate``); no MPI.
* :mod:`.runtime` - one runtime that executes any schedule for this rank's stage(s).

The training loop reaches the runtime through ``parallel/strategy.py`` (one pass of the
schedule per micro-batch, the stage's data-parallel reduction around it).  The checks of the
pipeline's settings are ``layout.schedules.problems`` (pure arithmetic: the planner uses them
too), and :func:`apply` is the composer's step for this axis.  Imports host, layout, model and
comm; nothing above ``parallel``.
"""


def apply(model, cfg, mesh):
    """The pipeline part of a run: with ``--pp`` > 1 the model keeps only this rank's stage(s)
    (``model.keep_stage``) and the runtime that executes the schedule for them, else None."""
    p = cfg.parallel
    if p.pp == 1:
        return None
    from minidist.parallel.pipeline.runtime import PipelineRuntime

    return PipelineRuntime(model, mesh.group("pp"), p.schedule, p.microbatches, p.virtual_stages)
