"""What a run tells its user: the start-up line, the progress line, the metrics records and
the end-of-run summary table.  Only rank 0 prints and writes; every rank takes part in the
few small gathers a record needs (the pipeline's figures, each rank's peak memory).

Kept out of the training loop (minidist/train/loop.py) so that the loop reads as the algorithm.
"""

from __future__ import annotations

import json
import math

from minidist.train.interrupt import held


class Reporter:
    """Builds each step's metrics record, writes it (``--metrics-jsonl``) and prints progress.

    ``rank0``: this rank prints and writes; ``world``: the number of ranks (records gain the
    mesh, communication time and per-rank peak memory under mpiexec)."""

    def __init__(self, cfg, strategy, world: int, rank0: bool, log=print, peak_gflops: float = 1.0):
        from minidist.observe.profile import flops_per_token
        from minidist.state.shards import describe

        self.cfg, self.strategy, self.world, self.rank0 = cfg, strategy, world, rank0
        self.log = log if rank0 else (lambda *_: None)
        m, d = cfg.model, cfg.data
        self.tokens_per_step = d.batch_size * d.seq_len
        self.flops_per_step = flops_per_token(m, d.seq_len) * self.tokens_per_step
        recomputes = cfg.device.checkpoint_activations or cfg.parallel.zero == 3  # ZeRO-3 recomputes each block
        self.hardware_flops_per_step = self.flops_per_step + self.tokens_per_step * recompute_flops_per_token(
            m, d.seq_len, recomputes)
        self.peak = peak_gflops
        self.bytes_per_token = dict(zip(("train", "val"), describe(d.data).bytes_per_token))
        self.metrics: list[dict] = []
        path = cfg.report.metrics_jsonl
        self.file = open(path, "w") if path and rank0 else None
        self.mesh = mesh_label(cfg.parallel)
        self.router = router_stats(cfg, strategy)

    def bits_per_byte(self, loss: float, split: str = "train") -> float:
        """``loss`` (nats per token) as bits per byte of text: / ln 2, / the split's bytes per
        token (1 for the byte tokenizer), so runs with different tokenizers compare."""
        return float(loss) / math.log(2) / self.bytes_per_token[split]

    def logged(self, step: int) -> bool:
        """Is the progress line of step ``step`` (1..steps) printed?  The first, every
        ``--log-every``-th after it, and the last."""
        steps, every = self.cfg.optim.steps, self.cfg.report.log_every
        return 1 <= step <= steps and ((step - 1) % every == 0 or step == steps)

    def record(self, step, loss, lr, update, step_time, comm_s, peak_bytes, traced, sent=None, held=None) -> dict:
        """The metrics record of step ``step`` (1..steps, as the progress line counts;
        ``update``: what the optimizer half filled in; ``sent``: the bytes this rank sent in
        the step on each group of the mesh; ``held``: strategy.memory_bytes() at the step's
        start, which with ``peak_bytes`` gives the peak memory and its parts)."""
        update = dict(update)
        state = update.pop("state_mb", None)
        capacity = step_time * self.peak * 1e9 * self.world
        r = {"step": step, "loss": loss, "bpb": self.bits_per_byte(loss), "lr": lr, **update, "step_time_s": step_time,
             "tokens_per_s": self.tokens_per_step / step_time,
             "mfu": self.flops_per_step / capacity, "hfu": self.hardware_flops_per_step / capacity}
        r.update(self.strategy.metrics())  # the pipeline's bubble and activation memory (collective)
        if self.router is not None:  # what the routers did, over the global batch (collective)
            m = self.cfg.model
            r["router"] = self.router.step(m.d_model, 2 if self.cfg.device.mixed_precision != "none" else
                                           {"float32": 4, "float64": 8}[m.dtype])
        if self.world > 1:
            r.update(mesh=self.mesh, comm_s=comm_s, comm_exposed_s=self.strategy.comm_wait_s,
                     bytes_sent=dict(sent or {}))
        if traced:
            r["peak_mem_mb"] = peak_bytes / 2**20
            r["state_mb"] = state  # params, grads, optimizer
            if self.world > 1:
                r["rank_peak_mem_mb"] = _per_rank(peak_bytes / 2**20)
            if held is not None and state is not None:
                r["mem_parts_mb"] = memory_parts(held, peak_bytes, state)
                if self.world > 1:
                    r["rank_mem_parts_mb"] = _per_rank_parts(r["mem_parts_mb"])
        return r

    def add(self, r: dict, peak_bytes: int):
        """Keep, write and (every ``--log-every`` steps, and with a validation loss) print ``r``."""
        with held():  # in memory and in the file together, or in neither
            self.metrics.append(r)
            if self.file:
                self.file.write(json.dumps(strict_json(r)) + "\n")
                self.file.flush()
        if not self.cfg.report.quiet and (self.logged(r["step"]) or "val_loss" in r):
            self.log(progress_line(r, self.cfg.optim.steps, self.metrics, peak_bytes))

    def close(self):
        if self.file:
            self.file.close()


