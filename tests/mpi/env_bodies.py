"""Rank bodies for tests/test_env.py."""
import os

from minidist import comm
from minidist.host import env


def late_read():
    """A variable read after start-up (as comm/nodes.py reads MINIDIST_RANKS_PER_NODE when
    asked) with a bad value: the abort hook reports its one line."""
    comm.world()
    os.environ["MINIDIST_RANKS_PER_NODE"] = "many"
    env.get("MINIDIST_RANKS_PER_NODE")
    raise AssertionError("a bad value went unnoticed")
