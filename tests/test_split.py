"""The one split rule (minidist/layout/split.py) cuts as np.array_split does."""
import numpy as np
import pytest

from minidist.layout.split import shard_bounds, split_bounds, split_sizes


def test_split_bounds_match_array_split():
    for length in range(0, 11):
        for size in range(1, 6):
            parts = np.array_split(np.arange(length), size)
            assert [list(range(a, b)) for a, b in split_bounds(length, size)] == [list(p) for p in parts]
            assert split_sizes(length, size) == [len(p) for p in parts]
            assert split_bounds(length, size, unit=3) == [(3 * a, 3 * b) for a, b in split_bounds(length, size)]


def test_shard_bounds_refuse_empty_shards():
    assert shard_bounds(5, np.int64(1), 2) == (3, 5)
    for rows, index, count in ((1, 0, 2), (4, 2, 2), (4, 0, 0)):
        with pytest.raises(ValueError):
            shard_bounds(rows, index, count)
