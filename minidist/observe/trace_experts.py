"""Expert parallelism's dispatch and combine as spans of their own (``--trace``).

GShard's two all-to-alls (Lepikhin et al. 2020) are the exchanges an expert-parallel step
waits on; each mixture's forward shows them on the rank's compute track as ``dispatch``
(the row counts, then the rows, to the ranks holding their experts) and ``combine`` (the
outputs back), nested in the block's span, with the collectives they run on the comm track
below.  They are timed at the dispatcher's seams (``ExpertParallelDispatch.send`` and
``send_back``, parallel/expert/), as :meth:`Tracer.wrap` times the other seams; the
backward's exchanges run inside the micro-batch's backward span (as ``all_to_all_v`` on the
ep group's comm track).
"""

from __future__ import annotations


def wrap_dispatch(tracer, model) -> int:
    """Time every expert-parallel mixture's dispatch and combine of ``model`` with ``tracer``;
    returns how many mixtures it wrapped (0 without expert parallelism)."""
    wrapped = 0
    for i, block in enumerate(model.h):
        d = getattr(getattr(block, "mlp", None), "dispatch", None)
        if not (hasattr(d, "send") and hasattr(d, "send_back")):
            continue  # a dense block, or every expert local (no exchange)
        d.send = tracer._timed(d.send, lambda xs, counts, b=i, g=d.group: (
            "dispatch", "compute", {"op": "dispatch", "block": b, "ep_group": g.name, "rows": int(xs.shape[0])}))
        d.send_back = tracer._timed(d.send_back, lambda back, got, b=i, g=d.group: (
            "combine", "compute", {"op": "combine", "block": b, "ep_group": g.name, "rows": int(back.shape[0])}))
        wrapped += 1
    return wrapped
