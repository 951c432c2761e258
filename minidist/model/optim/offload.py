"""Optimizer offload: AdamW's master weights and moments in pinned host memory, stepped there.

ZeRO-Offload (Ren et al. 2021, "ZeRO-Offload: Democratizing Billion-Scale Model Training")
moves the optimizer to the CPU: the GPU keeps the weights the forward reads and the gradients
backward writes; the master weights and Adam's moments live in host memory, where the CPU
updates them.  Each step copies the gradients to the host, runs AdamW there and copies the
weights back.  :class:`OffloadAdamW` (``--offload optimizer``; docs/gpu.md):

* **Pinned host memory** (``backend.host_empty``): the copies run on the GPU's DMA engines,
  queued on two streams of their own (one each way) beside the compute stream.
* **The same arithmetic**: the device's AdamW (``functional.adamw_flat``: the same passes,
  bias corrections, decoupled weight decay) on the host's NumPy, on the gradients as the device
  left them (clipped, unscaled), in chunks over a few threads (NumPy's loops release the GIL;
  elementwise, so any cut gives the same numbers).  On NumPy a run equals the one without
  offload bit for bit; on a GPU, whose AdamW is one fused kernel, to round-off.
* **Overlap**: the parameters are updated in groups in the order the next forward reads them,
  the ends (embeddings, final norm, head) first, then block by block.  ``step`` waits for the
  ends; a background thread steps the blocks while the host goes on to the next forward, and
  each block's forward waits (the model's block-runner seam) until its group is back on the
  device.  ZeRO-Offload's *delayed* parameter update, which changes the arithmetic, is not
  done.  ``overlap=False`` (``--no-offload-overlap``) finishes the update in ``step``.

The device keeps its weights in the master's dtype (under ``--mixed-precision`` the ops round
float32 weights per product), so the host copy equals them bit for bit, and what leaves the
GPU is AdamW's m and v: 8 of the 16 bytes of a float32 parameter.  On NumPy the "device" is
the host: the master is the parameter's own array and nothing is copied.  Readers of the
parameters between steps (checkpoints, ``parameters()``) call :meth:`wait` first; a checkpoint
load calls :meth:`reloaded`.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from minidist.model.backend import current_device, from_host, host, host_empty, to_host, using_device, xp
from minidist.model.optim.functional import _ADAM_BLOCK, adamw_block_hyper, adamw_flat
from minidist.model.optim.optimizers import AdamW

ON_GPU = xp is not host  # CuPy (or its emulator): host copies and streams; NumPy: none

_executors: dict = {}  # "worker" (one thread: the steps run in order) and the chunks' pools, made on first use


def _executor(name: str, threads: int) -> ThreadPoolExecutor:
    if name not in _executors:
        _executors[name] = ThreadPoolExecutor(max_workers=threads, thread_name_prefix=f"minidist-offload-{name}")
    return _executors[name]


def default_threads() -> int:
    """Threads for the host step: on NumPy one (the forward's BLAS has the cores), on a GPU
    this rank's share of the cores (OMP_NUM_THREADS, set under mpiexec), at most 8."""
    if not ON_GPU:
        return 1
    return max(1, min(8, int(os.environ.get("OMP_NUM_THREADS") or os.cpu_count() or 1)))


class _Item:
    """One parameter's part of a step: its device arrays and host copies, and its numbers."""
    __slots__ = ("p", "grad", "landing", "master", "m", "v", "hyper")

    def __init__(self, p, grad, landing, master, st, hyper):
        self.p, self.grad, self.landing, self.master = p, grad, landing, master
        self.m, self.v, self.hyper = st["exp_avg"], st["exp_avg_sq"], hyper


class _Job:
    """One step's host work, group by group; ``ready[k]`` is set once group k is back on the
    device (``uploaded[k]``: the event of its copies), or the step failed (``error``)."""

    def __init__(self, groups, start):
        self.groups, self.start = groups, start
        self.ready = [threading.Event() for _ in groups]
        self.uploaded = [None] * len(groups)
        self.waited = [False] * len(groups)
        self.error = None
        self.host_s = 0.0


class OffloadAdamW(AdamW):
    """:class:`AdamW` (same settings, state and checkpoints) whose state lives in host memory
    and whose update runs there (module docstring; ZeRO-Offload, Ren et al. 2021).

    ``overlap``: step the blocks in the background while the next forward runs (after
    :meth:`attach`); ``threads``: the host step's threads (``default_threads``).  ``totals``
    counts the finished host steps (``steps``), their seconds (``host_s``: copies and AdamW)
    and the seconds the main thread waited for them (``wait_s``: what the overlap did not hide)."""

    def __init__(self, params, lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, no_decay=None,
                 overlap: bool = True, threads: int | None = None):
        super().__init__(params, lr, betas, eps, weight_decay, no_decay)
        self.overlap = bool(overlap)
        self.threads = threads or default_threads()
        self.groups = [list(range(len(self.params)))]  # one group until attach() cuts them by block
        self._block_group: dict = {}  # id(block) -> its group
        self._master: dict = {}   # name -> pinned host copy of the weights (GPU only)
        self._landing: dict = {}  # name -> pinned host buffer the gradient is copied into (GPU only)
        self._job = None
        self._streams = None      # (down, up): the copies' streams, made on the first step
        self._device = current_device()  # the worker thread selects it (CUDA's device is per thread)
        self.totals = {"steps": 0, "host_s": 0.0, "wait_s": 0.0}

    # -- the order of the forward ------------------------------------------------------------
    def attach(self, model) -> None:
        """Group the parameters as ``model``'s forward reads them -- the ends (every parameter
        outside the blocks) first, then each block -- and make each block wait for its group
        before it runs (``GPT.use_block_runner``)."""
        index = {id(p): i for i, p in enumerate(self.params)}
        blocks = [b for b in model.h if b is not None]
        owner = {}
        for k, block in enumerate(blocks):
            for p in block.parameters():
                owner.setdefault(id(p), k)
        groups = [[i for i, p in enumerate(self.params) if id(p) not in owner]]
        for k, block in enumerate(blocks):
            groups.append([index[id(p)] for p in block.parameters() if id(p) in index and owner[id(p)] == k])
        self.groups = groups
        self._block_group = {id(b): k + 1 for k, b in enumerate(blocks)}
        model.use_block_runner(self._runner)

    def _runner(self, plain):
        def run(block, x):
            self._ready(self._block_group.get(id(block)))
            return plain(block, x)
        return run

    # -- the step ------------------------------------------------------------------------------
    def _zeros(self, like):  # m and v start at zero, in host memory
        return _host_zeros(like)

    def _update_all(self, items):
        """Start the host step of every (parameter, state) pair; return once the ends are
        back (with overlap) or everything is (without)."""
        self.wait()  # the last step's, normally waited for by the forward already
        job = self._job_of(items)
        self._job = job
        if not self.overlap:
            self._run(job)
            self.wait()
            return
        _executor("worker", 1).submit(self._run, job)
        self._ready(0)  # the next forward embeds before any block runs

    def _job_of(self, items) -> _Job:
        """The step's work by group, made on the main thread: the hyperparameters now (the
        loop sets the next lr while the blocks are stepped), the gradients as they are."""
        present = {id(p): st for p, st in items}
        b1, b2 = self.betas
        groups = []
        for group in self.groups:
            work = []
            for p, name in ((self.params[i], self.names[i]) for i in group if id(self.params[i]) in present):
                st = present[id(p)]  # a parameter without a gradient is skipped, as AdamW skips it
                hyper = adamw_block_hyper(st["step"], self.lr, b1, b2, self.eps, self.decay_of(p))
                work.append(_Item(p, self._grad_of(p), self._landing_of(name, p), self._master_of(name, p), st, hyper))
            groups.append(work)
        start = None
        if ON_GPU:  # the copies start once backward and clipping have written the gradients
            if self._streams is None:
                self._streams = (xp.cuda.Stream(non_blocking=True), xp.cuda.Stream(non_blocking=True))
            start = xp.cuda.get_current_stream().record()
        return _Job(groups, start)

    def _grad_of(self, p):
        """The gradient the step reads (kept by the job: the loop drops ``p.grad`` meanwhile)."""
        g = p.grad
        if ON_GPU and g.dtype != p.dtype:  # a lower-precision gradient: cast as AdamW's kernel would
            g = g.astype(p.dtype)
        if ON_GPU and not g.flags.c_contiguous:  # a DMA copy reads one contiguous range
            g = xp.ascontiguousarray(g)
        return g

    def _landing_of(self, name, p):
        if not ON_GPU:
            return None  # the host step reads the gradient itself
        if name not in self._landing:
            self._landing[name] = host_empty(p.shape, p.dtype)
        return self._landing[name]

    def _master_of(self, name, p):
        if not ON_GPU:
            if not (p.data.flags.c_contiguous or p.data.size == 0):
                raise ValueError(f"the offloaded AdamW updates {name!r} in place, but its array is strided")
            return p.data  # the host is the device: the parameter is its own master
        if name not in self._master:  # the weights as they are now (after a load, a broadcast)
            self._master[name] = to_host(p.data, "offload")
        return self._master[name]

    def _run(self, job: _Job) -> None:
        """The host work of ``job``, on the worker thread (or the caller's, without overlap):
        download every gradient, then per group: AdamW on the host, upload the weights."""
        t0 = time.perf_counter()
        try:
            with using_device(self._device):
                downloaded = self._download_all(job) if ON_GPU else None
                for k, items in enumerate(job.groups):
                    if downloaded is not None:
                        downloaded[k].synchronize()
                        for it in items:
                            it.grad = None  # copied: the pool may reuse its memory
                    self._host_step(items)
                    if ON_GPU:
                        job.uploaded[k] = self._upload(items)
                    job.host_s = time.perf_counter() - t0  # before the event: the last one ends the step
                    job.ready[k].set()
        except BaseException as exc:  # noqa: BLE001 - raised on the main thread by _ready
            job.error = exc
        finally:
            for event in job.ready:
                event.set()

    def _download_all(self, job: _Job) -> list:
        """Queue every gradient's copy into its pinned buffer, group by group, after the
        compute stream's work (an event per group)."""
        down = self._streams[0]
        job.start.synchronize()
        events = []
        for items in job.groups:
            for it in items:
                to_host(it.grad, "offload", out=it.landing, stream=down)
            events.append(down.record())
        return events

    def _upload(self, items):
        """Queue the updated weights' copies to the device; the event of the last one."""
        up = self._streams[1]
        for it in items:
            from_host(it.master, out=it.p.data, stream=up)
        return up.record()

    def _host_step(self, items) -> None:
        """AdamW on the host copies of one group, in chunks of whole cache blocks over the threads."""
        tasks = []
        for it in items:
            grad = it.landing if ON_GPU else it.grad
            P, G, M, V = (a.reshape(-1) for a in (it.master, grad, it.m, it.v))
            chunk = max(1, -(-P.size // (self.threads * _ADAM_BLOCK))) * _ADAM_BLOCK
            tasks += [(P[lo:lo + chunk], G[lo:lo + chunk], M[lo:lo + chunk], V[lo:lo + chunk], it.hyper)
                      for lo in range(0, P.size, chunk)]
        if self.threads == 1 or len(tasks) < 2:
            for task in tasks:
                _adamw_chunk(task)
            return
        list(_executor(f"chunks{self.threads}", self.threads).map(_adamw_chunk, tasks))  # list(): raises a task's error

    # -- waiting, loading ------------------------------------------------------------------------
    def _ready(self, k) -> None:
        """Wait until group ``k`` of the step in flight is back on the device."""
        job = self._job
        if job is None or k is None or job.waited[k]:
            return
        t0 = time.perf_counter()
        job.ready[k].wait()
        if job.error is not None:
            self._job = None
            raise RuntimeError("the offloaded optimizer step failed on the host") from job.error
        if job.uploaded[k] is not None:
            job.uploaded[k].synchronize()  # the copy stream's; the compute stream runs on meanwhile
        job.waited[k] = True
        self.totals["wait_s"] += time.perf_counter() - t0

    def wait(self) -> None:
        """Return once the step in flight has written every group back (its error raised here)."""
        job = self._job
        if job is None:
            return
        for k in range(len(job.groups)):
            self._ready(k)
        self.totals["steps"] += 1
        self.totals["host_s"] += job.host_s
        self._job = None

    def reloaded(self) -> None:
        """After a checkpoint load: the state the loader put on the device goes to host
        memory, and the master copies are taken again from the loaded weights."""
        self.wait()
        self._master.clear()
        for st in self.state.values():
            for key in self.state_keys:
                st[key] = to_host(st[key], "offload")  # a fresh (pinned) host array

    def load_state_dict(self, sd: dict):
        super().load_state_dict(sd)
        self.reloaded()

    def host_nbytes(self) -> int:
        """Host bytes held: m and v, and on a GPU the master copies and gradient buffers (pinned)."""
        return self.nbytes() + sum(a.nbytes for d in (self._master, self._landing) for a in d.values())

    def state_dict(self) -> dict:
        self.wait()
        return super().state_dict()


def _adamw_chunk(task) -> None:
    P, G, M, V, hyper = task
    adamw_flat(P, G, M, V, host.empty(min(P.size, _ADAM_BLOCK), P.dtype), hyper, lib=host)


def _host_zeros(like):
    out = host_empty(like.shape, like.dtype)
    out[...] = 0
    return out
