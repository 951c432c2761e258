"""minidist.model: one rank's arrays, autograd, ops, the GPT and its optimizers.

Read in this order:

  backend.py   ``xp``: NumPy, or CuPy on a GPU; every array op goes through it
  autograd.py  a Tensor that records its ops and runs their backward in reverse order
  ops/         the differentiable ops on plain arrays (NumPy first; ``ops/cuda/`` the GPU kernels)
  nn.py        the GPT (GPT-2's blocks) and its named seams, which the parallel axes use
  optim/       SGD, AdamW, the learning-rate schedule, clipping, loss scaling
  torch_reference.py  the same GPT in PyTorch: the oracle of the tests and the benchmarks

Imports only ``minidist.host`` and ``minidist.layout`` (never MPI): everything here runs on
one process, and the axes of ``minidist.parallel`` wrap it.
"""
