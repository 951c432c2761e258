"""Per-rank timelines: spans on thread tracks, clocks aligned with rank 0, one merged trace.

``--trace FILE`` records what every rank does during the training steps and writes ONE
Chrome-trace / Perfetto JSON (open it at https://ui.perfetto.dev or chrome://tracing, or
draw it with ``python -m minidist.observe.plot FILE``):

* one *process* track per rank, named by its mesh coordinates, e.g. ``rank 5 (dp1 pp0 tp1)``;
* *thread* tracks inside it: ``compute`` (the main thread: the step, forward and backward of
  each microbatch and block, pipeline actions, the optimizer, idle time waiting for a
  pipeline input), ``comm`` (the main thread's collectives, point-to-point messages and
  waits on asynchronous collectives: the communication it is exposed to) and one track per
  progress thread (the asynchronous collectives' messages, overlapping the compute track);
* complete events (``"ph": "X"``), so every span is closed by construction; spans of one
  track are either disjoint or nested (each track is one thread's call stack).

Recording costs one tuple appended to a list per span: the dicts of the JSON are built only
when the trace is saved.  With tracing off nothing is installed: the communication layer's
hooks are module-level ``None`` checks (``comm.p2p.trace``) or not there at all (the public
collectives are swapped for traced wrappers only while a tracer runs:
``comm.collectives.trace_calls``).

Clocks.  Each rank reads its own ``time.perf_counter``; at start-up every rank measures the
offset of its clock from rank 0's with Cristian's algorithm (Cristian 1989, "Probabilistic
clock synchronization"): it sends a request, rank 0 answers with its clock reading T, and
the rank estimates rank 0's clock as T + RTT/2 at the answer's arrival.  Of several round
trips it keeps the one with the smallest RTT, whose error is at most RTT/2.  Rank 0 merges:
every rank sends its events, already on rank 0's clock, as JSON bytes in two point-to-point
messages (a length, then the bytes): no MPI collective, no pickle.

The step breakdown (minidist/observe/breakdown.py) reads the main thread's spans of a step and
splits its wall time into compute, exposed communication per mesh axis, pipeline bubble,
optimizer and other, which sum to the step time.
"""

from __future__ import annotations

import contextlib
import json
import sys
import threading
import time

from minidist.host.files import replace_atomically
from minidist.model import backend

active = None
"""The running :class:`Tracer` (None: tracing off).  The spans of the step, the pipeline and
the blocks come from wrappers :meth:`Tracer.wrap` puts on the seams of the model and the
strategy, which check it; the loop itself holds no tracing."""

CLOCK_TAG, LENGTH_TAG, EVENTS_TAG = 29990, 29991, 29992  # below comm's reserved tags and the pipeline's
MAIN_TRACKS = ("compute", "comm")
MAX_EVENTS = 400_000
"""Spans one rank keeps (about 60 MB of tuples; a merged file Perfetto still opens): past
it, whole steps after the first are dropped, oldest first (:meth:`Tracer.step_done`)."""
COMM_CATS = ("collective", "p2p", "wait", "message")


