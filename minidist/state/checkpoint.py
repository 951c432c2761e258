"""Sharded, atomic, reshardable checkpoints.

A checkpoint is a directory ``DIR/step-000123/`` holding

* one file per rank that owns something, ``rank-00003.bin``: the raw bytes of the arrays this
  rank is the one to write -- its tensor-parallel slices of its pipeline stage's parameters
  and their optimizer state, or under ZeRO its flat shard of them, each replica written once
  (the first data-parallel rank; the tied embedding by the first pipeline stage);
* ``metadata.json``: the model, the step, the optimizer's step count and the loss scale, and
  for every tensor its global shape, dtype and *pieces*: which file and byte range holds which
  part of it (its tensor-parallel slice ``tp`` = (dim, index, parts, blocks) as
  ``parallel.tensor.Shard`` draws it, and the range ``flat`` of that slice's elements in C
  order), each with a CRC-32.

This is the layout of PyTorch's distributed checkpoint (DCP) and Megatron-LM's distributed
checkpoints: every rank writes only what it owns, and a rank of *another* mesh reads back only
the pieces that overlap what it needs (:func:`load`), so a run saved on dp2·tp2 with ZeRO-1
resumes on pp2·dp2, on cp2 or on one process.  Arrays are plain little-endian bytes; nothing
is ever unpickled.

Nothing a checkpoint says is trusted: every reader gets its metadata from
``checkpoint_meta.read``, which checks every field (file names, sizes, shapes, dtypes, byte
ranges, the tiling of the pieces) before any array file is opened or any array allocated.

Atomic: the ranks write into ``DIR/.tmp-step-000123``; rank 0 writes the metadata last, renames
the directory into place and only then points ``DIR/latest`` at it (a write and a rename).  A
crash or a kill during a save leaves the previous checkpoint, and ``latest``, as they were.
Resuming is bit-exact: the data order and the learning rate are functions of the step, and
every array that changes during training is saved.
"""

from __future__ import annotations

import json
import os
import shutil
import zlib

import numpy as np

from minidist.host.files import replace_atomically, write_synced
from minidist.state import checkpoint_meta
from minidist.state.checkpoint_meta import FORMAT, MODEL_FIELDS, CheckpointError

bytes_read = 0  # bytes this process read from checkpoint files (the resharding test counts them)


# ------------------------------------------------------------------------------------------------
# Finding checkpoints
# ------------------------------------------------------------------------------------------------
def step_dir(directory: str, step: int) -> str:
    return os.path.join(directory, f"step-{step:06d}")


def resolve(path: str) -> str:
    """The checkpoint a ``--resume PATH`` means: PATH itself (a ``step-*`` directory) or the one
    ``PATH/latest`` points to.  Raises CheckpointError naming what is wrong, and for a damaged
    latest checkpoint the previous good one."""
    if not os.path.isdir(path):
        raise CheckpointError(f"--resume {path}: no such checkpoint directory")
    if os.path.lexists(os.path.join(path, "metadata.json")):
        check(path)
        return path
    if not os.path.lexists(os.path.join(path, "latest")):
        raise CheckpointError(f"--resume {path}: not a checkpoint (no metadata.json) and no 'latest' in it")
    chosen = checkpoint_meta.latest(path)
    name = os.path.basename(chosen)
    try:
        check(chosen)
    except CheckpointError as exc:
        good = [d for d in checkpoint_meta.step_dirs(path) if d != name and _is_good(os.path.join(path, d))]
        hint = f"; the previous good one is {os.path.join(path, good[-1])}" if good else "; no other good checkpoint"
        raise CheckpointError(f"the latest checkpoint in {path} is damaged ({exc}){hint}") from None
    return chosen


def _is_good(path: str) -> bool:
    try:
        check(path)
        return True
    except CheckpointError:
        return False


def metadata(path: str) -> dict:
    """The ``metadata.json`` of checkpoint ``path``, every field checked (checkpoint_meta.py)."""
    return checkpoint_meta.read(path)