def router_stats(cfg, strategy):
    """The router statistics of ``--experts`` runs (minidist/observe/router.py), summed over
    the data-, context- and pipeline-parallel ranks: data-parallel ranks see other rows of the
    batch, context-parallel ranks other tokens of them, pipeline stages hold other mixtures;
    not over tp (its ranks route the same tokens).  None for a dense model, or one whose
    --moe-every passes every block: decided from the whole model, so every stage agrees, a
    stage without a mixture included."""
    if not cfg.model.experts:
        return None
    from minidist.observe.router import RouterStats

    mesh = strategy.mesh
    recomputed = cfg.device.checkpoint_activations or cfg.parallel.zero == 3  # ZeRO-3 recomputes each block
    stats = RouterStats(strategy.model, mesh.group(("dp", "pp", "cp")) if mesh is not None else None, recomputed)
    return stats if stats.L else None


def strict_json(r: dict) -> dict:
    """``r`` as strict JSON accepts it: a non-finite number (a diverged loss, an overflowed
    gradient norm) becomes null, and a record whose loss is not finite says ``"diverged": true``."""
    def clean(v):
        if isinstance(v, float) and not math.isfinite(v):
            return None
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items()}
        if isinstance(v, list):
            return [clean(x) for x in v]
        return v

    out = clean(r)
    if isinstance(r.get("loss"), float) and not math.isfinite(r["loss"]):
        out["diverged"] = True
    return out


def start_line(cfg, train_tokens: int, peak: float, strategy) -> str:
    from minidist.plan.model import num_params
    from minidist.state.shards import describe

    m, d = cfg.model, cfg.data
    num_params = num_params(m)  # the whole model
    arch = f"Llama {m.layers}x{m.d_model}, {m.heads} heads / {m.kv} key-value" if m.arch == "llama" else f"GPT {m.layers}x{m.d_model}"
    info = describe(d.data)
    data = f"{train_tokens:,} training bytes" if info.tokenizer == "bytes" else (
        f"{train_tokens:,} training tokens (tokenizer {info.tokenizer}: {m.vocab_size:,} tokens, "
        f"{info.bytes_per_token[0]:.2f} bytes per token)")
    return (f"minidist: {arch} ({num_params:,} parameters), {data}, "
            f"batch {d.batch_size}x{d.seq_len}, peak {peak:.1f} GFLOP/s per rank for MFU, {strategy.name}")


def mesh_label(p) -> str:
    """The mesh as the metrics name it, e.g. ``dp=2 zero=1 tp=2``."""
    label = f"dp={p.dp}"
    if p.hsdp_shard:
        label += f" (shard {p.hsdp_shard} x replicate {p.dp * p.cp // p.hsdp_shard})"
    if p.zero:
        label += f" zero={p.zero}"
    sizes = p.mesh_sizes()
    for axis in ("tp", "cp", "pp"):  # innermost first, unlike the mesh's AXES: the order metrics names already carry
        if sizes[axis] > 1:
            label += f" {axis}={sizes[axis]}" + (f" ({p.cp_impl})" if axis == "cp" else "")
    return label