class Tracer:
    """Spans of this rank: ``events`` holds ``(track, name, cat, t0, t1, args)`` tuples,
    times in seconds of ``clock`` (this rank's), ``offset`` added to reach rank 0's clock.

    ``label``: the process track's name (``rank 5 (dp1 pp0 tp1)``).  ``clock`` may be given
    (the tests skew it per rank to check the alignment)."""

    def __init__(self, rank: int = 0, label: str | None = None, clock=time.perf_counter,
                 max_events: int = MAX_EVENTS):
        self.rank, self.label, self.clock = rank, label or f"rank {rank}", clock
        self.events: list = []
        self.max_events, self.step_starts, self.dropped_steps = max_events, [], 0
        self.offset = 0.0
        self.origin = clock()
        self.main = threading.get_ident()
        self.in_call = False  # the main thread runs a traced collective: its messages are details
        self.counted = None  # comm.stats' bytes (sent, received) between start() and stop(), to check the spans
        self.meta: dict = {}  # about the run (mesh, schedule): rank 0's goes into the file's otherData
        self.tls = None  # comm.stats' thread-local state, set when the comm hooks are installed

    # ------------------------------------------------------------------- recording
    def add(self, track: str, name: str, cat: str, t0: float, t1: float, args=None) -> None:
        """One span; ``args`` a dict (or, from the hot hooks, a tuple decoded at save time)."""
        self.events.append((track, name, cat, t0, t1, args))

    @contextlib.contextmanager
    def span(self, name: str, cat: str = "compute", track: str = "compute", **args):
        t0 = self.clock()
        try:
            yield
        finally:
            self.events.append((track, name, cat, t0, self.clock(), args or None))

    def message(self, kind: str, peer, sent: int, received: int, t0: float) -> None:
        """A point-to-point message (or a wait for one) that ended now; called by comm.p2p."""
        t1 = self.clock()
        st = self.tls.state  # this thread's comm.stats state: the running collective, its group
        if threading.get_ident() == self.main:
            track, cat = "comm", "message" if self.in_call else "p2p"
        else:
            track, cat = st.thread, "p2p"
        self.events.append((track, kind, cat, t0, t1, ("msg", st.label, st, st.grec, peer, sent, received)))

    def staging(self, kind: str, nbytes: int, t0: float) -> None:
        """A copy between host and device (``backend.to_host``/``from_host``, CuPy only): a
        message's array staged through host memory, or a value the step reads (``host read``)."""
        track = "comm" if threading.get_ident() == self.main else threading.current_thread().name
        cat = "sync" if kind == "host read" else "staging"  # a read waits for the device's queue
        self.events.append((track, kind, cat, t0, self.clock(), {"bytes": int(nbytes)}))

    def wrap(self, strategy) -> None:
        """Time what a training step runs, at the seams the model and the strategy name:
        each micro-batch's forward and backward (``Strategy.micro_forward`` / ``micro_backward``)
        or, with a pipeline, each F, B and W (zero-bubble schedules' weight gradients) of the
        schedule and each wait for a stage's input (the bubble), each block's forward (``model.block_runner``; backward
        runs inside the micro-batch's backward span) and expert parallelism's dispatch and combine
        (observe/trace_experts.py).  The code timed holds no tracing of its own: these wrappers are the instrument."""
        from minidist.layout.schedules import RECV_ACT
        from minidist.observe.trace_experts import wrap_dispatch

        model, pipe = strategy.model, strategy.pipeline
        index = {id(b): i for i, b in enumerate(model.h) if b is not None}
        model.use_block_runner(lambda runner: self._timed(runner, lambda block, x: (
            f"block {index.get(id(block), '?')}", "compute", None)))
        chunk = (lambda c: f" chunk {c}") if pipe is not None and pipe.V > 1 else (lambda c: "")
        seams = [(strategy, "micro_forward", lambda m, *_: (f"F{m}", "compute", {"op": "forward", "microbatch": m})),
                 (strategy, "micro_backward", lambda m, *_: (f"B{m}", "compute", {"op": "backward", "microbatch": m}))
                 ] if pipe is None else [
            (pipe, method, lambda m, c, op=op: (f"{op[0].upper()}{m}{chunk(c)}", "compute",
                                                {"op": op, "microbatch": m, "chunk": c, "stage": pipe.stages[c]}))
            for method, op in (("_forward", "forward"), ("_backward", "backward"), ("_weights", "weight"))] + [
            (pipe, "_receive", lambda a: ("idle", "bubble", {"waits_for": "activation" if a.op == RECV_ACT else "gradient",
                                                             "microbatch": a.microbatch, "peer": a.peer}))]
        for owner, method, describe in seams:  # the strategy's or the pipeline's seam, timed
            setattr(owner, method, self._timed(getattr(owner, method), describe))
        wrap_dispatch(self, model)

    def _timed(self, inner, describe):
        """``inner`` timed: a span ``describe(*args)`` = (name, cat, args) on the compute track,
        while this tracer is the active one."""
        clock, events, tracer = self.clock, self.events, self

        def timed(*args):
            if active is not tracer:  # tracing stopped (or toggled off between steps, as the benchmark does)
                return inner(*args)
            t0 = clock()
            out = inner(*args)
            name, cat, info = describe(*args)
            events.append(("compute", name, cat, t0, clock(), info))
            return out

        return timed

    def step_done(self, first: int) -> None:
        """A training step's spans began at ``events[first]`` and have ended.  Past
        ``max_events``, the steps after the first are dropped, oldest first, down to half the
        limit: a long run keeps its first step (start-up effects) and its latest ones in
        bounded memory, and the file says how many steps it left out."""
        starts = self.step_starts
        starts.append(first)
        if len(self.events) <= self.max_events or len(starts) < 3:
            return
        k = 2  # drop events[starts[1]:starts[k]]: the steps 2..k, with what ran between them
        while k < len(starts) - 1 and len(self.events) - (starts[k] - starts[1]) > self.max_events // 2:
            k += 1
        removed = starts[k] - starts[1]
        del self.events[starts[1]:starts[k]]  # one list operation: progress threads' appends are safe
        self.dropped_steps += k - 1
        starts[1:] = [s - removed for s in starts[k:]]

    # ------------------------------------------------------------- saving, merging
    def payload(self) -> dict:
        """This rank's events as JSON-ready lists ``[track, name, cat, t0, t1, args]`` on
        rank 0's clock (seconds)."""
        off = self.offset
        return {"rank": self.rank, "label": self.label, "offset": off, "counted": self.counted,
                "dropped_steps": self.dropped_steps,
                "events": [[tr, name, cat, t0 + off, t1 + off, _args(name, a)]
                           for tr, name, cat, t0, t1, a in list(self.events)]}

    def save(self, path: str, world=None) -> None:
        """Write the merged trace of every rank of ``world`` (a comm.Group; None: this rank
        alone) to ``path`` on rank 0.  Collective over ``world``: point-to-point only."""
        mine = self.payload()
        if world is None or world.size == 1:
            write_trace(path, [mine], self.origin + self.offset, self.meta)
            return
        from minidist import comm
        from minidist.model.backend import host

        if world.rank != 0:
            data = host.frombuffer(json.dumps(mine).encode(), dtype=host.uint8)
            comm.send(host.array([data.size], dtype=host.int64), 0, world, tag=LENGTH_TAG)
            comm.send(data, 0, world, tag=EVENTS_TAG)
            return
        payloads = [mine]
        for r in range(1, world.size):
            n = comm.recv((1,), host.int64, r, world, tag=LENGTH_TAG)
            payloads.append(json.loads(comm.recv((int(n[0]),), host.uint8, r, world, tag=EVENTS_TAG).tobytes()))
        write_trace(path, payloads, self.origin + self.offset, self.meta)


