"""Per-rank timelines (minidist/observe/trace.py) and the step breakdown.

Under real mpiexec: ``--trace`` on --dp 2, --pp 2, --tp 2 and (4 ranks) --dp 2 --tp 2 --zero 1
runs of a tiny GPT (3 steps)
writes one merged Chrome trace: valid JSON, one process track per rank named by its mesh
coordinates, only complete events, spans of one thread track disjoint or nested, the bytes
on the message spans equal to comm.stats' counters of each rank.  Each record's time by
part equals the parts read back from the file's own spans (each instant to the innermost
main-thread span: computed here by a sweep, not by the library's code), and its parameters,
gradients and optimizer state, on every rank, equal counts made from the model's shapes; the
one-process run's activations match a measurement of the same step made in the test.  (The
parts summing to the step time, or to the peak, would prove nothing: ``other`` and
``activations`` are remainders.)  Clocks: ranks whose tracer clocks are skewed by 1000 s
each line up again after the Cristian offsets, and stopping removes every hook.  HFU over MFU
with activation checkpointing is the recomputed forward's share.  The breakdown itself on
hand-made spans.
"""
import collections
import json
import os

import pytest

from minidist.observe import trace
from minidist.observe.breakdown import breakdown
from minidist.train.testing import run_mpi, run_train

BODIES = os.path.join(os.path.dirname(__file__), "mpi", "trace_bodies.py")
TINY = ["--layers", "2", "--d-model", "16", "--heads", "2", "--seq-len", "8", "--batch-size", "8", "--steps", "3",
        "--eval-every", "0", "--peak-gflops", "10", "--log-every", "1"]


def spans(doc):
    return [e for e in doc["traceEvents"] if e["ph"] != "M"]