def check(path: str) -> dict:
    """Cheap checks of a whole checkpoint (every rank may run them before training): every
    field of the metadata, and every file there with the size it should have (a truncated
    file is named).  The bytes themselves are checked piece by piece, by CRC, as they are read."""
    return metadata(path)


def model_differences(meta: dict, model_config) -> list[str]:
    """The model fields on which a checkpoint and a run disagree, as ``name saved -> now``
    (``meta`` from :func:`metadata`: an older checkpoint's missing fields read as GPT-2's)."""
    saved, now = meta["model"], model_config.record()
    return [f"{k} {saved.get(k)} -> {now[k]}" for k in MODEL_FIELDS if saved.get(k) != now[k]]


# ------------------------------------------------------------------------------------------------
# Saving
# ------------------------------------------------------------------------------------------------
def save(directory: str, step: int, strategy, model_config, extra: dict | None = None) -> str:
    """Write this rank's part of checkpoint ``step`` of ``strategy``'s run into ``directory``
    (collective: every rank calls it); return the checkpoint's path."""
    pending = _begin(directory, step, strategy, model_config, extra)
    _write_part(pending["tmp"], pending["rank"], pending["snapshot"], pending["scalars"])
    return _commit(pending)


class AsyncSaver:
    """``--save-async`` (as PyTorch DCP's ``async_save``): :meth:`save` copies this rank's
    arrays to host memory at the step boundary and a background thread writes them while
    training goes on; the checkpoint is renamed into place (and ``latest`` moved) by the next
    :meth:`save` or by :meth:`wait`, once every rank has written its part.  The thread does no
    communication: the ranks agree (a barrier) only in the main thread."""

    def __init__(self):
        self.pending, self.thread, self.finisher = None, None, None
        self.blocking_s = 0.0   # time save() and wait() held the training loop
        self.writing_s = 0.0    # time the background threads spent writing

    def save(self, directory: str, step: int, strategy, model_config, extra: dict | None = None):
        import threading
        import time

        self.wait(final=False)
        t0 = time.perf_counter()
        pending = _begin(directory, step, strategy, model_config, extra, shared_tmp=True)

        def write():
            w0 = time.perf_counter()
            _write_part(pending["tmp"], pending["rank"], pending["snapshot"], pending["scalars"])
            self.writing_s += time.perf_counter() - w0

        self.pending, self.thread = pending, threading.Thread(target=write, name="checkpoint-writer", daemon=True)
        self.thread.start()
        self.blocking_s += time.perf_counter() - t0

    def wait(self, final: bool = True) -> str | None:
        """Finish the save in flight (collective); its path, or None when there was none.

        Once every rank has written its part (rank 0 watches for their part files: no message
        is needed), rank 0 merges the metadata and renames the checkpoint into place: in the
        background when ``final`` is False (a save followed by another), here when it is True
        (the end of the run, which then waits for every rank)."""
        import threading
        import time

        self._join_finisher()
        if self.pending is None:
            return None
        t0 = time.perf_counter()
        pending, self.pending = self.pending, None
        self.thread.join()  # this rank's part is on disk
        world = pending["world"]
        if pending["rank"] == 0:  # the others' parts: rank 0's finisher waits for their files
            size = world.size if world is not None else 1
            self.finisher = threading.Thread(target=_finish_when_written, args=(pending, size),
                                             name="checkpoint-finisher", daemon=True)
            self.finisher.start()
            if final:
                self._join_finisher()
        if final:
            _barrier(world)  # the checkpoint is in place for every rank
        self.blocking_s += time.perf_counter() - t0
        return pending["final"]

    def _join_finisher(self):
        if self.finisher is not None:
            self.finisher.join()
            self.finisher = None


