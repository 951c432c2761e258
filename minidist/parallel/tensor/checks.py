"""The tensor-parallel settings' checks: pure arithmetic on the run configuration, made on every
rank before any message (``parallel.compose.problems`` gathers every axis's)."""

from __future__ import annotations


def problems(given, cfg) -> list[str]:
    """Why the tensor-parallel settings cannot split this model (one line each; [] if they can).

    ``given``: the run configuration as the user gave it, ``cfg`` resolved.  With context
    parallelism, sequence parallelism splits each rank's ``seq_len / cp`` tokens over tp."""
    p, m = cfg.parallel, cfg.model
    tp, out = p.tp, []
    if p.tp_async and tp == 1:
        out.append(f"--tp-async {p.tp_async} needs --tp greater than 1 (got --tp {tp})")
    if p.sequence_parallel and tp == 1:
        out.append(f"--sequence-parallel needs --tp greater than 1 (got --tp {tp})")
    if tp == 1:
        return out
    for flag, value in (("--heads", m.heads), ("--d-model", m.d_model)):
        if value % tp:
            out.append(f"{flag} {value} is not divisible by --tp {tp}")
    if m.ffn % tp:
        width = f"--ffn-hidden {m.ffn}" if m.arch == "llama" else f"4 x --d-model = {m.ffn}"
        out.append(f"the MLP width {width} is not divisible by --tp {tp}")
    if m.kv % tp and tp % m.kv:
        out.append(f"--kv-heads {m.kv} and --tp {tp}: the key/value heads are split over the tensor-parallel "
                   "ranks or each shared by several, so one must divide the other")
    # Any vocabulary: one tp does not divide is padded (vocab_parallel.py).
    tokens = cfg.data.seq_len // p.cp
    if (p.sequence_parallel or p.tp_async) and tokens % tp:
        what = "--sequence-parallel" if p.sequence_parallel else f"--tp-async {p.tp_async} (sequence parallel)"
        seq = f"--seq-len {cfg.data.seq_len}" + (f" / --cp {p.cp} = {tokens} tokens per rank" if p.cp > 1 else "")
        out.append(f"{seq} is not divisible by --tp {tp}: {what} splits the sequence")
    return out
