"""Differentiable collectives: forward vs NumPy, backward vs finite differences (float64)."""
import os

import pytest

from minidist.comm import functional as F
from minidist.train.testing import run_mpi

BODIES = os.path.join(os.path.dirname(__file__), "mpi", "functional_bodies.py")
N_CASES = 17  # cases in functional_bodies._cases


def test_megatron_names_are_the_same_ops():
    assert F.copy_to_tp is F.copy_to_group and F.reduce_from_tp is F.reduce_from_group
    assert F.gather_from_sp is F.all_gather and F.reduce_scatter_to_sp is F.reduce_scatter


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", [2, 4])
def test_gradcheck_every_op(nprocs):
    out = run_mpi(nprocs, f"{BODIES}::gradcheck_all", timeout=120).stdout
    assert out.count("gradcheck ok:") == N_CASES + (1 if nprocs >= 4 else 0), out
    assert out.count("functional done") == nprocs, out


@pytest.mark.mpi
def test_megatron_mlp_matches_serial_on_a_mesh():
    out = run_mpi(4, f"{BODIES}::megatron_mlp_on_mesh", timeout=90).stdout
    assert out.count("megatron mlp ok: tensor parallel") == 4, out
    assert out.count("megatron mlp ok: sequence parallel") == 4, out
