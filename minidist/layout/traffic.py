"""Bytes one rank sends per optimizer step on each mesh axis, in closed form (no MPI).

``comm.stats.bytes_by_group()`` measures what a rank sent on each group; the functions here
predict it for one GPT training step (``strategy.forward_backward`` then ``train.update``,
the model and strategy from ``parallel.compose.build``) from the mesh, this rank's
coordinates, the model and the step's settings.  They are exact, to the byte, for the code
as it stands: tests/test_axis_bytes.py measures steps on real meshes and compares.  Each
axis is one function, each collective's cost one function:

* the **algorithms** (collective_bytes.py): what each collective sends per rank,
  for the algorithm the comm layer picks at that size;
* the **parameters** a rank holds (rank_params.py), which its gradient reduction sends;
* the **axes**: :func:`dp_bytes` (gradient reduction: DDP, ZeRO-1/2) and :func:`fsdp_bytes`
  (ZeRO-3), :func:`tp_bytes` (Megatron-LM), :func:`cp_bytes` (Ring Attention,
  DeepSpeed-Ulysses), :func:`pp_bytes` (activations and gradients between stages, the tied
  embedding);
* :func:`step_bytes` puts them together: ``{"dp", "pp", "tp", "cp", "world"} -> bytes``.
  "dp" is the traffic on the data-parallel *reduction* group, the ("dp", "cp") group
  (context-parallel ranks see different tokens of the same sequences, so their gradients
  are summed too); "world" the scalars every rank agrees on.  :func:`group_names` gives the
  name ``comm.Mesh`` gives each of these groups ("dp+cp"; "world" for a group of every
  rank), and :func:`by_group` re-keys a result by them, as ``bytes_by_group`` reports.

Mixtures of experts (model/moe.py) are counted: their parameters (the router, E whole MLPs
replicated over tp), reduced with the dense ones, or with expert parallelism over the "edp"
group (parallel/data/experts.py; ZeRO-3: each block's experts a unit of their own); the whole
sequences tp gathers for them and the routing choices cp gathers (parallel/expert/tokens.py);
the loss all-reduced over the pipeline with the stages' auxiliary losses.  The ep group's
dispatch and combine depend on the routing: layout/expert_traffic.py, from the step's
routing (observe/router.py).
The Llama family's blocks are counted too (``arch="llama"``: :func:`step_bytes`).  Mixed
precision and experts together are not checked by the tests.

The scalar collectives of a step travel too and are counted, each a float64 all-reduce of
one element (recursive doubling: 8 bytes per round, log2(N) rounds on 2^k ranks): the loss
summed over the reduction group, the squared gradient norm (``clip_grad``) and the fp16
overflow flag (``fp16``) over the world (parallel/strategy.py), and on a pipeline the loss
broadcast from the last stage after every pass.  Reporting is not part of a step and not
counted: the pipeline's metrics gather, the per-rank peak memory all-gather, evaluation;
nor is the check mode's signature exchange (MINIDIST_CHECK_COLLECTIVES=1).

Not covered (``step_bytes`` raises ValueError): collective matmuls (``--tp-async``) and
HSDP.  Mixed precision (``act_itemsize`` 2: the activations' low dtype) is exact where the
tests check it (bf16/fp16 with dp, pp, cp, Ulysses, tp without sequence parallelism, ZeRO-3):
reductions send 4 bytes per element (float32 accumulation, comm/reduction.py), the loss and
ring attention compute in float32.  Sequence parallelism under mixed precision is not checked.
"""

from __future__ import annotations

from minidist.layout.collective_bytes import (acc_itemsize, all_gather_bytes, all_reduce_bytes, broadcast_bytes,
                                              reduce_scatter_bytes)
from minidist.layout.mesh import AXES, MeshLayout
from minidist.layout.model import ModelConfig
from minidist.layout.rank_params import kv_heads_here, rank_params
from minidist.layout.schedules import LOOPING, layer_range, placement_of, rank_stages, stage_location
from minidist.layout.split import split_sizes


SCALAR = 8  # a float64 scalar (loss, squared norm, overflow flag) as one all-reduce element


