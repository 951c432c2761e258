"""``python -m minidist.plan --calibrate`` and ``--validate``: this machine measured, and the
cost model against real minidist runs here.

:func:`calibrate` runs the probes of :mod:`.machine` and one real single-process step whose
time, less what the cost model prices for the matmuls and fixed costs, gives the rate of
minidist's element-wise work; it writes ``this-machine``'s calibration file.

Each configuration trains a small GPT (or Llama: grouped-query attention, SwiGLU) for a few
steps under ``mpiexec`` (one BLAS thread per rank, as every minidist launcher pins it) with
``--metrics-jsonl``, in ``repeats`` launches; the measured step time is the median of the
untraced steps of the fastest launch (the first step pays warm-up and the first and last steps
run under tracemalloc), the measured peak memory the largest rank's tracemalloc high-water
mark of the last step (minidist.observe.profile.PeakMemory).  The prediction prices the same mesh on
the calibrated ``this-machine`` with minidist's own implementation (float32 NumPy arrays, no
sequence parallelism, plain attention); ranks beyond the cores share them.

What tracemalloc sees is what a step *allocates*: the weights and the optimizer state exist
before the step (after the first one) and are not in it; the gradients, the activations, the
logits, the messages' buffers and the update's temporaries are.  The predicted peak is the
same parts of :func:`minidist.plan.cost.memory_parts`.

The expert-parallel rows (a mixture of 4 experts in every block, ``--ep 2``) compare one
more thing: the bytes a rank sends per step on its ep group (``bytes_sent`` of the metrics,
rank 0), the all-to-alls of GShard's dispatch and combine, against the planner's
:func:`minidist.plan.moe_cost.sent_bytes` (balanced routing; a real router's imbalance moves
the measured bytes only a little, since a rank sends its rows out and receives others' back).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import replace

from minidist.plan import moe_cost
from minidist.plan.cost import FLOAT32, Plan, Step, estimate
from minidist.plan.machine import INF, Link, Machine, calibration_path, load
from minidist.plan.probes import (fixed_costs, measure_ring, measure_sync, one_blas_thread, run_probe, train_rows,
                                  with_others_load)
from minidist.layout.model import ModelConfig

# Small enough that all of them take 2-4 minutes on 2 cores, large enough that the
# arithmetic shows.  (name, mesh and settings, shape)
SHAPE = dict(layers=4, d_model=128, heads=4, seq_len=64, batch_size=16)
CONFIGS = [
    ("1 rank", {}, {}),
    ("dp2 ZeRO-0", dict(dp=2, zero=0), {}),
    ("dp2 ZeRO-1", dict(dp=2, zero=1), {}),
    ("dp2 ZeRO-2", dict(dp=2, zero=2), {}),
    ("dp2 ZeRO-3", dict(dp=2, zero=3), {}),
    ("tp2", dict(tp=2), {}),
    ("pp2 1F1B M=4", dict(pp=2, microbatches=4, schedule="1f1b"), {}),
    ("cp2 ring", dict(cp=2), {}),
    ("cp2 ulysses", dict(cp=2, cp_impl="ulysses"), {}),
    ("dp2 tp2", dict(dp=2, tp=2, zero=1), {}),
    ("pp2 tp2 M=4", dict(pp=2, tp=2, microbatches=4, schedule="1f1b"), {}),
    ("dp2 cp2", dict(dp=2, cp=2, zero=1), {}),
    ("1 rank, 2 layers d256", {}, dict(layers=2, d_model=256)),
    # The Llama family: 2 key/value heads for 4 query heads, SwiGLU of width 352.
    ("llama K=2, 1 rank", {}, dict(arch="llama", kv_heads=2)),
    ("llama K=2, tp2", dict(tp=2), dict(arch="llama", kv_heads=2)),
    ("llama K=1, dp2 ZeRO-1", dict(dp=2, zero=1), dict(arch="llama", kv_heads=1)),
    # A mixture of 4 GELU experts, top-2, in every block: on one rank, and split over ep = 2.
    ("moe E4, 1 rank", {}, dict(experts=4)),
    ("moe E4, dp2 ep2 ZeRO-1", dict(dp=2, ep=2, zero=1), dict(experts=4)),
]


def plan_of(mesh: dict) -> Plan:
    return Plan(tp=mesh.get("tp", 1), cp=mesh.get("cp", 1), pp=mesh.get("pp", 1), dp=mesh.get("dp", 1),
                zero=mesh.get("zero", 0), microbatches=mesh.get("microbatches", 1),
                schedule=mesh.get("schedule", "1f1b"), sequence_parallel=False, ep=mesh.get("ep", 1),
                cp_impl=mesh.get("cp_impl", "ring"))


def model_of(shape: dict) -> ModelConfig:
    """The model ``minidist.train`` builds from ``shape``'s flags (ring attention's tile: a
    whole chunk, the training flags' default)."""
    return ModelConfig(layers=shape["layers"], d_model=shape["d_model"], heads=shape["heads"],
                       arch=shape.get("arch", "gpt2"), kv_heads=shape.get("kv_heads"), experts=shape.get("experts", 0),
                       block_size=shape["seq_len"], attention_block=None)


