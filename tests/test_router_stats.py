"""The routers' statistics (minidist/observe/router.py) and expert parallelism's bytes
(minidist/layout/expert_traffic.py).

* On one process: the statistics against the layer's own numbers (its kept counts, its
  load-balancing and z losses with coefficient 1), summed over micro-batches, evaluation
  not counted.
* Under mpiexec (the body at the end of this file, on every rank): data x expert parallelism
  with two micro-batches gives one process's statistics of the whole batch, and the bytes
  ``comm.stats`` counted on each rank's ep group equal the closed form from the routing.
* The training command: the records, progress line and summary carry them with --experts
  only, and --dp 2 --ep 2 writes the one-process run's numbers.
"""
import json
import math
import re

import numpy as np
import pytest

from minidist.layout import expert_traffic as et
from minidist.model.autograd import no_grad
from minidist.layout.model import ModelConfig
from minidist.model.nn import GPT
from minidist.model.moe import mixtures
from minidist.observe.router import RouterStats
from minidist.train.testing import run_mpi, run_train


def _model(**kw):
    cfg = dict(vocab_size=256, block_size=8, layers=2, heads=2, d_model=16, dtype="float64", seed=0,
               experts=4, top_k=2, moe_every=1, capacity_factor=1.0)
    cfg.update(kw)
    return GPT(ModelConfig(**cfg))


def _batch(rows, seed=7):
    tokens = np.random.default_rng(seed).integers(0, 256, size=(rows, 9))
    return tokens[:, :-1], tokens[:, 1:]


# -- the formula alone ----------------------------------------------------------------------------
def test_mixture_bytes_by_hand():
    """2 ranks, 4 experts (rank 0: experts 0-1, rank 1: 2-3), d = 3 float64 values per row."""
    rows = [[5, 1, 2, 4],   # rank 0 keeps 6 rows, sends 2 + 4 = 6 to rank 1
            [3, 0, 7, 1]]   # rank 1 sends 3 to rank 0
    got = et.mixture_bytes(rows, 0, 3, 8)
    assert got == {"counts": 8 + 8 * 2, "dispatch": 2 * (8 + 6 * 24), "combine": 2 * (8 + 3 * 24)}
    assert et.mixture_bytes(rows, 1, 3, 8, backward=False) == {"counts": 24, "dispatch": 8 + 3 * 24,
                                                               "combine": 8 + 6 * 24}
    assert et.ep_step_bytes([rows, rows], 0, 3, 8) == 2 * sum(got.values())


