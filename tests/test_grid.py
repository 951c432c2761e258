"""The 4D grid's placement (minidist/layout/grid.py): pure arithmetic, no MPI."""
import itertools
import sys

import pytest

from minidist.layout import grid

SHAPES = [(2, 2, 2, 2), (1, 2, 2, 2), (2, 1, 4, 1), (3, 2, 1, 2), (1, 4, 1, 1), (1, 1, 1, 1)]  # dp, pp, tp, cp
MODEL = dict(n_layer=8, n_head=8, seq_len=32, batch_size=12)


def _place(dp, pp, tp, cp, **kw):
    return grid.placement(dp, pp, tp, cp, **{**MODEL, **kw})


def _cells(p):
    """Every (layer, head, token) a rank computes."""
    tokens = [t for r in p["tokens"] for t in r]
    return itertools.product(p["layers"], p["heads"], tokens)


@pytest.mark.parametrize("virtual_stages", [1, 2])
@pytest.mark.parametrize("cp_impl", ["ring", "ulysses"])
@pytest.mark.parametrize("dp,pp,tp,cp", SHAPES)
def test_each_replica_covers_the_model_once(dp, pp, tp, cp, cp_impl, virtual_stages):
    """For one dp coordinate the other three axes partition layers x heads x tokens: every
    (layer, head, token) computed by exactly one rank of the replica."""
    if MODEL["n_layer"] % (pp * virtual_stages):
        pytest.skip("layers not divisible")
    table = _place(dp, pp, tp, cp, cp_impl=cp_impl, virtual_stages=virtual_stages)
    for d in range(dp):
        seen = {}
        for p in (p for p in table if p["dp"] == d):
            for cell in _cells(p):
                assert cell not in seen, (cell, seen.get(cell), p["rank"])
                seen[cell] = p["rank"]
        assert len(seen) == MODEL["n_layer"] * MODEL["n_head"] * MODEL["seq_len"]


@pytest.mark.parametrize("dp,pp,tp,cp", SHAPES)
def test_rows_split_over_dp_only(dp, pp, tp, cp):
    """The replicas' rows partition the batch; ranks of one replica share theirs."""
    table = _place(dp, pp, tp, cp, grad_accum=2)
    for rest in {(p["pp"], p["cp"], p["tp"]) for p in table}:
        rows = [r for p in table if (p["pp"], p["cp"], p["tp"]) == rest for r in p["rows"]]
        assert sorted(rows) == list(range(MODEL["batch_size"]))
    for p in table:
        assert [r for m in p["micro_batches"] for r in m] == list(p["rows"])
        assert len(p["micro_batches"]) == 2


def test_2x2x2x2_counts_and_layout():
    table = _place(2, 2, 2, 2, n_layer=4, n_head=4, seq_len=16, batch_size=8)
    assert len(table) == 16 and [p["rank"] for p in table] == list(range(16))
    for layer in range(4):  # each layer held by dp * tp * cp ranks
        assert sum(layer in p["layers"] for p in table) == 2 * 2 * 2
    assert sum(p["embed"] for p in table) == 8 and sum(p["lm_head"] for p in table) == 8
    # tp innermost: ranks 2k, 2k+1 differ only in tp; dp outermost: rank r and r+8
    for k in range(8):
        a, b = table[2 * k], table[2 * k + 1]
        assert (a["tp"], b["tp"]) == (0, 1)
        assert [a[x] for x in ("dp", "pp", "cp")] == [b[x] for x in ("dp", "pp", "cp")]
        assert table[k]["dp"] == 0 and table[k + 8]["dp"] == 1
    p5 = table[5]
    assert (p5["dp"], p5["pp"], p5["cp"], p5["tp"]) == (0, 1, 0, 1)
    assert p5["layers"] == [2, 3] and p5["lm_head"] and not p5["embed"]
    assert p5["heads"] == range(2, 4) and p5["rows"] == range(0, 4)
    assert p5["tokens"] == [range(0, 4), range(12, 16)]  # zig-zag: chunks 0 and 3 of 4
    assert table[2]["tokens"] == [range(4, 8), range(8, 12)]  # chunks 1 and 2


def test_interleaved_stages_loop_around_the_ranks():
    """V=2 on pp=2: model stage c*P + p on pp rank p (the looping placement)."""
    table = _place(1, 2, 1, 1, n_layer=8, virtual_stages=2)
    assert table[0]["layers"] == [0, 1, 4, 5] and table[1]["layers"] == [2, 3, 6, 7]
    assert table[0]["embed"] and table[1]["lm_head"]