def check_trace(doc, ranks: int, payload: bool = True):
    """The structural checks every merged trace must pass."""
    events = doc["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert sorted(names) == list(range(ranks)), names  # one process track per rank
    for pid, name in names.items():
        assert name.startswith(f"rank {pid}"), name
    threads = {(e["pid"], e["tid"]) for e in events if e["name"] == "thread_name"}
    by_track = collections.defaultdict(list)
    for e in spans(doc):
        assert e["ph"] == "X" and e["dur"] >= 0, e  # complete events: every span closed
        assert (e["pid"], e["tid"]) in threads, e  # on a named track
        by_track[e["pid"], e["tid"]].append(e)
    for track, evs in by_track.items():  # one thread's spans: disjoint or properly nested
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack = []
        for e in evs:
            end = e["ts"] + e["dur"]
            while stack and stack[-1] <= e["ts"] + 1e-3:
                stack.pop()
            assert not stack or end <= stack[-1] + 1e-3, f"{e} overlaps its neighbour on track {track}"
            stack.append(end)
    counted = doc["otherData"]["bytes_counted"]
    if ranks > 1:
        for r in range(ranks):  # the message spans carry every byte the counters saw
            mine = [e for e in spans(doc) if e["pid"] == r and e["cat"] in ("collective", "p2p")]
            sent, received = counted[str(r)]["bytes_sent"], counted[str(r)]["bytes_recv"]
            assert sum(e["args"].get("bytes_sent", 0) for e in mine) == sent and (sent > 0) == payload
            assert sum(e["args"].get("bytes_recv", 0) for e in mine) == received and (received > 0) == payload
    return names, by_track


MAIN_THREAD = ("compute (main thread)", "communication (main thread)")
COMM = ("collective", "p2p", "wait", "message")
PART_OF = {"compute": "compute", "optimizer": "optimizer", "bubble": "bubble", "sync": "compute"}


def parts_from_file(doc, k: int, pid: int = 0) -> tuple:
    """Step ``k``'s time by part on rank ``pid``, read from the trace file alone: the duration
    of its ``step k`` span, and every instant of it given to the innermost main-thread span
    that covers it (docs/tracing.md).  Swept over the elementary intervals between span
    edges (the library walks a stack of spans instead); times in seconds."""
    tids = {e["tid"] for e in doc["traceEvents"]
            if e["pid"] == pid and e["name"] == "thread_name" and e["args"]["name"] in MAIN_THREAD}
    mine = [e for e in spans(doc) if e["pid"] == pid and e["tid"] in tids]
    (step,) = [e for e in mine if e["name"] == f"step {k}" and e["cat"] == "step"]
    t0, t1 = step["ts"], step["ts"] + step["dur"]
    inside = [e for e in mine if e["cat"] != "step" and e["ts"] >= t0 and e["ts"] + e["dur"] <= t1 + 1e-3]
    edges = sorted({t0, t1, *(e["ts"] for e in inside), *(e["ts"] + e["dur"] for e in inside)})
    parts = {"compute": 0.0, "comm": collections.Counter(), "bubble": 0.0, "optimizer": 0.0, "other": 0.0}
    for a, b in zip(edges, edges[1:]):
        if not t0 <= a < b <= t1:
            continue
        mid = (a + b) / 2
        chain = sorted((e for e in inside if e["ts"] < mid < e["ts"] + e["dur"]), key=lambda e: (e["ts"], -e["dur"]))
        part = "other", None  # no span: sampling the batch, the loop's Python
        for depth, e in enumerate(chain):  # outermost first: a part may depend on the spans around
            if e["cat"] in ("staging", "sync") and depth:
                continue  # a host<->device copy counts for what it serves
            if part[0] == "bubble":
                continue  # everything inside a pipeline stage's wait is bubble
            if e["cat"] in COMM:
                part = "comm", (e.get("args") or {}).get("group")
            elif e["cat"] == "staging":
                part = "comm", "host<->device"
            else:
                part = PART_OF.get(e["cat"], "other"), None
        if part[0] == "comm":
            parts["comm"][part[1]] += (b - a) / 1e6
        else:
            parts[part[0]] += (b - a) / 1e6
    parts["comm"] = dict(parts["comm"])
    return step["dur"] / 1e6, parts


# TINY's GPT-2 in numbers: width, vocabulary, positions, layers; float32 (4 bytes) parameters
C, VOCAB, POSITIONS, LAYERS = 16, 256, 8, 2


def expected_state_bytes(mesh: dict, rank: int, step: int) -> dict:
    """Bytes of parameters, gradients and AdamW state that ``rank`` holds after backward in
    step ``step``, counted from TINY's shapes (not from any array): each block has two
    LayerNorms and the row-split layers' biases whole on every tensor-parallel rank, its four
    matrices and the column-split biases split over ``tp``; the first pipeline stage holds the
    token table (vocabulary split over ``tp``) and the positions, the last the final norm and
    the tied table's copy; AdamW's two arrays per parameter exist from the first update on
    (ZeRO-1's shards of them, over ``dp``, from the start)."""
    dp, pp, tp = (mesh.get(k, 1) for k in ("dp", "pp", "tp"))
    zero = mesh.get("zero", 0)
    block = 4 * C + 2 * C + (3 * C * C + 3 * C + C * C + 4 * C * C + 4 * C + 4 * C * C) // tp
    stage = (rank // tp) % pp  # tp innermost, then pp, dp outermost
    n = LAYERS // pp * block
    if stage == 0:
        n += VOCAB * C // tp + POSITIONS * C
    if stage == pp - 1:
        n += 2 * C + (VOCAB * C // tp if pp > 1 else 0)
    params = 4 * n
    optimizer = 2 * params // dp if zero else 0 if step == 1 else 2 * params
    return {"params": params, "grads": params, "optimizer": optimizer}


def check_records(path, doc, mesh: dict, pipeline=False):
    """Each record's time by part against the same parts read from the trace file's spans
    (``parts_from_file``), and its memory parts against ``expected_state_bytes``: neither
    side is the other's remainder, so a span given to the wrong part, a lost span, or a
    state counted at the wrong moment makes them differ."""
    records = [json.loads(line) for line in open(path)]
    assert [r["step"] for r in records] == [1, 2, 3]
    world = mesh.get("dp", 1) * mesh.get("pp", 1) * mesh.get("tp", 1)
    for r in records:
        step_s, want = parts_from_file(doc, r["step"])
        b = r["time_s"]
        assert r["step_time_s"] == pytest.approx(step_s, abs=1e-8)
        for part in ("compute", "bubble", "optimizer", "other"):
            assert b[part] == pytest.approx(want[part], abs=1e-6), (r["step"], part, b, want)
        assert b["comm"].keys() == want["comm"].keys(), (r["step"], b["comm"], want["comm"])
        for group, seconds in want["comm"].items():
            assert b["comm"][group] == pytest.approx(seconds, abs=1e-6), (r["step"], group, b, want)
        assert b["compute"] > 0 and (b["bubble"] > 0) == pipeline
        assert r["hfu"] >= r["mfu"] > 0
    measured = [r for r in records if "mem_parts_mb" in r]
    assert [r["step"] for r in measured] == [1, 2]  # the first step, and the one before each printed line
    for r in measured:
        rows = r.get("rank_mem_parts_mb", [r["mem_parts_mb"]])
        assert len(rows) == world and rows[0] == r["mem_parts_mb"]
        for rank, row in enumerate(rows):
            want = expected_state_bytes(mesh, rank, r["step"])
            got = {k: round(row[k] * 2**20) for k in want}
            assert got == want, (r["step"], rank, got, want)
            assert row["activations"] > 0
    return records


def run(tmp_path, nprocs, *mesh):
    trace_path, metrics = str(tmp_path / "trace.json"), str(tmp_path / "m.jsonl")
    proc = run_train(nprocs, [*mesh, *TINY, "--trace", trace_path, "--metrics-jsonl", metrics], timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "time by part (rank 0)" in proc.stdout
    return json.load(open(trace_path)), metrics, proc.stdout


@pytest.mark.mpi
def test_dp2_trace_shows_async_gradient_reduction_on_its_own_track(tmp_path):
    doc, metrics, out = run(tmp_path, 2, "--dp", "2")
    names, tracks = check_trace(doc, 2)
    assert names == {0: "rank 0 (dp0)", 1: "rank 1 (dp1)"}
    threads = {e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "thread_name"}
    assert "async communication (dp progress thread)" in threads
    ev = spans(doc)
    progress = [e for e in ev if e["cat"] == "p2p" and e["tid"] >= 2]
    assert progress and all(e["args"]["group"] == "dp" and e["args"]["collective"] for e in progress)
    assert any(e["cat"] == "wait" and e["args"]["group"] == "dp" for e in ev)  # the exposed part of it
    for r in range(2):
        assert {"F0", "B0", "optimizer"} <= {e["name"] for e in ev if e["pid"] == r}
    records = check_records(metrics, doc, {"dp": 2})
    assert "dp" in records[-1]["time_s"]["comm"]
    assert len(records[0]["rank_mem_parts_mb"]) == 2


@pytest.mark.mpi
def test_pp2_trace_has_microbatches_bubble_and_messages(tmp_path):
    doc, metrics, _ = run(tmp_path, 2, "--pp", "2", "--microbatches", "4")
    names, _ = check_trace(doc, 2)
    assert names == {0: "rank 0 (pp0)", 1: "rank 1 (pp1)"}
    ev = spans(doc)
    for r in range(2):
        mine = [e for e in ev if e["pid"] == r]
        computed = {(e["args"]["op"], e["args"]["microbatch"]) for e in mine if e["cat"] == "compute" and "op" in e.get("args", {})}
        assert computed == {(op, m) for op in ("forward", "backward") for m in range(4)}  # each microbatch, once a step
        assert any(e["cat"] == "bubble" for e in mine)  # a stage waiting for its input
        sends = [e for e in mine if e["cat"] == "p2p" and e["name"] == "isend"]
        assert sends and all(e["args"]["group"] == "pp" and e["args"]["bytes_sent"] > 0 and e["args"]["peer"] == 1 - r
                             for e in sends)
    check_records(metrics, doc, {"pp": 2}, pipeline=True)


@pytest.mark.mpi
def test_tp2_trace_names_collectives_their_axis_and_algorithm(tmp_path):
    doc, metrics, _ = run(tmp_path, 2, "--tp", "2")
    check_trace(doc, 2)
    calls = [e for e in spans(doc) if e["cat"] == "collective" and e["args"]["group"] == "tp"]
    assert calls and all(e["args"]["algorithm"] and e["args"]["ranks"] == 2 for e in calls)
    assert {e["name"] for e in calls} & {"all_reduce", "all_gather", "reduce_scatter"}
    assert any(e["name"].startswith("block ") for e in spans(doc))
    assert "tp" in check_records(metrics, doc, {"tp": 2})[-1]["time_s"]["comm"]


@pytest.mark.mpi
def test_dp2_tp2_names_both_axes_and_counts_every_byte(tmp_path):
    doc, metrics, _ = run(tmp_path, 4, "--dp", "2", "--tp", "2", "--zero", "1")
    names, _ = check_trace(doc, 4)
    assert names == {0: "rank 0 (dp0 tp0)", 1: "rank 1 (dp0 tp1)", 2: "rank 2 (dp1 tp0)", 3: "rank 3 (dp1 tp1)"}
    groups = {e["args"].get("group") for e in spans(doc) if e["cat"] in ("collective", "p2p", "wait")}
    assert {"dp", "tp"} <= groups
    assert {"dp", "tp"} <= set(check_records(metrics, doc, {"dp": 2, "tp": 2, "zero": 1})[-1]["time_s"]["comm"])


def measured_activation_bytes(argv: list, step: int = 2) -> int:
    """The activations of step ``step`` of the one-process run of ``argv``, measured here:
    the same model and strategy built in this process (random tokens), tracemalloc's peak
    during that step's forward and backward above what the step started with, less the
    gradients counted from the shapes (``expected_state_bytes``).  The trainer's figure is
    its peak minus its own counts of parameters, gradients and optimizer state."""
    import tracemalloc

    import numpy as np

    from minidist.train.config import from_args
    from minidist.state.data import Sampler
    from minidist.train.flags import build_parser
    from minidist.parallel.compose import build, build_mesh
    from minidist.train.loop import update

    cfg = from_args(build_parser().parse_args(argv)).resolved(1)
    _, strategy = build(cfg, build_mesh(cfg.parallel))
    corpus = np.random.default_rng(1).integers(0, 256, 4000).astype(np.uint8)
    sampler = Sampler(corpus, cfg.data.seq_len, cfg.data.batch_size, cfg.model.seed)
    tracemalloc.start()
    try:
        for k in range(1, step + 1):
            x, y = sampler.batch(k - 1)
            tracemalloc.reset_peak()
            base = tracemalloc.get_traced_memory()[0]
            strategy.forward_backward(x, y, cfg.device.grad_accum)
            peak = tracemalloc.get_traced_memory()[1] - base
            update(strategy, None, cfg.optim.clip_grad)
    finally:
        tracemalloc.stop()
    return peak - expected_state_bytes({}, 0, step)["grads"]


def test_one_process_trace_and_hfu_with_recompute(tmp_path):
    """Besides the trace and the record checks, the activations the record reports for its
    second step against a measurement of the same step made here (measured_activation_bytes):
    within 15% (this process's allocations are not the trainer's, byte for byte)."""
    from minidist.layout.model import ModelConfig
    from minidist.observe.profile import model_flops_per_token
    from minidist.train.report import recompute_flops_per_token

    doc, metrics, _ = run(tmp_path, None, "--checkpoint-activations")
    names, _ = check_trace(doc, 1)
    assert names == {0: "rank 0"}
    records = check_records(metrics, doc, {})
    assert records[-1]["time_s"]["comm"] == {}
    reported = records[1]["mem_parts_mb"]["activations"] * 2**20
    assert reported == pytest.approx(measured_activation_bytes([*TINY, "--checkpoint-activations"]), rel=0.15)
    # HFU counts the recomputed forward of every block (PaLM appendix B): here 2 layers, C=16, T=8
    tiny = ModelConfig(layers=2, d_model=16, heads=2)
    ratio = 1 + recompute_flops_per_token(tiny, 8, True) / model_flops_per_token(2, 16, 8, 256)
    assert all(r["hfu"] / r["mfu"] == pytest.approx(ratio) for r in records)
    assert recompute_flops_per_token(tiny, 8, True) == 2 * (24 * 16 * 16 + 4 * 8 * 16)


@pytest.mark.mpi
def test_clock_offsets_align_skewed_ranks(tmp_path):
    path = str(tmp_path / "clock.json")
    run_mpi(3, f"{BODIES}::skewed_clocks", path, timeout=90)
    doc = json.load(open(path))
    offsets = doc["otherData"]["clock_offset_s"]
    for r in range(3):
        assert offsets[str(r)] == pytest.approx(-1000.0 * r, abs=0.01)  # Cristian's estimate of the skew
    ev = spans(doc)
    for i in range(3):  # a barrier releases every rank at nearly the same instant of rank 0's clock
        after = [e["ts"] for e in ev if e["name"] == f"after barrier {i}"]
        assert len(after) == 3 and max(after) - min(after) < 50_000, after  # µs: well under the 1000 s skew
    check_trace(doc, 3, payload=False)  # a barrier's messages are empty


def test_breakdown_parts_sum_to_the_step():
    ev = [("compute", "fb", "step", 0.0, 8.0, None),
          ("compute", "F0", "compute", 0.5, 3.0, None),
          ("comm", "all_reduce", "collective", 1.0, 1.5, {"group": "tp"}),
          ("compute", "idle", "bubble", 3.0, 4.0, None),
          ("comm", "wait recv", "p2p", 3.2, 3.9, {"group": "pp"}),  # inside the bubble: bubble
          ("compute", "B0", "compute", 4.0, 7.0, None),
          ("comm", "wait all_reduce", "wait", 7.0, 7.5, {"group": "dp"}),
          ("compute", "optimizer", "optimizer", 8.0, 9.0, None),
          ("comm", "all_reduce", "collective", 8.2, 8.4, {"group": "dp"})]
    b = breakdown(ev, 0.0, 10.0)
    assert b["compute"] == pytest.approx(2.0 + 3.0)
    assert b["comm"] == pytest.approx({"tp": 0.5, "dp": 0.7})
    assert b["bubble"] == pytest.approx(1.0)
    assert b["optimizer"] == pytest.approx(0.8)
    assert b["other"] == pytest.approx(10.0 - 5.0 - 1.2 - 1.0 - 0.8)


def test_a_host_device_copy_counts_for_what_it_serves():
    """Staging spans (CuPy) nest in the collective or the compute they serve and count for it;
    a copy on its own is communication between host and device."""
    ev = [("compute", "fb", "step", 0.0, 4.0, None),
          ("comm", "all_reduce", "collective", 0.0, 1.0, {"group": "dp"}),
          ("comm", "to_host", "staging", 0.1, 0.6, {"bytes": 8}),
          ("compute", "F0", "compute", 1.0, 2.0, None),
          ("comm", "from_host", "staging", 1.1, 1.2, {"bytes": 8}),
          ("comm", "host read", "sync", 1.5, 1.6, {"bytes": 8}),
          ("comm", "to_host", "staging", 3.0, 3.5, {"bytes": 8})]
    b = breakdown(ev, 0.0, 4.0)
    assert b["comm"] == pytest.approx({"dp": 1.0, "host<->device": 0.5})
    assert b["compute"] == pytest.approx(1.0)
    assert b["other"] == pytest.approx(2.5 - 1.0)


def test_rank_label_names_the_axes_of_size_above_one():
    assert trace.rank_label({"dp": 2, "pp": 2, "cp": 1, "tp": 2}, 5) == "rank 5 (dp1 pp0 tp1)"
    assert trace.rank_label({"dp": 1, "pp": 1, "cp": 1, "tp": 1}, 0) == "rank 0"


def test_a_long_run_keeps_its_first_and_latest_steps_in_bounded_memory():
    """Past max_events the steps after the first are dropped, oldest first, down to half the
    limit; the first step and the latest ones stay whole, and the file says how many went."""
    from minidist.observe import trace

    tr = trace.Tracer(0, max_events=100)
    tr.add("compute", "start-up", "compute", 0.0, 0.1)
    for step in range(1, 51):
        first = len(tr.events)
        for i in range(10):
            tr.add("compute", f"step {step}" if i == 0 else "F0", "compute", step, step + 0.5)
        tr.step_done(first)
        assert len(tr.events) <= 100 + 10
    names = [e[1] for e in tr.events if e[1].startswith("step ")]
    kept = [int(n.split()[1]) for n in names]
    assert tr.events[0][1] == "start-up" and kept[0] == 1 and kept[-1] == 50
    assert kept[1:] == list(range(kept[1], 51)), kept  # the latest steps, contiguous
    assert tr.dropped_steps == 50 - len(kept) and len(tr.events) == 1 + 10 * len(kept)
    p = tr.payload()
    assert p["dropped_steps"] == tr.dropped_steps


@pytest.mark.mpi
def test_ep2_trace_shows_dispatch_and_combine_on_every_rank(tmp_path):
    """Expert parallelism: each mixture's forward shows a ``dispatch`` and a ``combine`` span
    on every rank (observe/trace_experts.py), inside its block's span, each holding the
    ep group's all-to-alls it runs (dispatch: the counts, then the rows; combine: the rows)."""
    doc, _, out = run(tmp_path, 2, "--dp", "2", "--ep", "2", "--experts", "4")
    check_trace(doc, 2)
    ev = spans(doc)
    for r in range(2):
        mine = [e for e in ev if e["pid"] == r]
        for name, calls in (("dispatch", 2), ("combine", 1)):
            got = [e for e in mine if e["name"] == name]
            assert len(got) == 2 * 3, (r, name, len(got))  # 2 mixtures x 3 steps of one micro-batch
            for e in got:
                a, end = e["args"], e["ts"] + e["dur"] + 1e-3
                assert a["op"] == name and a["ep_group"] == "dp.ep2" and a["rows"] >= 0, e
                assert any(b["name"] == f"block {a['block']}" and b["ts"] <= e["ts"] and e["ts"] + e["dur"]
                           <= b["ts"] + b["dur"] + 1e-3 for b in mine), e
                inside = [c for c in mine if c["cat"] == "collective" and c["args"].get("group") == "dp.ep2"
                          and e["ts"] <= c["ts"] and c["ts"] + c["dur"] <= end]
                assert len(inside) == calls, (e, inside)
    one = run_train(None, [*TINY, "--experts", "4", "--trace", str(tmp_path / "one.json")], timeout=120)
    assert one.returncode == 0, one.stderr  # every expert local: nothing to dispatch, no such spans
    assert not [e for e in spans(json.load(open(tmp_path / "one.json"))) if e["name"] in ("dispatch", "combine")]
