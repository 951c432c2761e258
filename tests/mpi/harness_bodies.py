"""Bodies run on every rank by tests/test_harness.py."""
import time

from mpi4py import MPI


def one_rank_raises():
    comm = MPI.COMM_WORLD
    if comm.rank == 2:
        time.sleep(0.2)
        raise ValueError("deliberate failure on rank 2")
    buf = bytearray(8)
    comm.Recv(buf, source=2)  # would wait forever without abort-on-exception


def everyone_waits():
    comm = MPI.COMM_WORLD
    buf = bytearray(8)
    comm.Recv(buf, source=(comm.rank + 1) % comm.size)  # nobody sends: a deadlock


def say_rank():
    print(f"hello from {MPI.COMM_WORLD.rank}/{MPI.COMM_WORLD.size}")
