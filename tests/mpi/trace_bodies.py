"""Bodies run on every rank by tests/test_trace.py."""
import json
import sys
import time


def skewed_clocks(path):
    """Every rank's tracer reads a clock skewed by 1000 s per rank; spans around a barrier
    must line up again on rank 0's clock in the merged trace."""
    from minidist import comm
    from minidist.observe import trace

    world = comm.world()
    skew = 1000.0 * world.rank
    tracer = trace.Tracer(world.rank, f"rank {world.rank}", clock=lambda: time.perf_counter() + skew)
    trace.start(tracer, world)
    for i in range(3):
        with tracer.span(f"before barrier {i}"):
            time.sleep(0.002 * (world.rank + 1))  # uneven work: the barrier makes everyone wait for the last
        comm.barrier(world)
        with tracer.span(f"after barrier {i}"):
            pass
    trace.stop()
    from minidist.comm import collectives, p2p

    assert p2p.trace is None and trace.active is None  # every hook removed: untraced calls run the plain code
    assert comm.all_reduce is collectives._untraced["all_reduce"] is collectives.all_reduce
    tracer.save(path, world)
    if world.rank == 0:
        print("offsets", json.dumps(json.load(open(path))["otherData"]["clock_offset_s"]))


if __name__ == "__main__":
    globals()[sys.argv[1]](*sys.argv[2:])