def _args(name, a):
    """A span's args as a JSON dict (the hooks store tuples; decoded here, at save time)."""
    if a is None or isinstance(a, dict):
        return a
    if a[0] == "msg":
        _, label, st, grec, peer, sent, received = a
        group = next((g for g, rec in st.groups.copy().items() if rec is grec), None)
        out = {"collective": label, "group": group, "peer": peer, "bytes_sent": sent, "bytes_recv": received}
        return {k: v for k, v in out.items() if v is not None}
    if a[0] == "call":
        _, group, n, x_meta, out_meta, algorithm, sent, received = a
        return {"group": group, "ranks": n, "bytes_sent": sent, "bytes_recv": received,
                "algorithm": _algorithm_name(name, n, x_meta, out_meta, algorithm),
                **({"shape": list(x_meta[0]), "dtype": str(x_meta[1])} if x_meta else {})}
    if a[0] == "wait":
        return {"group": a[1], "collective": a[2]}
    return {"value": repr(a)}


def _algorithm_name(name, n, x_meta, out_meta, algorithm) -> str:
    """The algorithm a collective ran, found again from its arguments' shapes (the same
    choice the collective made: its selector functions)."""
    try:
        from minidist.model.backend import host

        from minidist.comm import collectives, reducing

        def stand_in(meta):  # an array of that shape and dtype that holds no memory
            return None if meta is None else host.broadcast_to(host.zeros((), meta[1]), meta[0])

        x = stand_in(x_meta)
        if n == 1:
            return "copy"
        if name == "all_reduce":
            return reducing.all_reduce_algorithm(n, x, algorithm)
        if name == "reduce_scatter":
            return reducing.reduce_scatter_algorithm(n, x.nbytes, algorithm)
        if name == "all_gather":
            return collectives.all_gather_algorithm(n, x, stand_in(out_meta), algorithm)
        if name == "broadcast":
            return algorithm if algorithm != "auto" else (
                "binomial" if x.nbytes <= collectives.SMALL_BROADCAST_BYTES else "chain")
        return {"all_to_all": "pairwise", "all_to_all_v": "pairwise", "ppermute": "direct",
                "barrier": "dissemination", "gather": "linear", "scatter": "linear"}.get(name, algorithm)
    except Exception:  # a name only; never let the trace fail over it
        return algorithm


