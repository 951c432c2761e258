"""Device operations per training step: the GPU's launch floor, counted on a CPU.

On a GPU every array operation is at least one kernel launch (~5-10 us of launch latency, plus
the framework's own Python or C++ overhead per call), so the number of device operations a
training step issues sets a floor under its time however fast the GPU computes: 10,000
operations at ~10 us each are 0.1 s a step.  This benchmark counts them without a GPU.

minidist: its CuPy code path under the CuPy emulator (tests/emulated_gpu, in a subprocess with
``MINIDIST_BACKEND=cupy``), whose ``cupy._emulator`` counts every call that launches work: a
ufunc, operator, function or method that writes a device array or allocates a new one (views,
``empty`` and no-op conversions count nothing), indexing that copies, setitem, a host->device
copy, a fused function, ElementwiseKernel or RawKernel launch as one each.  Device->host
copies (the loss, the clipping norm) are counted apart.

PyTorch eager (minidist/model/torch_reference.py's TorchGPT, as benchmarks/bench_gpu.py runs it),
profiled on the CPU with torch.profiler.  The rule: an ``aten::_foreach_*`` or fused optimizer
op counts as one launch (CUDA's multi_tensor_apply launches one kernel per group of tensors,
so this is a lower bound), its children are not looked at; otherwise an aten op with no aten
op below it counts as one launch unless it only makes a view, allocates, or reads metadata
(NO_KERNEL below) -- so ``aten::linear`` counts as its ``aten::addmm``, ``aten::to`` as its
``aten::copy_``.  ``aten::_local_scalar_dense`` (``.item()``) is not counted: in this step
PyTorch reads only AdamW's step counts, host tensors on a GPU too (the loss stays a tensor,
clipping reads nothing back).  AdamW and gradient clipping run with ``foreach=True``,
PyTorch's default on CUDA (on the CPU they default to a loop over the tensors).

The model is bench_gpu.py's GPT (12 layers, 12 heads, d_model 768, seq 1024, batch 8) with the
same number of layers and heads but a smaller d_model, sequence and batch (COUNT_SHAPE): the
number of operations does not depend on the sizes (no loop runs over rows, tiles or elements
on the host; the blockwise attention is cuda.flash's kernels, one launch per call).  Each
count is checked at a second size (SIZE_CHECK_SHAPE) and the result says whether they
agree.  A step is forward, backward, gradient clipping at 1.0 and the AdamW update, counted
after one warm-up step; fp32 and ``--mixed-precision bf16`` (PyTorch: bf16 autocast), with
minidist's plain attention and its blockwise one (cuda.flash's RawKernels under the emulator,
which compiles them as C++ for the CPU: that row is skipped without a C++ compiler).

    python benchmarks/bench_launches.py [--quick] [--out DIR]

``--quick``: 2 layers instead of 12 (every count scales with the layers), 8 tokens a step, no size check.
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EMULATOR = os.path.join(ROOT, "tests", "emulated_gpu")
GPU_SHAPE = dict(n_layer=12, n_head=12, d_model=768, seq_len=1024, batch=8)  # bench_gpu.py's SHAPE
COUNT_SHAPE = dict(n_layer=12, n_head=12, d_model=96, seq_len=32, batch=2)  # the same layers and heads
# Another width, sequence, batch and number of rows (80 against 64).  The emulator's time grows
# with rows x width: at d_model 192 and 192 rows one mode took minutes, and the four together ran
# past the child's ten-minute limit.
SIZE_CHECK_SHAPE = dict(n_layer=12, n_head=12, d_model=144, seq_len=16, batch=5)
# --quick: 2 layers, and 8 rows of tokens instead of 64: the counts do not depend on the rows (the
# full run checks that at SIZE_CHECK_SHAPE), but the emulator runs every CUDA kernel thread by
# thread on the CPU, so its time does (seq 32 x batch 2 took three times as long).
QUICK_SHAPE = dict(n_layer=2, n_head=12, d_model=96, seq_len=8, batch=1)
# (mode, --mixed-precision, minidist's attention); PyTorch runs its own fused attention in each.
MODES = (("fp32", "none", "plain"), ("bf16", "bf16", "plain"),
         ("fp32 flash", "none", "blockwise"), ("bf16 flash", "bf16", "blockwise"))

# aten ops that launch nothing on a GPU: views, allocation, metadata.
NO_KERNEL = {
    "aten::empty", "aten::empty_strided", "aten::empty_like", "aten::resize_", "aten::view", "aten::_unsafe_view",
    "aten::reshape", "aten::_reshape_alias", "aten::as_strided", "aten::transpose", "aten::t", "aten::permute",
    "aten::expand", "aten::expand_as", "aten::select", "aten::slice", "aten::unsqueeze", "aten::squeeze",
    "aten::alias", "aten::detach", "aten::detach_", "aten::lift_fresh", "aten::unbind", "aten::split",
    "aten::chunk", "aten::narrow", "aten::view_as", "aten::contiguous", "aten::result_type", "aten::size",
    "aten::stride", "aten::numel", "aten::dim", "aten::is_same_size", "aten::broadcast_tensors",
    "aten::set_", "aten::_has_compatible_shallow_copy_type", "aten::flatten", "aten::unflatten",
    "aten::to", "aten::type_as", "aten::_to_copy", "aten::movedim", "aten::swapaxes", "aten::matrix_H",
    "aten::numpy_T", "aten::mT", "aten::is_nonzero", "aten::resolve_conj", "aten::resolve_neg",
    "aten::_conj", "aten::conj", "aten::item",
}
TO_HOST = {"aten::_local_scalar_dense"}


def _minidist_counts(shape: dict, modes, steps_warm: int = 1) -> dict:
    """In the emulated-CuPy subprocess: {mode: counts} of one training step after warm-up."""
    import numpy as np

    from cupy import _emulator

    from minidist.model.backend import to_host
    from minidist.layout.model import ModelConfig
    from minidist.model.nn import GPT
    from minidist.model.optim import AdamW
    from minidist.parallel.data import OneReplica
    from minidist.parallel.strategy import Strategy
    from minidist.train.loop import precision, update

    s = shape
    rng = np.random.default_rng(0)
    seq = rng.integers(0, 256, size=(s["batch"], s["seq_len"] + 1))
    x, y = seq[:, :-1], seq[:, 1:]
    out = {}
    for mode, low_name, attention in modes:
        model = GPT(ModelConfig(block_size=s["seq_len"], layers=s["n_layer"], heads=s["n_head"], d_model=s["d_model"],
                                dtype="float32", attention=attention))
        strategy = Strategy(model, OneReplica(model, AdamW(model.parameters(), lr=1e-4, weight_decay=0.1,
                                                           betas=(0.9, 0.95), eps=1e-8)))
        low, scaler = precision(low_name)

        def step():
            loss = strategy.forward_backward(x, y, 1, low, scaler.scale if scaler else 1.0)
            fb = _emulator.op_count()
            update(strategy, scaler, 1.0)
            return loss, fb

        for _ in range(steps_warm):
            step()
        _emulator.reset()
        loss, fb = step()
        ops = _emulator.operations()
        d2h = _emulator.transfers("d2h")
        total = sum(ops.values())
        kinds = collections.Counter()
        for kind, n in ops.items():
            kinds[kind.split(":")[0]] += n
        out[mode] = {"ops": total, "forward_backward": fb, "update": total - fb, "d2h_copies": len(d2h),
                     "by_kind": dict(kinds), "top": ops.most_common(12),
                     "kernel_launches": {k: n for k, n in ops.items() if k.startswith("RawKernel:")},
                     "loss": float(to_host(loss)) if not isinstance(loss, float) else loss}
    return out


def minidist_child(args) -> None:
    """The subprocess: count every mode at args.shape, print one JSON line."""
    shape = json.loads(args.child)
    modes = [m for m in MODES if m[0] in json.loads(args.modes)]
    print("RESULT " + json.dumps(_minidist_counts(shape, modes)), flush=True)


def run_minidist(shape: dict, modes) -> dict:
    """Counts of minidist's step under the emulator (a subprocess: the backend is chosen at import)."""
    env = dict(os.environ, MINIDIST_BACKEND="cupy", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(p for p in (EMULATOR, ROOT, os.environ.get("PYTHONPATH")) if p))
    env.pop("MINIDIST_EMULATED_TRANSFER_LOG", None)
    r = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", json.dumps(shape),
                        "--modes", json.dumps([m[0] for m in modes])],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    if r.returncode or not lines:
        raise RuntimeError(f"the emulated minidist run failed (exit {r.returncode}):\n"
                           f"{r.stdout[-2000:]}{r.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def torch_launches(roots) -> tuple[collections.Counter, int]:
    """(launches by aten op name, top-level ops) of a torch.profiler run.  Launches, by the rule
    in this module's docstring: the innermost aten ops that do work (an op whose aten
    descendants only make views, allocate or read metadata counts once: aten::linear counts as
    its aten::addmm, aten::cross_entropy_loss as its log_softmax and nll_loss).  Top-level ops:
    the outermost aten op of each call that does any work (the operators as the model's Python
    code, the optimizer and the autograd engine call them), one each: a lower figure."""
    launches, top = collections.Counter(), 0

    def visit(ev, outer: bool) -> int:
        nonlocal top
        name = ev.name
        aten = name.startswith("aten::")
        if name.startswith(("aten::_foreach_", "aten::_fused_")):
            launches[name] += 1
            n = 1
        else:
            n = sum(visit(c, outer and not aten) for c in ev.cpu_children)
            if not n and aten and name not in NO_KERNEL and name not in TO_HOST:
                launches[name] += 1
                n = 1
        if aten and outer and n:
            top += 1
        return n

    for ev in roots:  # a profile's events (its top-level ones are walked) or chosen subtrees
        if ev.cpu_parent is None or ev.name == UPDATE_RANGE:
            visit(ev, True)
    return launches, top


UPDATE_RANGE = "minidist-bench: update"  # the torch.profiler range around clipping and AdamW's step


def run_torch(shape: dict, modes) -> dict:
    """PyTorch eager's launches per step of the same model on the CPU (profiler), fp32 and bf16
    autocast; {mode: counts} ('fp32', 'bf16': its attention is the same in the flash rows)."""
    import numpy as np
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from minidist.model.backend import to_host
    from minidist.layout.model import ModelConfig
    from minidist.model.nn import GPT
    from minidist.model.torch_reference import TorchGPT

    s = shape
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = GPT(ModelConfig(block_size=s["seq_len"], layers=s["n_layer"], heads=s["n_head"], d_model=s["d_model"],
                            dtype="float32"))
    state = {k: to_host(v) for k, v in model.state_dict().items()}
    rng = np.random.default_rng(0)
    seq = rng.integers(0, 256, size=(s["batch"], s["seq_len"] + 1))
    tx, ty = torch.tensor(seq[:, :-1]), torch.tensor(seq[:, 1:])
    out = {}
    for mode in sorted({m[0].split()[0] for m in modes}, key=["fp32", "bf16"].index):
        ref = TorchGPT(state, s["n_head"], torch.float32)
        opt = torch.optim.AdamW(ref.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                                foreach=True)

        def step():
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "bf16"):
                loss = ref(tx, ty)
            loss.backward()
            with record_function(UPDATE_RANGE):
                torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0, foreach=True)
                opt.step()
            return loss

        step()  # warm-up: the optimizer's state is created in the first step
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step()
        events = prof.events()
        launches, top = torch_launches(events)
        update, _ = torch_launches([e for e in events if e.name == UPDATE_RANGE])
        total = sum(launches.values())
        out[mode] = {"ops": total, "forward_backward": total - sum(update.values()), "update": sum(update.values()),
                     "top_level_ops": top, "top": launches.most_common(12), "all": dict(launches),
                     "foreach_ops": sum(n for k, n in launches.items() if k.startswith("aten::_foreach_"))}
    return out


