"""The rule every rank's rows obey in an all-gather (the blocks themselves are cut by
minidist.layout.split.split_bounds, as np.array_split)."""

ROWS_RULE = ("all_gather accepts row counts (axis 0) that differ by at most one between ranks, "
             "as np.array_split produces")