def recompute_flops_per_token(model, seq_len: int, recomputes: bool) -> int:
    """FLOPs per token that activation checkpointing adds to a run's model (a ModelConfig):
    one more forward of every block (PaLM, Chowdhery et al. 2022, appendix B: hardware FLOPs
    count them, model FLOPs do not; profile.recompute_flops_per_token, the planner's
    count).  0 without recompute."""
    from minidist.observe.profile import recompute_flops_per_token as per_token

    return per_token(model, seq_len) if recomputes else 0


MEMORY_PARTS = ("params", "grads", "optimizer", "activations")


def memory_parts(held: dict, peak_bytes: int, state_mb: dict) -> dict:
    """Peak memory of the step (MiB) and its parts, from counted arrays: ``held`` (bytes of
    parameters, gradients and optimizer state at the step's start) plus ``peak_bytes`` (the
    most allocated on top during forward and backward) is the peak; ``state_mb`` (MiB held
    after the update) gives parameters and gradients, ``held`` the optimizer state (the
    update creates it on the first step: it was not there at that step's peak); activations
    are the peak minus those three (with the step's temporaries and message buffers)."""
    peak = (sum(held.values()) + (peak_bytes or 0)) / 2**20
    parts = {k: float(state_mb[k]) for k in ("params", "grads")}
    parts["optimizer"] = held["optimizer"] / 2**20
    parts["activations"] = max(peak - sum(parts.values()), 0.0)
    return {"peak": peak, **parts}


def _per_rank_parts(parts: dict) -> list:
    """Every rank's ``mem_parts_mb`` (one all-gather of 5 numbers)."""
    from minidist import comm
    from minidist.model.backend import host

    keys = ("peak",) + MEMORY_PARTS
    rows = comm.all_gather(host.asarray([[parts[k] for k in keys]], dtype=host.float64), comm.world())
    return [{k: float(v) for k, v in zip(keys, row)} for row in rows]


def _per_rank(value: float) -> list:
    """``value`` of every rank, in rank order (a tiny all-gather over the world)."""
    from minidist import comm
    from minidist.model.backend import host  # host numbers: the all-gather stays on the host

    return [float(v) for v in comm.all_gather(host.asarray([value], dtype=host.float64), comm.world())]


def progress_line(r: dict, steps: int, history: list, mem_bytes: int) -> str:
    done = r["step"]
    recent = [h["step_time_s"] for h in history[-20:]]  # recent steps: the first one pays warm-up
    eta = sum(recent) / len(recent) * (steps - done)
    line = (f"step {done:>5}/{steps} | loss {r['loss']:.4f}{_bpb(r, 'bpb')} | lr {r['lr']:.2e} | "
            f"{r['tokens_per_s']:,.0f} tok/s | MFU {100 * r['mfu']:.1f}% | "
            f"mem {mem_bytes / 2**20:.0f} MiB | ETA {int(eta // 60)}m{int(eta % 60):02d}s")
    if "val_loss" in r:
        line += f" | val {r['val_loss']:.4f}{_bpb(r, 'val_bpb')}"
    if r.get("skipped"):
        line += " | skipped (overflow)"
    if "router" in r:
        from minidist.observe.router import progress_text

        line += progress_text(r)
    if "bubble" in r:
        line += (f" | bubble {100 * r['bubble']:.0f}% (theory {100 * r['bubble_theory']:.0f}%)"
                 f" | act {max(r['peak_activation_mb']):.1f} MiB")
    return line


def _bpb(r: dict, key: str, unit: str = "bpb") -> str:
    """`` (1.234 bpb)``: the record's bits per byte, where it has them."""
    return f" ({r[key]:.3f} {unit})" if isinstance(r.get(key), float) and math.isfinite(r[key]) else ""


