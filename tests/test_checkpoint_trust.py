"""A checkpoint is untrusted input: every field of its metadata is checked before any file is
opened or any array allocated, and every refusal is one line and exit code 2 from each reader
(train --resume, export, generate), never a traceback (minidist/state/checkpoint_meta.py)."""
import json
import os
import shutil
import subprocess
import sys
import tracemalloc

import numpy as np
import pytest

from minidist.train.testing import run_train

pytestmark = pytest.mark.xdist_group(name="checkpoint_trust")  # its module fixture runs once, in one worker

MODEL = ["--layers", "1", "--d-model", "16", "--heads", "2", "--seq-len", "16"]
TRAIN = MODEL + ["--batch-size", "8", "--eval-every", "0", "--warmup", "0", "--quiet", "--steps", "2",
                 "--peak-gflops", "1"]
STEP = "step-000002"
QKV = "h.0.attn.c_attn.weight/param"  # split over tp2: one piece per tensor-parallel rank


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A real sharded checkpoint (dp2·tp2, ZeRO-1: tensor-parallel slices and flat shards) of a
    1-layer model, and a small corpus for the resumed runs."""
    root = tmp_path_factory.mktemp("saved")
    (root / "save").mkdir()
    (root / "corpus.txt").write_text("".join(f"def f{i}(x):\n    return x * {i}\n" for i in range(400)))
    r = run_train(4, TRAIN + ["--dp", "2", "--tp", "2", "--zero", "1", "--save", str(root / "save")], timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    return root


def _copy(saved, tmp_path):
    """A fresh copy of the checkpoint's save directory; its metadata."""
    shutil.copytree(saved / "save", tmp_path / "save")
    return tmp_path / "save", json.loads((tmp_path / "save" / STEP / "metadata.json").read_text())


def _write(save, meta):
    (save / STEP / "metadata.json").write_text(json.dumps(meta))


# each command: (what ``python -m`` runs, the module whose ``main`` that calls)
COMMANDS = {"train": ("minidist.train", "minidist.train.loop"),
            "export": ("minidist.state.export", "minidist.state.export"),
            "generate": ("minidist.state.generate", "minidist.state.generate")}


def _cli(command, *args):
    return subprocess.run([sys.executable, "-m", COMMANDS[command][0], *args], capture_output=True, text=True,
                          timeout=120)


def _commands(save, saved, out):
    """Each reader's command line (after ``python -m``)."""
    return {"export": ["export", str(save), "-o", str(out)],
            "generate": ["generate", str(save), "--tokens", "4", "--seed", "0"],
            "train --resume": ["train", *TRAIN, "--data", str(saved / "corpus.txt"), "--resume", str(save)]}


def _assert_refused(name, code, stdout, stderr, needle):
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert code == 2, (name, code, stderr)
    assert len(lines) == 1 and "Traceback" not in stderr and "error:" in lines[0], (name, stderr)
    assert needle in lines[0], (name, needle, lines[0])
    assert not stdout.strip(), (name, stdout)


# ------------------------------------------------------------------------------------------------
# The edits that were once read: each refused by every real command, one line, exit 2
# ------------------------------------------------------------------------------------------------
def _passwd(save, meta):
    meta["tensors"][QKV]["pieces"][0]["file"] = "../../../../etc/passwd"
    return 'pieces[0].file is "../../../../etc/passwd"'


def _latest_outside(save, meta):
    other = save.parent / "some" / "other"
    shutil.copytree(save, other)
    (save / "latest").write_text(os.path.relpath(other / STEP, save) + "\n")
    return "not a step-NNNNNN directory"


def _huge_shape(save, meta):
    meta["tensors"]["wte.weight/param"]["global_shape"] = [256000000000, 16]
    return 'tensors["wte.weight/param"].global_shape is [256000000000, 16]'


def _object_dtype(save, meta):
    meta["tensors"][QKV]["dtype"] = "object"
    return f'tensors["{QKV}"].dtype is "object"'


