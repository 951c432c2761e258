"""Asynchronous collectives: a progress thread per group that really moves the data.

MPI only moves a message while some thread is inside an MPI call, so "nonblocking" alone
does not overlap communication with computation in a single-threaded Python program.
minidist therefore gives each group one worker thread (MPI_THREAD_MULTIPLE) that runs the
queued collectives one after another, in the order they were submitted (FIFO).  That order is
the same on every rank, which is what makes the messages of successive async collectives
match up.  The worker uses a *duplicate* of the group's communicator, so its messages can
never be confused with synchronous traffic the main thread sends at the same time.

While the worker is blocked in MPI or adds arrays in NumPy, the GIL is released, so the main
thread's NumPy work (a matmul, a backward pass) really runs in parallel: this is the overlap
DDP and tensor-parallel "async collective matmul" rely on.
"""

from __future__ import annotations

import queue
import threading

from minidist.model.backend import current_device, using_device


class Handle:
    """The future result of an async collective: ``wait()`` blocks until it is done and
    returns the result (or re-raises the worker's exception); ``is_completed()`` polls."""

    __slots__ = ("_event", "_result", "_error", "name")

    def __init__(self, name: str):
        self.name = name
        self._event = threading.Event()
        self._result = None
        self._error = None

    def is_completed(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float | None = None):
        if not self._event.wait(timeout):
            raise TimeoutError(f"async {self.name} not finished after {timeout} s")
        if self._error is not None:
            raise self._error
        return self._result

    def _finish(self, result=None, error=None):
        self._result, self._error = result, error
        self._event.set()


class ProgressWorker:
    """One daemon thread running submitted callables in FIFO order."""

    def __init__(self, name: str):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=f"minidist-progress-{name}", daemon=True)
        self._thread.start()

    def submit(self, name: str, fn, *args, **kwargs) -> Handle:
        """Queue ``fn(*args, **kwargs)``; it runs on the caller's GPU (CUDA's current device is
        per thread, and this thread would otherwise start on GPU 0)."""
        handle = Handle(name)
        self._queue.put((handle, fn, args, kwargs, current_device()))
        return handle

    def _loop(self) -> None:
        while True:
            handle, fn, args, kwargs, device = self._queue.get()
            try:
                with using_device(device):
                    handle._finish(fn(*args, **kwargs))
            except BaseException as err:  # handed to the caller's wait()
                handle._finish(error=err)