def summary_table(metrics: list, wall_s: float, expected_bytes: dict | None = None) -> str:
    """The end-of-run table (rank 0): steps, final losses, throughput, MFU, peak memory, time;
    under mpiexec the mesh, communication, and the bytes of the last step on each group of
    the mesh next to ``expected_bytes`` (the formulas of layout/traffic.py, where they apply).

    Throughput and MFU are over the steps after the first (which pays for warm-up), as
    total tokens (FLOPs) over total step time.
    """
    last = metrics[-1]
    timed = metrics[1:] or metrics
    step_s = sum(r["step_time_s"] for r in timed)
    tokens_per_s = sum(r["tokens_per_s"] * r["step_time_s"] for r in timed) / step_s
    mfu = sum(r["mfu"] * r["step_time_s"] for r in timed) / step_s
    vals = [r for r in metrics if "val_loss" in r]
    peaks = [r["peak_mem_mb"] for r in metrics if "peak_mem_mb" in r]
    rows = [
        ("steps", f"{len(metrics)}"),
        ("final train loss", f"{last['loss']:.4f}{_bpb(last, 'bpb', 'bits per byte')}"),
        ("final validation loss", f"{vals[-1]['val_loss']:.4f}{_bpb(vals[-1], 'val_bpb', 'bits per byte')} "
                                  f"(after step {vals[-1]['step']})" if vals
         else "not evaluated (--eval-every 0)"),
        ("tokens/s", f"{tokens_per_s:,.0f}"),
        ("MFU", f"{100 * mfu:.1f}%" + (f" (HFU {100 * sum(r['hfu'] * r['step_time_s'] for r in timed) / step_s:.1f}%)"
                                        if all("hfu" in r for r in timed) else "")),
        ("peak memory of a step", f"{max(peaks):,.0f} MiB" if peaks else "not measured"),
    ]
    rows += _device_rows()
    if "router" in last:
        from minidist.observe.router import summary_row

        rows += summary_row(metrics)
    if timed and "host_reads" in timed[-1]:  # each one waits for the device on a GPU
        reads = timed[-1]["host_reads"]
        rows.append(("host reads in a step", ", ".join(f"{why} {n}" for why, n in sorted(reads.items())) or "none"))
    rows += _breakdown_rows(timed)
    rows += _pipeline_rows(timed)
    rows.append(("wall time", f"{_duration(wall_s)} ({_duration(sum(r['step_time_s'] for r in metrics))} in steps)"))
    expected = {**(expected_bytes or {}), **last.get("router", {}).get("ep_bytes", {})}  # ep: from the routing
    if "mesh" in last:  # under mpiexec: the mesh, and rank 0's communication over the timed steps
        comm_s = sum(r["comm_s"] for r in timed)
        exposed = sum(r["comm_exposed_s"] for r in timed)
        held = next((r["state_mb"] for r in reversed(metrics) if "state_mb" in r), None)
        rows[1:1] = [("mesh", last["mesh"])]
        rows.append(("communication (rank 0)", f"{_duration(comm_s)} in collectives, {_duration(exposed)} "
                                               f"of it waited for after backward"))
        rows.append(("bytes sent per step (rank 0)", _bytes_text(last.get("bytes_sent", {}), expected)))
        if held:
            rows.append(("rank 0 holds", f"{held['params']:.1f} MiB params, {held['grads']:.1f} MiB grads, "
                                         f"{held['optimizer']:.1f} MiB optimizer state"))
    width = max(len(name) for name, _ in rows)
    rule = "-" * (width + 3 + max(len(value) for _, value in rows))
    return "\n".join(["summary", rule] + [f"{name:<{width}} | {value}" for name, value in rows] + [rule])


def mean_breakdown(timed: list) -> dict | None:
    """The mean over ``timed`` of the records' ``time_s`` (the step's time by parts, with
    --trace; None without): compute, comm per group, bubble, optimizer, other."""
    parts = [r["time_s"] for r in timed if "time_s" in r]
    if not parts:
        return None
    n = len(parts)
    out = {k: sum(p[k] for p in parts) / n for k in ("compute", "bubble", "optimizer", "other")}
    groups = sorted({g for p in parts for g in p["comm"]})
    out["comm"] = {g: sum(p["comm"].get(g, 0.0) for p in parts) / n for g in groups}
    return out