def predict(machine, shape: dict, mesh: dict, expert_load: float = 1.0) -> dict:
    """Predicted step seconds and step peak bytes (what tracemalloc sees) on this machine, and
    the bytes one rank sends per step on its ep group (the all-to-alls); ``expert_load``: the
    routing's imbalance over the ep ranks, as measured (:func:`expert_load`)."""
    plan = plan_of(mesh)
    tokens = shape["batch_size"] * shape["seq_len"]
    model = model_of(shape)
    e = estimate(model, machine, plan, tokens, FLOAT32, minidist=True, expert_load=expert_load)
    transient = {k: v for k, v in e.memory.items() if k not in ("params", "optimizer")}
    s = Step.of(model, machine, plan, FLOAT32, tokens, True)
    ep_bytes = plan.microbatches * moe_cost.most_mixtures(s) * moe_cost.a2a_per_mixture(s) * moe_cost.sent_bytes(s)
    return {"step_s": e.step_s, "peak_bytes": sum(transient.values()), "time": e.time, "memory": transient,
            "ep_bytes": ep_bytes}


def expert_load(rows: list, ep: int) -> float:
    """The busiest ep rank's routed rows over the mean, averaged over the mixtures and the
    steps of ``rows`` (the metrics' router counts: tokens per expert of each mixture, the
    experts split over the ep ranks in order); 1 without a mixture or ep.  The counts are
    summed over the data-parallel ranks and a step's microbatches, so with more than one ep
    group, or more than one microbatch, this is the pooled imbalance, a lower bound of the
    busiest group's and call's (exact for --validate's dp2·ep2, one microbatch)."""
    loads = []
    for r in rows:
        for tokens in (r.get("router") or {}).get("tokens", []) if ep > 1 else []:
            per = len(tokens) // ep
            ranks = [sum(tokens[i * per:(i + 1) * per]) for i in range(ep)]
            if sum(ranks):
                loads.append(max(ranks) * ep / sum(ranks))
    return statistics.mean(loads) if loads else 1.0


def run(shape: dict, mesh: dict, steps: int, timeout: float = 300) -> dict:
    """Train ``steps`` steps for real; the measured step seconds and peak bytes."""
    ranks = mesh.get("tp", 1) * mesh.get("cp", 1) * mesh.get("pp", 1) * mesh.get("dp", 1)
    args = ["--layers", str(shape["layers"]), "--d-model", str(shape["d_model"]), "--heads", str(shape["heads"]),
            "--seq-len", str(shape["seq_len"]), "--batch-size", str(shape["batch_size"])]
    flags = {"dp": "--dp", "tp": "--tp", "pp": "--pp", "cp": "--cp", "zero": "--zero", "microbatches": "--microbatches",
             "schedule": "--schedule", "ep": "--ep", "cp_impl": "--cp-impl"}
    for key, flag in flags.items():
        if key in mesh:
            args += [flag, str(mesh[key])]
    for key, flag in (("arch", "--arch"), ("kv_heads", "--kv-heads"), ("experts", "--experts")):
        if key in shape:
            args += [flag, str(shape[key])]
    rows, load = with_others_load(lambda: train_rows(args, steps, ranks, timeout), ranks, os.cpu_count() or 1)
    untraced = [r["step_time_s"] for r in rows[1:] if "peak_mem_mb" not in r]
    last = [r for r in rows if "peak_mem_mb" in r][-1]  # the last traced step (not the first: it allocates the state)
    peak_mb = max(last.get("rank_peak_mem_mb") or [last["peak_mem_mb"]])
    ep = mesh.get("ep", 1)  # rank 0's bytes on its ep group ("<dp group>.ep<N>"), per untraced step
    ep_bytes = [sum(n for g, n in r.get("bytes_sent", {}).items() if g.endswith(f".ep{ep}")) for r in rows[1:]
                if "peak_mem_mb" not in r] if ep > 1 else []
    return {"step_s": statistics.median(untraced), "peak_bytes": peak_mb * 2**20, "steps": len(rows), "load": load,
            "ep_bytes": statistics.median(ep_bytes) if ep_bytes else None,
            "expert_load": expert_load([r for r in rows[1:] if "peak_mem_mb" not in r], ep)}


