"""The rule every rank's rows obey in an all-gather (the blocks themselves are cut by
minidist.layout.split.split_bounds, as np.array_split), and the errors of a block that
breaks it."""

from minidist.comm.errors import CommError

ROWS_RULE = ("all_gather accepts row counts (axis 0) that differ by at most one between ranks, "
             "as np.array_split produces")


def rows_error(g, rows, what, out=None) -> CommError:
    """The error of a block that breaks ROWS_RULE (this rank has ``rows`` rows, received ``what``)."""
    hint = f" (or out.shape={out.shape} is wrong)" if out is not None else ""
    return CommError(f"all_gather on group {g.name!r}: this rank has {rows} rows but received {what}"
                     f"{hint}; {ROWS_RULE}.  Rerun with MINIDIST_CHECK_COLLECTIVES=1 to see what each "
                     f"rank called.")


def partial_rows_error(group_name, peer, nbytes, tail, dtype, row_bytes) -> CommError:
    """The error of a block of ``nbytes`` from rank ``peer`` that is not whole rows of this rank's shape."""
    return CommError(f"all_gather: rank {peer} of group {group_name!r} sent {nbytes} bytes, not a whole number "
                     f"of rows of shape {tail} {dtype} ({row_bytes} bytes each): the ranks passed different "
                     f"trailing shapes or dtypes")
