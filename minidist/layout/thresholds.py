"""The collectives' size thresholds: where each switches from its latency-optimal algorithm
to its bandwidth-optimal one.

Measured on the development machine (docs/perf-notes.md has the measurements).  The comm
layer picks its algorithms by them (comm/reducing.py, comm/collectives.py) and the traffic
formulas predict the bytes of the algorithm picked (collective_bytes.py), so they are
written here, where importing them does not start MPI.
"""

# all_reduce: recursive doubling up to these sizes (of the accumulator), pairwise
# reduce-scatter + all-gather above (docs/perf-notes.md, "All-reduce crossover").
SMALL_ALL_REDUCE_BYTES = 512 << 10       # groups of 2
SMALL_ALL_REDUCE_BYTES_WIDE = 512 << 10  # groups of 3 or more
# reduce: binomial tree below, pipelined chain above (docs/perf-notes.md).
SMALL_REDUCE_BYTES = 256 * 1024
# reduce_scatter: the one-shot exchange up to REDUCE_SCATTER_ONE_SHOT_BYTES of input, pairwise
# exchange from PAIRWISE_BYTES up on more than two ranks (docs/perf-notes.md, "Reduce-scatter
# crossovers").
REDUCE_SCATTER_ONE_SHOT_BYTES = 256 << 10
PAIRWISE_BYTES = 1 << 20
# broadcast: binomial tree up to this size, pipelined chain above (docs/perf-notes.md).
SMALL_BROADCAST_BYTES = 256 * 1024
# all_gather into out= of N equal blocks: the one-shot round up to ALL_GATHER_ONE_SHOT_BYTES
# of result on any number of ranks, and at every size on up to ONE_SHOT_MAX_RANKS ranks;
# rounds (doubling or ring) otherwise (docs/perf-notes.md, "All-gather crossover").
ALL_GATHER_ONE_SHOT_BYTES = 256 << 10
ONE_SHOT_MAX_RANKS = 4
# all_to_all_v, general path: the pairwise steps on two ranks and below this many bytes of
# rows sent, the one-shot rounds above it on three or more (docs/perf-notes.md, "All-to-all-v").
# With the fast path on, a synchronous call on host arrays runs the cached plan instead
# (comm/fast/alltoallv.py), at every size; this choice is left to async calls, device arrays
# and the check mode.  Every way sends the same messages between each pair, so ranks that
# choose differently (their rows differ) still pair up.
ALL_TO_ALL_V_ONE_SHOT_BYTES = 1 << 20