TARGETS = {"step": 0.10, "peak": 0.10}  # median |error| of the step time and of the peak memory


def launch_spread(launches: list) -> float | None:
    """The measurement's own noise: over the configurations (``launches``: each one's step
    seconds, one per launch), the median of how far one launch is from another of the same
    configuration, as an error, ``|a - b| / b`` over the ordered pairs.  A prediction equal to
    one launch would score that against the others.  This is the spread of single launches;
    the fastest of several, which the validation compares, varies less.  None when no
    configuration has two launches."""
    per = [statistics.median(abs(a - b) / b for i, a in enumerate(ls) for j, b in enumerate(ls) if i != j)
           for ls in launches if len(ls) > 1]
    return statistics.median(per) if per else None


PROBE_SHAPE = dict(layers=2, d_model=64, heads=4, seq_len=32, batch_size=16)  # not one of --validate's shapes


def elementwise_rate(machine: Machine, probe: dict) -> float | None:
    """The rate of minidist's element-wise work (norms, GELU, softmax, the residual and bias
    adds, their backward, each allocating its result) that makes the cost model price the
    real single-process step ``probe`` (``run(PROBE_SHAPE, {})``) exactly: the step's time
    less what the model prices for its matmuls and fixed costs, over the activation bytes the
    model says it moves.  None when the rest is lost in the noise."""
    loaded = replace(machine, load=probe["load"])
    without = predict(replace(loaded, mem_bw=1e30), PROBE_SHAPE, {})["step_s"]
    per_byte = predict(replace(loaded, mem_bw=1.0), PROBE_SHAPE, {})["step_s"] - without
    rest = probe["step_s"] - without
    return per_byte / rest if rest > 0 else None


def _with_elementwise_rate(machine: Machine, log=print, launches: int = 3) -> Machine:
    """``machine`` with :func:`elementwise_rate` from the fastest of ``launches`` probe
    launches: one launch's time varies from one calibration to the next, and this rate moves
    every prediction with it (docs/planner.md)."""
    meas = min((run(PROBE_SHAPE, {}, steps=10) for _ in range(launches)), key=lambda r: r["step_s"])
    rate = elementwise_rate(machine, meas)
    if rate is None:
        log("  element-wise work: hidden in the noise of the probe; the copy bandwidth stays")
        return machine
    log(f"  minidist's element-wise work: {rate / 1e9:.2f} GB/s of activations (a real {PROBE_SHAPE['layers']}-block "
        f"d{PROBE_SHAPE['d_model']} step, {meas['step_s'] * 1e3:.1f} ms, background load {meas['load']:.1f})")
    return replace(machine, mem_bw=rate, notes={**machine.notes, "copy_bw": machine.mem_bw,
                                                 "probe_step_s": meas["step_s"]})


