"""The composer: one function puts the four axes together into a model and its strategy.

The seeds' summary of large-scale training is one sentence: use TP, CP, PP and DP at the
same time, arranged as a 4D grid of ranks (Llama 3 405B: TP8 x CP16 x PP16 x DP8 on 16,384
GPUs).  :func:`build` does it in the order each axis needs the one before:

1. **tensor** (Megatron-LM): the layer set splits every weight over the tp group, so the
   model is *built* split (each rank draws its slices of the global weights from the seed);
2. **context** (Ring Attention / DeepSpeed-Ulysses): every block's attention and the token
   positions become those of this rank's part of each sequence;
3. **pipeline** (GPipe, 1F1B, interleaved): the model keeps only this rank's stage;
4. **expert** (GShard; ``--ep``): every mixture keeps only this rank's share of its experts,
   split over ``ep`` ranks of the ``("dp", "cp")`` group, and sends tokens to them and back;
5. **data** (DDP, ZeRO-1/2, ZeRO-3 = FSDP, HSDP): the gradients of what is left are reduced
   over the ``("dp", "cp")`` group -- the ranks that hold the same parameters and see different
   tokens -- each rank reducing (or sharding) *its* tensor-parallel slices, as FSDP2 x TP does
   in torchtitan; with expert parallelism the experts' gradients over the ranks holding the
   same experts instead (Megatron Core's expert data parallelism);
6. the loop's :class:`~minidist.parallel.strategy.Strategy`, the same interface for every mesh.

Which axes compose with which is one table, :data:`COMPOSES` (the README's table is checked
against it by a test); each axis checks its own settings in its own module (``problems``).
"""

from __future__ import annotations

from itertools import combinations

from minidist.layout.mesh import AXES

MODEL_AXES = tuple(a for a in AXES if a != "dp")  # the axes that split the model, in the mesh's order

#: Every pair of axes and every data-parallel flavour, with "yes" or the reason it is refused.
#: The target of the design is no refusal at all; each "yes" is tested by the equivalence matrix, each
#: refusal by a test of its one-line message.
COMPOSES = {
    **{pair: "yes" for pair in combinations(AXES, 2)},
    **{("zero", axis): "yes" for axis in MODEL_AXES},
    **{("hsdp", axis): "yes" for axis in MODEL_AXES},
    # Expert parallelism (--ep, parallel/expert/) splits the experts over data-parallel ranks;
    # the mixture of experts runs with every axis (docs/moe.md).
    ("ep", "dp"): "yes (DDP, ZeRO-1/2)",
    ("ep", "zero3"): "yes (each block's experts a unit of their own, sharded over edp)",
    ("ep", "pp"): "yes (each stage backpropagates its own auxiliary losses; every schedule)",
    ("ep", "cp"): "yes (each cp rank routes its own tokens, capacity from every cp rank's choices)",
    ("ep", "tp"): "yes (the router and experts replicated over tp)",
}


def composition_table() -> str:
    """:data:`COMPOSES` as the README's markdown table."""
    rows = ["| axes | composes |", "|---|---|"]
    for (a, b), verdict in COMPOSES.items():
        name = {"zero": "ZeRO-1/2/3", "hsdp": "HSDP"}.get(a, f"--{a}")
        other = "ZeRO-3 / HSDP" if b == "zero3" else f"--{b}"
        rows.append(f"| {name} x {other} | {verdict} |")
    return "\n".join(rows)


def problems(given, world_size: int) -> list[str]:
    """Every reason the run configuration ``given`` (as the user gave it: None = not given)
    cannot run on ``world_size`` ranks, one line each; [] if it can.  Pure arithmetic on the
    settings, so every rank reaches the same verdict before any message is sent."""
    from minidist.parallel import context, data, expert, tensor
    from minidist.layout import schedules

    out = _mesh_problems(given.parallel, world_size)
    if out:
        return out  # the other checks need a mesh that fits
    cfg = given.resolved(world_size)
    for axis in (data, expert, tensor, context, schedules):
        out += axis.problems(given, cfg)
    return out


def _mesh_problems(p, world: int) -> list[str]:
    others = p.pp * p.tp * p.cp
    sizes = p.mesh_sizes()
    axes = " x ".join(f"--{a} {sizes[a]}" for a in MODEL_AXES if sizes[a] > 1)
    if p.dp is None:
        if world % others:
            hint = f": run under mpiexec -n {others} or a multiple of it" if world == 1 else ""
            return [f"the world size {world} is not divisible by {axes} = {others}{hint}"]
        return []
    if p.dp * others != world:
        mesh = " x ".join([f"--dp {p.dp}"] + ([axes] if axes else []))
        return [f"{mesh} needs {p.dp * others} ranks (mpiexec -n {p.dp * others}), but this job has {world}"]
    return []


def build(cfg, mesh=None):
    """``(model, strategy)`` for the resolved run configuration ``cfg`` on ``mesh`` (a
    ``comm.Mesh``; None for one process).  Collective over the mesh: every rank calls it."""
    from minidist.model.nn import GPT
    from minidist.parallel import context, data, expert, pipeline, tensor
    from minidist.parallel.strategy import Strategy

    model = GPT(cfg.model, tensor.apply(cfg, mesh))                           # 1. tensor
    model.checkpoint_activations = cfg.device.checkpoint_activations
    sequence = context.apply(model, cfg, mesh)                                 # 2. context
    stages = pipeline.apply(model, cfg, mesh)                                  # 3. pipeline
    experts = expert.apply(model, cfg, mesh)                                   # 4. expert
    mine = set() if experts is None else {id(p) for p in experts.params}
    optimizer = make_optimizer(cfg.optim, [p for p in model.parameters() if id(p) not in mine], cfg.device)
    if cfg.device.offload == "optimizer":  # each block's forward waits for its host step (optim/offload.py)
        optimizer.attach(model)
    expert_optimizer = make_optimizer(cfg.optim, experts.params) if experts is not None else None
    replicas = data.apply(model, optimizer, cfg.parallel, mesh, experts, expert_optimizer)  # 5. data
    return model, Strategy(model, replicas, mesh, sequence, stages)            # 6. the loop's interface


def make_optimizer(o, params, device=None):
    """AdamW or SGD over ``params``; biases and LayerNorm gains are not decayed (GPT-2 / nanoGPT).
    With ``device.offload == "optimizer"`` (a DeviceConfig), AdamW on the host (optim/offload.py)."""
    from minidist.model.optim import SGD, AdamW, no_decay_below_2d

    if device is not None and device.offload == "optimizer":
        from minidist.model.optim.offload import OffloadAdamW

        return OffloadAdamW(params, lr=o.lr, weight_decay=o.weight_decay, no_decay=no_decay_below_2d,
                            overlap=device.offload_overlap)
    if o.optimizer == "sgd":
        return SGD(params, lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay, no_decay=no_decay_below_2d)
    return AdamW(params, lr=o.lr, weight_decay=o.weight_decay, no_decay=no_decay_below_2d)


def build_mesh(p):
    """The run's one ``Mesh(dp, pp, tp, cp)`` (tp innermost), or None for a single process
    (a run without mpiexec never initialises MPI)."""
    sizes = p.mesh_sizes()
    if p.world_size == 1:
        return None
    from minidist.comm import Mesh

    return Mesh(**sizes)
