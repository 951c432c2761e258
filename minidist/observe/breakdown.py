"""The time of a training step by part, read from the main thread's spans (minidist/observe/trace.py).

The parts sum to the step's wall time: ``compute`` (forward, backward, pipeline actions),
``comm`` (the main thread waiting in communication, per group: the communication the step is
*exposed* to, not what overlapped with compute on a progress thread), ``bubble`` (a pipeline
stage waiting for its input), ``optimizer`` and ``other``.  Spans of one thread nest, so each
instant counts for the innermost span that covers it.
"""

from __future__ import annotations

from minidist.observe.trace import COMM_CATS, MAIN_TRACKS

# A host read ("sync") waits for the device's queued work: compute the host had run ahead of.
_CLASS = {"compute": "compute", "optimizer": "optimizer", "bubble": "bubble", "staging": "comm", "sync": "compute"}


def breakdown(events, t0: float, t1: float, first: int = 0) -> dict:
    """Split the main thread's time between ``t0`` and ``t1`` (a step) into parts that sum
    to ``t1 - t0``: ``compute`` (forward, backward, pipeline actions), ``comm`` (a dict:
    the main thread waiting in communication, per group, e.g. {"dp": s, "tp": s}),
    ``bubble`` (a pipeline stage waiting for its input, messages inside included),
    ``optimizer`` and ``other`` (everything else: batch sampling, loss reduction, Python).

    Each instant counts for the innermost span covering it (the spans of one thread nest):
    the exclusive time of each span, from ``events[first:]``."""
    spans = sorted(((s, e, name, cat, a) for tr, name, cat, s, e, a in events[first:]
                    if tr in MAIN_TRACKS and s >= t0 and e <= t1 and cat != "step"),
                   key=lambda v: (v[0], -v[1]))
    parts = {"compute": 0.0, "comm": {}, "bubble": 0.0, "optimizer": 0.0, "other": 0.0}
    stack = []  # [end, class, group, children's time]

    def close(item):
        end, cls, group, start, child = item
        own = (end - start) - child
        if cls == "comm":
            parts["comm"][group] = parts["comm"].get(group, 0.0) + own
        else:
            parts[cls] += own
        if stack:
            stack[-1][4] += end - start

    covered = 0.0
    for s, e, name, cat, a in spans:
        while stack and stack[-1][0] <= s:
            close(stack.pop())
        if stack and e > stack[-1][0]:
            e = stack[-1][0]  # clipped into its parent (clock rounding)
        inside_bubble = any(item[1] == "bubble" for item in stack)
        group = _group_of(a)
        if cat in ("staging", "sync") and stack:
            # A copy between host and device belongs to what it serves: a collective's staging
            # is that collective's group, a batch's move inside a forward is compute.
            cls, group = stack[-1][1], stack[-1][2]
        elif cat in COMM_CATS:
            cls = "bubble" if inside_bubble else "comm"
        else:
            cls = "bubble" if inside_bubble else _CLASS.get(cat, "other")
        if not stack:
            covered += e - s
        stack.append([e, cls, group, s, 0.0])
    while stack:
        close(stack.pop())
    parts["other"] += (t1 - t0) - covered
    return parts


def _group_of(a) -> str:
    if isinstance(a, tuple):
        if a[0] == "msg":
            st, grec = a[2], a[3]
            return next((g for g, rec in st.groups.copy().items() if rec is grec), "p2p")
        if a[0] in ("call", "wait"):
            return a[1] or "?"
    if isinstance(a, dict) and "group" in a:
        return a["group"]
    if isinstance(a, dict) and "bytes" in a:  # a top-level staging copy: no collective around it
        return "host<->device"
    return "?"
