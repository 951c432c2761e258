"""Context parallelism (ring attention, Ulysses): cp in {2, 4} and dp=2 x cp=2 train exactly
like one process (float64); memory below T x T; zig-zag balances the work; bad input."""
import os
import re

import numpy as np
import pytest

from minidist.parallel import context as ctx
from minidist.train.testing import run_mpi

BODIES = os.path.join(os.path.dirname(__file__), "mpi", "context_bodies.py")


def test_positions_cover_the_sequence_once():
    for zigzag in (True, False):
        for cp in (1, 2, 4):
            seen = np.concatenate([ctx.positions(r, cp, 16, zigzag) for r in range(cp)])
            assert sorted(seen.tolist()) == list(range(16))
    assert ctx.positions(1, 4, 16, True).tolist() == [2, 3, 12, 13]  # chunks 1 and 6 of 8


def test_zigzag_balances_ring_work():
    """Causal attention over 4 ranks, one tile per chunk pair: with contiguous slices rank r
    meets r + 1 blocks of keys; zig-zag gives every rank 2C + 1 chunk pairs (of a quarter of
    the size), the same work everywhere, and the busiest rank less than before."""
    plain, zigzag = ctx.ring_work(4, 64, False), ctx.ring_work(4, 64, True)
    assert plain == [16 * 16 * (r + 1) for r in range(4)]
    assert zigzag == [9 * 8 * 8] * 4 and max(zigzag) < max(plain)


def test_ring_tiles_count_the_tiles_the_kernels_run():
    """layout.grid.ring_tiles (what the planner prices) against the tiles the online softmax's
    own loop (blockwise.tiles) yields for every chunk pair a rank meets."""
    from minidist.layout.grid import chunk_starts, ring_tiles
    from minidist.model.ops import blockwise as bw

    for cp, seq, zigzag, block in [(2, 64, True, None), (2, 64, True, 8), (4, 64, True, 5), (4, 64, False, 4),
                                   (3, 36, False, None), (3, 48, True, 16)]:
        want = []
        for r in range(cp):
            mine, c = chunk_starts(r, cp, seq, zigzag)
            tiles = [(rows, cols) for src in range(cp) for qa in mine for kb in chunk_starts(src, cp, seq, zigzag)[0]
                     for rows, cols, _ in bw.tiles(c, c, qa, kb, block or c, True, np.float64)]
            want.append((len(tiles), sum((r.stop - r.start) * (k.stop - k.start) for r, k in tiles)))
        assert ring_tiles(cp, seq, zigzag, block) == want, (cp, seq, zigzag, block)
    assert ring_tiles(2, 64, True) == [(5, 5 * 16 * 16)] * 2  # 2C + 1 chunk pairs, one tile each


def _given(**kw):
    """The run configuration as given: --cp 2 --cp-impl ring --seq-len 64 --heads 4 unless ``kw``
    says otherwise (``kw`` names flags: cp, cp_impl, seq_len, heads, tp, zero, attention, attention_block)."""
    from minidist.train.config import RunConfig

    f = {"cp": 2, "cp_impl": "ring", "seq_len": 64, "heads": 4, **kw}
    return RunConfig().replace(
        model=dict(heads=f["heads"], d_model=16 * f["heads"], attention=f.get("attention", "plain"),
                   attention_block=f.get("attention_block")),
        data=dict(seq_len=f["seq_len"]),
        parallel=dict(cp=f["cp"], cp_impl=f["cp_impl"], tp=f.get("tp", 1), zero=f.get("zero")))


def _problems(**kw):
    """parallel.context.problems of these flags."""
    given = _given(**kw)
    return ctx.problems(given, given.resolved(given.parallel.world_size))


def test_bad_context_configurations():
    with pytest.raises(ValueError, match="unknown context-parallel implementation 'tree'"):
        ctx.ContextParallel(None, "tree")
    for kw, message in [(dict(cp=2, cp_impl="ring", seq_len=30, heads=4),
                         r"--seq-len 30 is not divisible by 2 x --cp = 4: zig-zag ring attention"),
                        (dict(cp=4, cp_impl="ulysses", seq_len=64, heads=6), r"--heads 6 is not divisible by --cp 4"),
                        (dict(cp=2, cp_impl="tree", seq_len=64, heads=4),
                         r"unknown context-parallel implementation 'tree'")]:
        found = _problems(**kw)
        assert len(found) == 1 and re.search(message, found[0]), (kw, found)
    assert _problems(cp=2, cp_impl="ring", seq_len=28, heads=4) == []
    assert _problems(cp=4, cp_impl="ulysses", seq_len=8, heads=4) == []


@pytest.mark.mpi
def test_context_parallel_trains_like_one_process():
    out = run_mpi(4, f"{BODIES}::train_all", timeout=240).stdout
    assert out.count("context done") == 4, out
    assert out.count("cp ok:") == 4 * 8, out


@pytest.mark.mpi
def test_training_strategy_dp_x_cp_trains_like_one_process():
    """The training command's strategy: DDP buckets over ("dp", "cp"), its loop, --grad-accum,
    --checkpoint-activations, --attention blockwise, against one process (float64)."""
    out = run_mpi(4, f"{BODIES}::strategy_matrix", timeout=240).stdout
    assert out.count("strategy done") == 4, out
    assert out.count("cp ok:") == 4 * 4, out


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", [2, 4])
def test_context_parallel_memory_and_work(nprocs):
    out = run_mpi(nprocs, f"{BODIES}::memory_and_work", timeout=120).stdout
    assert out.count("cp memory ok") == 2, out
    assert out.count("cp work ok") == 2, out