@pytest.mark.parametrize("ep", [2, 4])
def test_balanced_routing_is_the_planning_formula(ep):
    E, k, tokens, d = 8, 2, 32, 16  # every rank sends tokens·k / E rows to every expert
    rows = [[tokens * k // E] * E for _ in range(ep)]
    for r in range(ep):
        assert et.ep_step_bytes([rows] * 3, r, d, 4) == et.balanced_ep_step_bytes(tokens, k, E, ep, d, 4, mixtures=3)


# -- one process ------------------------------------------------------------------------------------
def test_statistics_are_the_layers_own_numbers():
    x, y = _batch(4)
    stats = RouterStats(model := _model(aux_loss_coef=1.0, z_loss_coef=0.0))
    counts, aux = [], []
    for half in (slice(0, 2), slice(2, 4)):  # two micro-batches of one step
        model(x[half], y[half]).backward()
        counts.append([m.last_counts.copy() for m in mixtures(model.h)])
        aux.append([float(m.aux_loss.data) for m in mixtures(model.h)])
    with no_grad():
        model(x, y)  # evaluation: not counted
    s = stats.step()
    kept = np.sum(counts, axis=0)
    assert s["tokens"] == kept.tolist()
    assert (s["min"], s["max"], s["mean"]) == (kept.min(), kept.max(), kept.mean())
    assert s["dropped"] == pytest.approx(1 - kept.sum() / (2 * 4 * 8 * 2), rel=1e-12)  # mixtures x tokens x k
    assert 0 < s["dropped"] < 1  # capacity 1.0 of random tokens drops some
    # the load-balancing loss: the mean over sequences (2 per micro-batch) and mixtures
    assert s["aux_loss"] == pytest.approx(np.mean(aux), rel=1e-12)
    assert s["tokens"] != stats.step()["tokens"]  # the sums start again each step

    stats = RouterStats(model := _model(aux_loss_coef=0.0, z_loss_coef=1.0))
    model(x, y).backward()
    z = np.mean([float(m.aux_loss.data) for m in mixtures(model.h)])
    assert stats.step()["z_loss"] == pytest.approx(z, rel=1e-12) and z > 0


def test_dropless_routing_drops_nothing_and_keeps_every_choice():
    x, y = _batch(2)
    stats = RouterStats(model := _model(capacity_factor=0.0))
    model(x, y).backward()
    s = stats.step()
    assert s["dropped"] == 0.0 and all(sum(row) == 2 * 8 * 2 for row in s["tokens"])


# -- every rank: data x expert parallelism equals one process, bytes equal the formula ----------
def ep_equals_one_process(ep, out_dir):
    """MPI body: each rank runs the one-process reference on the whole batch, then its rows in
    two micro-batches with its experts; writes both statistics and its ep group's bytes to
    ``out_dir``/rank<r>.json (lines printed by several ranks may interleave)."""
    from minidist import comm
    from minidist.comm.stats import bytes_by_group
    from minidist.parallel import expert

    world, ep = comm.world(), int(ep)
    D, r = world.size, world.rank
    ep_group, _ = expert.expert_groups(world, ep)
    x, y = _batch(4 * D)
    ref = RouterStats(model := _model())
    for half in (slice(0, 2 * D), slice(2 * D, 4 * D)):
        model(x[half], y[half]).backward()
    want = ref.step()
    model = _model()
    expert.split_experts(model, ep_group)
    stats = RouterStats(model, world)
    before = bytes_by_group().get(ep_group.name, 0)
    for rows in (slice(4 * r, 4 * r + 2), slice(4 * r + 2, 4 * r + 4)):  # this rank's 4 rows, 2 micro-batches
        model(x[rows], y[rows]).backward()
    sent = bytes_by_group()[ep_group.name] - before
    got = stats.step(d_model=16, itemsize=8)
    formula = got.pop("ep_bytes")[ep_group.name]
    with open(f"{out_dir}/rank{r}.json", "w") as f:
        json.dump({"want": want, "got": got, "sent": sent, "formula": formula}, f)


def _same(got, want):
    assert got["tokens"] == want["tokens"] and got["min"] == want["min"] and got["max"] == want["max"]
    for key in ("mean", "dropped", "aux_loss", "z_loss"):
        assert math.isclose(got[key], want[key], rel_tol=1e-9), (key, got[key], want[key])


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs, ep", [(2, 2), (4, 2)], ids=["ep2", "dp4-ep2"])
def test_expert_parallel_statistics_and_bytes_on_every_rank(tmp_path, nprocs, ep):
    run_mpi(nprocs, f"{__file__}::ep_equals_one_process", str(ep), str(tmp_path), timeout=180)
    lines = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(nprocs)]
    for line in lines:
        _same(line["got"], line["want"])
        assert line["sent"] == line["formula"] > 0, line


# -- every rank of a pipeline: the whole model's mixtures, one process's numbers -----------------
PIPELINES = [  # 4 ranks, 4 blocks; "pp0 none": the first pipeline rank holds no mixture
    ["--dp", "2", "--pp", "2", "--moe-every", "2"],                                     # 1f1b, one each
    ["--pp", "2", "--tp", "2", "--schedule", "interleaved", "--virtual-stages", "2",    # pp0 none: blocks 0, 2
     "--moe-every", "2", "--sequence-parallel"],
    ["--pp", "4", "--moe-every", "4", "--capacity-factor", "0"],                        # pp0-2 none, dropless
    ["--dp", "2", "--pp", "2", "--schedule", "zb-h1", "--ep", "2"],                     # ep bytes beside a pipeline
    ["--pp", "2", "--cp", "2", "--schedule", "zbv", "--microbatches", "4", "--moe-every", "3",  # V: pp0 none
     "--top-k", "1"],
]


def pipeline_equals_one_process(out_dir):
    """MPI body (4 ranks): for each mesh of ``PIPELINES``, one training step's router record
    on every rank (``report.router_stats``, as the training command builds it) and the
    one-process model's record of the same batch; with --ep the ep group's counted bytes."""
    from minidist.comm.stats import bytes_by_group
    from minidist.parallel.compose import build, build_mesh
    from minidist.state.data import Sampler
    from minidist.train.flags import build_parser, validate
    from minidist.train.report import router_stats

    parser, out = build_parser(), []
    for flags in PIPELINES:
        cfg = validate(parser.parse_args([*TINY, *MOE, "--layers", "4", "--seq-len", "8", "--microbatches", "2",
                                          "--quiet", *flags]), parser)
        mesh = build_mesh(cfg.parallel)
        _, strategy = build(cfg, mesh)
        stats = router_stats(cfg, strategy)
        corpus = np.random.default_rng(1).integers(0, 256, 4000).astype(np.uint8)
        x, y = Sampler(corpus, cfg.data.seq_len, cfg.data.batch_size, cfg.model.seed).batch(0)
        before = bytes_by_group()
        strategy.forward_backward(x, y, cfg.device.grad_accum, None, 1.0)
        sent = {g: n - before.get(g, 0) for g, n in bytes_by_group().items()}
        got = stats.step(cfg.model.d_model, 8)
        ref = RouterStats(model := GPT(cfg.model))
        model(x, y).backward()
        ep = {g: [n, sent[g]] for g, n in got.pop("ep_bytes", {}).items()}  # formula, counted
        out.append({"flags": " ".join(flags), "got": got, "want": ref.step(), "ep": ep, "held": len(stats.layers)})
    with open(f"{out_dir}/rank{mesh.rank}.json", "w") as f:
        json.dump(out, f)


@pytest.mark.mpi
def test_pipelines_report_every_stages_mixtures_on_every_rank(tmp_path):
    """Each stage counts its own mixtures in rows of the whole model's buffer, summed over dp x pp:
    every rank, a stage without a mixture among them, reports one process's record."""
    run_mpi(4, f"{__file__}::pipeline_equals_one_process", str(tmp_path), timeout=400)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    for flags, *meshes in zip(PIPELINES, *ranks):
        for line in meshes:
            _same(line["got"], line["want"])
            assert bool(line["ep"]) == ("--ep" in flags), line
            assert all(formula == counted > 0 for formula, counted in line["ep"].values()), line
    assert [ranks[0][i]["held"] for i in range(len(PIPELINES))] == [1, 0, 0, 2, 0]  # rank 0 reports, mixtures or none


# -- the training command -----------------------------------------------------------------------
TINY = ["--layers", "2", "--d-model", "16", "--heads", "2", "--seq-len", "16", "--batch-size", "8", "--steps", "2",
        "--eval-every", "0", "--peak-gflops", "10", "--dtype", "float64", "--log-every", "1"]
MOE = ["--experts", "4", "--capacity-factor", "1.0"]


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.mpi
def test_training_reports_the_one_process_statistics_and_ep_bytes(tmp_path):
    one, two = tmp_path / "one.jsonl", tmp_path / "two.jsonl"
    p1 = run_train(None, [*TINY, *MOE, "--metrics-jsonl", str(one)])
    p2 = run_train(2, [*TINY, *MOE, "--dp", "2", "--ep", "2", "--metrics-jsonl", str(two)], timeout=180)
    assert p1.returncode == 0 and p2.returncode == 0, p1.stderr + p2.stderr
    for a, b in zip(_records(one), _records(two)):
        ep_bytes = b["router"].pop("ep_bytes")
        _same(b["router"], a["router"])
        assert ep_bytes == {"dp.ep2": b["bytes_sent"]["dp.ep2"]}, (ep_bytes, b["bytes_sent"])
    for out in (p1.stdout, p2.stdout):
        assert out.count("experts max/mean") == 2 and "router (last step)" in out, out
    m = re.search(r"dp\.ep2 ([\d,]+) B \(formula ([\d,]+)\)", p2.stdout)  # the summary's bytes row
    assert m and m.group(1) == m.group(2), p2.stdout


@pytest.mark.parametrize("moe", [[], ["--experts", "2", "--moe-every", "3"]], ids=["dense", "no-mixture-in-2-layers"])
def test_runs_without_a_mixture_have_no_router_statistics(tmp_path, moe):
    path = tmp_path / "dense.jsonl"
    proc = run_train(None, [*TINY, *moe, "--steps", "1", "--metrics-jsonl", str(path)])
    assert proc.returncode == 0, proc.stderr
    assert "router" not in _records(path)[0] and "experts max/mean" not in proc.stdout
    assert "router (last step)" not in proc.stdout
