"""The teaching examples run under mpiexec -n 4 and print the right numbers."""
import os
import re

import pytest

from minidist.train.testing import run_mpi

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "examples")


def _rows(out, title_start):
    """The table printed under the title that starts with ``title_start``: {rank: row text}."""
    lines = out.splitlines()
    i = next(k for k, line in enumerate(lines) if line.startswith(title_start))
    rows = {}
    for line in lines[i + 2:]:
        if "|" not in line:
            break
        rank, before, after = (part.strip() for part in line.split("|"))
        rows[int(rank)] = (before, after)
    return rows


@pytest.mark.mpi
def test_01_collectives_tables():
    out = run_mpi(4, os.path.join(EXAMPLES, "01_collectives.py"), timeout=90).stdout
    expect_after = {
        "all_reduce(x, op='sum')": ["[60 64 68 72]"] * 4,
        "all_reduce(w, op='max')": ["[40 47 44 31]"] * 4,
        "reduce_scatter(x)": ["[60]", "[64]", "[68]", "[72]"],
        "all_gather(x[:2])": ["[0 1 10 11 20 21 30 31]"] * 4,
        "broadcast(x, root=0)": ["[0 1 2 3]"] * 4,
        "reduce(x, root=0)": ["[60 64 68 72]", "None", "None", "None"],
        "scatter(x, root=0)": ["[0 1]", "[2 3]", "[4 5]", "[6 7]"],
        "gather(x[:1], root=0)": ["[0 10 20 30]", "None", "None", "None"],
        "all_to_all(y)": ["[0 10 20 30]", "[1 11 21 31]", "[2 12 22 32]", "[3 13 23 33]"],
        "ppermute(x, perm=[(i, i+1 mod n)])": ["[30 31 32 33]", "[0 1 2 3]", "[10 11 12 13]", "[20 21 22 23]"],
        "ppermute(x, perm=[(0, 3)])": ["[0 0 0 0]", "[0 0 0 0]", "[0 0 0 0]", "[0 1 2 3]"],
    }
    for title, afters in expect_after.items():
        rows = _rows(out, title)
        assert [rows[r][1] for r in range(4)] == afters, (title, rows, out)
    assert _rows(out, "all_reduce(x, op='sum')")[2][0] == "[20 21 22 23]"
    assert "barrier(): all 4 ranks arrived" in out


@pytest.mark.mpi
def test_02_ring_traffic_matches_formulas():
    out = run_mpi(4, os.path.join(EXAMPLES, "02_ring_traffic.py"), timeout=120).stdout
    rows = [line for line in out.splitlines() if line.startswith(("all_reduce", "all_gather", "reduce_scatter"))]
    assert len(rows) >= 9, out
    for name in ("all_reduce", "all_gather", "reduce_scatter"):
        assert sum(row.startswith(name) for row in rows) >= 3, out
    # Every row of the ring algorithms ends with "exact"; measured == formula
    for row in rows:
        assert row.rstrip().endswith("exact"), row


@pytest.mark.mpi
def test_04_data_parallel_bytes_match_the_ring_formula():
    out = run_mpi(4, os.path.join(EXAMPLES, "04_data_parallel.py"), "--quick", "--steps", "2", timeout=120).stdout
    m = re.search(r"measured ([\d,]+), 2\(N-1\)/N·Ψ·4 = ([\d,]+)", out)
    measured, formula = (int(v.replace(",", "")) for v in m.groups())
    assert abs(measured - formula) <= 64, m.group(0)  # rank 0's share: N need not divide a bucket
    for mode in ("no overlap", "overlap", "one bucket"):
        assert any(l.startswith(mode) for l in out.splitlines()), out


@pytest.mark.mpi
def test_05_zero_memory_table():
    out = run_mpi(4, os.path.join(EXAMPLES, "05_zero.py"), "--quick", "--steps", "2", timeout=120).stdout
    for symbolic in ("16Ψ", "8Ψ+8Ψ/N", "4Ψ+12Ψ/N", "16Ψ/N"):
        assert symbolic in out, out
    assert "stage 3 held at most 2 blocks" in out, out


@pytest.mark.mpi
def test_06_async_sgd_prints_three_curves():
    out = run_mpi(4, os.path.join(EXAMPLES, "06_async_sgd.py"), "--quick", timeout=120).stdout
    assert "ASP: 3 workers, staleness 2" in out and out.count("final: sequential") == 1, out


@pytest.mark.mpi
def test_07_tensor_parallel_modes_agree():
    out = run_mpi(4, os.path.join(EXAMPLES, "07_tensor_parallel.py"), "--quick", "--reps", "1", timeout=120).stdout
    for mode in ("tensor", "sequence parallel", "ring", "bidirectional"):
        assert sum(line.strip().startswith(mode) for line in out.splitlines()) >= 2, (mode, out)
    assert "in every mode" in out and "sequence parallelism saves" in out, out