def compiler_missing() -> str | None:
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    try:
        import cuda_on_cpu  # tests/cuda_on_cpu.py: how the emulator runs RawModule kernels

        return None if cuda_on_cpu.compiler() is not None else "no C++ compiler to run the CUDA kernels on the CPU"
    finally:
        sys.path.pop(0)


def measure(quick: bool) -> dict:
    shape = QUICK_SHAPE if quick else COUNT_SHAPE
    missing = compiler_missing()
    modes = [m for m in MODES if not (m[2] == "blockwise" and missing)]
    result = {"shape": shape, "model": GPU_SHAPE if not quick else dict(GPU_SHAPE, n_layer=shape["n_layer"]),
              "modes": {}, "skipped_modes": {m[0]: missing for m in MODES if m not in modes}}
    md = run_minidist(shape, modes)
    check = run_minidist(dict(SIZE_CHECK_SHAPE, n_layer=shape["n_layer"]), modes) if not quick else None
    if importlib.util.find_spec("torch") is not None:
        pt, why_no_torch = run_torch(shape, modes), None
    else:
        pt, why_no_torch = {}, "PyTorch is not installed (pip install -e '.[torch]')"
    for mode, _, attention in modes:
        row = {"attention": attention, "minidist": md[mode]}
        if check is not None:
            row["minidist_at_other_size"] = check[mode]["ops"]
            row["size_independent"] = check[mode]["ops"] == md[mode]["ops"]
        t = pt.get(mode.split()[0])
        if t is not None:
            row["torch"] = t
            row["ratio"] = md[mode]["ops"] / t["ops"]
        result["modes"][mode] = row
    if why_no_torch:
        result["torch_skipped"] = why_no_torch
    return result


