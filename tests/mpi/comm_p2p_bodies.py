"""Rank bodies for tests/test_comm_p2p.py: point-to-point layer, groups, async, links."""
import os
import sys
import threading
import time

import numpy as np
from mpi4py import MPI

from minidist import comm
from minidist.model.backend import bfloat16
from minidist.layout.split import split_bounds

DTYPES = [np.float16, bfloat16, np.float32, np.float64, np.int32, np.int64, np.uint8, np.bool_]


def p2p_roundtrip():
    g = comm.world()
    n, r = g.size, g.rank
    right, left = (r + 1) % n, (r - 1) % n
    comm.reset_stats()
    sent = 0
    for i, dt in enumerate(DTYPES):
        x = (np.arange(12).reshape(3, 4) * (r + 1) + i).astype(dt)
        want = (np.arange(12).reshape(3, 4) * (left + 1) + i).astype(dt)
        if r % 2 == 0:  # even ranks send first: blocking send/recv in a ring without deadlock
            comm.send(x, right, g, tag=i)
            got = comm.recv((3, 4), dt, left, g, tag=i)
        else:
            got = comm.recv((3, 4), dt, left, g, tag=i)
            comm.send(x, right, g, tag=i)
        assert got.dtype == want.dtype and np.array_equal(got.astype(np.float64), want.astype(np.float64)), dt
        sent += x.nbytes
        got = comm.sendrecv(x, right, left, g, tag=100 + i)
        assert np.array_equal(got.astype(np.float64), want.astype(np.float64)), dt
        sent += x.nbytes
    s = comm.stats()
    assert s["send"]["bytes_sent"] + s["sendrecv"]["bytes_sent"] == sent, s
    assert s["recv"]["bytes_recv"] == s["send"]["bytes_sent"], s
    assert s["send"]["calls"] == len(DTYPES) and s["send"]["time_s"] > 0, s

    # Nonblocking, into a non-contiguous destination (staged through a temporary).
    big = np.zeros((4, 10))
    req_r = comm.irecv(big[:, ::2], left, g, tag=7)
    req_s = comm.isend(np.full((4, 5), float(r)), right, g, tag=7)
    got = req_r.wait()
    req_s.wait()
    assert req_r.is_completed() and req_s.is_completed()
    # Polling: is_completed() completes a receive once it has arrived; wait() then returns it.
    polled = np.zeros(3)
    req_p = comm.irecv(polled, left, g, tag=8)
    comm.send(np.full(3, float(r)), right, g, tag=8)
    while not req_p.is_completed():
        time.sleep(0.0005)
    assert np.all(req_p.wait() == left) and np.all(polled == left)
    assert np.all(big[:, ::2] == left) and np.all(big[:, 1::2] == 0) and got.base is big

    # recv_into with the wrong size: a clear error naming both sizes.
    if n > 1:
        if r == 0:
            comm.send(np.ones(5, np.float32), 1, g, tag=9)
        elif r == 1:
            try:
                comm.recv_into(np.empty(4, np.float32), 0, g, tag=9)
                raise AssertionError("a too-long message was accepted")
            except comm.CommError as err:
                assert "expected a 16-byte message from rank 0" in str(err), err
                assert "MINIDIST_CHECK_COLLECTIVES=1" in str(err)
    print(f"rank {r}: p2p ok")


def groups_and_recent_ops():
    g = comm.world()
    n, r = g.size, g.rank
    assert g is comm.world() and g.world_ranks == tuple(range(n)) and g.name == "world"
    # Odd and even world ranks form two groups (world rank order reversed inside each).
    sub = comm.Group(MPI.COMM_WORLD.Split(r % 2, -r), name=f"parity{r % 2}")
    members = [k for k in range(n) if k % 2 == r % 2][::-1]
    assert sub.world_ranks == tuple(members) and sub.size == len(members), sub
    got = comm.all_reduce(np.array([r], np.int64), sub)
    assert got[0] == sum(members)
    got = comm.all_gather(np.array([r], np.int64), sub)
    assert list(got) == members
    ops = comm.recent_ops(sub)
    assert [o["name"] for o in ops] == ["all_reduce", "all_gather"] and ops[0]["group"] == sub.name, ops
    assert ops[0]["shape"] == (1,) and ops[0]["dtype"] == "int64"
    assert comm.recent_ops()[-1]["name"] == "all_gather"
    print(f"rank {r}: groups ok")