@pytest.mark.mpi
def test_08_context_parallel_balances_and_agrees():
    out = run_mpi(4, os.path.join(EXAMPLES, "08_context_parallel.py"), "--quick", timeout=120).stdout
    assert "same loss everywhere: True" in out, out
    zigzag = next(line for line in out.splitlines() if line.strip().startswith("zig-zag:"))
    contiguous = next(line for line in out.splitlines() if line.strip().startswith("contiguous:"))
    assert zigzag.endswith(" 1.00x") and not contiguous.endswith(" 1.00x"), out
    for name in ("ring, zig-zag", "ring, contiguous", "ulysses", "one rank (plain attention)"):
        assert f"\n{name}: loss " in out, out


@pytest.mark.mpi
def test_09_pipeline_every_schedule_same_loss():
    out = run_mpi(4, os.path.join(EXAMPLES, "09_pipeline.py"), "--quick", timeout=120).stdout
    table = out[out.index("schedule         bubble meas."):].splitlines()[1:6]
    names = [row.split()[0] for row in table]
    assert names == ["naive", "gpipe", "1f1b", "interleaved", "looping"], out
    theory = {row.split()[0]: [t for t in row.split() if t.endswith("%")][1] for row in table}
    assert theory == {"naive": "75.0%", "gpipe": "27.3%", "1f1b": "27.3%", "interleaved": "15.8%",
                      "looping": "15.8%"}, out
    losses = {row.split()[-1] for row in table}
    assert len(losses) == 1, out  # every schedule computes the same gradient
    assert out.count("measured (F/B") == 5 and out.count("rank 3 |") == 10, out


@pytest.mark.mpi
def test_10_4d_parallel_grid_training_and_bytes_per_axis():
    """16 ranks, dp2·pp2·cp2·tp2: the grid (tp innermost), a few training steps, and every
    rank's bytes per axis equal to the closed-form formulas."""
    out = run_mpi(16, os.path.join(EXAMPLES, "10_4d_parallel.py"), "--no-png", timeout=240).stdout
    assert "tp groups: [0 1] [2 3]" in out and "dp groups: [0 8] [1 9]" in out, out
    assert "step     3/3" in out, out
    assert "every rank's bytes equal the formulas" in out, out
    table = out.split("measured (formula)")[1]
    assert sum(line.strip().split()[0].isdigit() for line in table.splitlines() if line.strip()) == 16, out


def test_10_4d_parallel_llama_shows_who_holds_each_kv_head():
    """The same grid with Llama's grouped-query attention, one key/value head for tp=2: each tp
    rank holds two query heads and shares key/value head 0.  (The grid alone, on one process:
    a Llama on dp2·pp2·tp2·cp2 trains equal to one process in tests/test_compose.py.)"""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, os.path.join(EXAMPLES, "10_4d_parallel.py"), "--grid-only", "--no-png",
                          "--arch", "llama", "--kv-heads", "1"], capture_output=True, text=True, timeout=60).stdout
    assert "4 heads sharing 1 key/value heads" in out, out
    lines = [line for line in out.splitlines() if line.startswith("rank ") and " | " in line]
    assert len(lines) == 16 and all(("heads 0-1 kv 0" if i % 2 == 0 else "heads 2-3 kv 0") in line
                                     for i, line in enumerate(lines)), lines


@pytest.mark.mpi
def test_11_experts_routing_table_and_falling_loss():
    """8 ranks, 8 experts split over ep groups of 4: the routing table of the untrained model
    (every rank's tokens with expert@rank, each rank inside its own ep group), the dispatch
    matrix (rows only within an ep group), and the loss falling with the routers' statistics."""
    out = run_mpi(8, os.path.join(EXAMPLES, "11_experts.py"), "--steps", "3", timeout=240).stdout
    lines = out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("rank | token 0"))
    table = lines[head + 1:head + 9]
    assert [int(line.split("|")[0]) for line in table] == list(range(8)), out
    for r, line in enumerate(table):  # ranks 0-3 send to 0-3, ranks 4-7 to 4-7
        holders = {int(pick.split("@")[1].rstrip("*")) for pick in re.findall(r"\d+@\d+\*?", line)}
        assert holders and holders <= set(range(r // 4 * 4, r // 4 * 4 + 4)), line
    matrix = lines[lines.index(next(l for l in lines if l.startswith("from \\ to"))) + 1:][:8]
    for r, line in enumerate(matrix):
        counts = [int(c) for c in line.split()[1:9]]
        other = counts[:4] if r >= 4 else counts[4:]
        # 2 sequences of 16 tokens, top-2, less those dropped over capacity; within the group only
        assert 0 < sum(counts) <= 2 * 32 and not any(other), line
    assert out.count("experts max/mean") == 3, out
    m = re.search(r"loss ([\d.]+) -> ([\d.]+) over 3 steps \(fell\)", out)
    assert m and float(m.group(2)) < float(m.group(1)), out
