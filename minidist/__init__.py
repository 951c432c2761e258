"""minidist: distributed training, built by hand on NumPy and MPI point-to-point messages."""

__version__ = "0.1.0"