def _negative_offset(save, meta):
    meta["tensors"][QKV]["pieces"][0]["offset"] = -100
    return f'tensors["{QKV}"].pieces[0].offset is -100'


@pytest.mark.mpi
@pytest.mark.parametrize("edit", [_passwd, _latest_outside, _huge_shape, _object_dtype, _negative_offset],
                         ids=["file-outside", "latest-outside", "huge-shape", "object-dtype", "negative-offset"])
def test_the_edits_once_read_are_refused_by_every_command(edit, saved, tmp_path):
    save, meta = _copy(saved, tmp_path)
    needle = edit(save, meta)
    _write(save, meta)
    for name, argv in _commands(save, saved, tmp_path / "out").items():
        r = _cli(*argv)
        _assert_refused(name, r.returncode, r.stdout, r.stderr, needle)
    assert not (tmp_path / "out").exists()


@pytest.mark.mpi
def test_every_rank_refuses_before_any_collective(saved, tmp_path):
    """On 2 ranks each rank checks the metadata itself: exit 2, one line (rank 0's), no hang."""
    save, meta = _copy(saved, tmp_path)
    needle = _negative_offset(save, meta)
    _write(save, meta)
    r = run_train(2, TRAIN + ["--dp", "2", "--data", str(saved / "corpus.txt"), "--resume", str(save)], timeout=120)
    _assert_refused("train --resume on 2 ranks", r.returncode, r.stdout, r.stderr, needle)


# ------------------------------------------------------------------------------------------------
# One test per rule, through each command's main (in this process: a traceback fails the test)
# ------------------------------------------------------------------------------------------------
def _run(command, argv, capsys):
    """The command's ``main(ARGV)`` in this process: (exit code, stdout, stderr)."""
    import importlib

    main = importlib.import_module(COMMANDS[command][1]).main
    try:
        main(argv)
        code = 0
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def _split(meta):
    """A tensor and tensor-parallel slice whose flat range is cut into two pieces (ZeRO)."""
    for key, entry in meta["tensors"].items():
        by_spec = {}
        for i, pc in enumerate(entry["pieces"]):
            by_spec.setdefault(str(pc["tp"]), []).append(i)
        for indices in by_spec.values():
            if len(indices) > 1:
                return key, indices
    raise AssertionError("no tensor with a slice in two pieces")


def _link_outside(save, meta):
    outside = save.parent / "elsewhere.bin"
    shutil.copy(save / STEP / "rank-00001.bin", outside)
    os.remove(save / STEP / "rank-00001.bin")
    os.symlink(outside, save / STEP / "rank-00001.bin")
    return "rank-00001.bin: a link that leads outside"


def _step_link_outside(save, meta):
    other = save.parent / "other"
    shutil.copytree(save / STEP, other / STEP)
    os.symlink(other / STEP, save / "step-000007")
    (save / "latest").write_text("step-000007\n")
    return "names step-000007, a link that leads outside"


def _latest_link(save, meta):
    (save.parent / "latest").write_text(STEP + "\n")
    os.remove(save / "latest")
    os.symlink(save.parent / "latest", save / "latest")
    return "latest: a link that leads outside"


def _metadata_link(save, meta):
    shutil.move(save / STEP / "metadata.json", save.parent / "metadata.json")
    os.symlink(save.parent / "metadata.json", save / STEP / "metadata.json")
    return "metadata.json: a link that leads outside"


def _fifo(save, meta):
    os.remove(save / STEP / "rank-00001.bin")
    os.mkfifo(save / STEP / "rank-00001.bin")  # opening it would wait for a writer forever
    return "rank-00001.bin: not a regular file"


