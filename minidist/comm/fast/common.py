"""What every cached plan shares: the MPI constants, the clock, the result array of an
all-reduce, and the general path's error for a message of the wrong size."""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from minidist.comm import stats
from minidist.comm.errors import CommError
from minidist.comm.identity import identity, mismatch_error
from minidist.comm.p2p import ANY_TAG, TAG_COLLECTIVE as TAG, _size_error, _truncated

BYTE = MPI.BYTE
clock = stats._clock  # time.perf_counter, one global lookup instead of two
# A plan that owns buffers of X bytes is made only up to this size (the cache holds up to
# 256 plans); above it Python's per-call work is noise next to moving the bytes.
PLAN_MAX_BYTES = 512 * 1024

__all__ = ["BYTE", "TAG", "ANY_TAG", "clock", "PLAN_MAX_BYTES", "fail", "result_array", "tags", "mismatch_error"]


def tags(name, op, dtype, nbytes=None, algorithm=None) -> tuple:
    """(tag to send with, tag to receive with) of a plan's messages: the call's identity
    (identity.identity with the general path's arguments for the same call, ``algorithm``
    the one the plan runs) and ANY_TAG, the received tag then compared with it; with identity
    tags off, TAG for both."""
    ident = identity(name, op, dtype, nbytes, algorithm)
    return (TAG, TAG) if ident is None else (ident, ANY_TAG)


def fail(what, g, x, status, src, expected, err=None, tag=TAG) -> CommError:
    """The general path's error for a message of another call (its tag is not ``tag``), of
    the wrong size, or a truncated one.  The call is logged now: a plan only logs it at the
    end, when it succeeded."""
    stats.note_op(what, g.name, x.shape, x.dtype)
    comm = g.comm
    if status.Get_tag() != tag and (err is None or err.Get_error_class() == MPI.ERR_TRUNCATE):
        got = status.Get_count(BYTE) if err is None else f"more than {expected}"
        return mismatch_error(comm, src, tag, status.Get_tag(), got, expected)
    if err is not None:
        return _truncated(comm, src, TAG, expected, err, what)
    return _size_error(comm, src, TAG, expected, status.Get_count(BYTE), what)


def result_array(out, shape, dtype):
    """A plan's result array: a fresh one, or ``out`` when it fits (that shape and the very
    dtype object; C-contiguous, as the general path demands and later rounds send from it;
    writeable, or numpy would raise between two messages); None (the general path then
    raises the clear error, before any message) otherwise."""
    if out is None:
        return np.empty(shape, dtype)
    if (type(out) is np.ndarray and out.shape == shape and out.dtype is dtype and out.flags.c_contiguous
            and out.flags.writeable):
        return out
    return None