def calibrate(path: str | None = None, log=print, quick: bool = False) -> Machine:
    """Measure this machine and write it to ``path`` (default: the calibration
    file); returns it.  ``quick``: each repeated probe launched once, not three times (about
    20 s instead of 40), for the quick benchmark, which checks that the validation runs, not
    its figures, and keeps its calibration to itself."""
    launches = 1 if quick else 3
    code = "import json, minidist.plan.probes as m; print(json.dumps(m.measure_compute()))"
    compute = json.loads(subprocess.run([sys.executable, "-c", code], check=True, env=one_blas_thread(),
                                        capture_output=True, text=True, timeout=300).stdout)
    log(f"  GEMM on one core: {compute['peak']['float32'] / 1e9:.1f} GFLOP/s float32, "
        f"{compute['peak']['float64'] / 1e9:.1f} float64; element-wise {compute['mem_bw'] / 1e9:.1f} GB/s")
    p2p = run_probe("_p2p_probe", 2)
    log(f"  point-to-point between two local ranks: {p2p['latency'] * 1e6:.1f} us, {p2p['bw'] / 1e9:.2f} GB/s; "
        f"a collective call's own cost {p2p['coll_overhead_s'] * 1e6:.0f} us")
    fixed = fixed_costs(repeats=launches)
    log(f"  minidist's fixed costs (tiny steps): {fixed['block_mb_s'] * 1e3:.2f} ms per block and microbatch, "
        f"{fixed['block_step_s'] * 1e3:.2f} ms per block and step, {fixed['mb_overhead_s'] * 1e3:.2f} ms per "
        f"microbatch and {fixed['step_overhead'] * 1e3:.2f} ms per step outside the blocks")
    cores = os.cpu_count() or 1
    from minidist.host import cli_checks

    machine = Machine(
        name="this-machine", peak=compute["peak"], mem_bytes=float(cli_checks.available_memory_bytes() or 8e9),
        mem_bw=compute["mem_bw"], links=(Link("shared memory", INF, p2p["bw"], p2p["latency"]),),
        gemm_eff=1.0, attn_eff=1.0, link_eff=1.0, mem_usable=0.8,
        overlap=0.0, **fixed, **measure_ring(log), cores=cores, coll_overhead_s=p2p["coll_overhead_s"], sync_slice_s=measure_sync(cores, log, launches),
        notes={"measured": time.strftime("%Y-%m-%d %H:%M:%S"), "python": sys.version.split()[0],
               "numpy_op_s": compute["numpy_op_s"]})
    machine = _with_elementwise_rate(machine, log, launches)
    path = calibration_path(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(machine.to_json(), f, indent=1)
    log(f"  written to {path}")
    return machine


def validate(machine, steps: int = 8, log=print, configs=None, repeats: int = 2) -> dict:
    """Each configuration trained ``repeats`` times, in rounds (every configuration once, then
    again), and priced on the machine as it was during the validation: at the background load
    of its fastest launch, whose step time counts (load only ever adds), and at the element-wise
    rate of the median of the probe steps run before every launch.  This VM runs in two speed
    levels that switch over minutes, unseen by the load and the steal time; the slow one slows
    minidist's element-wise work and Python, not its GEMMs, so a rate calibrated minutes
    earlier can be off by a third (docs/planner.md)."""
    configs = CONFIGS if configs is None else configs
    launches, probes = [[] for _ in configs], []
    for _ in range(repeats):
        for i, (name, mesh, change) in enumerate(configs):
            probes.append(run(PROBE_SHAPE, {}, steps=10))
            launches[i].append(run({**SHAPE, **change}, mesh, steps))
    probe = {"step_s": statistics.median(p["step_s"] for p in probes), "load": statistics.median(p["load"] for p in probes)}
    calibrated, rate = machine.mem_bw, elementwise_rate(machine, probe) or machine.mem_bw
    log(f"the probe step beside the launches: median {probe['step_s'] * 1e3:.1f} ms of {len(probes)} "
        f"({min(p['step_s'] for p in probes) * 1e3:.1f}-{max(p['step_s'] for p in probes) * 1e3:.1f}): element-wise "
        f"work at {rate / 1e9:.2f} GB/s (calibrated: {calibrated / 1e9:.2f})")
    machine = replace(machine, mem_bw=rate)
    rows = []
    log(f"{'configuration':<24} {'ranks':>5} {'step ms pred':>12} {'meas':>8} {'err':>6}   "
        f"{'peak MiB pred':>13} {'meas':>8} {'err':>6}")
    for (name, mesh, change), runs in zip(configs, launches):
        shape = {**SHAPE, **change}
        meas = min(runs, key=lambda r: r["step_s"])
        load = meas["load"]  # the machine as it was: other processes' share of the cores during the run
        pred = predict(replace(machine, load=load), shape, mesh, meas["expert_load"])
        t_err = (pred["step_s"] - meas["step_s"]) / meas["step_s"]
        m_err = (pred["peak_bytes"] - meas["peak_bytes"]) / meas["peak_bytes"]
        ranks = plan_of(mesh).devices
        rows.append({"name": name, "mesh": mesh, "shape": shape, "ranks": ranks, "background_load": load,
                     "step_s_predicted": pred["step_s"], "step_s_measured": meas["step_s"], "step_error": t_err,
                     "step_s_launches": [r["step_s"] for r in runs], "loads": [r["load"] for r in runs],
                     "peak_mb_predicted": pred["peak_bytes"] / 2**20, "peak_mb_measured": meas["peak_bytes"] / 2**20,
                     "peak_error": m_err, "time_parts_s": pred["time"],
                     "memory_parts_mb": {k: v / 2**20 for k, v in pred["memory"].items()}})
        spread = max(r["step_s"] for r in runs) / meas["step_s"]
        log(f"{name:<24} {ranks:>5} {1e3 * pred['step_s']:>12.1f} {1e3 * meas['step_s']:>8.1f} {100 * t_err:>+5.0f}%   "
            f"{pred['peak_bytes'] / 2**20:>13.2f} {meas['peak_bytes'] / 2**20:>8.2f} {100 * m_err:>+5.0f}%   "
            f"load {load:.1f}" + (f", slowest launch {spread:.2f}x" if len(runs) > 1 else ""))
        if meas.get("ep_bytes"):  # the all-to-alls' bytes on the ep group, per step and rank
            b_err = (pred["ep_bytes"] - meas["ep_bytes"]) / meas["ep_bytes"]
            rows[-1].update(ep_bytes_predicted=pred["ep_bytes"], ep_bytes_measured=meas["ep_bytes"], ep_bytes_error=b_err)
            rows[-1]["expert_load"] = meas["expert_load"]
            log(f"{'  all-to-all bytes':<30} {pred['ep_bytes']:>12,.0f} {meas['ep_bytes']:>10,.0f} {100 * b_err:>+5.1f}%"
                f"   (priced at the routing measured: busiest ep rank {meas['expert_load']:.2f}x the mean)")
    med_t = statistics.median(abs(r["step_error"]) for r in rows)
    med_m = statistics.median(abs(r["peak_error"]) for r in rows)
    log(f"median |predicted - measured| / measured: step time {100 * med_t:.1f}% (target <= {100 * TARGETS['step']:.0f}%), "
        f"peak memory {100 * med_m:.1f}% (target <= {100 * TARGETS['peak']:.0f}%), over {len(rows)} configurations, "
        f"the fastest of {repeats} launch{'es' * (repeats > 1)} each")
    noise = launch_spread([r["step_s_launches"] for r in rows])
    if noise is not None:
        log(f"the measurement's own noise: two launches of one configuration differ by a median of {100 * noise:.1f}% "
            f"of its step time (docs/planner.md)")
    return {"machine": machine.to_json(), "cores": os.cpu_count(), "steps": steps, "repeats": repeats,
            "probe_step_s": [p["step_s"] for p in probes], "elementwise_bw_calibrated": calibrated,
            "configurations": rows, "median_step_error": med_t, "median_peak_error": med_m, "launch_spread": noise,
            "targets": {"median_step_error": TARGETS["step"], "median_peak_error": TARGETS["peak"]}}


def main(args) -> int:
    path = calibration_path(args.calibration)
    if args.calibrate or not os.path.isfile(path):
        print("calibrating this machine:")
        machine = calibrate(path)
    else:
        machine = load("this-machine", args.calibration)
        print(f"this machine as calibrated at {machine.notes.get('measured', '?')} ({path})")
    t0 = time.perf_counter()
    result = validate(machine, steps=6 if args.quick else 8, configs=CONFIGS[:4] if args.quick else None,
                      repeats=1 if args.quick else args.repeats)
    result["wall_s"] = time.perf_counter() - t0
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0
