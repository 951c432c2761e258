"""Experts under context parallelism (parallel/expert/tokens.py): each cp rank runs the mixture
on its own tokens only, deciding capacity and the balancing loss's shares from every cp rank's
routing choices, and trains exactly like one process.

* The equivalence matrix's body (tests/mpi/compose_bodies.py: 5 float64 steps, the losses,
  validation loss and every parameter to 1e-9 of one process) on cp2 and dp2·cp2 with
  capacity dropping and dropless, ring attention's zig-zag chunks and Ulysses' slices,
  cp4 (four zig-zag ranks), expert parallelism over dp x cp, ZeRO-3 and checkpointing.
* The work is split: a cp rank's experts take its own tokens' choices only.
"""
import json
import os

import pytest

from minidist.train.testing import run_mpi

BODIES = os.path.join(os.path.dirname(__file__), "mpi", "compose_bodies.py")
MOE = dict(experts=4)
CASES = {
    "cp2": [dict(cp=2, **MOE, capacity_factor=0.5), dict(cp=2, **MOE, cp_impl="ulysses", top_k=1),
            dict(cp=2, **MOE, capacity_factor=1.0, checkpoint_activations=True, moe_every=2)],
    "dp2-cp2": [dict(dp=2, cp=2, **MOE, capacity_factor=0.5, ep=2, zero=1),
                dict(dp=2, cp=2, **MOE, zero=3, cp_impl="ulysses"),
                dict(dp=2, cp=2, **MOE, ep=4, capacity_factor=1.0, top_k=1, grad_accum=2)],
    "cp4": [dict(cp=4, **MOE, capacity_factor=0.5, arch="llama", kv_heads=2)],
}


@pytest.mark.mpi
@pytest.mark.parametrize("name", list(CASES))
def test_experts_under_context_parallelism_train_like_one_process(name):
    variants = CASES[name]
    ranks = variants[0].get("dp", 1) * variants[0]["cp"]
    out = run_mpi(ranks, BODIES, json.dumps(variants), timeout=120 + 60 * len(variants) * ranks // 2).stdout
    assert out.count("equal to one process:") == len(variants), out


def own_tokens_only(out_dir):
    """MPI body (2 ranks, cp2, dropless): each mixture's kept choices on a rank are its own
    tokens' k choices, half of one process's."""
    import numpy as np

    from minidist.model.moe import MoE
    from minidist.parallel.compose import build, build_mesh
    from minidist.train.flags import build_parser, validate

    parser = build_parser()
    cfg = validate(parser.parse_args(["--cp", "2", "--experts", "4", "--layers", "2", "--d-model", "16",
                                      "--heads", "2", "--seq-len", "8", "--batch-size", "4", "--dtype", "float64",
                                      "--quiet"]), parser)
    model, strategy = build(cfg, mesh := build_mesh(cfg.parallel))
    x = np.random.default_rng(0).integers(0, 256, (4, 8))
    strategy.forward_backward(x, np.roll(x, -1, axis=1), 1, None, 1.0)
    counts = [int(b.mlp.last_counts.sum()) for b in model.h if isinstance(b.mlp, MoE)]
    with open(f"{out_dir}/rank{mesh.rank}.json", "w") as f:
        json.dump(counts, f)


@pytest.mark.mpi
def test_a_cp_rank_runs_the_experts_on_its_own_tokens(tmp_path):
    run_mpi(2, f"{__file__}::own_tokens_only", str(tmp_path), timeout=120)
    for r in range(2):
        assert json.loads((tmp_path / f"rank{r}.json").read_text()) == [4 * 4 * 2] * 2  # rows x T/cp x k, per mixture