def _separator(save, meta):
    os.mkdir(save / STEP / "sub")
    shutil.copy(save / STEP / "rank-00000.bin", save / STEP / "sub" / "rank-00000.bin")
    meta["files"]["sub/rank-00000.bin"] = meta["files"].pop("rank-00000.bin")
    for entry in meta["tensors"].values():
        for pc in entry["pieces"]:
            pc["file"] = "sub/rank-00000.bin" if pc["file"] == "rank-00000.bin" else pc["file"]
    return 'files["sub/rank-00000.bin"] is not a plain rank-NNNNN.bin name'


def _dotdot(save, meta):
    meta["files"][".."] = 4096
    return 'files[".."] is not a plain'


def _foreign_rank(save, meta):
    shutil.copy(save / STEP / "rank-00000.bin", save / STEP / "rank-00009.bin")
    meta["files"]["rank-00009.bin"] = meta["files"]["rank-00000.bin"]
    return "is not the file of a rank of world_size 4"


def _negative_shape(save, meta):
    meta["tensors"]["wpe.weight/param"]["global_shape"] = [-16, 16]
    return "global_shape[0] is -16"


def _model_disagrees(save, meta):
    meta["model"]["d_model"] = 32
    meta["model"]["ffn_hidden"] = 128  # GPT-2's 4 d: the config is consistent, its tensors are not
    return "the model recorded beside it has"


def _dtype_disagrees(save, meta):
    meta["tensors"][QKV]["dtype"] = "float64"
    return "the model's dtype is float32"


def _negative_nbytes(save, meta):
    meta["tensors"][QKV]["pieces"][0]["nbytes"] = -4
    return "pieces[0].nbytes is -4"


def _beyond_the_file(save, meta):
    pc = meta["tensors"][QKV]["pieces"][1]
    pc["offset"] = meta["files"][pc["file"]] - 4
    return "lie beyond the end of"


def _wrong_length(save, meta):
    meta["tensors"][QKV]["pieces"][0]["nbytes"] += 4
    return "elements of float32 take"


def _gap(save, meta):
    key, (i, j) = _split(meta)
    del meta["tensors"][key]["pieces"][j]
    return "are missing"


def _overlap(save, meta):
    key, (i, j) = _split(meta)
    meta["tensors"][key]["pieces"].append(dict(meta["tensors"][key]["pieces"][i]))
    return "overlap"


def _missing_slice(save, meta):
    del meta["tensors"][QKV]["pieces"][1]
    return "lack tensor-parallel slice 1 of 2"


def _bad_split(save, meta):
    meta["tensors"][QKV]["pieces"][0]["tp"] = [1, 0, 5, 3]
    return "do not split into 5 parts"


def _shared_bytes(save, meta):
    wte, wpe = meta["tensors"]["wte.weight/param"]["pieces"][0], meta["tensors"]["wpe.weight/param"]["pieces"][0]
    wpe["file"], wpe["offset"] = wte["file"], wte["offset"]
    return "are claimed by both"


def _nan_step(save, meta):
    meta["step"] = float("nan")  # json.dumps writes NaN
    return "NaN is not a number JSON allows"


def _string_size(save, meta):
    meta["files"]["rank-00000.bin"] = str(meta["files"]["rank-00000.bin"])
    return 'files["rank-00000.bin"] is "'


def _string_step(save, meta):
    meta["step"] = "2"
    return 'step is "2": must be an integer'


def _bool_count(save, meta):
    meta["world_size"] = True
    return "world_size is true"


def _missing_field(save, meta):
    del meta["tensors"][QKV]["pieces"][0]["crc32"]
    return 'pieces[0] has no field "crc32"'


def _bad_crc(save, meta):
    meta["tensors"][QKV]["pieces"][0]["crc32"] = -1
    return "crc32 is -1"


def _mesh(save, meta):
    meta["mesh"]["dp"] = 1
    return "mesh sizes multiply to 2, not world_size 4"


def _huge_model(save, meta):
    meta["model"]["layers"] = 10**12
    return "the model (model.layers 1000000000000"


