"""The run configuration: every setting of a training run, typed, built once.

``python -m minidist.train`` parses its flags (minidist/train/flags.py) into a :class:`RunConfig`
with :func:`from_args`; a script can write one directly::

    from minidist.train.config import RunConfig, ParallelConfig
    cfg = RunConfig(parallel=ParallelConfig(dp=2, pp=2, tp=2)).resolved(world_size=8)

Each section is one concern, as the flags' groups are in ``--help``.  A field left ``None``
means "not given": :meth:`RunConfig.resolved` fills the defaults that depend on other
settings (the data-parallel size from the world size, the pipeline's microbatches, ...),
after the axes' checks have seen what the user actually gave (``--cp-impl`` without
``--cp`` is refused, not silently ignored).  Nothing downstream reads the flags again.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from minidist.layout.model import ModelConfig
from minidist.layout.settings import ParallelConfig, VIRTUAL


@dataclass
class DataConfig:
    data: str | None = None           # a text file; None: the standard library's source
    seq_len: int = 128
    batch_size: int = 16              # the global batch, in sequences
    val_fraction: float = 0.05


@dataclass
class OptimConfig:
    steps: int = 300
    optimizer: str = "adamw"
    lr: float = 3e-3
    min_lr: float | None = None       # None: lr / 10
    warmup: int = 20
    weight_decay: float = 0.1
    momentum: float = 0.9
    clip_grad: float = 1.0


@dataclass
class DeviceConfig:
    """What one device does to fit and speed a step (the seeds' per-device techniques)."""
    grad_accum: int = 1
    checkpoint_activations: bool = False
    mixed_precision: str = "none"     # none | bf16 | fp16
    backend: str | None = None        # numpy | cupy; None: $MINIDIST_BACKEND
    tf32: bool = False                # CuPy: float32 matmuls on TF32 tensor cores (CUPY_TF32=1)
    offload: str = "none"             # none | optimizer: AdamW's state in host memory, stepped there
    offload_overlap: bool = True      # the host step of the blocks overlaps the next forward


@dataclass
class ReportConfig:
    eval_every: int = 50
    eval_batches: int = 4
    log_every: int = 10
    metrics_jsonl: str | None = None
    peak_gflops: float | None = None
    trace: str | None = None
    quiet: bool = False
    timeout_s: float | None = None


@dataclass
class CheckpointConfig:
    save: str | None = None           # a directory: checkpoints go to save/step-NNNNNN, save/latest
    save_every: int | None = None     # None: only at the end of the run
    resume: str | None = None         # a checkpoint directory, or a --save directory (its latest)
    save_async: bool = False          # write in a background thread while training goes on


@dataclass
class RunConfig:
    # --attention-block not given (None): its tile is refused without tiled attention (parallel/context/checks.py)
    model: ModelConfig = field(default_factory=lambda: ModelConfig(attention_block=None))
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    report: ReportConfig = field(default_factory=ReportConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def replace(self, **sections) -> "RunConfig":
        """A copy with some fields changed: ``cfg.replace(parallel=dict(tp=2), model=dict(layers=2))``."""
        out = dataclasses.replace(self)
        for name, changes in sections.items():
            setattr(out, name, dataclasses.replace(getattr(self, name), **changes))
        return out

    def resolved(self, world_size: int | None = None) -> "RunConfig":
        """A copy with every default that depends on other settings filled in.  Run the
        checks (``compose.problems``) on the config as given first: they tell "not given"
        (None) from a value."""
        m, p = self.model, self.parallel
        unset = {f.name: f.default for f in dataclasses.fields(m) if getattr(m, f.name) is None}
        model = dataclasses.replace(m, **{**unset, "block_size": m.block_size or self.data.seq_len,
                                          "top_k": m.top_k or min(2, m.experts) or 2})  # 1 with one expert
        others = p.pp * p.tp * p.cp
        dp = p.dp if p.dp is not None else max(1, (world_size or others) // others)
        schedule = p.schedule or ("1f1b" if p.pp > 1 else None)
        parallel = dataclasses.replace(
            p, dp=dp, zero=p.zero if p.zero is not None else (3 if p.hsdp_shard else 0),
            cp_impl=p.cp_impl or "ring", bucket_mb=25.0 if p.bucket_mb is None else p.bucket_mb,
            schedule=schedule,
            microbatches=p.microbatches or (2 * p.pp if p.pp > 1 else 1),
            virtual_stages=p.virtual_stages or (2 if schedule in VIRTUAL else 1))
        optim = dataclasses.replace(self.optim, min_lr=self.optim.lr / 10 if self.optim.min_lr is None
                                    else self.optim.min_lr)
        return dataclasses.replace(self, model=model, parallel=parallel, optim=optim)


_CLASSES = {"model": ModelConfig, "data": DataConfig, "optim": OptimConfig, "device": DeviceConfig,
            "parallel": ParallelConfig, "report": ReportConfig, "checkpoint": CheckpointConfig}


def from_args(args) -> RunConfig:
    """The RunConfig of parsed flags (an argparse Namespace; ``--no-overlap`` becomes
    ``parallel.overlap``, ``--untied`` ``model.tied``).  Flags are matched to fields by name."""
    values = dict(vars(args))
    values["overlap"] = not values.pop("no_overlap", False)
    values["tied"] = False if values.pop("untied", False) else None  # None: the architecture's
    sections = {}
    for name, cls in _CLASSES.items():
        sections[name] = cls(**{f.name: values[f.name] for f in dataclasses.fields(cls) if f.name in values})
    return RunConfig(**sections)
