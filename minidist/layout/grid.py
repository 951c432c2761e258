"""Who holds what in a 4D-parallel run: every rank's layers, heads, tokens and batch rows.

Llama 3 trained its 405B model on a 4D grid, TP8 · CP16 · PP16 · DP8 = 16,384 GPUs (Llama
Team 2024, *The Llama 3 Herd of Models*, section 3.3.2), extending Megatron-LM's 3D
parallelism (Narayanan et al. 2021, *Efficient Large-Scale Language Model Training on GPU
Clusters Using Megatron-LM*) with context parallelism.  Each rank then holds the
intersection of four cuts of the work:

* ``pp``: its pipeline stage's consecutive blocks (V chunks of them with an interleaved
  schedule; the first stage also holds the embedding, the last the LM head),
* ``tp``: H/tp of the attention heads (and the matching slices of every weight matrix),
* ``cp``: its part of every sequence (ring attention's zig-zag chunks, or Ulysses' T/C),
* ``dp``: its rows of the global batch.

The ranks are ordered as :mod:`minidist.layout.mesh` numbers them: ``tp`` innermost
(consecutive ranks, which share a node's fastest links), then ``cp``, then ``pp``, ``dp``
outermost::

    rank = ((dp * PP + pp) * CP + cp) * TP + tp

:func:`placement` lists it as data, :func:`describe` as a table, :func:`draw` as a PNG.
Pure arithmetic, no MPI: importing this module does not start MPI.
"""

from __future__ import annotations

from minidist.layout.settings import CP_IMPLEMENTATIONS as IMPLEMENTATIONS, cp_unsplit
from minidist.layout.mesh import AXES, MeshLayout
from minidist.layout.split import shard_bounds
from minidist.layout.schedules import layer_range, rank_stages

MAX_DRAWN_RANKS = 256  # beyond this the boxes are too small to read; describe() still works


# ------------------------------------------------------------------ what each coordinate holds
def stage_layers(pp_rank: int, pp: int, n_layer: int, virtual_stages: int = 1) -> list[int]:
    """The blocks of pipeline rank ``pp_rank``: model stage ``c*P + p`` for each chunk c
    (the looping placement of interleaved 1F1B; with V=1 one run of n_layer/P blocks)."""
    return [layer for stage in rank_stages(pp_rank, pp, virtual_stages)
            for layer in layer_range(stage, n_layer, pp * virtual_stages)]


def head_range(tp_rank: int, tp: int, n_head: int) -> range:
    """Megatron-LM's split of attention: tp rank t computes heads [t*H/tp, (t+1)*H/tp)."""
    per = n_head // tp
    return range(tp_rank * per, (tp_rank + 1) * per)


