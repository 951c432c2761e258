"""`make bench` keeps working: each benchmark runs in its smallest form and writes the JSON
its table is made from.  No timing is asserted here (benchmarks check speed, tests never do:
the machines are shared and noisy), only that every row is there and every number is sane."""
import json
import math
import os
import subprocess
import sys

import pytest

BENCH = os.path.join(os.path.dirname(__file__), "..", "benchmarks")


def _run(script, *args, timeout=300):
    subprocess.run([sys.executable, os.path.join(BENCH, script), *args], check=True, timeout=timeout,
                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


@pytest.mark.mpi
@pytest.mark.slow
def test_bench_collectives_quick(tmp_path):
    sys.path.insert(0, BENCH)
    try:
        import bench_collectives as bc
    finally:
        sys.path.remove(BENCH)
    _run("bench_collectives.py", "--quick", "--ranks", "2", "--launches", "1", "--out", str(tmp_path))
    with open(tmp_path / "collectives.json") as f:
        report = json.load(f)
    rows = {(r["collective"], r["ranks"], r["bytes"]): r for r in report["results"]}
    assert set(rows) == {(c, 2, s) for c in bc.COLLECTIVES for s in bc.QUICK_SIZES}
    for row in rows.values():
        for field in ("minidist_s", "mpi_s", "minidist_busbw_GBps", "mpi_busbw_GBps", "ratio", "ratio_after_other"):
            assert math.isfinite(row[field]) and row[field] > 0, (row, field)
        assert row["ratio"] == pytest.approx(row["mpi_s"] / row["minidist_s"])
        assert row["ratio_min"] <= row["ratio"] <= row["ratio_max"]
    assert {r["collective"] for r in report["crossover"]} == set(bc.COLLECTIVES)
    assert report["memcpy_GBps"] > 0
    assert "ratio = MPI time / minidist time" in bc.table(report)


@pytest.mark.slow
def test_bench_model_quick(tmp_path):
    pytest.importorskip("torch")
    _run("bench_model.py", "--reps", "1", "--threads", "1", "--out", str(tmp_path))
    with open(tmp_path / "model_step.json") as f:
        (row,) = json.load(f)["results"]
    for side in ("minidist", "torch"):
        assert row[side]["tokens_per_s"] > 0 and 0 < row[side]["mfu"] < 1, row
    assert row["ratio"] == pytest.approx(row["minidist"]["tokens_per_s"] / row["torch"]["tokens_per_s"])