def async_semantics():
    g = comm.world()
    n, r = g.size, g.rank
    rng = np.random.default_rng(r)
    xs = [rng.integers(-5, 5, size=s).astype(np.float32) for s in (10, 70_000, 3, 300_000)]
    # Several ops in flight at once, of different kinds, waited in reverse order, while the
    # main thread computes and sends its own synchronous traffic on the same group.
    handles = [comm.all_reduce(xs[0], g, async_op=True),
               comm.all_gather(xs[1], g, async_op=True),
               comm.reduce_scatter(xs[2], g, op="max", async_op=True),
               comm.all_reduce(xs[3], g, op="min", async_op=True),
               comm.barrier(g, async_op=True)]
    a = rng.standard_normal((200, 200))
    _ = a @ a
    sync_results = [comm.all_reduce(xs[0], g), comm.all_gather(xs[1], g),
                    comm.reduce_scatter(xs[2], g, op="max"), comm.all_reduce(xs[3], g, op="min")]
    results = [h.wait() for h in reversed(handles)][::-1]
    assert results[4] is None
    for got, want in zip(results, sync_results):
        assert got.dtype == want.dtype and np.array_equal(got, want)
    assert all(h.is_completed() for h in handles)
    # The input may be reused once wait() returned; results are new arrays.
    assert results[0] is not xs[0]
    print(f"rank {r}: async ok")


def link_model_from_env():
    """MINIDIST_LINK_LATENCY_US=3000 (set by the test): every message takes >= 3 ms."""
    g = comm.world()
    model = comm.link_model()
    assert model["latency_us"] == 3000 and model["gbps"] is None, model
    x = np.ones(8)
    comm.barrier(g)
    t0 = time.perf_counter()
    for _ in range(3):
        comm.sendrecv(x, (g.rank + 1) % g.size, (g.rank - 1) % g.size, g)
    assert time.perf_counter() - t0 >= 3 * 3e-3
    comm.set_link_model(latency_us=0, gbps=8.0)  # 1 GB/s: 4 MB take >= 4 ms
    t0 = time.perf_counter()
    comm.sendrecv(np.ones(500_000), (g.rank + 1) % g.size, (g.rank - 1) % g.size, g)
    assert time.perf_counter() - t0 >= 4e-3
    comm.set_link_model()
    assert comm.link_model() == {"latency_us": 0.0, "gbps": None}
    print(f"rank {g.rank}: link model ok")


def helpers():
    for n in range(0, 12):
        for parts in range(1, 6):
            want = [len(p) for p in np.array_split(np.arange(n), parts)]
            got = [(b - a) for a, b in split_bounds(n, parts)]
            assert got == want, (n, parts)
    assert threading.active_count() >= 1


def all_p2p_cases():
    helpers()
    p2p_roundtrip()
    groups_and_recent_ops()
    async_semantics()
    comm.barrier(comm.world())


def device_p2p():
    """Point-to-point messages between device arrays (run under the CuPy emulator, with or
    without MINIDIST_EMULATED_CUDA_AWARE_MPI=1 and MINIDIST_CUDA_AWARE_MPI=1): blocking,
    combined and nonblocking, from a strided view and into one, each right after the device
    work that writes the array sent or frees memory the receive may get.  Prints how many
    device->host copies the messages made."""
    import cupy
    from cupy import _emulator

    from minidist.model.backend import xp

    g = comm.world()
    r, n = g.rank, g.size
    right, left = (r + 1) % n, (r - 1) % n
    base = xp.arange(24, dtype=xp.float64).reshape(4, 6)
    _emulator.reset()
    for step in range(2):
        want = (base * (left + 1) + step).get()
        x = base * (r + 1) + step  # a kernel writes what is sent next; device work is queued
        if r % 2 == 0:
            comm.send(x[:, ::2], right, g, tag=1)  # strided: a copy kernel makes it contiguous
            x = x + 1  # queued again before the receive
            got = comm.recv((4, 3), xp.float64, left, g, tag=1)
        else:
            got = comm.recv((4, 3), xp.float64, left, g, tag=1)
            comm.send(x[:, ::2], right, g, tag=1)
            x = x + 1
        assert isinstance(got, cupy.ndarray) and np.array_equal(got.get(), want[:, ::2])
        into = xp.zeros((4, 6))
        comm.sendrecv(x, right, left, g, out=into, tag=2)
        assert np.array_equal(into.get(), want + 1)
        x = x * 2
        into, strided = xp.zeros((4, 6)), xp.zeros((4, 12))
        reqs = [comm.irecv(into, left, g, tag=3), comm.irecv(strided[:, ::2], left, g, tag=4),  # the view: staged
                comm.isend(x, right, g, tag=3), comm.isend(x, right, g, tag=4)]
        for req in reqs:
            req.wait()
        assert np.array_equal(into.get(), (want + 1) * 2)
        assert np.array_equal(strided.get()[:, ::2], (want + 1) * 2) and not strided.get()[:, 1::2].any()
    p2p = os.path.join("comm", "p2p", "__init__.py")
    staged = [t for t in _emulator.transfers("d2h") if any(f.endswith(p2p) for f, _, _ in t.stack)]
    sys.stdout.write(f"rank {r}: {len(staged)} staged device->host copies\n")  # one write: ranks' lines do not merge
    sys.stdout.flush()
