"""4D parallelism: every mesh of dp x pp x tp x cp trains exactly like one process.

One parametrised equivalence matrix: each entry is a mesh, run once under mpiexec, with a few
variants (data-parallel flavour, schedule, context implementation, per-device techniques);
each variant's 5 steps in float64 must equal the single-process run to 1e-9 relative in the
loss trajectory, the final validation loss and every parameter each rank holds.
"""
import json
import os

import pytest

from minidist.testing import run_mpi

BODIES = os.path.join(os.path.dirname(__file__), "mpi", "compose_bodies.py")

PAIRS = {  # every pair of axes at size 2 (4 ranks) x {DDP, ZeRO-1, ZeRO-3} where the design allows
    "dp2-pp2": [dict(dp=2, pp=2, zero=0, bucket_mb=0.0), dict(dp=2, pp=2, zero=1, schedule="gpipe", grad_accum=2),
                dict(dp=2, pp=2, zero=2), dict(dp=2, pp=2, zero=3, schedule="interleaved", untied=True)],
    "dp2-tp2": [dict(dp=2, tp=2, zero=0, sequence_parallel=True), dict(dp=2, tp=2, zero=1, tp_async="ring"),
                dict(dp=2, tp=2, zero=3, checkpoint_activations=True)],
    "dp2-cp2": [dict(dp=2, cp=2, zero=0), dict(dp=2, cp=2, zero=1, cp_impl="ulysses"),
                dict(dp=2, cp=2, zero=3, grad_accum=2)],
    "pp2-tp2": [dict(pp=2, tp=2, sequence_parallel=True),
                dict(pp=2, tp=2, schedule="interleaved", tp_async="bidirectional", untied=True)],
    "pp2-cp2": [dict(pp=2, cp=2, zero=0), dict(pp=2, cp=2, zero=1, cp_impl="ulysses", schedule="gpipe"),
                dict(pp=2, cp=2, zero=3, checkpoint_activations=True)],
    "tp2-cp2": [dict(tp=2, cp=2, zero=0, sequence_parallel=True), dict(tp=2, cp=2, zero=1, cp_impl="ulysses"),
                dict(tp=2, cp=2, zero=3, tp_async="ring", attention="blockwise", attention_block=2)],
}
TRIPLES = {  # 8 ranks
    "dp2-pp2-tp2": [dict(dp=2, pp=2, tp=2, schedule="1f1b", zero=1),
                    dict(dp=2, pp=2, tp=2, schedule="interleaved", sequence_parallel=True, grad_accum=2)],
    "dp2-tp2-cp2": [dict(dp=2, tp=2, cp=2, cp_impl="ring", zero=0),
                    dict(dp=2, tp=2, cp=2, cp_impl="ulysses", hsdp_shard=2)],
    "pp2-tp2-cp2": [dict(pp=2, tp=2, cp=2, sequence_parallel=True, zero=3)],
}
FULL = {"dp2-pp2-tp2-cp2": [dict(dp=2, pp=2, tp=2, cp=2, zero=1, sequence_parallel=True, checkpoint_activations=True)]}


def _cases():
    for table, ranks, marks in ((PAIRS, 4, ()), (TRIPLES, 8, ()), (FULL, 16, (pytest.mark.slow,))):
        for name, variants in table.items():
            yield pytest.param(ranks, variants, id=name, marks=[pytest.mark.mpi, *marks])


@pytest.mark.parametrize("ranks, variants", list(_cases()))
def test_mesh_trains_like_one_process(ranks, variants):
    out = run_mpi(ranks, BODIES, json.dumps(variants), timeout=120 + 60 * len(variants) * ranks // 4).stdout
    assert out.count("equal to one process:") == len(variants), out
