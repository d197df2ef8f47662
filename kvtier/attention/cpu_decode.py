"""Decode attention on the CPU over token-major KV extents, with log-sum-exp, multi-threaded.

The KV of a streamed slice already lives in host memory (`[E, 2, G, D]` extents); for one
decode token the CPU can attend it where it is instead of copying it over PCIe. All query heads
of a KV head read its keys once (GQA), accumulation is fp32, and the result is (out, lse) per
query head, to merge exactly with other partial results (`kvtier.attention.dense.merge_into`,
or `merge_stacked` for many at once, as the store merges a layer's CPU parts).

```
 extents:  [e0: tokens 0..E) [e1: E..2E) [e2: 2E..length)
 tasks:    token ranges within one extent (all KV heads of the slice), ~1 MiB each; task n
           writes out[n], lse[n] only
 native:   one issuing thread per decoder: waits for `ready`, then one call runs every task of
           the start on native threads (cpu_pool.cpp), the GIL released once, and one more
           merges them in task order (kvtier_merge)
 torch:    one Python pool task per task, merged by PyTorch at result()
 merge:    softmax over the tasks' lse (independent of which thread ran which task)
```

Two backends, chosen by measurement (bench/results/cpu_attention_cpu.json): "native", a C++
kernel (`cpu_decode.cpp`, built with `cpu_pool.cpp` by the system compiler at first use into
kvtier's cache folder and called through ctypes) and "torch", PyTorch's CPU flash kernel over
the same tasks (used when no compiler is found, or for fp16 and shapes the kernel does not
take). The task split depends on the shapes only, so each backend gives bitwise the same
result with any number of decoder threads (the native one with any PyTorch thread count too).

This module holds the decoder; its parts live beside it and are re-exported here: the task split
(`cpu_tasks`), building and loading the native kernel (`cpu_native`), the torch backend's task
and merge (`cpu_torch`), and a started decode's handle (`cpu_pending`).
"""

from __future__ import annotations

import ctypes
import os
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from kvtier.attention.cpu_native import MAX_NATIVE_DIM, native_library, wide_vectors
from kvtier.attention.cpu_pending import PendingDecode
from kvtier.attention.cpu_tasks import TASK_BYTES, Task, plan_row_tasks, plan_tasks
from kvtier.attention.cpu_torch import merge, run_torch_task
from kvtier.attention.row_formats import ROW_KINDS, RowCodec, native_row_format
from kvtier.errors import ConfigError

__all__ = [
    "BACKENDS",
    "MAX_NATIVE_DIM",
    "TASK_BYTES",
    "CpuDecoder",
    "PendingDecode",
    "RowCodec",
    "Task",
    "default_threads",
    "merge",
    "native_library",
    "plan_row_tasks",
    "plan_tasks",
    "wide_vectors",
]

BACKENDS = ("auto", "native", "torch")


def default_threads() -> int:
    """Worker threads for CPU attention: the cores this process may use, less one for the thread
    that issues GPU work (at least one). `KVTIER_CPU_ATTENTION_THREADS` overrides it."""
    env = os.environ.get("KVTIER_CPU_ATTENTION_THREADS")
    if env:
        if not env.isdigit() or int(env) < 1:
            raise ConfigError(f"KVTIER_CPU_ATTENTION_THREADS={env!r}: give a positive number of threads")
        return int(env)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores - 1)


def _check_into(into: tuple[torch.Tensor, torch.Tensor] | None, heads: int, head_dim: int) -> None:
    """ValueError unless `into` is None or float32 contiguous CPU (out [heads, head_dim], lse [heads])."""
    if into is None:
        return
    out, lse = into
    for x, shape in ((out, (heads, head_dim)), (lse, (heads,))):
        if (
            tuple(x.shape) != shape
            or x.dtype != torch.float32
            or x.device.type != "cpu"
            or not x.is_contiguous()
        ):
            raise ValueError(
                f"`into` needs contiguous float32 CPU tensors of shapes {(heads, head_dim)}, {(heads,)}"
            )