def _begin(directory, step, strategy, model_config, extra, shared_tmp: bool = False) -> dict:
    """The start of a save: the temporary directory, and every rank's copy of what it owns in
    host memory (so training may change the arrays afterwards).  Rank 0 clears a directory a
    killed save left behind and the others wait for it (a barrier); ``shared_tmp`` (the
    asynchronous saver) skips that wait: every rank makes the directory, each writes only its
    own files, and rank 0 merges only this world's parts."""
    from minidist import comm

    world = comm.world() if strategy.mesh is not None else None
    rank = world.rank if world is not None else 0
    tmp = os.path.join(directory, f".tmp-step-{step:06d}")
    if shared_tmp:
        os.makedirs(tmp, exist_ok=True)
    else:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # a save killed half-way before this one
            os.makedirs(tmp)
        _barrier(world)
    snapshot = [(p.name, tuple(p.global_shape), p.sharding, what, flat, np.array(_host(array), copy=True))
                for p, what, flat, array in strategy.owned_state()]
    return {"directory": directory, "tmp": tmp, "final": step_dir(directory, step), "step": step,
            "rank": rank, "world": world, "snapshot": snapshot, "scalars": strategy.checkpoint_scalars(),
            "mesh": strategy.mesh_sizes(), "model": model_config.record(), "extra": extra or {}}


def _commit(pending) -> str:
    """The collective end of a save: once every rank's part is written, rank 0 merges the
    metadata and renames the checkpoint into place."""
    world = pending["world"]
    _barrier(world)
    if pending["rank"] == 0:
        _finish(pending, world.size if world is not None else 1)
    _barrier(world)
    return pending["final"]


def _write_part(tmp: str, rank: int, snapshot, scalars) -> None:
    """Write this rank's owned arrays into one file and the description of their pieces."""
    pieces, offset = [], 0
    name = f"rank-{rank:05d}.bin"
    with open(os.path.join(tmp, name), "wb") as f:
        for pname, shape, sh, what, flat, array in snapshot:
            data = np.ascontiguousarray(array).tobytes()
            f.write(data)
            pieces.append({"tensor": f"{pname}/{what}", "global_shape": list(shape), "dtype": str(array.dtype),
                           "file": name, "offset": offset, "nbytes": len(data), "crc32": zlib.crc32(data),
                           "tp": None if sh is None else [sh.dim, sh.index, sh.parts, sh.blocks],
                           "flat": None if flat is None else [flat.start, flat.stop]})
            offset += len(data)
        f.flush()
        os.fsync(f.fileno())
    _test_kill(rank, "part-written", tmp)
    part = {"file": name, "size": offset, "pieces": pieces, "scalars": scalars}
    # Renamed into place when complete: its existence means "written".
    replace_atomically(os.path.join(tmp, f"rank-{rank:05d}.json"), json.dumps(part))


def _finish_when_written(pending: dict, world_size: int, poll_s: float = 0.005) -> None:
    """Rank 0's finisher of an asynchronous save: wait until every rank's part file exists."""
    import time

    parts = [os.path.join(pending["tmp"], f"rank-{r:05d}.json") for r in range(world_size)]
    while not all(os.path.exists(p) for p in parts):
        time.sleep(poll_s)
    _finish(pending, world_size)


