"""Data parallelism (DDP, ZeRO-1/2/3, HSDP): every configuration trains like one process.

The MPI bodies live in tests/mpi/data_parallel_bodies.py; each rank trains the single-process
reference itself and compares, in float64, 5 steps' losses and parameters (<= 1e-9 relative).
"""
import json
import os

import pytest

from minidist.train.testing import run_mpi, run_train

BODIES = os.path.join(os.path.dirname(__file__), "mpi", "data_parallel_bodies.py")


def body(n, name, timeout=180, env=None):
    return run_mpi(n, f"{BODIES}::{name}", timeout=timeout, env=env).stdout


@pytest.mark.mpi
@pytest.mark.parametrize("dp", [2, 3, 4])
def test_every_zero_stage_equals_one_process(dp):
    out = body(dp, "matrix")
    for zero in range(4):
        for variant in ("plain", "grad-accum 2", "checkpointing", "clipped"):
            assert f"dp ok: dp={dp} zero={zero} {variant}" in out, out
    assert out.count("matrix done") == dp


@pytest.mark.mpi
def test_hsdp_equals_one_process():
    out = body(4, "hsdp")
    assert out.count("hsdp ok") == 4, out


@pytest.mark.mpi
def test_bucketed_unbucketed_and_no_overlap_are_equal():
    out = body(2, "buckets_and_overlap")
    assert out.count("bucket ok") == 8, out


@pytest.mark.mpi
def test_memory_equals_formulas_and_stage3_holds_two_blocks():
    out = body(3, "memory_and_live_params")
    assert out.count("memory ok") == 4, out


@pytest.mark.mpi
def test_textbook_allreduce_equals_bucketed_ddp():
    assert body(3, "textbook_equals_bucketed").count("textbook ok") == 3


@pytest.mark.mpi
def test_ring_ddp_sends_2_n_minus_1_times_the_gradients():
    assert body(3, "ring_bytes").count("ring bytes ok") == 3


@pytest.mark.mpi
def test_overlap_is_real_on_a_slow_link():
    out = body(2, "overlap_timeline", env={"MINIDIST_LINK_GBPS": "0.05"})
    assert out.count("early launch ok") == 2 and out.count("no-overlap ok") == 2, out


# -- the CLI under mpiexec -------------------------------------------------------------------------
TINY = ["--layers", "2", "--d-model", "16", "--heads", "2", "--seq-len", "16", "--batch-size", "8",
        "--peak-gflops", "10", "--eval-batches", "1"]


def train(n, args, timeout=240):
    return run_train(n, TINY + args, timeout)


@pytest.mark.mpi
def test_cli_trains_data_parallel_and_only_rank_0_reports(tmp_path):
    out = tmp_path / "m.jsonl"
    r = train(2, ["--steps", "4", "--eval-every", "4", "--zero", "2", "--metrics-jsonl", str(out)])
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("summary") == 1 and "ZeRO-2 over 2 ranks" in r.stdout, r.stdout
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 4
    first = records[0]
    assert first["mesh"] == "dp=2 zero=2" and first["comm_s"] > 0 and "comm_exposed_s" in first
    assert set(first["state_mb"]) == {"params", "grads", "optimizer"} and len(first["rank_peak_mem_mb"]) == 2


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.parametrize("precision, zero", [("bf16", "0"), ("fp16", "0"), ("bf16", "3")])
def test_low_precision_dp2_loss_falls(tmp_path, precision, zero):
    out = tmp_path / "m.jsonl"
    r = train(2, ["--steps", "30", "--eval-every", "0", "--lr", "1e-2", "--mixed-precision", precision,
                  "--zero", zero, "--metrics-jsonl", str(out)])
    assert r.returncode == 0, r.stderr
    losses = [json.loads(line)["loss"] for line in out.read_text().splitlines()]
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.3, losses


@pytest.mark.mpi
@pytest.mark.parametrize("n, args, needle", [
    (2, ["--dp", "3"], "--dp 3 needs 3 ranks (mpiexec -n 3), but this job has 2"),
    (2, ["--batch-size", "3", "--grad-accum", "2"], "--batch-size 3 has fewer rows than --dp 2 x --grad-accum 2"),
    (4, ["--hsdp-shard", "3"], "--hsdp-shard 3 does not divide --dp 4"),
    (2, ["--hsdp-shard", "2", "--zero", "1"], "--hsdp-shard shards with ZeRO-3, but --zero 1 was given"),
    (2, ["--zero", "4"], "argument --zero: invalid choice: 4 (choose from 0, 1, 2, 3)"),
    (2, ["--zero", "3", "--bucket-mb", "1"], "--bucket-mb sets the gradient buckets of DDP and ZeRO-1/2, but ZeRO-3"),
    (1, ["--no-overlap"], "--no-overlap sets the gradient buckets of DDP and ZeRO-1/2, but one data-parallel rank"),
])
def test_bad_data_parallel_input_is_one_message_exit_2(n, args, needle):
    r = train(n, args, timeout=60)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert r.stderr.count(needle) == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stdout == ""


@pytest.mark.mpi
def test_an_overflow_on_one_rank_skips_the_step_on_every_rank():
    assert body(2, "overflow_is_agreed").count("overflow ok") == 4


@pytest.mark.mpi
def test_cli_under_mpiexec_n_1_is_the_single_process_run(tmp_path):
    out = tmp_path / "m.jsonl"
    r = train(1, ["--steps", "2", "--eval-every", "0", "--dtype", "float64", "--metrics-jsonl", str(out)])
    assert r.returncode == 0, r.stderr
    plain = run_train(None, TINY + ["--steps", "2", "--eval-every", "0", "--dtype", "float64",
                                    "--metrics-jsonl", str(tmp_path / "p.jsonl")])
    assert plain.returncode == 0, plain.stderr
    losses = [[json.loads(line)["loss"] for line in f.read_text().splitlines()] for f in (out, tmp_path / "p.jsonl")]
    assert losses[0] == losses[1]


@pytest.mark.mpi
def test_zero_with_one_data_parallel_rank_is_refused():
    r = train(1, ["--zero", "2"], timeout=60)
    assert r.returncode == 2 and r.stderr.count("--zero 2 shards over the data-parallel ranks, but there is one") == 1
