"""minidist.parallel: the parallel training strategies, each on minidist's own collectives.

Each strategy is an object built from the parameters and the ``comm.Group`` (or ``Mesh``)
it works over; it never reaches for a global.  Start reading at ``data.py``:

  data.py     data parallelism: DDP (Li et al. 2020) with gradient buckets launched from the
              gradient hooks and overlapped with the backward pass; the textbook version
              (one all-reduce per gradient after backward) beside it
  flat.py     flat views of a list of parameters: the units ZeRO shards
  zero.py     ZeRO stages 1-3 (Rajbhandari et al. 2020; stage 3 = FSDP) and HSDP
  strategy.py the small interface the training loop talks to, and the factory from CLI flags
  collective_matmul.py  all-gather / reduce-scatter hidden behind chunk matmuls (Wang et al. 2022)
  tensor.py   tensor parallelism (Megatron-LM): split layers, sequence parallelism, the
              vocabulary-parallel loss; nn.GPT builds its layers through TensorParallelLayers
  context.py  context parallelism: ring attention (Liu et al. 2023) with the zig-zag layout and
              DeepSpeed-Ulysses (Jacobs et al. 2023) over the cp group; its training strategy
  context_cli.py  the training command's long-sequence flags and their checks (no MPI)
  pipeline/   pipeline parallelism: schedules as data (schedules.py), one runtime for every
              schedule (runtime.py), the CLI flags (cli.py), the loop's strategy (strategy.py)
"""
