"""Any vocabulary under tensor parallelism: padded to a multiple of tp, the padding masked out of
the loss, so every mesh equals one process (parallel/tensor/vocab_parallel.py)."""
import json
import os

import numpy as np
import pytest

from minidist.model.backend import from_host, to_host
from minidist.parallel import tensor as tpm
from minidist.train.testing import run_mpi

BODIES = os.path.join(os.path.dirname(__file__), "mpi", "vocab_padding_bodies.py")


def test_a_shard_of_a_padded_vocabulary_ends_in_zero_rows():
    full = np.arange(7 * 2, dtype=np.float64).reshape(7, 2) + 1  # 7 tokens on 3 ranks: 3 rows each, 2 padding
    parts = [tpm.Shard(dim=0, index=r, parts=3) for r in range(3)]
    assert all(s.local_shape(full.shape) == (3, 2) for s in parts)
    assert [to_host(s.indices(7)).tolist() for s in parts] == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    np.testing.assert_array_equal(to_host(parts[2].take(from_host(full))), [[13, 14], [0, 0], [0, 0]])
    np.testing.assert_array_equal(np.concatenate([to_host(s.take(full)) for s in parts])[:7], full)
    assert [tpm.real_columns(7, 3, r) for r in range(3)] == [3, 3, 1]
    assert tpm.real_columns(5, 2, 3) == 0  # a rank all of whose rows are padding


@pytest.mark.mpi
def test_tp4_tp2_and_dp2_x_tp2_with_301_tokens_equal_one_process():
    out = run_mpi(4, f"{BODIES}::training_matches_serial", timeout=240).stdout
    for label in ("tp=4 tied", "tp=4 untied, sequence parallel", "tp=2 ring", "dp=2 x tp=2"):
        assert f"padded ok: {label}" in out, out
    assert out.count("padded done") == 4, out
