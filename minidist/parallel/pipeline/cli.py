"""The training CLI's pipeline flags and their checks (made before any message is sent).

    mpiexec -n 4 python -m minidist.train --pp 4 --microbatches 8 --schedule 1f1b
    mpiexec -n 2 python -m minidist.train --pp 2 --schedule interleaved --virtual-stages 2

:func:`add_arguments` adds the flags in their own group; :func:`validate` checks them
against each other and the model (pure arithmetic on the flags: every rank reaches the same
verdict, so every rank stops with the same one-line message and exit code 2 before any
message is sent).
"""

from __future__ import annotations

from minidist.cli_checks import InputError, int_in
from minidist.parallel.pipeline.schedules import ORDERS, VIRTUAL, schedule_problem

DEFAULT_SCHEDULE = "1f1b"


def add_arguments(parser) -> None:
    g = parser.add_argument_group("pipeline parallelism (run under mpiexec -n N)")
    g.add_argument("--pp", type=int_in(lo=1), default=1, metavar="P",
                   help="pipeline stages: the blocks are cut into P consecutive stages, one per rank")
    g.add_argument("--microbatches", type=int_in(lo=1), default=None, metavar="M",
                   help="microbatches per pipeline pass (default: 2 x --pp)")
    g.add_argument("--schedule", choices=list(ORDERS), default=None,
                   help=f"pipeline schedule (default: {DEFAULT_SCHEDULE})")
    g.add_argument("--virtual-stages", type=int_in(lo=1), default=None, metavar="V",
                   help="model chunks per rank, for the interleaved and looping schedules (default: 2 for them)")


def validate(args) -> None:
    """Fill the defaults and refuse bad combinations with one line naming the flags.

    Needs ``args.dp`` (the data-parallel size) and ``args.grad_accum``: each pipeline pass
    splits a rank's share of an accumulation step into M microbatches of at least one row.
    """
    pp = getattr(args, "pp", 1)
    given = [flag for flag, value in (("--microbatches", args.microbatches), ("--schedule", args.schedule),
                                      ("--virtual-stages", args.virtual_stages)) if value is not None]
    if pp == 1:
        if given:
            raise InputError(f"{' and '.join(given)} {'needs' if len(given) == 1 else 'need'} pipeline parallelism: "
                             "add --pp 2 or more")
        return
    if args.schedule is None:
        args.schedule = DEFAULT_SCHEDULE
    if args.virtual_stages is not None and args.schedule not in VIRTUAL:
        raise InputError(f"--virtual-stages {args.virtual_stages}: the {args.schedule} schedule has no virtual "
                         f"stages (only {' and '.join(VIRTUAL)} have)")
    if args.virtual_stages is None:
        args.virtual_stages = 2 if args.schedule in VIRTUAL else 1
    if args.microbatches is None:
        args.microbatches = 2 * pp
    P, M, V = pp, args.microbatches, args.virtual_stages
    if args.layers % (P * V):
        raise InputError(f"--layers {args.layers} cannot be cut into --pp {P} x --virtual-stages {V} = {P * V} "
                         f"equal stages")
    problem = schedule_problem(args.schedule, P, M, V, args.layers)
    if problem:
        raise InputError(f"--schedule {args.schedule} --pp {P} --microbatches {M}: {problem}")
    if getattr(args, "tp", 1) > 1:
        raise InputError(f"--pp {P} with --tp {args.tp}: pipeline and tensor parallelism do not compose yet; "
                         "use one of them (each composes with --dp)")
    if getattr(args, "cp", 1) > 1:
        raise InputError(f"--pp {P} with --cp {args.cp}: pipeline and context parallelism do not compose yet; "
                         "use one of them (each composes with --dp)")
    if getattr(args, "zero", 0) not in (0, 1, None) or getattr(args, "hsdp_shard", None) is not None:
        raise InputError(f"--pp {P} composes with DDP (--zero 0) and ZeRO-1 (--zero 1); "
                         f"ZeRO-{args.zero} shards gradients or parameters across a stage's replicas, "
                         "which the pipeline does not support")
    dp = getattr(args, "dp", None) or 1
    rows = args.batch_size // dp // args.grad_accum  # the fewest rows a rank gets per accumulation step
    if rows < M:
        raise InputError(f"--microbatches {M} exceeds the {rows} sequence(s) of a pipeline pass "
                         f"(--batch-size {args.batch_size} / --dp {dp} / --grad-accum {args.grad_accum}): "
                         f"every microbatch needs at least one")


def build(args, model, mesh):
    """For ``--pp`` > 1: this rank's :class:`PipelineRuntime` over ``mesh``'s pp group, which
    keeps only this rank's stage of ``model`` (so build the optimizer after it).  Otherwise None."""
    if getattr(args, "pp", 1) == 1:
        return None
    from minidist.parallel.pipeline.runtime import PipelineRuntime

    return PipelineRuntime(model, mesh.group("pp"), args.schedule, args.microbatches, args.virtual_stages)


def wrap(runtime, strategy):
    """The training loop's strategy: ``strategy`` (data parallelism of this stage) inside the
    pipeline, or ``strategy`` itself without one."""
    if runtime is None:
        return strategy
    from minidist.parallel.pipeline.strategy import PipelineParallel

    return PipelineParallel(runtime, strategy)


def progress_text(record: dict) -> str:
    """The pipeline's part of a progress line ("" without a pipeline)."""
    if "bubble" not in record:
        return ""
    return (f" | bubble {100 * record['bubble']:.0f}% (theory {100 * record['bubble_theory']:.0f}%)"
            f" | act {max(record['peak_activation_mb']):.1f} MiB")


def summary_rows(metrics: list) -> list:
    """The pipeline's rows of the end-of-run table: bubble (steps after the first, mean) and
    the largest stage's peak activation memory."""
    timed = [r for r in metrics[1:] or metrics if "bubble" in r]
    if not timed:
        return []
    bubble = sum(r["bubble"] for r in timed) / len(timed)
    peaks = [max(r["peak_activation_mb"]) for r in timed]
    return [("pipeline bubble", f"{100 * bubble:.1f}% measured, {100 * timed[-1]['bubble_theory']:.1f}% theory"),
            ("peak activations of a stage", f"{max(peaks):,.2f} MiB")]
