"""minidist.observe: the instruments, beside the textbook and never inside it.

  profile.py    FLOPs, MFU and the memory a step holds
  trace.py      per-rank timelines (Chrome trace JSON), entering at the strategy's seams
  breakdown.py  a step's time and memory by part
  plot.py       pictures of timelines and meshes (``python -m minidist.observe.plot``)
  router.py     what the mixture-of-experts routers did each step, over the global batch
  expert_load.py  the expert load over a run's steps, drawn from its metrics file
  trace_experts.py  expert parallelism's dispatch and combine as trace spans

Imports the layers below it; the training command (``minidist.train``) switches them on.
"""
