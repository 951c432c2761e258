"""Errors raised by the communication layer (each message names the values that disagree)."""

from __future__ import annotations


class CommError(RuntimeError):
    """A message could not be exchanged as expected."""


class CollectiveMismatchError(CommError):
    """Ranks of a group called different collectives, or the same one with different shapes,
    dtypes, ops or roots.  Set ``MINIDIST_CHECK_COLLECTIVES=1`` (or ``comm.set_check(True)``)
    to have every rank raise this, with what each rank called, before any data moves."""