def table(result: dict) -> str:
    layers = result["shape"]["n_layer"]
    lines = [f"device operations per training step ({layers} layers, {result['shape']['n_head']} heads; "
             "forward + backward + clip + AdamW, after a warm-up step)",
             f"{'':<11} {'---------- minidist ----------':>30}  {'------ PyTorch eager ------':>27}",
             f"{'mode':<11} {'ops':>7} {'fwd+bwd':>8} {'update':>7} {'d2h':>4}  {'ops':>7} {'fwd+bwd':>8} {'update':>7}"
             f"  {'ratio':>6}"]
    for mode, r in result["modes"].items():
        m, t = r["minidist"], r.get("torch")
        pt = f"{t['ops']:>7,} {t['forward_backward']:>8,} {t['update']:>7,}" if t else f"{'n/a':>24}"
        ratio = f"{r['ratio']:>6.2f}" if t else f"{'':>6}"
        size = "" if "size_independent" not in r else ("" if r["size_independent"] else
                                                      f"  (other size: {r['minidist_at_other_size']:,}!)")
        lines.append(f"{mode:<11} {m['ops']:>7,} {m['forward_backward']:>8,} {m['update']:>7,} {m['d2h_copies']:>4}  "
                     f"{pt}  {ratio}{size}")
    for mode, why in result.get("skipped_modes", {}).items():
        lines.append(f"{mode:<11} skipped: {why}")
    if result.get("torch_skipped"):
        lines.append(f"PyTorch: skipped: {result['torch_skipped']}")
    floor = [(mode, r["minidist"]["ops"]) for mode, r in result["modes"].items()]
    if floor:
        mode, n = floor[0]
        lines.append(f"launch floor at 10 us an operation: minidist {mode} {n * 10e-6 * 1e3:.0f} ms a step"
                     + (f", PyTorch {result['modes'][mode]['torch']['ops'] * 10e-6 * 1e3:.0f} ms"
                        if "torch" in result["modes"][mode] else ""))
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 layers, no second-size check (seconds)")
    ap.add_argument("--out", default=None, help="directory for launches.json")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--modes", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        minidist_child(args)
        return
    result = measure(args.quick)
    result["title"] = "device operations per training step: the GPU launch floor"
    summary = []
    for mode, r in result["modes"].items():
        if "ratio" in r:
            summary.append({"figure": f"minidist / PyTorch device ops per step, {mode}", "value": r["ratio"],
                            "note": f"{r['minidist']['ops']:,} vs {r['torch']['ops']:,} ({result['shape']['n_layer']} "
                                    "layers); <1: fewer launches than PyTorch eager"})
        else:
            summary.append({"figure": f"minidist device ops per step, {mode}", "value": r["minidist"]["ops"],
                            "note": "PyTorch not counted"})
    result["summary"] = summary
    print(table(result))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "launches.json"), "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    main()