def test_training_flags_are_checked_with_their_names():
    from minidist.train.estimate import score_values

    def refused(message, **kw):
        found = _problems(**kw)
        assert any(re.search(message, line) for line in found) and all("\n" not in f for f in found), (kw, found)

    refused(r"--seq-len 30 is not divisible by 2 x --cp = 4", seq_len=30)
    refused(r"--heads 6 is not divisible by --cp 4", cp=4, cp_impl="ulysses", heads=6)
    refused(r"--seq-len 30 is not divisible by --cp 4", cp=4, cp_impl="ulysses", seq_len=30)
    # with tensor parallelism Ulysses splits each tp rank's heads over cp
    refused(r"--heads 4 / --tp 2 = 2 heads per tensor-parallel rank is not divisible by --cp 4",
            cp=4, cp_impl="ulysses", tp=2)
    # --cp with --zero, and --cp with --tp, were refused; they compose now (tests/test_compose.py)
    from minidist.parallel.compose import problems

    assert problems(_given(zero=2), 2) == [] and problems(_given(tp=2), 4) == []
    assert _problems(seq_len=30, cp=1, cp_impl=None) == []  # no context parallelism: any length
    # a flag of an axis that is off is refused, not ignored
    refused(r"--cp-impl ulysses needs --cp greater than 1", cp=1, cp_impl="ulysses")
    refused(r"--attention-block 16 needs --attention blockwise or ring attention",
            cp=1, cp_impl=None, attention="plain", attention_block=16)
    # Ulysses runs one rank's attention on its heads: plain attention there has no blocks either
    refused(r"--attention-block 16 needs --attention blockwise or ring attention",
            cp=4, cp_impl="ulysses", attention="plain", attention_block=16)
    assert _problems(cp=4, cp_impl="ulysses", attention="blockwise", attention_block=16) == []
    # the memory estimate's attention scores per sequence and block
    def scores(**kw):
        given = _given(**kw)
        return score_values(given.resolved(given.parallel.world_size))

    plain = dict(cp=1, cp_impl=None, attention="plain", attention_block=16)
    assert scores(**plain) == 4 * 64 * 64
    assert scores(**{**plain, "attention": "blockwise"}) == 4 * 16 * 16
    assert scores(cp=4, cp_impl=None, attention="plain", attention_block=128) == 4 * 8 * 8  # ring: chunks of 8
    assert scores(cp=4, cp_impl="ulysses", attention="plain", attention_block=16) == 64 * 64
    assert _problems(seq_len=30, cp=3, cp_impl="ulysses", heads=3) == []


# -- the training command ------------------------------------------------------------------------
TINY = ["--layers", "2", "--d-model", "16", "--heads", "4", "--seq-len", "16", "--batch-size", "4",
        "--peak-gflops", "10", "--eval-batches", "1"]


def _train(n, args, timeout=120):
    from minidist.train.testing import run_train

    return run_train(n if n > 1 else None, TINY + args, timeout)


@pytest.mark.mpi
def test_cli_trains_dp2_x_cp2_with_ring_attention(tmp_path):
    out = tmp_path / "m.jsonl"
    r = _train(4, ["--steps", "3", "--eval-every", "3", "--dp", "2", "--cp", "2", "--cp-impl", "ring",
                   "--attention-block", "4", "--metrics-jsonl", str(out)])
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("summary") == 1 and "dp=2 x cp=2: DDP over 4 ranks, ring context parallelism over 2 ranks" in r.stdout, r.stdout
    records = [__import__("json").loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 3 and records[0]["mesh"] == "dp=2 cp=2 (ring)" and "val_loss" in records[-1]


@pytest.mark.mpi
@pytest.mark.parametrize("n, args, needle", [
    (2, ["--cp", "2", "--seq-len", "18", "--block-size", "18"],
     "--seq-len 18 is not divisible by 2 x --cp = 4: zig-zag ring attention"),
    (2, ["--cp", "2", "--cp-impl", "ulysses", "--heads", "1", "--d-model", "16"],
     "--heads 1 is not divisible by --cp 2: Ulysses"),
    (1, ["--attention-block", "0"], "argument --attention-block: "),
    (1, ["--cp-impl", "tree"], "argument --cp-impl: invalid choice: 'tree'"),
])
def test_bad_context_input_is_one_message_exit_2(n, args, needle):
    r = _train(n, args, timeout=60)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert r.stderr.count(needle) == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stdout == ""


@pytest.mark.mpi
def test_cli_blockwise_attention_under_tensor_parallelism_equals_one_process(tmp_path):
    """--attention blockwise runs on each rank's heads under --tp: same losses as one process
    with plain attention (float64)."""
    import json

    common = ["--steps", "3", "--eval-every", "0", "--dtype", "float64", "--metrics-jsonl"]
    runs = {}
    for name, n, extra in (("one", 1, []), ("tp", 2, ["--tp", "2", "--attention", "blockwise",
                                                      "--attention-block", "5"])):
        out = tmp_path / f"{name}.jsonl"
        r = _train(n, common + [str(out)] + extra)
        assert r.returncode == 0, r.stderr
        runs[name] = [json.loads(line)["loss"] for line in out.read_text().splitlines()]
    assert len(runs["one"]) == 3
    np.testing.assert_allclose(runs["tp"], runs["one"], rtol=1e-9)
