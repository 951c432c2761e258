"""Expert parallelism (minidist/parallel/expert/) equals one process, in float64."""
import os

import pytest

from minidist.train.testing import run_mpi

BODIES = os.path.join(os.path.dirname(__file__), "mpi", "expert_bodies.py")


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs, ep", [(2, 2), (4, 2), (4, 4)], ids=["ep2", "dp4-ep2", "ep4"])
def test_expert_parallel_equals_one_process(nprocs, ep):
    out = run_mpi(nprocs, f"{BODIES}::equal_to_one_process", str(ep), timeout=180).stdout
    assert out.count("expert parallel ok:") == 4, out
    for r in range(nprocs):
        assert f"rank {r}: expert parallelism equals one process" in out
