"""minidist.train: the training command, ``python -m minidist.train`` (or ``minidist-train``).

  config.py     RunConfig: every setting of a run, typed, built once
  flags.py      the command line and its checks, made on every rank before any message
  loop.py       the run: build the mesh and the model, train, evaluate, save, report
  report.py     the progress lines, the metrics file and the summary table
  interrupt.py  Ctrl-C and SIGTERM: finish the step, save, exit together
  launch.py     ``minidist-launch``: the command under mpiexec, restarted from its latest
                checkpoint when it fails, on fewer ranks when ranks are lost
  __main__.py   ``python -m minidist.train``
  testing.py    the helpers that run minidist under mpiexec for the tests and benchmarks

The top layer: it may import every other package; none imports it.
"""