def _unknown_arch(save, meta):
    meta["model"]["arch"] = "mistral"
    return 'model.arch is "mistral": must be one of gpt2, llama'


def _kv_heads_not_dividing(save, meta):
    meta["model"]["kv_heads"] = 3
    return "model.kv_heads 3 does not divide model.heads 2"


def _gpt2_with_another_mlp(save, meta):
    meta["model"]["ffn_hidden"] = 48
    return "model.ffn_hidden is 48: GPT-2 has"


def _huge_rope_theta(save, meta):
    meta["model"]["rope_theta"] = 10**400  # an integer no float holds
    return "model.rope_theta is"


def _gpt2_tensors_as_llama(save, meta):
    meta["model"]["arch"] = "llama"
    return "arch llama) has 10"


def _unknown_tensor(save, meta):
    meta["tensors"]["h.7.mlp.c_fc.weight/param"] = meta["tensors"].pop("h.0.mlp.c_fc.weight/param")
    return 'tensors["h.7.mlp.c_fc.weight/param"] is not a parameter of this model'


def _missing_tensor(save, meta):
    del meta["tensors"]["ln_f.bias/param"]
    return "hold 15 parameters"


def _loss_scale(save, meta):
    meta["scalars"]["loss_scale"], meta["scalars"]["loss_scale_clean_steps"] = "inf", 0
    return 'scalars.loss_scale is "inf"'


def _metadata_too_large(save, meta):
    with open(save / STEP / "metadata.json", "r+b") as f:
        f.truncate(64 * 2**20 + 1)  # sparse: nothing is written
    return "larger than 67,108,864"


RULES = [_link_outside, _step_link_outside, _latest_link, _metadata_link, _fifo, _separator, _dotdot, _foreign_rank,
         _negative_shape, _model_disagrees, _dtype_disagrees, _negative_nbytes, _beyond_the_file, _wrong_length,
         _gap, _overlap, _missing_slice, _bad_split, _shared_bytes, _nan_step, _string_size, _string_step,
         _bool_count, _missing_field, _bad_crc, _mesh, _huge_model, _unknown_arch, _kv_heads_not_dividing,
         _gpt2_with_another_mlp, _huge_rope_theta, _gpt2_tensors_as_llama, _unknown_tensor, _missing_tensor,
         _loss_scale, _metadata_too_large]


@pytest.mark.mpi
@pytest.mark.parametrize("rule", RULES, ids=[r.__name__[1:] for r in RULES])
def test_each_rule_is_one_line_and_exit_2_from_every_command(rule, saved, tmp_path, capsys):
    save, meta = _copy(saved, tmp_path)
    _write(save, meta)
    needle = rule(save, meta)
    if rule is not _metadata_too_large:
        (save / STEP / "metadata.json").write_text(json.dumps(meta))  # through a link, if one is there
    for name, argv in _commands(save, saved, tmp_path / "out").items():
        _assert_refused(name, *_run(argv[0], argv[1:], capsys), needle)
    assert not (tmp_path / "out").exists()


@pytest.mark.mpi
def test_resume_checks_the_model_being_built(saved, tmp_path, capsys):
    """A checkpoint whose config is consistent but of another model than the run's."""
    save, meta = _copy(saved, tmp_path)
    argv = [a if a != "16" else "32" for a in TRAIN] + ["--data", str(saved / "corpus.txt"), "--resume", str(save)]
    _assert_refused("train --resume", *_run("train", argv, capsys), "d_model 16 -> 32")


@pytest.mark.mpi
def test_links_inside_the_checkpoint_are_fine(saved, tmp_path, capsys):
    """Not every link is refused: one to a file in the same directory loads."""
    save, meta = _copy(saved, tmp_path)
    os.rename(save / STEP / "rank-00001.bin", save / STEP / "rank-00001.copy")
    os.symlink("rank-00001.copy", save / STEP / "rank-00001.bin")
    code, out, err = _run("export", [str(save), "-o", str(tmp_path / "out")], capsys)
    assert code == 0 and not err, err