def write_trace(path: str, payloads: list, origin: float, meta: dict | None = None) -> None:
    """The Chrome-trace JSON of every rank's payload, times in µs from ``origin`` (rank 0's
    clock); metadata events name each process (rank) and thread (track)."""
    events, offsets, counted, dropped = [], {}, {}, {}
    for p in sorted(payloads, key=lambda p: p["rank"]):
        pid = p["rank"]
        offsets[str(pid)] = p["offset"]
        if p.get("counted") and not p.get("dropped_steps"):  # the spans' bytes are whole: checkable
            counted[str(pid)] = p["counted"]
        if p.get("dropped_steps"):
            dropped[str(pid)] = p["dropped_steps"]
        tracks = {t: i for i, t in enumerate(MAIN_TRACKS)}
        for tr, *_ in p["events"]:
            tracks.setdefault(tr, len(tracks))
        events.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": p["label"]}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0, "args": {"sort_index": pid}})
        for tr, tid in tracks.items():
            events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": _track_name(tr)}})
            events.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid,
                           "args": {"sort_index": tid}})
        for tr, name, cat, t0, t1, args in p["events"]:
            # Rounded to the ns, end first, so that a span nested in another stays inside it.
            ts, end = round((t0 - origin) * 1e6, 3), round((t1 - origin) * 1e6, 3)
            e = {"name": name, "cat": cat, "ph": "X", "pid": pid, "tid": tracks[tr], "ts": ts,
                 "dur": round(end - ts, 3)}
            if args:
                e["args"] = args
            events.append(e)
    doc = {"traceEvents": events, "displayTimeUnit": "ms",
           "otherData": {"clock_offset_s": offsets, "clock": "perf_counter, aligned to rank 0 (Cristian)",
                         "bytes_counted": counted, "run": meta or {}, "dropped_steps": dropped}}
    # A reader never sees half a file; the JSON is written in pieces, never whole in memory.
    replace_atomically(path, (piece.encode() for piece in json.JSONEncoder().iterencode(doc)))


def _track_name(track: str) -> str:
    if track == "compute":
        return "compute (main thread)"
    if track == "comm":
        return "communication (main thread)"
    if track.startswith("minidist-progress-"):
        return f"async communication ({track[len('minidist-progress-'):]} progress thread)"
    return track


# ---------------------------------------------------------------------- clock alignment
def clock_offset(world, clock=time.perf_counter, rounds: int = 8) -> float:
    """Seconds to add to this rank's ``clock`` to read rank 0's (Cristian's algorithm: of
    ``rounds`` round trips with rank 0, the one with the smallest delay).  Collective over
    ``world``; rank 0 serves the others one after another, with point-to-point messages."""
    if world is None or world.size == 1:
        return 0.0
    from minidist.model.backend import host

    from minidist import comm

    buf = host.zeros(1, dtype=host.float64)
    if world.rank == 0:
        for r in range(1, world.size):
            for _ in range(rounds):
                comm.recv_into(buf, r, world, tag=CLOCK_TAG)
                buf[0] = clock()
                comm.send(buf, r, world, tag=CLOCK_TAG)
        return 0.0
    best_rtt, offset = float("inf"), 0.0
    for _ in range(rounds):
        t0 = clock()
        comm.send(buf, 0, world, tag=CLOCK_TAG)
        comm.recv_into(buf, 0, world, tag=CLOCK_TAG)
        t1 = clock()
        if t1 - t0 < best_rtt:
            best_rtt, offset = t1 - t0, float(buf[0]) + (t1 - t0) / 2 - t1
    return offset