def _device_rows() -> list:
    """On a GPU: which one, its memory, and what CuPy's pool holds (the step's peak above is
    the pool's high-water mark during a step)."""
    from minidist.model.backend import device_memory

    dev = device_memory()
    if dev is None:
        return []
    return [("device", f"GPU {dev['device']}: {dev['name']}, {dev['total_bytes'] / 2**30:.1f} GiB; "
                       f"CuPy's memory pool holds {dev['pool_used_bytes'] / 2**20:,.0f} MiB at the end")]


def _breakdown_rows(timed: list) -> list:
    """``time by part (rank 0)``: the mean breakdown, in ms and % of the step (with --trace);
    the largest rank's memory parts at the peak."""
    rows = []
    b = mean_breakdown(timed)
    if b is not None:
        total = sum(v for k, v in b.items() if k != "comm") + sum(b["comm"].values())
        pieces = [("compute", b["compute"])] + [(f"comm {g}", v) for g, v in b["comm"].items()] + \
                 [("bubble", b["bubble"]), ("optimizer", b["optimizer"]), ("other", b["other"])]
        rows.append(("time by part (rank 0)", ", ".join(f"{name} {1e3 * v:.1f} ms ({100 * v / total:.0f}%)"
                                                         for name, v in pieces if v > 0 or name == "compute")))
    parts = [r for r in timed if "mem_parts_mb" in r]
    if parts:
        last = parts[-1]
        ranks = last.get("rank_mem_parts_mb", [last["mem_parts_mb"]])
        top = max(range(len(ranks)), key=lambda i: ranks[i]["peak"])
        p = ranks[top]
        rows.append((f"peak memory, rank {top}", f"{p['peak']:.1f} MiB = " + " + ".join(
            f"{p[k]:.1f} {k}" for k in MEMORY_PARTS) + " (MiB)"))
    return rows


def _bytes_text(sent: dict, expected: dict) -> str:
    """``tp 82,688 B (formula 82,688)``, one entry per group; "none" when nothing was sent."""
    parts = []
    for group in sorted(set(sent) | set(expected)):
        text = f"{group} {sent.get(group, 0):,} B"
        if group in expected:
            text += f" (formula {expected[group]:,})"
        parts.append(text)
    return ", ".join(parts) or "none"


def expected_step_bytes(cfg) -> dict:
    """Rank 0's bytes per step on each group from the closed-form formulas ({} where there is
    no formula: collective matmuls, HSDP)."""
    from minidist.layout.traffic import expected_step_bytes as formula

    try:
        return formula(cfg, rank=0)
    except ValueError:
        return {}


def _pipeline_rows(timed: list) -> list:
    """The pipeline's rows of the summary: bubble (mean over the timed steps) and the largest
    stage's peak activation memory ([] without a pipeline)."""
    timed = [r for r in timed if "bubble" in r]
    if not timed:
        return []
    bubble = sum(r["bubble"] for r in timed) / len(timed)
    peaks = [max(r["peak_activation_mb"]) for r in timed]
    return [("pipeline bubble", f"{100 * bubble:.1f}% measured, {100 * timed[-1]['bubble_theory']:.1f}% theory"),
            ("peak activations of a stage", f"{max(peaks):,.2f} MiB")]


def grid_text(p) -> str:
    """The grid of the mesh ``p`` (a ParallelConfig): each rank's coordinates and which ranks
    form each tp / cp / pp / dp group (tp innermost), printed under the summary."""
    from minidist.layout.mesh import MeshLayout

    return MeshLayout(**p.mesh_sizes()).describe()


def _duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    if seconds < 60:
        return f"{seconds:.1f}s"
    m, s = divmod(int(round(seconds)), 60)
    return f"{m // 60}h{m % 60:02d}m{s:02d}s" if m >= 60 else f"{m}m{s:02d}s"
