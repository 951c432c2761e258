"""Per-rank timelines (minidist/trace.py) and the step breakdown.

Under real mpiexec: ``--trace`` on --dp 2, --pp 2, --tp 2 and (4 ranks) --dp 2 --tp 2 --zero 1
runs of a tiny GPT (3 steps)
writes one merged Chrome trace: valid JSON, one process track per rank named by its mesh
coordinates, only complete events, spans of one thread track disjoint or nested, the bytes
on the message spans equal to comm.stats' counters of each rank, and each record's time
breakdown summing to its step time.  Clocks: ranks whose tracer clocks are skewed by 1000 s
each line up again after the Cristian offsets, and stopping removes every hook.  HFU over MFU
with activation checkpointing is the recomputed forward's share.  The breakdown itself on
hand-made spans.
"""
import collections
import json
import os

import pytest

from minidist import trace
from minidist.breakdown import breakdown
from minidist.testing import run_mpi, run_train

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


def check_records(path, pipeline=False):
    records = [json.loads(line) for line in open(path)]
    assert len(records) == 3
    for r in records:
        b = r["time_s"]
        total = b["compute"] + b["bubble"] + b["optimizer"] + b["other"] + sum(b["comm"].values())
        assert total == pytest.approx(r["step_time_s"], rel=1e-9, abs=1e-9)
        assert b["compute"] > 0 and b["other"] >= 0
        assert (b["bubble"] > 0) == pipeline
        assert r["hfu"] >= r["mfu"] > 0
    parts = records[0]["mem_parts_mb"]  # measured on the first step
    assert parts["peak"] == pytest.approx(parts["params"] + parts["grads"] + parts["optimizer"] + parts["activations"])
    assert parts["params"] > 0 and parts["activations"] > 0
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
    records = check_records(metrics)
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
    check_records(metrics, pipeline=True)


@pytest.mark.mpi
def test_tp2_trace_names_collectives_their_axis_and_algorithm(tmp_path):
    doc, metrics, _ = run(tmp_path, 2, "--tp", "2")
    check_trace(doc, 2)
    calls = [e for e in spans(doc) if e["cat"] == "collective" and e["args"]["group"] == "tp"]
    assert calls and all(e["args"]["algorithm"] and e["args"]["ranks"] == 2 for e in calls)
    assert {e["name"] for e in calls} & {"all_reduce", "all_gather", "reduce_scatter"}
    assert any(e["name"].startswith("block ") for e in spans(doc))
    assert "tp" in check_records(metrics)[-1]["time_s"]["comm"]


@pytest.mark.mpi
def test_dp2_tp2_names_both_axes_and_counts_every_byte(tmp_path):
    doc, metrics, _ = run(tmp_path, 4, "--dp", "2", "--tp", "2", "--zero", "1")
    names, _ = check_trace(doc, 4)
    assert names == {0: "rank 0 (dp0 tp0)", 1: "rank 1 (dp0 tp1)", 2: "rank 2 (dp1 tp0)", 3: "rank 3 (dp1 tp1)"}
    groups = {e["args"].get("group") for e in spans(doc) if e["cat"] in ("collective", "p2p", "wait")}
    assert {"dp", "tp"} <= groups
    assert {"dp", "tp"} <= set(check_records(metrics)[-1]["time_s"]["comm"])


def test_one_process_trace_and_hfu_with_recompute(tmp_path):
    from minidist.profile import model_flops_per_token
    from minidist.report import recompute_flops_per_token

    doc, metrics, _ = run(tmp_path, None, "--checkpoint-activations")
    names, _ = check_trace(doc, 1)
    assert names == {0: "rank 0"}
    records = check_records(metrics)
    assert records[-1]["time_s"]["comm"] == {}
    # HFU counts the recomputed forward of every block (PaLM appendix B): here 2 layers, C=16, T=8
    ratio = 1 + recompute_flops_per_token(2, 16, 8, True) / model_flops_per_token(2, 16, 8, 256)
    assert all(r["hfu"] / r["mfu"] == pytest.approx(ratio) for r in records)
    assert recompute_flops_per_token(2, 16, 8, True) == 2 * (24 * 16 * 16 + 4 * 8 * 16)


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
    from minidist import trace

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