# ------------------------------------------------------------------ the comm hooks
def _wrap_collective(tracer: Tracer, name: str, fn):
    """``fn`` (a public collective) timed as one span on the calling thread's comm track,
    with the bytes it sent and received (read from comm.stats' counters around it), its
    group and algorithm; an asynchronous call returns a handle whose ``wait()`` is timed."""
    from minidist.comm.progress import Handle
    from minidist.comm.stats import _tallies as tallies, _tls as tls

    main, clock, events = tracer.main, tracer.clock, tracer.events

    def traced(*args, **kw):
        st = tls.state
        if st.label is not None or threading.get_ident() != main:  # inside another call, or off the main thread
            return fn(*args, **kw)  # its messages are recorded by p2p's hook
        c, t = st.counters.get(name), tallies.get(name)
        s0 = (c[1] if c else 0) + (t.sent if t else 0)
        r0 = (c[2] if c else 0) + (t.received if t else 0)
        tracer.in_call = True
        t0 = clock()
        try:
            out = fn(*args, **kw)
        finally:
            tracer.in_call = False
        t1 = clock()
        g = kw["g"] if "g" in kw else next((a for a in args if hasattr(a, "user_comm")), None)  # the Group, wherever
        gname = getattr(g, "name", None)
        if isinstance(out, Handle):  # asynchronous: its messages travel on the progress thread
            return _TracedHandle(out, tracer, name, gname)
        c, t = st.counters.get(name), tallies.get(name)
        s1 = (c[1] if c else 0) + (t.sent if t else 0)
        r1 = (c[2] if c else 0) + (t.received if t else 0)
        x = None if name == "barrier" else (args[0] if args else kw.get("x"))
        o = kw.get("out")
        events.append(("comm", name, "collective", t0, t1,
                       ("call", gname, getattr(g, "size", 1),
                        (x.shape, x.dtype) if hasattr(x, "shape") else None,
                        (o.shape, o.dtype) if hasattr(o, "shape") else None,
                        kw.get("algorithm", "auto"), s1 - s0, r1 - r0)))
        return out

    traced.__name__ = traced.__qualname__ = name
    traced.__doc__ = fn.__doc__
    traced.__wrapped__ = fn
    return traced


class _TracedHandle:
    """An async collective's handle whose ``wait()`` on the main thread is a span (the time
    the main thread is exposed to that communication)."""

    __slots__ = ("_handle", "_tracer", "name", "_group")

    def __init__(self, handle, tracer, name, group):
        self._handle, self._tracer, self.name, self._group = handle, tracer, name, group

    def is_completed(self) -> bool:
        return self._handle.is_completed()

    def wait(self, timeout: float | None = None):
        tr = self._tracer
        t0 = tr.clock()
        try:
            return self._handle.wait(timeout)
        finally:
            if threading.get_ident() == tr.main:
                tr.events.append(("comm", f"wait {self.name}", "wait", t0, tr.clock(), ("wait", self._group, self.name)))


def start(tracer: Tracer, world=None) -> Tracer:
    """Align ``tracer``'s clock with rank 0's and install the hooks (collective over
    ``world`` when given, the communication layer's hooks only then)."""
    if world is not None and world.size > 1:
        tracer.offset = clock_offset(world, tracer.clock)
    return install(tracer, world is not None and world.size > 1)


def install(tracer: Tracer, comm_hooks: bool = True) -> Tracer:
    """Make ``tracer`` the running one: spans from the loop, the pipeline and the blocks,
    and with ``comm_hooks`` every collective and message (undone by :func:`stop`)."""
    global active
    if comm_hooks:
        from minidist.comm import collectives, p2p
        from minidist.comm.stats import _tls

        tracer.tls = _tls
        collectives.trace_calls(lambda name, fn: _wrap_collective(tracer, name, fn))
        p2p.trace = tracer
        tracer.counted = _bytes_counted()
    backend.tracer = tracer  # host<->device copies (CuPy only)
    active = tracer
    return tracer


def _bytes_counted() -> list:
    """This rank's [bytes sent, bytes received] so far by comm.stats' counters."""
    from minidist.comm.stats import stats

    totals = stats().values()
    return [sum(v["bytes_sent"] for v in totals), sum(v["bytes_recv"] for v in totals)]


def stop() -> None:
    """Remove every hook (tracing off again)."""
    global active
    backend.tracer = None
    if active is not None:
        if "minidist.comm.p2p" in sys.modules:
            from minidist.comm import collectives, p2p

            p2p.trace = None
            collectives.trace_calls(None)
            if active.counted is not None:  # {"bytes_sent", "bytes_recv"} counted while the hooks were on
                now = _bytes_counted()
                active.counted = {"bytes_sent": now[0] - active.counted[0], "bytes_recv": now[1] - active.counted[1]}
    active = None


def rank_label(mesh_sizes: dict, rank: int) -> str:
    """``rank 5 (dp1 pp0 tp1)``: the rank and its coordinates on the axes of size > 1."""
    from minidist.layout.mesh import MeshLayout

    if all(n == 1 for n in mesh_sizes.values()):
        return f"rank {rank}"
    coords = MeshLayout(**mesh_sizes).coords(rank)
    return f"rank {rank} (" + " ".join(f"{a}{coords[a]}" for a in coords if mesh_sizes[a] > 1) + ")"
