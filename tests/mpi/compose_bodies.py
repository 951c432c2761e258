"""Bodies of tests/test_compose.py: every mesh trains like one process (run under mpiexec)."""
import dataclasses
import json
import sys

import numpy as np

from minidist import comm
from minidist.backend import from_host, to_host
from minidist.config import RunConfig
from minidist.parallel.compose import problems
from minidist.testing import train_steps

STEPS = 5
BASE = RunConfig().replace(model=dict(layers=4, d_model=16, heads=4, dtype="float64"),
                           data=dict(seq_len=8, batch_size=8),
                           optim=dict(steps=STEPS, lr=1e-2, warmup=1, clip_grad=0.05),
                           report=dict(eval_every=0))
_SECTION = {f.name: section for section in ("model", "data", "optim", "device", "parallel", "report")
            for f in dataclasses.fields(getattr(BASE, section))}


def config(**flat) -> RunConfig:
    """BASE with fields changed by name, whatever their section (``tp=2, grad_accum=2``)."""
    sections = {}
    if flat.get("pp", 1) > 1:
        flat = {"microbatches": 2, **flat}
    for key, value in flat.items():
        sections.setdefault(_SECTION[key], {})[key] = value
    return BASE.replace(**sections)


def _rel(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-300))


def _serial(cfg):
    """The single-process run of the same model, data and global batch."""
    one = dataclasses.replace(cfg.parallel, dp=1, pp=1, tp=1, cp=1, zero=None, hsdp_shard=None,
                              sequence_parallel=False, tp_async=None, cp_impl=None, schedule=None,
                              microbatches=None, virtual_stages=None)
    return train_steps(dataclasses.replace(cfg, parallel=one).resolved(1), STEPS)


def equal_to_one_process(variants_json: str):
    """Each variant (a JSON list of flat overrides) trains 5 steps equal to one process:
    losses, the final validation loss and every parameter this rank holds, to 1e-9 in
    float64; with mixed precision (float32 master weights, bf16/fp16 compute) the losses
    to 2e-2, as round-off in 8 or 11 bits of mantissa allows."""
    world = comm.world()
    worst = 0.0
    for flat in json.loads(variants_json):
        given = config(**flat)
        assert not problems(given, world.size), problems(given, world.size)
        cfg = given.resolved(world.size)
        assert cfg.parallel.world_size == world.size, (flat, cfg.parallel)
        ref_losses, ref_params, _ = _serial(cfg)
        losses, params, sharding = train_steps(cfg, STEPS)
        errs = [_rel(losses, ref_losses)]
        for name, value in params.items():
            want = ref_params[name]
            if sharding[name] is not None:
                want = to_host(sharding[name].take(from_host(want)))  # take() works on the device
            errs.append(_rel(value, want))
        low = cfg.device.mixed_precision != "none"
        err = errs[0] if low else max(errs)
        tol = 2e-2 if low else 1e-9
        label = " ".join(f"{k}={v}" for k, v in flat.items())
        assert np.all(np.isfinite(losses)), f"rank {world.rank}: {label}: losses {losses}"
        assert err <= tol, f"rank {world.rank}: {label}: relative difference {err:.2e} from one process"
        worst = max(worst, err)
        if world.rank == 0:
            print(f"equal to one process: {label} (rel {err:.1e}, {len(params)} parameters here)", flush=True)
    if world.rank == 0:
        print(f"worst rel {worst:.2e}", flush=True)


if __name__ == "__main__":
    equal_to_one_process(sys.argv[1])