def _finish(pending: dict, world_size: int):
    """Rank 0: merge the parts into metadata.json, rename into place, then point ``latest``."""
    directory, tmp, final = pending["directory"], pending["tmp"], pending["final"]
    files, tensors, scalars = {}, {}, {}
    parts = [f"rank-{r:05d}" for r in range(world_size)]
    for name in os.listdir(tmp):  # leftovers of a killed save: a larger world's, temporary ".NAME.tmp-PID" or "NAME.tmp"
        if name.split(".")[0] not in parts or name.endswith(".tmp"):
            os.remove(os.path.join(tmp, name))
    for part_name in [f"{p}.json" for p in parts if os.path.exists(os.path.join(tmp, f"{p}.json"))]:
        with open(os.path.join(tmp, part_name)) as f:
            part = json.load(f)
        os.remove(os.path.join(tmp, part_name))
        files[part["file"]] = part["size"]
        for piece in part["pieces"]:
            key, shape, dtype = piece.pop("tensor"), piece.pop("global_shape"), piece.pop("dtype")
            entry = tensors.setdefault(key, {"global_shape": shape, "dtype": dtype, "pieces": []})
            entry["pieces"].append(piece)
        for key, value in part["scalars"].items():
            if isinstance(value, dict):
                scalars.setdefault(key, {}).update(value)
            else:
                scalars.setdefault(key, value)
    meta = {"format": FORMAT, "step": pending["step"], "world_size": world_size, "mesh": pending["mesh"],
            "model": pending["model"], "scalars": {**scalars, **pending["extra"]},
            "files": files, "tensors": tensors}
    write_synced(os.path.join(tmp, "metadata.json"), json.dumps(meta, indent=1))
    if os.path.exists(final):
        shutil.rmtree(final)  # the same step saved again (a rerun): replace it whole
    os.rename(tmp, final)
    _test_kill(0, "renamed", final)
    for name in os.listdir(directory):  # the temporary pointers of saves killed before their rename
        if name.startswith(".latest.tmp-"):
            os.remove(os.path.join(directory, name))
    replace_atomically(os.path.join(directory, "latest"), os.path.basename(final) + "\n")


def _test_kill(rank: int, point: str, path: str) -> None:
    """A test's kill -9 at a chosen point of a save (MINIDIST_TEST_KILL_IN_SAVE=RANK:POINT:STEP):
    "part-written", when the rank's array file is written but not yet declared complete;
    "renamed" (rank 0), when the checkpoint is in place but ``latest`` not yet moved to it."""
    from minidist.host import env

    want = env.get("MINIDIST_TEST_KILL_IN_SAVE")
    if want is not None and env.get("MINIDIST_RESTART") == 0 and want == (rank, point, int(path.rsplit("-", 1)[-1])):
        import signal

        os.kill(os.getpid(), signal.SIGKILL)


def _barrier(world):
    if world is not None:
        from minidist import comm
        comm.barrier(world)


def _host(array):
    from minidist.model.backend import to_host
    return to_host(array)