@pytest.mark.mpi
def test_export_refuses_an_output_that_is_a_link(saved, tmp_path):
    (tmp_path / "target").mkdir()
    os.symlink(tmp_path / "target", tmp_path / "out")
    r = _cli("export", str(saved / "save"), "-o", str(tmp_path / "out"))
    _assert_refused("export", r.returncode, r.stdout, r.stderr, "a symbolic link")
    assert os.listdir(tmp_path / "target") == []


def test_the_expected_shapes_are_the_models():
    from minidist.layout.model import ModelConfig, parameter_count, parameter_shapes
    from minidist.model.nn import GPT

    llama = {"arch": "llama", "heads": 4, "d_model": 16}
    for kw in ({}, {"bias": False}, {"tied": False}, {"bias": False, "tied": False},
               llama, {**llama, "kv_heads": 2}, {**llama, "kv_heads": 1, "ffn_hidden": 24},
               {**llama, "kv_heads": 2, "tied": True},
               {"experts": 3, "top_k": 1}, {"experts": 2, "moe_every": 2, "bias": False},
               {**llama, "kv_heads": 2, "experts": 2, "moe_every": 2, "tied": False}):
        cfg = ModelConfig(**{"layers": 2, "d_model": 8, "heads": 2, "block_size": 4, **kw})
        got = {name: tuple(p.data.shape) for name, p in GPT(cfg).named_parameters()}
        assert parameter_shapes(cfg) == got and parameter_count(cfg) == len(got), kw


# ------------------------------------------------------------------------------------------------
# Fuzz: every field of a real sharded checkpoint's metadata, mutated
# ------------------------------------------------------------------------------------------------
def _paths(obj, at=()):
    """Every place in the metadata: (path of keys and indices) for each value, container or not."""
    out = []
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for k, v in items:
        out.append(at + (k,))
        out.extend(_paths(v, at + (k,)))
    return out


def _field(path):
    """The field a path is an instance of: tensor names, file names and indices generalised."""
    return tuple("*" if isinstance(k, int) or (i and path[i - 1] in ("tensors", "files", "param_steps")) else k
                 for i, k in enumerate(path))


VALUES = [-1, 0, 1, 7, 2**63, 10**30, 2.5, 1e308, float("nan"), "", "x", "../../../../outside.bin", "/etc/passwd",
          "rank-00000.bin", None, True, [], {}, [0, 0], [0, 0, 2, 1], [1, 2, 3, 4, 5], {"a": 1}]


MUTATIONS = ("value", "perturb", "delete", "rename", "length", "value")


