"""The data-parallel settings' checks: one line per reason they cannot run, before any message."""

from __future__ import annotations


def problems(given, cfg) -> list[str]:
    """Why the data-parallel settings cannot run (one line each; [] if they can).

    ``given`` is the run configuration as the user gave it, ``cfg`` the same resolved.  The
    gradients are reduced over the ("dp", "cp") group: ZeRO and HSDP shard over it."""
    p, g = cfg.parallel, given.parallel
    rows, accum = cfg.data.batch_size, cfg.device.grad_accum
    out = []
    if rows < p.dp * accum:
        out.append(f"--batch-size {rows} has fewer rows than --dp {p.dp} x --grad-accum {accum} = "
                   f"{p.dp * accum}: a rank would get an empty micro-batch")
    replicas = p.dp * p.cp
    if g.hsdp_shard is not None:
        if g.zero not in (None, 3):
            out.append(f"--hsdp-shard shards with ZeRO-3, but --zero {g.zero} was given")
        elif replicas % g.hsdp_shard:
            over = f"--dp {p.dp} x --cp {p.cp} = {replicas}" if p.cp > 1 else f"--dp {p.dp}"
            out.append(f"--hsdp-shard {g.hsdp_shard} does not divide {over}")
    buckets = [f for f, given_ in (("--bucket-mb", g.bucket_mb is not None), ("--no-overlap", not g.overlap)) if given_]
    if buckets and (replicas == 1 or p.zero == 3):
        why = ("one data-parallel rank reduces no gradients" if replicas == 1 else
               "ZeRO-3 reduce-scatters each block's gradients from its backward, without buckets")
        out.append(f"{' and '.join(buckets)} {'sets' if len(buckets) == 1 else 'set'} the gradient buckets of DDP "
                   f"and ZeRO-1/2, but {why}: leave {'it' if len(buckets) == 1 else 'them'} out")
    if p.zero and replicas == 1:
        flag = f"--hsdp-shard {g.hsdp_shard}" if g.hsdp_shard else f"--zero {p.zero}"
        out.append(f"{flag} shards over the data-parallel ranks, but there is one (--dp 1): "
                   "run under mpiexec with more ranks, or leave it out")
    return out