def kv_head_range(tp_rank: int, tp: int, kv_heads: int) -> range:
    """Grouped-query attention's key/value heads on tp rank t: K/tp of them, or where tp > K
    the one head t shares with tp/K ranks (the one its query heads read)."""
    if kv_heads >= tp:
        return head_range(tp_rank, tp, kv_heads)
    return range(tp_rank // (tp // kv_heads), tp_rank // (tp // kv_heads) + 1)


def chunk_starts(rank: int, cp: int, seq_len: int, zigzag: bool = True) -> tuple[list[int], int]:
    """(global start of each of ``rank``'s chunks, chunk length).

    Zig-zag: chunks ``rank`` and ``2 * cp - 1 - rank`` of ``2 * cp``; else the ``rank``-th of ``cp``.
    """
    if zigzag:
        c = seq_len // (2 * cp)
        return [rank * c, (2 * cp - 1 - rank) * c], c
    c = seq_len // cp
    return [rank * c], c


def ring_tiles(cp: int, seq_len: int, zigzag: bool = True, block: int | None = None) -> list[tuple[int, int]]:
    """(tiles, scores) each cp rank's ring attention computes in forward, per sequence and
    head: the ``block`` x ``block`` tiles of the online softmax (default: a whole chunk) that
    the causal mask does not skip, and their scores (a tile on the diagonal counts whole, as
    it is computed whole).  Ring attention meets every chunk pair of the rank's queries and
    every rank's keys; a tile is skipped when its first key comes after its last query."""
    out = []
    for r in range(cp):
        mine, c = chunk_starts(r, cp, seq_len, zigzag)
        b = c if block is None else min(block, c)
        tiles = scores = 0
        for src in range(cp):
            for qa in mine:
                for kb in chunk_starts(src, cp, seq_len, zigzag)[0]:
                    for i0 in range(0, c, b):
                        rows = min(b, c - i0)
                        for j0 in range(0, c, b):
                            if kb + j0 > qa + i0 + rows - 1:
                                break  # causal: this tile and the later key tiles of the row are skipped
                            tiles, scores = tiles + 1, scores + rows * min(b, c - j0)
        out.append((tiles, scores))
    return out


def token_ranges(cp_rank: int, cp: int, seq_len: int, cp_impl: str = "ring") -> list[range]:
    """The sequence positions cp rank r holds between attentions.

    Ring attention uses the zig-zag layout (:func:`chunk_starts`): 2C equal chunks, rank r
    takes chunks r and 2C-1-r, so under the causal mask every rank has the same number of
    scores to compute.  Ulysses keeps a contiguous T/C: its all-to-all gathers the sequence
    in rank order.
    """
    if cp == 1:
        return [range(seq_len)]
    starts, c = chunk_starts(cp_rank, cp, seq_len, zigzag=cp_impl == "ring")
    return [range(s, s + c) for s in starts]


def ulysses_heads(tp_rank: int, tp: int, cp_rank: int, cp: int, n_head: int) -> range:
    """Inside Ulysses' attention a cp rank holds the whole sequence for 1/C of its tp rank's
    heads: the all-to-all splits the local heads in cp-rank order."""
    local = head_range(tp_rank, tp, n_head)
    per = len(local) // cp
    return range(local.start + cp_rank * per, local.start + (cp_rank + 1) * per)


def batch_rows(dp_rank: int, dp: int, batch_size: int) -> range:
    """The global batch rows of data-parallel rank ``dp_rank`` (``np.array_split`` blocks,
    as ``minidist.layout.split.shard``: the first ``batch_size % dp`` ranks get one row more)."""
    return range(*shard_bounds(batch_size, dp_rank, dp))


def _check(dp, pp, tp, cp, n_layer, n_head, seq_len, batch_size, grad_accum, virtual_stages, cp_impl, kv_heads):
    """ValueError naming the size that the grid cannot split evenly (as the training flags do)."""
    sizes = dict(dp=dp, pp=pp, tp=tp, cp=cp, n_layer=n_layer, n_head=n_head, seq_len=seq_len,
                 batch_size=batch_size, grad_accum=grad_accum, virtual_stages=virtual_stages, kv_heads=kv_heads)
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive int")
    if cp_impl not in IMPLEMENTATIONS:
        raise ValueError(f"unknown cp_impl {cp_impl!r}; choose from {IMPLEMENTATIONS}")
    if n_layer % (pp * virtual_stages):
        raise ValueError(f"{n_layer} layers cannot be cut into pp {pp} x virtual_stages {virtual_stages} equal stages")
    if n_head % tp:
        raise ValueError(f"{n_head} heads are not divisible by tp = {tp}")
    if n_head % kv_heads or (kv_heads % tp and tp % kv_heads):
        raise ValueError(f"{kv_heads} key/value heads must divide the {n_head} heads, and divide or be "
                         f"divided by tp = {tp}")
    if cp_unsplit(cp, cp_impl, seq_len, n_head // tp):
        if cp_impl == "ring":
            raise ValueError(f"seq_len {seq_len} is not divisible by 2 x cp = {2 * cp} (zig-zag: two chunks per rank)")
        raise ValueError(f"Ulysses needs seq_len {seq_len} and the {n_head // tp} heads of a tp rank "
                         f"divisible by cp = {cp}")
    if batch_size < dp * grad_accum:
        raise ValueError(f"batch_size {batch_size} has fewer rows than dp {dp} x grad_accum {grad_accum}")


def placement(dp: int, pp: int, tp: int, cp: int, n_layer: int, n_head: int, seq_len: int, batch_size: int,
              grad_accum: int = 1, virtual_stages: int = 1, cp_impl: str = "ring",
              kv_heads: int | None = None) -> list[dict]:
    """One dict per world rank, in rank order: its coordinates and what it holds.

    Keys: ``rank``, ``dp``, ``pp``, ``cp``, ``tp``; ``layers`` (block indices), ``embed`` /
    ``lm_head`` (first / last pipeline stage), ``heads`` (a range), ``tokens`` (a list of
    ranges of sequence positions), ``rows`` (a range of global batch rows), ``micro_batches``
    (``rows`` cut into ``grad_accum`` ranges), and for Ulysses ``attention_heads`` (the heads
    it holds, over the whole sequence, inside attention); with ``kv_heads`` (grouped-query
    attention, fewer than ``n_head``) ``kv_heads``, the key/value heads it holds.
    """
    kv = n_head if kv_heads is None else kv_heads
    _check(dp, pp, tp, cp, n_layer, n_head, seq_len, batch_size, grad_accum, virtual_stages, cp_impl, kv)
    layout = MeshLayout(dp=dp, pp=pp, tp=tp, cp=cp)
    out = []
    for rank in range(layout.world_size):
        c = layout.coords(rank)
        rows = batch_rows(c["dp"], dp, batch_size)
        entry = {"rank": rank, **c,
                 "layers": stage_layers(c["pp"], pp, n_layer, virtual_stages),
                 "embed": c["pp"] == 0, "lm_head": c["pp"] == pp - 1,
                 "heads": head_range(c["tp"], tp, n_head),
                 "tokens": token_ranges(c["cp"], cp, seq_len, cp_impl),
                 "rows": rows,
                 "micro_batches": [range(rows.start + a, rows.start + b)
                                   for a, b in (shard_bounds(len(rows), i, grad_accum) for i in range(grad_accum))]}
        if cp > 1 and cp_impl == "ulysses":
            entry["attention_heads"] = ulysses_heads(c["tp"], tp, c["cp"], cp, n_head)
        if kv != n_head:
            entry["kv_heads"] = kv_head_range(c["tp"], tp, kv)
        out.append(entry)
    return out


# ------------------------------------------------------------------ text
def runs(values) -> str:
    """``[0, 1, 2, 3, 12, 13]`` -> ``"0-3,12-13"`` (ranges and lists of ranges also work)."""
    if isinstance(values, range):
        values = list(values)
    elif values and isinstance(values[0], range):
        values = [v for r in values for v in r]
    values = sorted(values)
    if not values:
        return "-"
    parts, start = [], values[0]
    for prev, v in zip(values, values[1:] + [None]):
        if v != prev + 1:
            parts.append(str(start) if start == prev else f"{start}-{prev}")
            start = v
    return ",".join(parts)


GROUP_NOTES = {
    "tp": "all-reduce activations in every layer: consecutive ranks, the fastest links",
    "cp": "K/V blocks passed around the ring in every attention",
    "cp ulysses": "two all-to-alls in every attention, tokens <-> heads",
    "pp": "activations forward, gradients back, between neighbouring stages",
    "dp": "gradients once per step: outermost, may cross the slowest network",
}


def describe(dp: int, pp: int, tp: int, cp: int, n_layer: int, n_head: int, seq_len: int, batch_size: int,
             grad_accum: int = 1, virtual_stages: int = 1, cp_impl: str = "ring", kv_heads: int | None = None) -> str:
    """The grid as text: one line per rank, then the groups of each axis (innermost first).

    ``rank  5  dp0 pp1 cp0 tp1 | layers 2-3 +lm_head | heads 2-3 | tokens 0-3,12-15 | rows 0-3``
    (with grouped-query attention ``heads 2-3 kv 0``: query heads, then key/value heads)
    """
    table = placement(dp, pp, tp, cp, n_layer, n_head, seq_len, batch_size, grad_accum, virtual_stages, cp_impl,
                      kv_heads)
    layout = MeshLayout(dp=dp, pp=pp, tp=tp, cp=cp)
    lines = [f"4D grid dp={dp} x pp={pp} x cp={cp} x tp={tp} = {len(table)} ranks "
             "(tp innermost: consecutive ranks; dp outermost)",
             f"model: {n_layer} layers" + (f" in {pp * virtual_stages} stages ({virtual_stages} per pp rank)"
                                          if virtual_stages > 1 else "")
             + f", {n_head} heads" + (f" sharing {kv_heads} key/value heads" if kv_heads not in (None, n_head) else "")
             + f"; sequence {seq_len} tokens"
             + (f" ({'zig-zag ring' if cp_impl == 'ring' else 'Ulysses'})" if cp > 1 else "")
             + f"; global batch {batch_size} rows" + (f", {grad_accum} micro-batches" if grad_accum > 1 else "")]
    rows = [_rank_fields(p, len(str(len(table) - 1)), seq_len) for p in table]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines += [" | ".join(f.ljust(w) for f, w in zip(r, widths)).rstrip() for r in rows]
    for axis in reversed(AXES):
        groups = " ".join("[" + " ".join(map(str, g)) + "]" for g in layout.partition(axis))
        key = "cp ulysses" if axis == "cp" and cp_impl == "ulysses" else axis
        note = "size 1: every rank alone" if layout.shape[axis] == 1 else GROUP_NOTES[key]
        lines.append(f"{axis} groups: {groups}  ({note})")
    return "\n".join(lines)


def _rank_fields(p: dict, digits: int, seq_len: int) -> list[str]:
    """The columns of one rank's line in :func:`describe`."""
    fields = [f"rank {p['rank']:>{digits}}  " + " ".join(f"{a}{p[a]}" for a in AXES),
              f"layers {runs(p['layers'])}" + (" +embed" if p["embed"] else "") + (" +lm_head" if p["lm_head"] else ""),
              f"heads {runs(p['heads'])}" + (f" kv {runs(p['kv_heads'])}" if "kv_heads" in p else ""),
              f"tokens {runs(p['tokens'])}", f"rows {runs(p['rows'])}"]
    if len(p["micro_batches"]) > 1:
        fields[-1] += " (micro-batches " + " ".join(runs(m) for m in p["micro_batches"]) + ")"
    if "attention_heads" in p:  # Ulysses: the all-to-all trades tokens for heads inside attention
        fields.append(f"in attention: heads {runs(p['attention_heads'])} x tokens 0-{seq_len - 1}")
    return fields


# ------------------------------------------------------------------ picture
MAX_COLUMNS = 8  # wider than this, the cp axis moves from the columns to the rows


def draw(dp: int, pp: int, tp: int, cp: int, n_layer: int, n_head: int, seq_len: int, batch_size: int,
         path: str, grad_accum: int = 1, virtual_stages: int = 1, cp_impl: str = "ring",
         kv_heads: int | None = None) -> None:
    """Draw the grid into the PNG ``path`` (needs matplotlib: ``pip install 'minidist[plot]'``).

    One box per rank, in the spirit of the Llama 3 paper's 4D-parallelism figure: a row per
    (dp, pp) and a column per (cp, tp), so ranks read in order left to right, top to bottom
    (with more than 8 columns cp moves into the rows); boxes coloured by pipeline stage, tp
    groups outlined, a frame around each data-parallel replica.  Each box names the rank,
    its coordinates, layers, heads, tokens and batch rows.
    """
    try:
        import matplotlib
    except ImportError:
        raise ImportError("draw() needs matplotlib, which is not installed: pip install 'minidist[plot]' "
                          "(or pip install matplotlib); describe() gives the same grid as text") from None
    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    table = placement(dp, pp, tp, cp, n_layer, n_head, seq_len, batch_size, grad_accum, virtual_stages, cp_impl,
                      kv_heads)
    if len(table) > MAX_DRAWN_RANKS:
        raise ValueError(f"{len(table)} ranks are too many to draw legibly (at most {MAX_DRAWN_RANKS}); "
                         "use describe()")
    W, H, gap = 2.2, 1.25, 0.25  # box size in inches; the gap between cp blocks (half between replicas)
    if cp > 1 and cp_impl == "ulysses":
        H += 0.15  # room for the line of the heads held inside attention
    cp_cols = cp if cp * tp <= MAX_COLUMNS else 1  # cp blocks side by side, or stacked in the rows
    cp_rows = cp // cp_cols

    def x_of(c):  # columns: cp outer, tp inner, a gap after each tp group
        k = c["cp"] % cp_cols
        return (k * tp + c["tp"]) * W + k * gap

    def y_of(c):  # rows: dp outer, pp inner (then cp, if it is not in the columns)
        row = (c["dp"] * pp + c["pp"]) * cp_rows + c["cp"] // cp_cols
        return -(row * H + c["dp"] * 2 * gap)

    width = cp_cols * tp * W + (cp_cols - 1) * gap
    height = dp * pp * cp_rows * H + (dp - 1) * 2 * gap
    fig, ax = plt.subplots(figsize=(max(width + 1.4, 7.5), height + 1.9))  # at least the title's width
    colours = plt.get_cmap("Pastel1" if pp <= 9 else "tab20").colors
    for p in table:
        x, y = x_of(p), y_of(p)
        ax.add_patch(Rectangle((x + 0.04, y - H + 0.04), W - 0.08, H - 0.08, facecolor=colours[p["pp"] % len(colours)],
                               edgecolor="black", linewidth=0.8))
        ax.text(x + W / 2, y - 0.2, f"rank {p['rank']}", ha="center", va="center", fontsize=10, weight="bold")
        ax.text(x + W / 2, y - 0.34, "  ".join(f"{a}{p[a]}" for a in AXES), ha="center", va="top",
                fontsize=7, color="0.35")
        ax.text(x + 0.14, y - 0.52, "\n".join(_box_lines(p)), ha="left", va="top", fontsize=7.5,
                family="monospace", linespacing=1.25)
    for group in MeshLayout(dp=dp, pp=pp, tp=tp, cp=cp).partition("tp") if tp > 1 else []:
        c = table[group[0]]
        ax.add_patch(Rectangle((x_of(c), y_of(c) - H), tp * W, H, fill=False, edgecolor="tab:blue",
                               linewidth=1.6, linestyle="--"))
    for k in range(cp if cp_cols == cp > 1 else 0):  # what each column block of the sequence holds
        x = x_of({"cp": k, "tp": 0})
        ax.text(x + tp * W / 2, 0.12, f"cp {k}: tokens {runs(token_ranges(k, cp, seq_len, cp_impl))}",
                ha="center", va="bottom", fontsize=9)
    for d in range(dp):
        top = y_of({"dp": d, "pp": 0, "cp": 0})
        ax.add_patch(Rectangle((-0.08, top - pp * cp_rows * H - 0.08), width + 0.16, pp * cp_rows * H + 0.16,
                               fill=False, edgecolor="0.3", linewidth=1.2))
        ax.text(-0.2, top - pp * cp_rows * H / 2, f"dp {d}: rows {runs(batch_rows(d, dp, batch_size))}",
                rotation=90, ha="right", va="center", fontsize=9)
    legend = [Patch(facecolor=colours[s % len(colours)], edgecolor="black",
                    label=f"pp stage {s}: layers {runs(stage_layers(s, pp, n_layer, virtual_stages))}"
                    + (" +embed" if s == 0 else "") + (" +lm_head" if s == pp - 1 else ""))
              for s in range(pp)]
    if tp > 1:
        legend.append(Patch(fill=False, edgecolor="tab:blue", linestyle="--",
                            label=f"tp group: consecutive ranks, heads split {tp} ways"))
    ax.legend(handles=legend, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=min(len(legend), 3),
              fontsize=8, frameon=False)
    ax.set_title(f"4D parallelism: dp={dp} x pp={pp} x cp={cp} x tp={tp} = {len(table)} ranks "
                 f"(tp innermost, dp outermost)\n{n_layer} layers, {n_head} heads, {seq_len} tokens"
                 + (f" ({'zig-zag ring' if cp_impl == 'ring' else 'Ulysses'})" if cp > 1 else "")
                 + f", batch {batch_size} rows", fontsize=10)
    ax.set_xlim(-0.6, width + 0.2)
    ax.set_ylim(-height - 0.2, 0.45)
    ax.set_aspect("equal")
    ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _box_lines(p: dict) -> list[str]:
    extra = ("+embed " if p["embed"] else "") + ("+lm_head" if p["lm_head"] else "")
    lines = [f"layers {runs(p['layers'])} {extra}".rstrip(), f"heads  {runs(p['heads'])}" + (f" kv {runs(p['kv_heads'])}" if "kv_heads" in p else ""),
             f"tokens {runs(p['tokens'])}", f"rows   {runs(p['rows'])}"]
    if "attention_heads" in p:  # Ulysses: inside attention, fewer heads over the whole sequence
        lines.append(f"attn:  heads {runs(p['attention_heads'])} x all tokens")
    return lines