def _mutate(meta, path, how, rng):
    """One change at ``path``, ``how``: another value (of any type), a perturbed one, the field
    removed, its key renamed, or its list lengthened or shortened (another value where that
    does not apply).  Returns a description."""
    parent = meta
    for k in path[:-1]:
        parent = parent[k]
    key, value = path[-1], parent[path[-1]]
    if how == "delete":
        del parent[key]
    elif how == "rename" and isinstance(parent, dict):
        parent[rng.choice(["", "x", "../" + str(key), str(key) + "/..", "rank-00000.bin"])] = parent.pop(key)
    elif how == "length" and isinstance(value, list) and value:
        if rng.random() < 0.5:
            value.append(json.loads(json.dumps(value[-1])))
        else:
            value.pop(rng.integers(len(value)))
    elif how == "perturb" and type(value) is int:
        parent[key] = int(rng.choice([value + 1, value - 1, value * 2, value // 2, -value]))
    elif how == "perturb" and isinstance(value, str):
        parent[key] = rng.choice([value + "/..", "../" + value, value.upper(), value[:-1]])
    elif how == "perturb" and isinstance(value, list):
        parent[key] = value[::-1]
    else:
        how = "value"
        parent[key] = VALUES[rng.integers(len(VALUES))]
    return f"{how} at {path}"


class _Opens:
    """The files this process opens while watching (an audit hook: builtins.open, os.open, ...)."""

    def __init__(self):
        self.paths, self.on = [], False
        sys.addaudithook(self)

    def __call__(self, event, args):
        if self.on and event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
            self.paths.append(os.path.realpath(os.fsdecode(args[0])))


@pytest.mark.mpi
@pytest.mark.slow
def test_fuzz_every_field_loads_correctly_or_is_refused_in_one_line(saved, tmp_path, capsys, monkeypatch):
    """Each field of the metadata (every kind of field, at a random instance), mutated each
    way: each reader either loads what an unchanged checkpoint gives or refuses with one line
    and exit 2 -- never a traceback, never a file opened outside the checkpoint, never more
    memory than an unchanged checkpoint takes."""
    import minidist.train.loop

    # a CRC failure found while loading ends train with os._exit(2): here, a SystemExit instead
    monkeypatch.setattr(minidist.train.loop.os, "_exit", lambda code: (_ for _ in ()).throw(SystemExit(code)))
    save, meta = _copy(saved, tmp_path)
    shutil.copy(save / STEP / "rank-00000.bin", tmp_path / "outside.bin")  # a decoy a traversal could reach
    allowed = [os.path.realpath(p) for p in (save, tmp_path / "out", saved / "corpus.txt")]
    root = os.path.realpath(tmp_path)
    watch = _Opens()
    commands = _commands(save / STEP, saved, tmp_path / "out")

    def run_all():
        results = {}
        for name, argv in commands.items():
            shutil.rmtree(tmp_path / "out", ignore_errors=True)
            tracemalloc.start()
            watch.on = True
            try:
                code, out, err = _run(argv[0], argv[1:], capsys)
            finally:
                watch.on = False
                peak = tracemalloc.get_traced_memory()[1]
                tracemalloc.stop()
            tensors = None
            if name == "export" and code == 0:
                from minidist.state.export import read_safetensors

                tensors = read_safetensors(str(tmp_path / "out" / "model.safetensors"))[1]
            results[name] = (code, out, err, peak, tensors)
        return results

    baseline = run_all()
    assert all(r[0] == 0 for r in baseline.values()), {k: r[2] for k, r in baseline.items()}
    rng = np.random.default_rng(0)
    by_field = {}
    for path in _paths(meta):
        by_field.setdefault(_field(path), []).append(path)
    cases = refused = 0
    for field, paths in sorted(by_field.items(), key=str):
        params = [p for p in paths if len(p) < 2 or p[0] != "tensors" or p[1].endswith("/param")]
        for i, how in enumerate(MUTATIONS):
            mutated = json.loads(json.dumps(meta))
            among = params if i % 2 and params else paths  # half in parameters: what export and generate compare
            what = _mutate(mutated, among[rng.integers(len(among))], how, rng)
            _write(save, mutated)
            watch.paths.clear()
            for name, (code, out, err, peak, tensors) in run_all().items():
                cases += 1
                lines = [line for line in err.splitlines() if line.strip()]
                if code == 2:
                    refused += 1
                    assert len(lines) == 1 and "error:" in lines[0], (what, name, err)
                else:
                    assert code == 0, (what, name, code, err)
                    want = baseline[name]
                    if name == "export":
                        assert tensors.keys() == want[4].keys(), what
                        assert all(np.array_equal(tensors[k], want[4][k]) for k in tensors), what
                    if name == "generate":
                        assert out == want[1], (what, out)
                assert peak <= 1.5 * baseline[name][3] + 2**20, (what, name, peak, baseline[name][3])
            outside = [p for p in watch.paths if p.startswith(root) and not any(p.startswith(a) for a in allowed)]
            assert not outside, (what, outside)
    assert refused > cases // 2, (refused, cases)  # most changes are refused; the rest load unchanged