def test_ulysses_tokens_contiguous_and_heads_in_attention():
    table = _place(1, 1, 2, 2, cp_impl="ulysses")
    assert [p["tokens"] for p in table] == [[range(0, 16)], [range(0, 16)], [range(16, 32)], [range(16, 32)]]
    # inside attention each (tp, cp) rank holds H/(tp*cp) heads over the whole sequence, all distinct
    assert [p["attention_heads"] for p in table] == [range(0, 2), range(4, 6), range(2, 4), range(6, 8)]
    assert "attention_heads" not in _place(1, 1, 2, 2)[0]


@pytest.mark.parametrize("shape, kw, message", [
    ((2, 2, 2, 2), dict(n_layer=5), "cannot be cut"),
    ((1, 1, 1, 1), dict(n_layer=4, virtual_stages=3), "cannot be cut"),
    ((2, 2, 2, 2), dict(n_head=5), "not divisible by tp"),
    ((2, 2, 2, 2), dict(seq_len=18), "2 x cp"),
    ((2, 2, 2, 2), dict(batch_size=1), "fewer rows"),
    ((2, 1, 1, 1), dict(batch_size=3, grad_accum=2), "fewer rows"),
    ((2, 2, 2, 2), dict(cp_impl="x"), "unknown cp_impl"),
    ((1, 1, 4, 4), dict(n_head=8, cp_impl="ulysses"), "Ulysses"),
    ((0, 1, 1, 1), {}, "dp=0"),
])
def test_refuses_what_does_not_split(shape, kw, message):
    with pytest.raises(ValueError, match=message):
        _place(*shape, **kw)


def test_describe_lines_and_groups():
    text = grid.describe(2, 2, 2, 2, n_layer=4, n_head=4, seq_len=16, batch_size=16)
    lines = text.splitlines()
    rank5 = next(line for line in lines if line.startswith("rank  5 "))
    assert [f.strip() for f in rank5.split("|")] == ["rank  5  dp0 pp1 cp0 tp1", "layers 2-3 +lm_head", "heads 2-3",
                                                     "tokens 0-3,12-15", "rows 0-7"]
    assert "tp groups: [0 1] [2 3] [4 5] [6 7] [8 9] [10 11] [12 13] [14 15]" in text
    assert "cp groups: [0 2] [1 3]" in text and "pp groups: [0 4] [1 5]" in text and "dp groups: [0 8] [1 9]" in text
    assert sum(line.startswith("rank ") for line in lines) == 16
    assert "micro-batches 0-3 4-7" in grid.describe(2, 1, 1, 1, 2, 2, 8, 16, grad_accum=2)


def test_runs():
    assert grid.runs([0, 1, 2, 3, 12, 13]) == "0-3,12-13"
    assert grid.runs([range(0, 4), range(12, 16)]) == "0-3,12-15"
    assert grid.runs(range(5, 6)) == "5" and grid.runs([]) == "-"


def test_draw_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "grid.png"
    grid.draw(2, 2, 2, 2, n_layer=4, n_head=4, seq_len=16, batch_size=8, path=str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    grid.draw(1, 1, 4, 4, n_layer=2, n_head=16, seq_len=32, batch_size=4, path=str(path), cp_impl="ulysses")


def test_draw_without_matplotlib_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails as if not installed
    with pytest.raises(ImportError, match="minidist\\[plot\\]"):
        grid.draw(1, 1, 1, 1, 2, 2, 8, 2, path=str(tmp_path / "x.png"))


def test_llama_key_value_heads_split_or_shared():
    """Grouped-query attention: K/tp key/value heads per tp rank, or where tp > K the head the
    rank's query heads read (query head h reads key/value head h // (H / K))."""
    table = grid.placement(dp=1, pp=1, tp=4, cp=1, n_layer=2, n_head=8, seq_len=8, batch_size=2, kv_heads=2)
    for p in table:
        assert list(p["kv_heads"]) == sorted({h // 4 for h in p["heads"]}) == [p["tp"] // 2]
    table = grid.placement(dp=1, pp=1, tp=2, cp=1, n_layer=2, n_head=8, seq_len=8, batch_size=2, kv_heads=4)
    assert [list(p["kv_heads"]) for p in table] == [[0, 1], [2, 3]]
    assert "kv" not in grid.describe(dp=1, pp=1, tp=2, cp=1, n_layer=2, n_head=8, seq_len=8, batch_size=2)
    with pytest.raises(ValueError, match="3 key/value heads must divide the 8 heads"):
        grid.placement(dp=1, pp=1, tp=2, cp=1, n_layer=2, n_head=8, seq_len=8, batch_size=2, kv_heads=3)
