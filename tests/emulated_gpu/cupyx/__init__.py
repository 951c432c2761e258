"""The part of cupyx minidist uses, for the CuPy emulator (see cupy/__init__.py): pinned host
buffers (plain NumPy arrays here) and scatter_add."""

import numpy as _np

import cupy as _cupy


def empty_pinned(shape, dtype=float, order="C"):
    """A host array in (emulated) page-locked memory: a plain numpy.ndarray, as in CuPy."""
    return _np.empty(shape, dtype=dtype, order=order)


def zeros_pinned(shape, dtype=float, order="C"):
    return _np.zeros(shape, dtype=dtype, order=order)


def empty_like_pinned(a, dtype=None, order="K", subok=None, shape=None):
    return _np.empty_like(a, dtype=dtype, order=order, shape=shape)


def zeros_like_pinned(a, dtype=None, order="K", subok=None, shape=None):
    return _np.zeros_like(a, dtype=dtype, order=order, shape=shape)


def scatter_add(a, slices, value):
    """a[slices] += value with repeated indices accumulated (CuPy's scatter kernel dtypes)."""
    _cupy._scatter(a, slices, value, "add")


def scatter_max(a, slices, value):
    _cupy._scatter(a, slices, value, "maximum")


def scatter_min(a, slices, value):
    _cupy._scatter(a, slices, value, "minimum")