# ------------------------------------------------------------------------------------------------
# Loading (resharding)
# ------------------------------------------------------------------------------------------------
class Reader:
    """This rank's view of a checkpoint: ``read(p, what, flat)`` gives the part of tensor
    ``p.name/what`` that ``p`` (its tensor-parallel slice) needs, reading only pieces that
    overlap it; every piece read is checked against its CRC.  ``meta`` (default: read and
    checked here) must come from :func:`metadata`: the reads trust its checked ranges."""

    def __init__(self, path: str, meta: dict | None = None):
        self.path = path
        self.meta = meta if meta is not None else metadata(path)

    def has(self, p, what: str) -> bool:
        return f"{p.name}/{what}" in self.meta["tensors"]

    def read(self, p, what: str, flat: slice | None = None):
        """The local (tensor-parallel) array of ``p``'s ``what`` ("param", "exp_avg", ...),
        flattened and cut to ``flat`` when given; shaped like ``p`` otherwise."""
        key = f"{p.name}/{what}"
        if key not in self.meta["tensors"]:
            raise CheckpointError(f"{self.path}: no tensor {key} in the checkpoint")
        entry = self.meta["tensors"][key]
        if tuple(entry["global_shape"]) != tuple(p.global_shape):
            raise CheckpointError(f"{self.path}: {key} has shape {tuple(entry['global_shape'])}, "
                                  f"the model's is {tuple(p.global_shape)}")
        sh = p.sharding
        spec = None if sh is None else [sh.dim, sh.index, sh.parts, sh.blocks]
        local_shape = tuple(p.global_shape) if sh is None else sh.local_shape(p.global_shape)
        want = flat if flat is not None else slice(0, int(np.prod(local_shape)))
        same = [pc for pc in entry["pieces"] if pc["tp"] == spec]
        if _covers(same, want, int(np.prod(local_shape))):
            out = self._assemble_flat(same, want, entry["dtype"], int(np.prod(local_shape)))
        else:  # another tensor-parallel layout: rebuild the global tensor, take this rank's slice
            full = self._global(entry)
            local = full if sh is None else sh.take(full)
            out = np.ascontiguousarray(local).reshape(-1)[want]
        return out if flat is not None else out.reshape(local_shape)

    def _assemble_flat(self, pieces, want: slice, dtype: str, size: int):
        out = np.empty(want.stop - want.start, dtype=checkpoint_meta.numpy_dtype(dtype))
        for pc in pieces:
            lo, hi = pc["flat"] if pc["flat"] is not None else (0, size)
            a, b = max(lo, want.start), min(hi, want.stop)
            if a < b:
                data = self._bytes(pc)  # the whole piece: its CRC covers it
                out[a - want.start:b - want.start] = np.frombuffer(data, dtype=out.dtype)[a - lo:b - lo]
        return out

    def _global(self, entry):
        """The whole global tensor, from every saved tensor-parallel slice."""
        shape, dtype = tuple(entry["global_shape"]), checkpoint_meta.numpy_dtype(entry["dtype"])
        by_spec = {}
        for pc in entry["pieces"]:
            by_spec.setdefault(tuple(pc["tp"]) if pc["tp"] is not None else None, []).append(pc)
        full = np.empty(shape, dtype=dtype)
        for spec, pieces in by_spec.items():
            if spec is None:
                size = int(np.prod(shape))
                return self._assemble_flat(pieces, slice(0, size), entry["dtype"], size).reshape(shape)
            from minidist.parallel.tensor import Shard

            sh = Shard(spec[0], spec[1], spec[2], spec[3])
            local_shape = sh.local_shape(shape)
            size = int(np.prod(local_shape))
            local = self._assemble_flat(pieces, slice(0, size), entry["dtype"], size).reshape(local_shape)
            index, indices = [slice(None)] * len(shape), _host(sh.indices(shape[sh.dim]))
            index[sh.dim] = indices[indices < shape[sh.dim]]  # a padded vocabulary's rows from V on: dropped
            full[tuple(index)] = np.compress(indices < shape[sh.dim], local, axis=sh.dim)
        return full

    def _bytes(self, pc) -> bytes:
        global bytes_read
        file = os.path.join(self.path, pc["file"])
        with open(file, "rb") as f:
            f.seek(pc["offset"])
            data = f.read(pc["nbytes"])
        bytes_read += len(data)
        if len(data) != pc["nbytes"] or zlib.crc32(data) != pc["crc32"]:
            raise CheckpointError(f"{file}: damaged (bytes {pc['offset']}..{pc['offset'] + pc['nbytes']} fail "
                                  "their checksum)")
        return data


def _covers(pieces, want: slice, size: int) -> bool:
    """Do the flat ranges of ``pieces`` cover ``want``?"""
    ranges = sorted((pc["flat"][0], pc["flat"][1]) if pc["flat"] is not None else (0, size) for pc in pieces)
    reach = want.start
    for lo, hi in ranges:
        if lo > reach:
            break
        reach = max(reach, hi)
    return reach >= want.stop


def load(path: str, strategy) -> dict:
    """Fill ``strategy``'s parameters and optimizer state (this rank's part, in this run's
    layout) from checkpoint ``path``; return the checkpoint's metadata (its ``step`` and
    ``scalars``)."""
    reader = Reader(path)
    strategy.load_state(reader)
    return reader.meta


def load_full(path: str) -> tuple[dict, dict]:
    """``(model config dict, {parameter name: whole array})`` of a checkpoint, gathered from any
    sharding on one process (for export and generation)."""
    path = resolve(path)
    reader = Reader(path)  # the metadata checked again as it is read: the one this reader uses
    params = {key[:-len("/param")]: reader._global(entry)
              for key, entry in reader.meta["tensors"].items() if key.endswith("/param")}
    return reader.meta["model"], params
