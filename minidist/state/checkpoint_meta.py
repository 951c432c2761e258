"""A checkpoint is untrusted input: its metadata, every field checked before any use.

Checkpoints are downloaded, shared and resumed on other machines, so nothing that
``metadata.json`` or ``latest`` says is believed until it is checked: :func:`read` and
:func:`latest` are the only ways minidist reads them (resume, export, generate and the
resharding reader all go through them), and they check every field *before* an array file is
opened or an array allocated.  Each violation is a :class:`CheckpointError` of one line that
names the file and the field (``tensors["wte.weight/param"].pieces[0].offset is -100: ...``);
the commands print it and exit with code 2 (on every rank: each reads the same files and
reaches the same verdict before any message is exchanged).

The rules, those of the format ``minidist.state.checkpoint`` writes:

* ``metadata.json`` is a regular file of at most :data:`MAX_METADATA_BYTES`, strict JSON
  (no NaN or Infinity), of format :data:`FORMAT` (or :data:`FORMAT_1`, whose model fields
  had GPT-2's names, ``n_layer``, ``n_head``, ...: they read as :data:`RENAMED` renames them);
* ``latest`` (a few bytes) names a ``step-NNNNNN`` directory inside the save directory;
* file names are plain ``rank-NNNNN.bin`` names (no separators, no ``..``), of a rank of the
  saving world, and each is a regular file inside the checkpoint directory (a link may not
  lead outside) with exactly its recorded size;
* numbers are JSON integers where integers are meant (no NaN step, no string sizes, no
  booleans), in their ranges; the mesh's sizes multiply to the world size;
* the model config (``layout.model.ModelConfig``, its defaults written out) is one minidist
  builds (byte vocabulary, positive sizes, heads dividing the width, a known dtype and
  attention; a known family, ``gpt2`` or ``llama``, with key/value heads dividing the query
  heads, a positive feed-forward width, a positive finite rotary base and norm epsilon), and
  the tensors are exactly its parameters (``layout.model.parameter_shapes``) and their
  optimizer states, each with the shape and dtype the config gives;
  on resume, ``minidist.train.flags`` then compares that config with the model being built;
* a checkpoint written before the Llama family lacks its fields (``arch``, ``kv_heads``,
  ``ffn_hidden``, ``rope_theta``, ``norm_eps``): it reads as the GPT-2 it is
  (:data:`LEGACY_DEFAULTS`), and :func:`read` returns its model with them filled in;
* dtypes come from :data:`DTYPES`;
* a piece's tensor-parallel slice divides its dimension, its flat range lies inside the
  slice, its byte range lies inside its file, and its length is exactly the bytes of its
  elements; the pieces of a tensor tile it with no gap and no overlap, and no two pieces share
  a byte of a file -- so the arrays a reader allocates never exceed the bytes the files hold.

The bytes themselves are checked piece by piece, by CRC, as they are read (``checkpoint.Reader``).
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
import sys

from minidist.layout.mesh import AXES
from minidist.layout.model import ARCHS, ATTENTIONS, ROPE_THETA, ModelConfig, numel, parameter_count, parameter_shapes

FORMAT = "minidist-checkpoint-2"
FORMAT_1 = "minidist-checkpoint-1"  # the model's fields by nn.GPTConfig's old names
RENAMED = {"seq_len": "block_size", "n_layer": "layers", "n_head": "heads", "n_kv_head": "kv_heads",
           "tie_embeddings": "tied", "n_experts": "experts"}
STEP_DIR = re.compile(r"^step-(\d{6,})$")
PART_FILE = re.compile(r"^rank-(\d{5,9})\.bin$")  # the names checkpoint._write_part gives
DTYPES = ("float16", "bfloat16", "float32", "float64")
STATES = ("param", "exp_avg", "exp_avg_sq", "momentum_buffer")  # the optimizers' state_keys
#: Fields of the model that a checkpoint's arrays depend on: a resumed run must agree on them
#: (``rope_theta`` and ``norm_eps`` change no array: they are checked, not compared).
MODEL_FIELDS = ("vocab_size", "block_size", "layers", "heads", "d_model", "bias", "tied", "dtype",
                "arch", "kv_heads", "ffn_hidden", "experts", "moe_every")
#: How a checkpoint written before the Llama family reads: each field it lacks takes GPT-2's
#: value, a function of the fields it has (GPT-2: a key/value head per query head, a 4 d MLP).
LEGACY_DEFAULTS = {"arch": lambda m: "gpt2", "kv_heads": lambda m: m["heads"],
                   "ffn_hidden": lambda m: 4 * m["d_model"], "rope_theta": lambda m: ROPE_THETA,
                   "norm_eps": lambda m: 1e-5, "experts": lambda m: 0, "moe_every": lambda m: 1,
                   "top_k": lambda m: 2, "capacity_factor": lambda m: 0.0, "aux_loss_coef": lambda m: 0.01,
                   "z_loss_coef": lambda m: 0.001}
MAX_EXPERTS = 2**16  # a bound on what a checkpoint may claim, far above any mixture's
MAX_METADATA_BYTES = 64 * 2**20  # far above any minidist run's (about 20 KB per layer and rank)
MAX_LATEST_BYTES = 4096
MAX_INT = 2**63 - 1  # every count, size and offset fits an int64
TOP_FIELDS = ("step", "world_size", "mesh", "model", "scalars", "files", "tensors")


class CheckpointError(ValueError):
    """A checkpoint that is missing, damaged, of another model or not to be trusted (one line
    naming the file and the field)."""


# ------------------------------------------------------------------------------------------------
# Files: plain names, inside their directory, regular, of bounded size
# ------------------------------------------------------------------------------------------------
def _inside(directory: str, name: str, label: str) -> os.stat_result:
    """The stat of ``directory/name``: a regular file that is there and does not lead outside."""
    file = os.path.join(directory, name)
    try:
        st = os.stat(file)
    except FileNotFoundError:
        raise CheckpointError(f"{file}: missing") from None
    except OSError as exc:
        raise CheckpointError(f"{file}: cannot be read ({exc.strerror or exc})") from None
    if os.path.dirname(os.path.realpath(file)) != os.path.realpath(directory):
        raise CheckpointError(f"{file}: a link that leads outside {directory}; {label} must be inside it")
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointError(f"{file}: not a regular file")
    return st


def _read_capped(file: str, cap: int) -> bytes:
    try:
        with open(file, "rb") as f:
            data = f.read(cap + 1)
    except OSError as exc:
        raise CheckpointError(f"{file}: cannot be read ({exc.strerror or exc})") from None
    if len(data) > cap:
        raise CheckpointError(f"{file}: larger than {cap:,} bytes; not a minidist checkpoint's")
    return data


def latest(directory: str) -> str:
    """The step directory that ``directory/latest`` names: a ``step-NNNNNN`` directory inside
    ``directory`` (a link to elsewhere is refused)."""
    file = os.path.join(directory, "latest")
    _inside(directory, "latest", "latest")
    text = _read_capped(file, MAX_LATEST_BYTES).decode("utf-8", errors="replace").strip()
    if not STEP_DIR.match(text):
        raise CheckpointError(f"{file}: names {_show(text)}, not a step-NNNNNN directory of {directory}")
    path = os.path.join(directory, text)
    if os.path.dirname(os.path.realpath(path)) != os.path.realpath(directory):
        raise CheckpointError(f"{file}: names {text}, a link that leads outside {directory}")
    if not os.path.isdir(path):
        raise CheckpointError(f"{file}: names {text}, which is not a directory in {directory}")
    return path


def step_dirs(directory: str) -> list[str]:
    """The names of the ``step-NNNNNN`` directories in ``directory`` (none leading outside), in order."""
    real = os.path.realpath(directory)
    return sorted(d for d in os.listdir(directory) if STEP_DIR.match(d)
                  and os.path.dirname(os.path.realpath(os.path.join(directory, d))) == real
                  and os.path.isdir(os.path.join(directory, d)))


def read(path: str) -> dict:
    """The metadata of checkpoint directory ``path``, every field checked (module docstring)."""
    file = os.path.join(path, "metadata.json")
    size = _inside(path, "metadata.json", "metadata.json").st_size
    if size > MAX_METADATA_BYTES:
        raise CheckpointError(f"{file}: {size:,} bytes, larger than {MAX_METADATA_BYTES:,}; "
                              "not a minidist checkpoint's")
    try:
        meta = json.loads(_read_capped(file, MAX_METADATA_BYTES).decode("utf-8"),
                          parse_constant=_no_constant, parse_float=_finite)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise CheckpointError(f"{file}: cannot be read ({_one_line(exc)})") from None
    if not isinstance(meta, dict) or meta.get("format") not in (FORMAT, FORMAT_1):
        raise CheckpointError(f"{file}: not a {FORMAT} file")
    if meta["format"] == FORMAT_1 and isinstance(meta.get("model"), dict):
        meta["model"] = {RENAMED.get(k, k): v for k, v in meta["model"].items()}
    _Check(path, file).all(meta)
    return meta


def _no_constant(name):
    raise ValueError(f"{name} is not a number JSON allows")


def _finite(text):
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text[:20]} is not a finite number")
    return value


def _one_line(exc) -> str:
    return " ".join(str(exc).split())[:200]


def _show(value) -> str:
    """A value in a message: on one line and short (containers by their size)."""
    if isinstance(value, (dict, list)):
        return f"a {'list' if isinstance(value, list) else 'mapping'} of {len(value)}"
    text = json.dumps(value[:60] + "..." if isinstance(value, str) and len(value) > 60 else value)
    return text if len(text) <= 70 else text[:60] + "..."


def numpy_dtype(name: str):
    """The NumPy dtype of a checked dtype name (bfloat16 from ml_dtypes)."""
    from minidist.model.backend import dtype

    return dtype(name)


# ------------------------------------------------------------------------------------------------
# The checks
# ------------------------------------------------------------------------------------------------
class _Check:
    """The checks of one metadata file; each failure is one line naming the file and the field."""

    def __init__(self, path: str, file: str):
        self.path, self.file = path, file

    def fail(self, where: str, why: str):
        raise CheckpointError(f"{self.file}: {where} {why}")

    def get(self, obj: dict, key: str, where: str):
        if key not in obj:
            self.fail(where, f"has no field {_show(key)}")
        return obj[key]

    def kind(self, value, types, where: str, what: str):
        if not isinstance(value, types) or (bool not in _tuple(types) and isinstance(value, bool)):
            self.fail(where, f"is {_show(value)}: must be {what}")
        return value

    def integer(self, value, where: str, lo: int = 0, hi: int = MAX_INT) -> int:
        if type(value) is not int or not lo <= value <= hi:
            upto = f" and <= {hi:,}" if hi != MAX_INT else ""
            self.fail(where, f"is {_show(value)}: must be an integer >= {lo}{upto}")
        return value

    def all(self, meta: dict) -> None:
        for key in TOP_FIELDS:
            self.get(meta, key, "the metadata")
        self.integer(meta["step"], "step")
        world = self.integer(meta["world_size"], "world_size", lo=1)
        self.mesh(meta["mesh"], world)
        model = self.model(meta["model"])
        shapes = self.tensor_names(meta["tensors"], model)
        self.scalars(meta["scalars"], shapes)
        files = self.files(meta["files"], world)
        claimed = {name: [] for name in files}  # (start, stop, tensor) of every piece, per file
        for key, entry in meta["tensors"].items():
            self.tensor(key, entry, shapes[key.rpartition("/")[0]], model["dtype"], files, claimed)
        for name, ranges in claimed.items():
            ranges.sort()
            for (a0, a1, a), (b0, b1, b) in zip(ranges, ranges[1:]):
                if b0 < a1:
                    self.fail(f"files[{_show(name)}]", f"bytes {b0}..{min(a1, b1)} are claimed by both "
                              f"{_show(a)} and {_show(b)}")

    def mesh(self, mesh, world: int) -> None:
        self.kind(mesh, dict, "mesh", f"a mapping of {', '.join(AXES)} to sizes")
        if sorted(mesh) != sorted(AXES):
            self.fail("mesh", f"has {len(mesh)} axes: must have exactly {', '.join(AXES)}")
        for axis in AXES:
            self.integer(mesh[axis], f"mesh.{axis}", lo=1, hi=world)
        if numel(mesh[a] for a in AXES) != world:
            self.fail("mesh", f"sizes multiply to {numel(mesh[a] for a in AXES)}, not world_size {world}")

    def model(self, model) -> dict:
        self.kind(model, dict, "model", "a mapping")
        for key in MODEL_FIELDS:
            if key not in LEGACY_DEFAULTS:
                self.get(model, key, "model")
        if type(model["vocab_size"]) is not int or not 256 <= model["vocab_size"] <= 2**32:
            self.fail("model.vocab_size", f"is {_show(model['vocab_size'])}: minidist's vocabularies hold the 256 "
                      "byte values and at most 2**32 tokens (uint32 shards)")
        for key in ("block_size", "layers", "heads", "d_model"):
            self.integer(model[key], f"model.{key}", lo=1)
        for key in ("bias", "tied"):
            self.kind(model[key], bool, f"model.{key}", "true or false")
        if model["dtype"] not in DTYPES:
            self.fail("model.dtype", f"is {_show(model['dtype'])}: must be one of {', '.join(DTYPES)}")
        if "seed" in model:
            self.integer(model["seed"], "model.seed")
        if "attention" in model and model["attention"] not in ATTENTIONS:
            self.fail("model.attention", f"is {_show(model['attention'])}: must be one of {', '.join(ATTENTIONS)}")
        if "attention_block" in model:
            self.integer(model["attention_block"], "model.attention_block", lo=1)
        for key, default in LEGACY_DEFAULTS.items():  # a checkpoint older than the Llama family
            if key not in model:
                model[key] = default(model)
        self.family(model)
        return model

    def family(self, model: dict) -> None:
        """The fields of the model's family: which one, its key/value heads and feed-forward
        width, its rotary base and norm epsilon (positive, finite), its mixture; then the rules
        that tie them together, ``ModelConfig.check``'s (GPT-2's one key/value head per query
        head and 4 d MLP, whole heads, even rotary heads), spelled as this file's fields."""
        if model["arch"] not in ARCHS:
            self.fail("model.arch", f"is {_show(model['arch'])}: must be one of {', '.join(ARCHS)}")
        self.integer(model["kv_heads"], "model.kv_heads", lo=1)
        self.integer(model["ffn_hidden"], "model.ffn_hidden", lo=1)
        for key in ("rope_theta", "norm_eps"):
            value = self.kind(model[key], (int, float), f"model.{key}", "a positive finite number")
            if not 0 < value <= sys.float_info.max:  # NaN fails too; a huge integer is no float
                self.fail(f"model.{key}", f"is {_show(value)}: must be a positive finite number")
        self.moe(model)
        try:
            ModelConfig.from_record(model).check(name=lambda field: f"model.{field}")
        except ValueError as exc:
            raise CheckpointError(f"{self.file}: {exc}") from None

    def moe(self, model: dict) -> None:
        """The mixture-of-experts fields (model/moe.py), as ``ModelConfig.check`` accepts them:
        the experts (0: dense) and the blocks holding them, which decide the arrays; top-k (at
        most the experts), the capacity factor and the two losses' weights, which do not."""
        E = self.integer(model["experts"], "model.experts", lo=0, hi=MAX_EXPERTS)
        self.integer(model["moe_every"], "model.moe_every", lo=1)
        self.integer(model["top_k"], "model.top_k", lo=1, hi=E or MAX_INT)
        for key in ("capacity_factor", "aux_loss_coef", "z_loss_coef"):
            value = self.kind(model[key], (int, float), f"model.{key}", "a non-negative finite number")
            if not 0 <= value <= sys.float_info.max:
                self.fail(f"model.{key}", f"is {_show(value)}: must be a non-negative finite number")

    def tensor_names(self, tensors, model: dict) -> dict:
        """Check that the tensors are the model's parameters (all of them) and their optimizer
        states; return the parameters' shapes.  The count comes first, so a config claiming a
        huge model is refused without listing its parameters."""
        self.kind(tensors, dict, "tensors", "a mapping")
        config = ModelConfig.from_record(model)
        count = parameter_count(config)
        held = sum(key.endswith("/param") for key in tensors)
        if held != count:
            self.fail("tensors", f"hold {held} parameters, the model (model.layers {model['layers']}, "
                      f"bias {model['bias']}, tied {model['tied']}, arch {model['arch']}) has {count}")
        shapes = parameter_shapes(config)
        for key in tensors:
            name, _, what = key.rpartition("/")
            if name not in shapes or what not in STATES:
                self.fail(f"tensors[{_show(key)}]", "is not a parameter of this model or its optimizer state "
                          f"({', '.join(STATES)})")
        return shapes

    def scalars(self, scalars, shapes: dict) -> None:
        self.kind(scalars, dict, "scalars", "a mapping")
        self.integer(self.get(scalars, "optimizer_steps", "scalars"), "scalars.optimizer_steps")
        steps = scalars.get("param_steps", {})
        self.kind(steps, dict, "scalars.param_steps", "a mapping")
        for name, value in steps.items():
            if name not in shapes:
                self.fail(f"scalars.param_steps[{_show(name)}]", "is not a parameter of this model")
            self.integer(value, f"scalars.param_steps[{_show(name)}]")
        if ("loss_scale" in scalars) != ("loss_scale_clean_steps" in scalars):
            self.fail("scalars", "must hold loss_scale and loss_scale_clean_steps together")
        if "loss_scale" in scalars:
            scale = self.kind(scalars["loss_scale"], (int, float), "scalars.loss_scale", "a positive number")
            if not 0 < scale <= 2.0**128:  # float32's range, where a loss scale lives
                self.fail("scalars.loss_scale", f"is {_show(scale)}: must be a positive number")
            self.integer(scalars["loss_scale_clean_steps"], "scalars.loss_scale_clean_steps")

    def files(self, files, world: int) -> dict:
        """``{name: size}``: plain names of the saving world's ranks, regular files inside the
        checkpoint, of exactly their recorded sizes."""
        self.kind(files, dict, "files", "a mapping of file names to sizes")
        if not files:
            self.fail("files", "is empty")
        for name, size in files.items():
            match = PART_FILE.match(name)
            if not match:
                self.fail(f"files[{_show(name)}]", "is not a plain rank-NNNNN.bin name of this directory")
            if int(match.group(1)) >= world:
                self.fail(f"files[{_show(name)}]", f"is not the file of a rank of world_size {world}")
            self.integer(size, f"files[{_show(name)}]")
            actual = _inside(self.path, name, "every file").st_size
            if actual != size:
                raise CheckpointError(f"{os.path.join(self.path, name)}: {actual} bytes, expected {size}")
        return files

    def tensor(self, key: str, entry, shape: tuple, model_dtype: str, files: dict, claimed: dict) -> None:
        at = f"tensors[{_show(key)}]"
        self.kind(entry, dict, at, "a mapping")
        saved = self.kind(self.get(entry, "global_shape", at), list, f"{at}.global_shape", "a list of sizes")
        for i, n in enumerate(saved):
            self.integer(n, f"{at}.global_shape[{i}]")
        if tuple(saved) != shape:
            self.fail(f"{at}.global_shape", f"is {list(saved)}: the model recorded beside it has {list(shape)}")
        dtype = self.get(entry, "dtype", at)
        if dtype not in DTYPES:
            self.fail(f"{at}.dtype", f"is {_show(dtype)}: must be one of {', '.join(DTYPES)}")
        if dtype != model_dtype:  # parameters and their optimizer states are kept in the model's dtype
            self.fail(f"{at}.dtype", f"is {dtype}: the model's dtype is {model_dtype}")
        itemsize = numpy_dtype(dtype).itemsize
        pieces = self.kind(self.get(entry, "pieces", at), list, f"{at}.pieces", "a list")
        if not pieces:
            self.fail(f"{at}.pieces", "is empty")
        slices = {}  # tensor-parallel slice -> (its element count, the flat ranges of its pieces)
        for i, pc in enumerate(pieces):
            where = f"{at}.pieces[{i}]"
            self.kind(pc, dict, where, "a mapping")
            name = self.get(pc, "file", where)
            if not isinstance(name, str) or name not in files:
                self.fail(f"{where}.file", f"is {_show(name)}: must be one of the checkpoint's files")
            offset = self.integer(self.get(pc, "offset", where), f"{where}.offset")
            nbytes = self.integer(self.get(pc, "nbytes", where), f"{where}.nbytes")
            self.integer(self.get(pc, "crc32", where), f"{where}.crc32", hi=2**32 - 1)
            spec, size = self.tp(self.get(pc, "tp", where), shape, f"{where}.tp")
            lo, hi = self.flat(self.get(pc, "flat", where), size, f"{where}.flat")
            if nbytes != (hi - lo) * itemsize:
                self.fail(f"{where}.nbytes", f"is {nbytes}: its {hi - lo} elements of {dtype} take "
                          f"{(hi - lo) * itemsize} bytes")
            if offset + nbytes > files[name]:
                self.fail(f"{where}.offset", f"is {offset}: bytes {offset}..{offset + nbytes} lie beyond the end of "
                          f"{name} ({files[name]} bytes)")
            slices.setdefault(spec, (size, []))[1].append((lo, hi))
            if nbytes:
                claimed[name].append((offset, offset + nbytes, key))
        self.tiling(at, slices)

    def tp(self, tp, shape: tuple, where: str):
        """``(dim, index, parts, blocks)`` of a tensor-parallel slice (None: the whole tensor) and
        its element count."""
        if tp is None:
            return None, numel(shape)
        if not isinstance(tp, list) or len(tp) != 4:
            self.fail(where, f"is {_show(tp)}: must be null or [dim, index, parts, blocks]")
        dim = self.integer(tp[0], f"{where}[0] (dim)", hi=len(shape) - 1)
        parts = self.integer(tp[2], f"{where}[2] (parts)", lo=1)
        index = self.integer(tp[1], f"{where}[1] (index)", hi=parts - 1)
        blocks = self.integer(tp[3], f"{where}[3] (blocks)", lo=1)
        if blocks > 1 and shape[dim] % (parts * blocks):  # one block may be padded: a vocabulary
            self.fail(where, f"is {tp}: {blocks} block(s) of dimension {dim} ({shape[dim]}) do not split "
                      f"into {parts} parts")
        return (dim, index, parts, blocks), numel(shape) // max(shape[dim], 1) * -(-shape[dim] // parts)

    def flat(self, flat, size: int, where: str) -> tuple[int, int]:
        if flat is None:
            return 0, size
        if not isinstance(flat, list) or len(flat) != 2:
            self.fail(where, f"is {_show(flat)}: must be null or [start, stop]")
        lo = self.integer(flat[0], f"{where}[0]", hi=size)
        hi = self.integer(flat[1], f"{where}[1]", lo=lo, hi=size)
        return lo, hi

    def tiling(self, at: str, slices: dict) -> None:
        """The pieces tile the tensor: either one whole-tensor slice or every part of one
        tensor-parallel split, and within each, flat ranges with no gap and no overlap."""
        specs = list(slices)
        if None in specs and len(specs) > 1:
            self.fail(f"{at}.pieces", "mix whole-tensor pieces with tensor-parallel slices")
        if None not in specs:
            dim, _, parts, blocks = specs[0]
            want = {(dim, i, parts, blocks) for i in range(parts)}
            if set(specs) != want:
                missing = sorted(want - set(specs))
                why = (f"lack tensor-parallel slice {missing[0][1]} of {parts}" if missing and
                       all(s[0] == dim and s[2] == parts and s[3] == blocks for s in specs)
                       else f"mix tensor-parallel splits {specs[0]} and {next(s for s in specs if s not in want)}")
                self.fail(f"{at}.pieces", why)
        for spec, (size, ranges) in slices.items():
            reach = 0
            for lo, hi in sorted(r for r in ranges if r[0] < r[1]):
                if lo != reach:
                    what = "slice" if spec is None else f"tensor-parallel slice {spec[1]} of {spec[2]}"
                    gap = f"elements {reach}..{lo} are missing" if lo > reach else f"elements {lo}..{reach} overlap"
                    self.fail(f"{at}.pieces", f"do not tile the {what}: {gap}")
                reach = hi
            if reach != size:
                self.fail(f"{at}.pieces", f"do not tile the tensor: elements {reach}..{size} are missing")


def _tuple(types) -> tuple:
    return types if isinstance(types, tuple) else (types,)