def buckets(numels: list[int], itemsize: int, bucket_mb: float) -> list[int]:
    """Elements of each gradient bucket (data.make_buckets): parameters in reverse order,
    a new bucket when the next would pass ``bucket_mb`` MiB (one dtype throughout)."""
    cap, out, size = bucket_mb * 2**20, [], None
    for numel in reversed(numels):
        nbytes = numel * itemsize
        if size is not None and size + nbytes > cap:
            out.append(size // itemsize)
            size = None
        size = nbytes if size is None else size + nbytes
    if size is not None:
        out.append(size // itemsize)
    return out


# ------------------------------------------------------------------ the data-parallel axis


def dp_bytes(numels: list[int], itemsize: int, n: int, r: int, zero: int = 0, bucket_mb: float = 25.0,
             micro_steps: int = 1) -> int:
    """Gradient reduction of one step over the data-parallel group (n ranks, this rank r),
    for this rank's parameters ``numels`` (its stage's, its tensor-parallel slices):

    * DDP / ZeRO-1: each bucket all-reduced once per step (after the last micro-step),
      2(N-1)/N Ψ b for large buckets by a bandwidth-optimal algorithm (Patarasuk & Yuan
      2009; PyTorch DDP, Li et al. 2020), log2(N) Ψ b for small ones (recursive doubling);
    * ZeRO-2 (Rajbhandari et al. 2020): each bucket reduce-scattered every micro-step,
      (N-1)/N Ψ b; after the update ZeRO-1/2 all-gather each bucket's updated shard
      (np.array_split pieces of the flat bucket), (N-1)/N Ψ b.
    ZeRO-3 is :func:`fsdp_bytes`."""
    if n == 1:
        return 0
    total = 0
    for numel in buckets(numels, itemsize, bucket_mb):
        if zero == 2:
            total += micro_steps * reduce_scatter_bytes(numel, 1, itemsize, n, r)
        else:
            total += all_reduce_bytes(numel, itemsize, n, r)
        if zero in (1, 2):
            total += all_gather_bytes(split_sizes(numel, n), itemsize, r)  # a 1-d shard: a row is an element
    return total


def fsdp_bytes(units: list[int], itemsize: int, n: int, r: int, passes: list[list[tuple]]) -> int:
    """ZeRO-3 / FSDP (Zhao et al. 2023; fsdp.py) over n ranks: ``units`` = [root unit
    (embeddings, final LayerNorm, head; 0 on a middle pipeline stage), block 1, 2, ...] in
    elements; ``passes``: per micro-step (or pipeline pass) the compute actions, ("F" or "B",
    the block units of the chunk).  A pass gathers the root and prefetches block 1; a block's
    forward gathers it (unless already gathered or prefetched), prefetches the next, frees it;
    its backward, recomputing it, gathers it again and prefetches the one before; a pass ends
    reduce-scattering each block's and the root's gradient.  Without a pipeline: the root
    once, every block twice, each unit reduce-scattered once, per micro-step.  An empty unit
    (0 elements) sends nothing: with expert parallelism the experts' units, gathered and
    scattered with their blocks over the edp group, are this list with 0 for the root and the
    blocks without a mixture."""
    if n == 1:
        return 0
    gather = [all_gather_bytes(split_sizes(u, n), itemsize, r) for u in units]
    scatter = [reduce_scatter_bytes(u, 1, itemsize, n, r) for u in units]
    total = 0
    for actions in passes:
        live = set()

        def launch(i):
            nonlocal total
            if 0 <= i < len(units) and units[i] and i not in live:
                live.add(i)
                total += gather[i]

        launch(0)
        launch(1)
        for op, blocks in actions:
            for i in (blocks if op == "F" else reversed(blocks)):
                launch(i)
                launch(i + 1 if op == "F" else i - 1 if i > 1 else -1)
                live.discard(i)
                total += scatter[i] if op == "B" else 0
        total += scatter[0] if units[0] else 0
    return total


def compute_actions(pp: int, pp_rank: int, schedule: str | None, microbatches: int, virtual_stages: int,
                    chunk_units: list[list[int]]) -> list[tuple]:
    """This rank's compute actions of one pass, ("F" | "B", the block units of the chunk): the
    pipeline schedule's (schedules.py, pure data), or one forward and one backward."""
    if pp == 1:
        return [("F", chunk_units[0]), ("B", chunk_units[0])]
    from minidist.layout.schedules import COMPUTE, make_schedule

    actions = make_schedule(schedule, pp, microbatches, virtual_stages).actions[pp_rank]
    return [(a.op, chunk_units[a.chunk]) for a in actions if a.op in COMPUTE]


# ------------------------------------------------------------------ the tensor-parallel axis


def tp_bytes(rows: list[int], tokens: int, d_model: int, n_layer: int, block_size: int, tp: int, r: int,
             itemsize: int, act_itemsize: int, sequence_parallel: bool = False, checkpoint: bool = False,
             embed: bool = True, head: bool = True, mixtures: int = 0, llama: bool = False) -> int:
    """Megatron-LM (Shoeybi et al. 2019) over ``tp`` ranks, summed over the micro-batches of
    ``rows[k]`` sequences of ``tokens`` tokens each (``n_layer``: this rank's blocks; ``embed``
    / ``head``: it runs the embedding / the LM head and loss).  Per micro-batch, with
    X = rows x tokens x d_model activations and n = rows x tokens:

    * without sequence parallelism: an all-reduce of X where the vocabulary-parallel
      embedding's partial sums meet, 2 per block forward (g after attention and MLP), 2 per
      block backward (f's gradient before them), 2 more per block when checkpointed blocks
      are recomputed, 1 backward at the LM head's input (f); the vocabulary-parallel
      cross-entropy all-reduces the per-token max (n values) and the sums (2n);
    * sequence parallelism (Korthikanti et al. 2022): each all-reduce becomes an all-gather
      of the sequence before a column-parallel layer and a reduce-scatter after a row-parallel
      one, and backward gathers each column-parallel input again for its weight gradient;
      the replicated parameters used on a sequence shard (LayerNorms, row-parallel biases,
      the position table) have their gradients all-reduced (f).

    ``mixtures`` of the ``n_layer`` blocks hold a mixture of experts, replicated over tp
    (parallel/expert/tokens.py): only the attention's half of the block's collectives remain;
    with sequence parallelism the mixture all-gathers the sequence before routing (again when
    recomputed), and its output slice's backward all-gathers the gradient.  ``llama``: the
    replicated parameters are RMSNorm weights alone (no biases, no position table)."""
    if tp == 1:
        return 0
    ce_itemsize = max(act_itemsize, 4)  # the loss computes in float32 at least (ops.precision)
    ar = lambda k, b=act_itemsize: all_reduce_bytes(k, b, tp, r)  # noqa: E731
    total = 0
    for rows_k in rows:
        n = rows_k * tokens
        loss = ar(n, ce_itemsize) + ar(2 * n, ce_itemsize)
        if not sequence_parallel:
            per_block = ar(n * d_model) * (3 if checkpoint else 2)  # one g forward (twice recomputed), one f back
            blocks = (2 * n_layer - mixtures) * per_block  # a dense block's MLP as many again
            total += blocks + embed * ar(n * d_model, itemsize) + head * (ar(n * d_model) + loss)
            continue
        gather = lambda b: all_gather_bytes(split_sizes(tokens, tp), rows_k * d_model * b, r)  # noqa: E731  (by token)
        ag, rs = gather(act_itemsize), reduce_scatter_bytes(tokens, rows_k * d_model, act_itemsize, tp, r)
        small = lambda k: ar(k, itemsize)  # noqa: E731  (a replicated parameter's gradient)
        # attention or MLP: forward g (gather) and f (scatter), again when recomputed; backward
        # the two swapped and the input gathered again for the weight's gradient; the row bias
        half = (ag + rs) * (2 if checkpoint else 1) + 2 * ag + rs + (0 if llama else small(d_model))
        norm = small(d_model if llama else 2 * d_model)  # a LayerNorm's weight and bias, an RMSNorm's weight
        moe = ag * (2 if checkpoint else 1) + ag  # the mixture's sequence gathered; its output slice's backward
        per_block = 2 * half + 2 * norm
        per_mixture = half + 2 * norm + moe
        # the embedding's partial sums (parameter dtype) scattered, their gradient gathered; wpe's gradient
        embedding = rs + gather(itemsize) + (0 if llama else small(block_size * d_model))
        lm_head = norm + ag + rs + ag + loss  # ln_f; logits: gather, backward scatter + gather
        total += (n_layer - mixtures) * per_block + mixtures * per_mixture + embed * embedding + head * lm_head
    return total


# ------------------------------------------------------------------ the context-parallel axis


def cp_bytes(rows: list[int], tokens: int, d_local: int, n_layer: int, cp: int, r: int, act_itemsize: int,
             impl: str = "ring", checkpoint: bool = False, mixtures: int = 0, top_k: int = 0,
             qkv_local: int | None = None) -> int:
    """Attention over ``cp`` ranks holding ``tokens`` tokens each of every sequence, per block
    and micro-batch of ``rows[k]`` sequences (``d_local``: this rank's heads x head size):

    * Ring Attention (Liu et al. 2023; context.ring_attention): one K|V block,
      2 x rows x tokens x d_local values, per ppermute step: C-1 steps forward, backward C-1
      K|V steps again plus C steps of their gradients travelling home (3C-2 messages;
      C-1 more when the block is recomputed).  The blocks travel in the attention's compute
      dtype: float32 under mixed precision (ops.precision.gemm_operands);
    * DeepSpeed-Ulysses (Jacobs et al. 2023): all-to-all of Q|K|V (3 x) to heads and of the
      output (1 x) back, each sending (C-1)/C of its bytes, and the same two backward.
      ``qkv_local``: the width of this rank's Q|K|V when its key/value heads are fewer
      (grouped-query attention: context/ulysses.py sends them as they are where cp divides
      them, else repeated for their query heads, 3 x ``d_local``); ring attention always
      passes them repeated.

    Each of the ``mixtures`` blocks with a mixture of experts decides capacity and the
    balancing loss's shares from the whole sequences' routing (parallel/expert/tokens.py):
    it all-gathers the ranks' ``top_k`` choices per token, int64 (again when recomputed)."""
    if cp == 1:
        return 0
    total = 0
    for rows_k in rows:
        x = rows_k * tokens * d_local * act_itemsize
        if impl == "ring":
            messages = (cp - 1) * (2 if checkpoint else 1) + (cp - 1) + cp
            total += n_layer * messages * 2 * x // act_itemsize * acc_itemsize(act_itemsize)
        elif impl == "ulysses":
            q = rows_k * tokens * (qkv_local or 3 * d_local) * act_itemsize
            forward = q - q // cp + x - x // cp  # (C-1)/C of Q|K|V and of the output; the heads divide evenly
            total += n_layer * forward * (3 if checkpoint else 2)
        else:
            raise ValueError(f"cp_bytes: unknown implementation {impl!r}")
        total += mixtures * all_gather_bytes([tokens] * cp, rows_k * top_k * 8, r) * (2 if checkpoint else 1)
    return total


# ------------------------------------------------------------------ the pipeline axis


def pp_bytes(passes: list[list[int]], tokens: int, d_model: int, pp: int, pp_rank: int, virtual_stages: int,
             act_itemsize: int, tied_numel: int = 0, itemsize: int = 4, tied_swaps: int = 1,
             placement: str = LOOPING, experts: bool = False) -> int:
    """Activations and gradients between pipeline stages (GPipe, Huang et al. 2019; 1F1B,
    Narayanan et al. 2019; interleaved, Narayanan et al. 2021), per pass of ``passes[k]``
    microbatch rows (one pass per gradient-accumulation part): every chunk but the model's
    last sends each microbatch's output, rows x tokens x d_model values, to the next stage's
    rank, every chunk but the first sends its input's gradient back, unless that neighbour is
    on the same rank (with the looping placement never for P > 1; ZB-V's V shape turns at rank
    P-1, whose two chunks hand over locally: ``placement``).  After each pass the last stage
    broadcasts the loss (one float64); a model with ``experts`` all-reduces it instead, each
    stage adding its mixtures' auxiliary losses (pipeline/runtime.py).  Before each gradient
    reduction (``tied_swaps``: once per step, or every micro-step for ZeRO-2/3) the first and
    last stages swap their ``tied_numel``-element parts of the tied embedding's gradient
    (Megatron-LM's embedding group), unless one rank holds both (the V shape's rank 0)."""
    if pp == 1:
        return 0
    S = pp * virtual_stages
    stages = rank_stages(pp_rank, pp, virtual_stages, placement)
    elsewhere = lambda s: stage_location(s, pp, placement)[0] != pp_rank  # noqa: E731
    sends = sum(s < S - 1 and elsewhere(s + 1) for s in stages) + sum(s > 0 and elsewhere(s - 1) for s in stages)
    total = 0
    for rows in passes:
        total += sends * sum(rows) * tokens * d_model * act_itemsize
        total += all_reduce_bytes(1, SCALAR, pp, pp_rank) if experts else \
            broadcast_bytes(SCALAR, pp, pp_rank, stage_location(S - 1, pp, placement)[0])
    if (0 in stages) != (S - 1 in stages):
        total += tied_swaps * tied_numel * itemsize
    return total


# ------------------------------------------------------------------ one step


def group_names(dp: int = 1, pp: int = 1, tp: int = 1, cp: int = 1, ep: int = 1) -> dict[str, str]:
    """The name of the group each key of :func:`step_bytes` travels on, as ``comm.Mesh`` names
    it: its axes of size > 1 joined by "+" in the mesh's order (dp, pp, cp, tp), "self" for
    none; "dp" is the data-parallel reduction group, ("dp", "cp"), so "dp+cp" when both are
    split; "world" is the mesh's world group (``comm.world()``), which the scalars use; with
    ``ep`` > 1, "edp": the ranks holding the same experts, as parallel/expert/ names it."""
    sizes = {"dp": dp, "pp": pp, "tp": tp, "cp": cp}
    out = {}
    for key, members in (("dp", ("dp", "cp")), ("pp", ("pp",)), ("tp", ("tp",)), ("cp", ("cp",))):
        axes = [a for a in ("dp", "pp", "cp", "tp") if a in members and sizes[a] > 1]
        out[key] = "+".join(axes) if axes else "self"
    out["world"] = "world"
    if ep > 1:
        out["edp"] = f"{out['dp']}.edp{dp * cp // ep}"
    return out


def by_group(per_axis: dict[str, int], dp: int = 1, pp: int = 1, tp: int = 1, cp: int = 1,
             ep: int = 1) -> dict[str, int]:
    """``step_bytes``' result keyed by group name (what ``comm.stats.bytes_by_group`` reports);
    axes sharing a group (dp = 1 with cp: the reduction group is the cp group) are summed."""
    names = group_names(dp, pp, tp, cp, ep)
    out: dict[str, int] = {}
    for axis, nbytes in per_axis.items():  # a key that is no axis is a group's name already ("tp-kv0")
        if nbytes:
            out[names.get(axis, axis)] = out.get(names.get(axis, axis), 0) + nbytes
    return out


def step_bytes(*, n_layer: int, d_model: int, n_head: int, seq_len: int, batch_size: int,
               dp: int = 1, pp: int = 1, tp: int = 1, cp: int = 1, coords: dict | None = None,
               vocab: int = 256, block_size: int | None = None, tied: bool = True, itemsize: int = 4,
               act_itemsize: int | None = None, grad_accum: int = 1, microbatches: int = 1,
               virtual_stages: int = 1, schedule: str | None = "1f1b", zero: int = 0,
               sequence_parallel: bool = False, cp_impl: str = "ring", bucket_mb: float = 25.0,
               clip_grad: bool = True, fp16: bool = False, checkpoint_activations: bool = False,
               tp_async: str | None = None, hsdp_shard: int | None = None, experts: int = 0,
               moe_every: int = 1, top_k: int = 2, ep: int = 1, arch: str = "gpt2", kv_heads: int | None = None,
               ffn: int | None = None) -> dict[str, int]:
    """Bytes this rank (``coords``: its {"dp", "pp", "tp", "cp"} coordinates) sends in one
    optimizer step, per axis: ``{"dp", "pp", "tp", "cp", "world"}`` (see the module
    docstring; ``itemsize``: the parameters' dtype, ``act_itemsize``: the activations',
    default the same).  "dp" is the ("dp", "cp") reduction group's traffic, "world" the
    scalars every rank agrees on (gradient norm, fp16 overflow; a step skipped for an fp16
    overflow clips nothing, so it sends one norm all-reduce less).

    ``experts`` E > 0: every ``moe_every``-th block's MLP is a mixture of E experts, ``top_k``
    of them per token.  Without
    expert parallelism they are ordinary data-parallel parameters; with ``ep`` > 1 this rank
    holds E/ep of them, reduced over the edp group (key "edp"), the dense ones over "dp".
    Dispatch and combine (the ep group's all-to-alls) depend on the routing: they are
    layout/expert_traffic.py's, not here.

    ``arch="llama"`` (docs/llama.md): RMSNorm, no biases nor position table, SwiGLU of width
    ``ffn``, ``kv_heads`` key/value heads.  With fewer of them than tp ranks each is held by
    tp/K ranks, whose gradients of its k and v weights are summed over them in every backward
    (the group the tensor-parallel layers name "tp-kv<i>", a key of its own)."""
    if tp_async or (hsdp_shard and hsdp_shard != dp * cp):
        raise ValueError("step_bytes has no formula for collective matmuls (tp_async) or HSDP")
    c = {a: 0 for a in AXES} | dict(coords or {})
    b, ba = itemsize, act_itemsize or itemsize
    block_size = block_size or seq_len
    n_dp, r_dp = dp * cp, c["dp"] * cp + c["cp"]  # the reduction group: dp outer, cp inner
    parts = split_sizes(split_sizes(batch_size, dp)[c["dp"]], grad_accum)  # each micro-step's (pipeline pass's) rows
    V = virtual_stages if pp > 1 else 1
    placement = placement_of(schedule) if pp > 1 else LOOPING
    S, stages = pp * V, rank_stages(c["pp"], pp, V, placement)
    layers = [l for s in stages for l in layer_range(s, n_layer, S)]  # this rank's blocks, by chunk
    first, last = 0 in stages, S - 1 in stages
    llama = {"heads": n_head, "kv_heads": kv_heads or n_head, "ffn": ffn} if arch == "llama" else None
    model = ModelConfig(arch=arch, layers=n_layer, d_model=d_model, heads=n_head, kv_heads=kv_heads, ffn_hidden=ffn,
                        vocab_size=vocab, block_size=block_size, tied=tied, experts=experts, moe_every=moe_every)
    params = rank_params(model, tp, stages, S, ep, r_dp % ep)  # ep groups: consecutive ranks of the reduction group
    dense = [n for n, unit in params if unit[0] != "experts"]
    mixtures = sum(model.is_moe(l) for l in layers)
    tokens = seq_len // cp
    micro = [split_sizes(p, microbatches) for p in parts] if pp > 1 else [[p] for p in parts]
    rows = [m for pass_rows in micro for m in pass_rows]  # every forward/backward's rows
    recompute = checkpoint_activations or zero == 3
    out = {
        "tp": tp_bytes(rows, tokens, d_model, len(layers), block_size, tp, c["tp"], b, ba, sequence_parallel,
                       recompute, first, last, mixtures, llama is not None),
        "cp": cp_bytes(rows, tokens, d_model // tp, len(layers), cp, c["cp"], ba, cp_impl, recompute, mixtures,
                       top_k, qkv_width(d_model, n_head, cp, tp, llama)),
        "pp": pp_bytes(micro, tokens // tp if sequence_parallel else tokens, d_model, pp, c["pp"], V, ba,
                       -(-vocab // tp) * d_model if tied else 0, b, grad_accum if zero >= 2 else 1, placement,
                       experts > 0),
        "world": 0,
    }
    n_edp, r_edp = n_dp // ep, r_dp // ep  # the edp group: the same place in every ep group
    mine = [n for n, unit in params if unit[0] == "experts"]
    if zero == 3:
        unit_of = lambda kind: [sum(n for n, u in params if u == (kind, l)) for l in layers]  # noqa: E731
        units = [sum(n for n, u in params if u[0] == "root")] + unit_of("block")
        chunks = [[k + 1 for k, l in enumerate(layers) if l in layer_range(s, n_layer, S)] for s in stages]
        actions = [compute_actions(pp, c["pp"], schedule, microbatches, V, chunks)] * grad_accum
        out["dp"] = fsdp_bytes(units, b, n_dp, r_dp, actions)
        out["edp"] = fsdp_bytes([0] + unit_of("experts"), b, n_edp, r_edp, actions)  # with their blocks
    else:
        out["dp"] = dp_bytes(dense, b, n_dp, r_dp, zero, bucket_mb, grad_accum)
        out["edp"] = dp_bytes(mine, b, n_edp, r_edp, zero, bucket_mb, grad_accum) if mine else 0
    if llama and llama["kv_heads"] < tp:  # a shared key/value head: its k and v gradients summed over its copies
        copies = tp // llama["kv_heads"]
        kv = 2 * len(layers) * len(rows) * all_reduce_bytes(d_model * d_model // n_head, b, copies, c["tp"] % copies)
        out[f"{group_names(tp=tp)['tp']}-kv{c['tp'] // copies}"] = kv
    world, r_world = dp * pp * tp * cp, MeshLayout(dp=dp, pp=pp, tp=tp, cp=cp).rank_of(**c)
    out["dp"] += all_reduce_bytes(1, SCALAR, n_dp, r_dp)  # the loss, summed over the reduction group
    out["world"] += (clip_grad + fp16) * all_reduce_bytes(1, SCALAR, world, r_world)  # norm, overflow
    return out


def qkv_width(d: int, heads: int, cp: int, tp: int, llama: dict | None) -> int | None:
    """The width of a tensor-parallel rank's Q|K|V that Ulysses sends: with grouped-query
    attention its K/tp key/value heads as they are where cp divides them, else repeated for
    the query heads (context/ulysses.py); None for GPT-2's 3 x d / tp."""
    if llama is None:
        return None
    D, kv = d // heads, kv_heads_here(llama["kv_heads"], tp)
    return (heads // tp + 2 * (heads // tp if kv % cp else kv)) * D


def expected_step_bytes(cfg, rank: int = 0) -> dict[str, int]:
    """:func:`step_bytes` of world rank ``rank`` for a resolved run configuration
    (``minidist.train.config.RunConfig``, as ``flags.validate`` returns it), keyed by group name:
    what ``comm.stats.bytes_by_group()`` gains in one step of ``python -m minidist.train``."""
    m, p, dev = cfg.model, cfg.parallel, cfg.device
    sizes = {"dp": p.dp, "pp": p.pp, "tp": p.tp, "cp": p.cp}
    moe = {"experts": m.experts, "moe_every": m.moe_every or 1, "top_k": m.top_k or min(2, m.experts), "ep": p.ep}
    llama = m.arch == "llama"
    arch = {"arch": m.arch, "kv_heads": m.kv, "ffn": m.ffn}
    low = dev.mixed_precision in ("bf16", "fp16")
    per_axis = step_bytes(
        n_layer=m.layers, d_model=m.d_model, n_head=m.heads, seq_len=cfg.data.seq_len,
        batch_size=cfg.data.batch_size, coords=MeshLayout(**sizes).coords(rank), block_size=m.block_size,
        tied=not (m.untied or llama), itemsize={"float32": 4, "float64": 8}[m.dtype], act_itemsize=2 if low else None,
        grad_accum=dev.grad_accum, microbatches=p.microbatches, virtual_stages=p.virtual_stages,
        schedule=p.schedule, zero=p.zero, sequence_parallel=p.sequence_parallel, cp_impl=p.cp_impl,
        bucket_mb=p.bucket_mb, clip_grad=bool(cfg.optim.clip_grad), fp16=dev.mixed_precision == "fp16",
        checkpoint_activations=dev.checkpoint_activations, tp_async=p.tp_async, hsdp_shard=p.hsdp_shard,
        vocab=m.vocab_size, **moe, **arch, **sizes)
    return by_group(per_axis, **sizes, ep=p.ep)
