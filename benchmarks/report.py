"""One report of `make bench`: the machine, then every benchmark's headline ratios.

    python benchmarks/report.py [--out bench-results]

Each benchmark writes its own JSON into the results directory; this script reads them and
writes ``REPORT.md`` there (and ``report.png``, a bar chart of the same ratios, when
matplotlib is installed).  Every figure is a ratio measured inside one run of its
benchmark (minidist vs MPI's built-ins, vs PyTorch, vs one rank, measured vs formula),
never an absolute time compared across runs: the machines these run on are shared and
noisy.  A benchmark that did not run (or was skipped) is listed as such.

Each reader below knows one benchmark's JSON and returns its rows: (figure, value, what the
value means).  A benchmark that writes a ``"summary"`` list of such rows needs no reader.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys


def _fmt(value) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, str):
        return value
    return f"{value:.2f}" if abs(value) < 100 else f"{value:,.0f}"


def _cell(text) -> str:
    return str(text).replace("|", "\\|")  # a table cell's own bars must not end it


def machine() -> list[str]:
    """What the figures were measured on, one line each."""
    lines = []
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            names = [ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    lines.append(f"CPU: {cpu}, {os.cpu_count()} logical cores")
    try:
        with open("/proc/meminfo") as f:
            total_kb = int(next(ln for ln in f if ln.startswith("MemTotal")).split()[1])
        lines.append(f"memory: {total_kb / 2**20:.1f} GiB")
    except (OSError, StopIteration, ValueError):
        pass
    lines.append(f"OS: {platform.platform()}; Python {platform.python_version()}")
    try:
        import numpy

        blas = ""
        try:
            cfg = numpy.show_config(mode="dicts")
            blas = " with " + cfg["Build Dependencies"]["blas"]["name"]
        except Exception:  # older NumPy: no dict form
            pass
        lines.append(f"NumPy {numpy.__version__}{blas}")
    except ImportError:
        pass
    try:
        from mpi4py import MPI

        lines.append(f"MPI: {MPI.Get_library_version().splitlines()[0].strip()} (mpi4py)")
    except Exception:
        lines.append("MPI: not available")
    try:
        import torch

        lines.append(f"PyTorch {torch.__version__} (the comparison)")
    except ImportError:
        lines.append("PyTorch: not installed (its comparisons are skipped)")
    except Exception as exc:  # a broken installation: say so, the report goes on
        lines.append(f"PyTorch: fails to import ({type(exc).__name__}: {exc})")
    try:
        load = os.getloadavg()
        lines.append(f"load average when the report was written: {load[0]:.2f} (1 min), {load[1]:.2f} (5 min)")
    except OSError:
        pass
    return lines


# ----------------------------------------------------------------------- one reader each
def _collectives(d):
    rows = []
    for r in d.get("results", []):
        rows.append((f"{r['collective']} {r['ranks']} ranks {r['bytes']:,} B: MPI time / minidist time", r["ratio"],
                     f"median of {r.get('launches', 1)} launch(es), range {_fmt(r['ratio_min'])}..{_fmt(r['ratio_max'])}; "
                     ">1: minidist faster"))
    return rows


def _model(d):
    return [(f"GPT step, {r['threads']} BLAS thread(s): minidist / PyTorch tokens/s", r["ratio"],
             f"MFU minidist {100 * r['minidist']['mfu']:.0f}%, PyTorch {100 * r['torch']['mfu']:.0f}% "
             f"of a {r['peak_gflops']:.0f} GFLOP/s GEMM") for r in d.get("results", [])]


def _llama(d):
    return [(f"Llama step, {r['threads']} BLAS thread(s): minidist / PyTorch tokens/s", r["ratio"],
             f"CPU-time ratio {r['cpu_ratio']:.2f}; MFU minidist {100 * r['minidist']['mfu']:.0f}%, "
             f"PyTorch {100 * r['torch']['mfu']:.0f}%") for r in d.get("results", [])]


def _ddp(d):
    rows = [("DDP 2 ranks / 1 rank tokens/s (minidist)", d.get("minidist_scaling_2_over_1"), "weak scaling"),
            ("DDP 2 ranks / 1 rank tokens/s (PyTorch DDP, gloo)", d.get("torch_scaling_2_over_1"), "weak scaling"),
            ("minidist DDP / PyTorch DDP tokens/s, 2 ranks", d.get("minidist_2_over_torch_2"), ">1: minidist faster")]
    for name, share in (d.get("hidden_share") or {}).items():
        rows.append((f"share of the gradient reduction hidden behind backward, {name}", share,
                     "1: fully overlapped"))
    for z in (1, 2, 3):
        v = d.get(f"zero{z}_step_time_over_ddp")
        if v is not None:
            rows.append((f"ZeRO-{z} step time / DDP step time", v, "the price of sharding on this machine"))
    return rows


def _tensor(d):
    rows = []
    for mode, r in (d.get("mlp", {}).get("modes") or {}).items():
        if mode != "sync":
            rows.append((f"TP MLP, collective matmul ({mode}) speed-up vs synchronous", r["speedup_vs_sync"],
                         f"share of the ideal overlap {_fmt(r.get('share_of_ideal'))}"))
    for name, v in (d.get("gpt", {}).get("ratio_vs_1_rank") or {}).items():
        if name != "1 rank":
            rows.append((f"GPT {name} / 1 rank tokens/s", v, "2 ranks on the same cores"))
    return rows


def _context(d):
    one = d.get("one_rank", {})
    rows = [("blockwise / plain attention step time, one rank", one.get("time_ratio"), f"seq {one.get('seq')}"),
            ("blockwise / plain attention peak memory", one.get("attention_memory_ratio"), "attention's own arrays")]
    cp = d.get("cp2", {})
    base = (cp.get("one rank (blockwise)") or {}).get("tokens_per_s")
    for name, r in cp.items():
        if isinstance(r, dict) and name.startswith(("ring", "ulysses")) and base:
            rows.append((f"{name} / one rank tokens/s", r["tokens_per_s"] / base,
                         f"attention bytes sent {r['attention_bytes_sent']:,}"))
    return rows


def _pipeline(d):
    rows = []
    for res in d.get("results", []):
        for r in res.get("rows", []):
            v = f" V={r['V']}" if r.get("V", 1) > 1 else ""
            rows.append((f"{r['schedule']}{v} P={r['P']} M={r['M']}: measured bubble / formula",
                         r["bubble_measured"] / r["bubble_theory"] if r.get("bubble_theory") else None,
                         f"measured {_fmt(r['bubble_measured'])}, formula {_fmt(r['bubble_theory'])}, "
                         f"simulated with the measured times {_fmt(r.get('bubble_replayed'))}; "
                         f"{_fmt(r['speedup_vs_1_rank'])}x one rank"))
    return rows


def _compose(d):
    rows = []
    for r in d.get("results", []):
        if r["mesh"] == "1 rank":
            continue
        exact = r.get("bytes_sent_last_step") == r.get("expected_bytes")
        rows.append((f"{r['mesh']} / 1 rank tokens/s", r["vs_one_rank"],
                     "bytes per axis equal the formula" if exact else "bytes per axis differ from the formula"))
    return rows


def _oversubscribed(d):
    return [(f"{r['arm']} / one process tokens/s, {d.get('cores')} cores", r["median_vs_one_process"],
             f"{r['median_tokens_per_s']:,.0f} tokens/s; target >= {d.get('target', 0.25)} for 8 ranks")
            for r in d.get("results", []) if r["arm"].startswith("8 ranks")]


def _checkpoint(d):
    return [(f"checkpoint save at {d.get('mesh')}: sharded / gathered-by-rank-0 time", d["sharded_save_s"] / d["gathered_save_s"],
             f"{max(d['bytes_written_per_rank']):,} B per rank vs {d['whole_bytes']:,} B whole"),
            ("--save-async: share of the save hidden behind training", d.get("hidden_share"), "target >= 0.8")]


def _moe(d):
    return [(f"{name}: step time / dense step time", r["over_dense"],
             f"{r['tokens_per_s']:,.0f} tokens/s, {r['parameters']:,} parameters")
            for name, r in d.get("arms", {}).items() if not name.startswith("dense")]


def _data(d):
    rows = [(f"prepare ({label}): MB of text per CPU-second", r["mb_per_cpu_s"],
             f"{r['bytes']:,} B, {r['mb_per_s']:.2f} MB/s wall; target >= {d['targets']['prepare_mb_per_cpu_s']}")
            for label, r in d.get("prepare", {}).items()]
    load = d["loading"]
    rows.append(("batches from memory-mapped shards: added share of a training step", load["overhead"],
                 f"step {load['step_s'] * 1e3:.1f} ms, batch {load['batch_from_shards_s'] * 1e6:.0f} us "
                 f"(in memory {load['batch_from_memory_s'] * 1e6:.0f} us); target <= {d['targets']['loading_overhead']}"))
    return rows


def _tracing(d):
    return [(f"traced / untraced step time - 1, {mesh}", r["overhead"],
             f"{r['spans_per_traced_step']:.0f} spans per step; target <= {d.get('target', 0.1):.2f}")
            for mesh, r in d.get("meshes", {}).items()]


def _plan(d):
    v = d.get("validation", {})
    n = len(v.get("configurations", []))
    t = v.get("targets", {})
    rows = [(f"planner here: median relative error of the predicted step time, {n} runs", v.get("median_step_error"),
             f"target <= {t.get('median_step_error', 0.10):.2f}" + (
                 f"; two launches of one configuration differ by a median of {v['launch_spread']:.2f}"
                 if v.get("launch_spread") is not None else "")),
            (f"planner here: median relative error of the predicted peak memory, {n} runs", v.get("median_peak_error"),
             f"target <= {t.get('median_peak_error', 0.10):.2f}")]
    for r in d.get("llama3_405b", []):
        m = r["mesh"]
        rows.append((f"Llama 3 405B, {r['devices']:,} GPUs, seq {r['seq_len']:,}: predicted / published MFU",
                     r["predicted_mfu"] / r["published_mfu"],
                     f"TP{m['tp']} CP{m['cp']} PP{m['pp']} DP{m['dp']}: {100 * r['predicted_mfu']:.1f}% vs "
                     f"{100 * r['published_mfu']:.0f}%, place {r['rank']} of {r['meshes_ranked']}"))
    return rows


READERS = {
    "plan.json": ("the planner vs real runs and Llama 3", _plan),
    "tracing.json": ("tracing overhead", _tracing),
    "collectives.json": ("collectives vs MPI's built-ins", _collectives),
    "model_step.json": ("a training step vs PyTorch", _model),
    "llama_step.json": ("a Llama training step vs PyTorch", _llama),
    "ddp.json": ("data parallelism vs PyTorch DDP", _ddp),
    "tensor_parallel.json": ("tensor parallelism: overlap", _tensor),
    "context.json": ("long sequences", _context),
    "pipeline.json": ("pipeline bubbles vs formula", _pipeline),
    "compose.json": ("4D composition", _compose),
    "oversubscribed.json": ("more ranks than cores", _oversubscribed),
    "checkpoint.json": ("checkpoints", _checkpoint),
    "data.json": ("token data: prepare and memory-mapped shards", _data),
    "moe.json": ("a mixture-of-experts step vs dense", _moe),
}


def _summary_rows(d):
    return [(r["figure"], r.get("value"), r.get("note", "")) for r in d.get("summary", [])]


def sections(out: str, since: float | None = None) -> list[tuple[str, str, list]]:
    """(file, title, rows) for every result file in ``out``: known ones through their reader,
    others through their ``summary``; a file that says it was skipped gives its reason, and
    one written before ``since`` (a part that did not run this time) is named, not shown."""
    import time

    found = []
    for name in sorted(os.listdir(out)) if os.path.isdir(out) else []:
        if not name.endswith(".json") or name == "run_all.json":
            continue
        written = os.path.getmtime(os.path.join(out, name))
        if since is not None and written < since:
            when = time.strftime("%Y-%m-%d %H:%M", time.localtime(written))
            found.append((name, READERS.get(name, (name[:-5],))[0],
                          [("not run this time", None, f"the file is from an earlier run ({when}): not shown")]))
            continue
        try:
            with open(os.path.join(out, name)) as f:
                data = json.load(f)
        except (OSError, ValueError) as exc:
            found.append((name, name, [("unreadable", None, str(exc))]))
            continue
        title, reader = READERS.get(name, (data.get("title", name[:-5]) if isinstance(data, dict) else name,
                                           _summary_rows))
        if isinstance(data, dict) and data.get("skipped"):
            found.append((name, title, [("skipped", None, str(data["skipped"]))]))
            continue
        try:
            rows = reader(data) if isinstance(data, dict) else []
        except (KeyError, TypeError, ZeroDivisionError) as exc:
            rows = [("could not be read", None, f"{type(exc).__name__}: {exc}")]
        found.append((name, title, rows or [("no headline figures", None, "see the JSON")]))
    return found


def markdown(out: str, since: float | None = None) -> str:
    parts = ["# minidist benchmark report", "",
             "Every figure is a ratio measured within one run of its benchmark; the JSON beside this "
             "file holds every sample.", "", "## The machine", ""]
    parts += [f"- {ln}" for ln in machine()]
    for name, title, rows in sections(out, since):
        parts += ["", f"## {title} (`{name}`)", "", "| figure | value | note |", "| --- | ---: | --- |"]
        parts += [f"| {_cell(fig)} | {_fmt(v)} | {_cell(note)} |" for fig, v, note in rows]
    return "\n".join(parts) + "\n"


def plot(out: str, path: str, since: float | None = None) -> bool:
    """A bar chart of every numeric figure, one panel per benchmark; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    panels = [(title, [(fig, v) for fig, v, _ in rows if isinstance(v, (int, float))])
              for _, title, rows in sections(out, since)]
    panels = [p for p in panels if p[1]]
    if not panels:
        return False
    fig, axes = plt.subplots(len(panels), 1, figsize=(10, 1.2 + sum(0.32 * len(r) + 0.6 for _, r in panels)),
                             gridspec_kw={"height_ratios": [len(r) + 1 for _, r in panels]}, squeeze=False)
    for ax, (title, rows) in zip(axes[:, 0], panels):
        labels, values = [r[0] for r in rows], [r[1] for r in rows]
        ax.barh(range(len(rows)), values, color="#4c72b0")
        ax.axvline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_yticks(range(len(rows)), [lb if len(lb) < 70 else lb[:67] + "..." for lb in labels], fontsize=7)
        ax.invert_yaxis()
        ax.set_title(title, fontsize=9, loc="left")
        ax.tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write(out: str, since: float | None = None) -> list[str]:
    """Write REPORT.md (and report.png when matplotlib is there) into ``out``; their paths.
    ``since``: when this run of the benchmarks began (older results are only named)."""
    written = [os.path.join(out, "REPORT.md")]
    with open(written[0], "w") as f:
        f.write(markdown(out, since))
    if plot(out, os.path.join(out, "report.png"), since):
        written.append(os.path.join(out, "report.png"))
    return written


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench-results", help="the directory of the benchmarks' JSON results")
    args = ap.parse_args(argv)
    if not os.path.isdir(args.out):
        ap.error(f"--out {args.out}: no such directory (run `make bench` first)")
    for path in write(args.out):
        print(f"report: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
