"""Body of tests/test_checkpoint.py: resharding reads only overlapping pieces (under mpiexec -n 4)."""
import os
import sys

from minidist.state import checkpoint
from minidist import comm
from minidist.train.config import RunConfig
from minidist.parallel.compose import build, build_mesh


def main(path):
    world = comm.world()
    total = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".bin"))
    base = RunConfig().replace(model=dict(layers=2, d_model=16, heads=2, dtype="float64"),
                               data=dict(seq_len=16, batch_size=8))
    for mesh, exact in ((dict(pp=2, dp=2), False), (dict(dp=2, tp=2), True)):
        cfg = base.replace(parallel=mesh).resolved(world.size)
        model, strategy = build(cfg, build_mesh(cfg.parallel))
        checkpoint.bytes_read = 0
        checkpoint.load(path, strategy)
        mine = sum(int(p.data.nbytes) for p in model.parameters())  # this rank's parameters
        held = mine * 3  # and AdamW's two state arrays of the same shape
        if exact:  # the saving layout: each rank reads exactly its own slices and their state
            assert checkpoint.bytes_read == held, (world.rank, checkpoint.bytes_read, held)
        else:  # another layout: only this stage's tensors, never the whole checkpoint
            assert held <= checkpoint.bytes_read < total, (world.rank, checkpoint.bytes_read, held, total)
    print(f"read ok rank {world.rank}: {checkpoint.bytes_read} of {total} bytes", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