class CpuDecoder:
    """Runs decode attention over host extents on `threads` threads.

    Native backend: a start is one job for the decoder's issuing thread, which waits for the
    start's `ready` event, runs every task on `threads` native threads (itself and `threads - 1`
    pool threads) and merges them. Torch backend: one task per Python pool thread. `start` may be
    called again while earlier starts still run (they run in order). `close()` stops the threads.
    """

    def __init__(self, threads: int | None = None, backend: str = "auto") -> None:
        if backend not in BACKENDS:
            raise ConfigError(f"CPU attention backend {backend!r}: use one of {', '.join(BACKENDS)}")
        self.threads = threads or default_threads()
        self.lib = native_library() if backend != "torch" else None
        if backend == "native" and self.lib is None:
            raise ConfigError("the native CPU attention kernel did not build: install a C++ compiler (g++)")
        self.backend = "native" if self.lib is not None else "torch"
        # Seconds the native jobs ran (from their query's arrival to their merge), summed: with
        # the bytes they read, the CPU's attention rate while the link copies (bench/tiered_store.py)
        self.busy_s = 0.0
        # When a list: each native job's (start, end) perf_counter seconds, in the order started
        # (bench/tiered_store.py --trace-cpu)
        self.trace: list[tuple[float, float]] | None = None
        self._free: weakref.finalize | None = None
        self._threads_for(os.getpid())

    def _threads_for(self, pid: int) -> None:
        """New executors (their threads start at the first submit, so an unused one costs
        nothing); the native pool is made at the first native start. NOTE: called again in a
        forked child, which has none of the parent's threads (and never frees their pool)."""
        self._pid = pid
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="kvtier-cpu-attn")
        self._issuer = ThreadPoolExecutor(1, thread_name_prefix="kvtier-cpu-attn-issue")
        self._native: int | None = None  # the native pool's handle
        if self._free is not None:
            self._free.detach()
            self._free = None

    def start(
        self,
        q: torch.Tensor,
        extents: list[torch.Tensor],
        length: int,
        ready: torch.cuda.Event | None = None,
        into: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> PendingDecode:
        """Attend q [H_q, D] (one token; any float dtype, CPU) over tokens [0, length) of the
        token-major `extents` (each [E, 2, G, D], CPU), non-causally. Returns at once; the work
        runs on the decoder's threads, after waiting for `ready` (e.g. q's copy to the host and
        the last write to the extents) off the caller's thread. length must be at least 1.
        `into`: float32 CPU tensors (out [H_q, D], lse [H_q]) the result is written to (e.g.
        views of one pinned buffer a caller copies to the GPU at once)."""
        e, _, g, d = extents[0].shape
        hq = q.shape[0]
        r = hq // g
        if length < 1 or length > e * len(extents):
            raise ValueError(f"length {length} outside 1..{e * len(extents)}")
        tasks = plan_tasks(extents, length)
        out, lse = self._outputs(len(tasks), g, r, d)
        _check_into(into, hq, d)
        native = (
            self.lib is not None
            and extents[0].dtype in (torch.float32, torch.bfloat16)
            and d % 8 == 0
            and d <= MAX_NATIVE_DIM
            and all(x.is_contiguous() for x in extents)
        )
        if native:
            row = 2 * g * d * extents[0].element_size()
            kind = int(extents[0].dtype == torch.bfloat16)
            return self._start_native(q, extents, tasks, row, kind, out, lse, ready, into)
        futures = [
            self._pool.submit(run_torch_task, q, extents[t.extent], t, out[n], lse[n], ready)
            for n, t in enumerate(tasks)
        ]
        return PendingDecode(futures, out, lse, hq, into=into)

    def start_rows(
        self,
        q: torch.Tensor,
        codec: RowCodec,
        extents: list[torch.Tensor],
        rows: int,
        heads: int,
        head_dim: int,
        ready: torch.cuda.Event | None = None,
        into: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> PendingDecode:
        """As `start`, over the first `rows` packed rows of `codec` (rows of `codec.group` tokens
        of `heads` KV heads, in row `extents` [R_e, row_bytes] uint8, CPU): the values attended
        are exactly `codec.unpack`'s. The native kernel reads KIVI rows of 32 tokens (2, 4 or 8
        bits) and FP8 rows in place (`native_row_format`); other codecs unpack each task's rows
        with torch first."""
        e, row_bytes = extents[0].shape
        g, d, hq = heads, head_dim, q.shape[0]
        r = hq // g
        if rows < 1 or rows > e * len(extents):
            raise ValueError(f"rows {rows} outside 1..{e * len(extents)}")
        if row_bytes != codec.row_bytes(g, d):
            raise ValueError(f"rows of {row_bytes} bytes, but the codec's hold {codec.row_bytes(g, d)}")
        tasks = plan_row_tasks(extents, rows)
        out, lse = self._outputs(len(tasks), g, r, d)
        _check_into(into, hq, d)
        fmt = native_row_format(codec)
        native = (
            self.lib is not None
            and fmt is not None
            and d % 8 == 0
            and d <= MAX_NATIVE_DIM
            and all(x.is_contiguous() for x in extents)
        )
        if native:
            assert fmt is not None
            return self._start_native(q, extents, tasks, row_bytes, ROW_KINDS[fmt], out, lse, ready, into)
        futures = [
            self._pool.submit(run_torch_task, q, extents[t.extent], t, out[n], lse[n], ready, codec)
            for n, t in enumerate(tasks)
        ]
        return PendingDecode(futures, out, lse, hq, into=into)

    def _outputs(self, tasks: int, g: int, r: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The tasks' partial results out [P, G, r, D] and lse [P, G, r] (float32), after making
        new threads in a forked child (`_threads_for`)."""
        if os.getpid() != self._pid:
            self._threads_for(os.getpid())
        return torch.empty(tasks, g, r, d), torch.empty(tasks, g, r)

    def _start_native(
        self,
        q: torch.Tensor,
        extents: list[torch.Tensor],
        tasks: list[Task],
        unit: int,
        kind: int,
        out: torch.Tensor,
        lse: torch.Tensor,
        ready: torch.cuda.Event | None,
        into: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> PendingDecode:
        """One native job over `tasks` (`unit`: bytes per token or row; `kind`: the pool's kernel),
        merged into `into` (else new tensors)."""
        hq, d = q.shape[0], out.shape[-1]
        merged = into if into is not None else (torch.empty(hq, d), torch.empty(hq))
        ptrs = [extents[t.extent].data_ptr() + t.start * unit for t in tasks]
        job = (q, ptrs, [t.tokens for t in tasks], kind, out, lse, merged, ready, extents)
        return PendingDecode([self._issuer.submit(self._run_native, *job)], out, lse, hq, merged)

    def signal(self, pending: list[PendingDecode], done: Callable[[], None]) -> Future[None]:
        """Call `done()` once every start in `pending` has its result (merged into its `into`),
        on the issuing thread after the native starts queued before this call; the returned
        future holds the first start's error, if any. NOTE: `done` runs even then, so a stream
        that waits for it (`kvtier.kv.host_flag`) never stalls."""
        return self._issuer.submit(_results_then, pending, done)

    def attend(
        self, q: torch.Tensor, extents: list[torch.Tensor], length: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`start(...).result()`: (out [H_q, D] float32, lse [H_q] float32)."""
        return self.start(q, extents, length).result()

    def _native_pool(self) -> int:
        """The native thread pool's handle (only the issuing thread calls this)."""
        assert self.lib is not None
        if self._native is None:
            handle = self.lib.kvtier_pool_new(self.threads - 1)
            if not handle:
                raise RuntimeError(f"could not start {self.threads - 1} native CPU attention threads")
            self._native = handle
            self._free = weakref.finalize(self, self.lib.kvtier_pool_free, handle)
        return self._native

    def _run_native(
        self,
        q: torch.Tensor,
        ptrs: list[int],
        counts: list[int],
        kind: int,
        out: torch.Tensor,
        lse: torch.Tensor,
        merged: tuple[torch.Tensor, torch.Tensor],
        ready: torch.cuda.Event | None,
        extents: list[torch.Tensor],
    ) -> None:
        """Every task of a start in one native call (`kind`: the pool's kernel; task i reads
        counts[i] tokens or rows from address ptrs[i] of `extents`, kept alive here), then their
        merge into `merged` (out [H_q, D], lse [H_q]) in another, on the issuing thread (the GIL
        released in both)."""
        assert self.lib is not None
        if ready is not None:
            ready.synchronize()  # NOTE: before q is read: it may still be in flight from the GPU
        t0 = time.perf_counter()
        p, g, r, d = out.shape
        # NOTE: inference mode is per thread; the model's tensors (q, out) may be inference tensors.
        with torch.inference_mode():
            qs = q.float().contiguous()  # [G * r, D]
        kv = (ctypes.c_void_p * p)(*ptrs)
        n = (ctypes.c_int64 * p)(*counts)
        args = (kv, n, p, g, qs.data_ptr(), d**-0.5, r, d, out.data_ptr(), lse.data_ptr())
        if self.lib.kvtier_pool_run(self._native_pool(), kind, *args) != 0:
            raise RuntimeError(f"native CPU attention (kernel {kind}) rejected G={g}, r={r}, D={d}")
        self.lib.kvtier_merge(p, g * r, d, out.data_ptr(), lse.data_ptr(), *(x.data_ptr() for x in merged))
        t1 = time.perf_counter()
        self.busy_s += t1 - t0  # NOTE: the issuing thread runs one job at a time
        if self.trace is not None:
            self.trace.append((t0, t1))
        del extents

    def close(self) -> None:
        """Stop the threads (after the tasks already started)."""
        self._issuer.shutdown(wait=True)
        self._pool.shutdown(wait=True)
        if self._free is not None:
            self._free()


def _results_then(pending: list[PendingDecode], done: Callable[[], None]) -> None:
    """Wait for every start's result, then `done()` (whatever happened)."""
    try:
        with torch.inference_mode():  # NOTE: per thread; the torch backend's merge writes `into`
            for p in pending:
                p.result()
    finally:
        done()
