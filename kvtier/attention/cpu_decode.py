"""Decode attention on the CPU over token-major KV extents, with log-sum-exp, multi-threaded.

The KV of a streamed slice already lives in host memory (`[E, 2, G, D]` extents); for one
decode token the CPU can attend it where it is instead of copying it over PCIe. All query heads
of a KV head read its keys once (GQA), accumulation is fp32, and the result is (out, lse) per
query head, to merge exactly with other partial results (`kvtier.attention.dense.merge_into`).

```
 extents:  [e0: tokens 0..E) [e1: E..2E) [e2: 2E..length)
 tasks:    token ranges within one extent (all KV heads of the slice), ~1 MiB each, on a pool
 merge:    softmax over the tasks' lse, in task order (independent of thread timing)
```

Two backends, chosen by measurement (bench/results/cpu_attention.json): "native", a C++ kernel
(`cpu_decode.cpp`, built with the system compiler at first use into kvtier's cache folder and
called through ctypes, which releases the GIL) and "torch", PyTorch's CPU flash kernel over
the same tasks (used when no compiler is found, or for fp16 and shapes the kernel does not
take). On the 2-core development machine the native kernel read bf16 KV about 1.7x as fast.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from kvtier.errors import ConfigError

BACKENDS = ("auto", "native", "torch")
TASK_BYTES = 1 << 20  # KV bytes per task (per KV head), about: enough to amortize a task's overhead
MAX_NATIVE_HEADS = 8  # query heads per KV head one native call takes; more run in several calls
_SOURCE = Path(__file__).with_name("cpu_decode.cpp")
_FLAGS = ("-O3", "-march=native", "-funroll-loops", "-shared", "-fPIC")


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


def _cache_dir() -> Path:
    # NOTE: the same folder as kvtier.loading.gguf.cache_root (not imported: the attention layer
    # may not import kvtier.loading).
    env = os.environ.get("KVTIER_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "kvtier"


@functools.cache
def native_library() -> ctypes.CDLL | None:
    """The compiled kernel, built once per source, compiler and machine; None when no C++
    compiler is found or the build fails (the torch backend is used instead)."""
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        return None
    source = _SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join((cxx, *_FLAGS, os.uname().machine)).encode()).hexdigest()[:16]
    lib = _cache_dir() / "cpu_decode" / f"cpu_decode-{key}.so"
    if not lib.exists():
        lib.parent.mkdir(parents=True, exist_ok=True)
        # NOTE: built under a temporary name and renamed, so concurrent processes never load a
        # half-written library.
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=lib.parent)
        os.close(fd)
        try:
            done = subprocess.run([cxx, *_FLAGS, str(_SOURCE), "-o", tmp], capture_output=True, timeout=300)
            if done.returncode != 0:
                print(
                    f"kvtier: CPU attention kernel did not build, using torch: {done.stderr[-400:]!r}",
                    file=sys.stderr,
                )
                return None
            os.replace(tmp, lib)
        except (OSError, subprocess.TimeoutExpired):
            return None
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    dll = ctypes.CDLL(str(lib))
    for name in ("kvtier_decode_f32", "kvtier_decode_bf16"):
        fn = getattr(dll, name)
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_float]
        fn.argtypes += [ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
        fn.restype = ctypes.c_int
    return dll


@dataclass(frozen=True)
class _Task:
    extent: int
    start: int  # token offset in the extent
    tokens: int


class PendingDecode:
    """CPU attention started by `CpuDecoder.start`; `result()` waits for it and merges."""

    def __init__(self, futures: list[Future[None]], out: torch.Tensor, lse: torch.Tensor, heads: int) -> None:
        self._futures = futures
        self._out = out  # [P, G, r, D] float32
        self._lse = lse  # [P, G, r]
        self._heads = heads

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(out [H_q, D] float32, lse [H_q] float32), H_q = G x r, on the CPU."""
        for f in self._futures:
            f.result()
        w = torch.softmax(self._lse, dim=0)  # [P, G, r]
        out = (self._out * w[..., None]).sum(0)  # [G, r, D]
        lse = torch.logsumexp(self._lse, dim=0)
        return out.reshape(self._heads, -1), lse.reshape(self._heads)


class CpuDecoder:
    """Runs decode attention over host extents on a pool of `threads` worker threads.

    `start` may be called again while earlier starts still run (their tasks queue in order).
    `close()` stops the pool.
    """

    def __init__(self, threads: int | None = None, backend: str = "auto") -> None:
        if backend not in BACKENDS:
            raise ConfigError(f"CPU attention backend {backend!r}: use one of {', '.join(BACKENDS)}")
        self.threads = threads or default_threads()
        self.lib = native_library() if backend != "torch" else None
        if backend == "native" and self.lib is None:
            raise ConfigError("the native CPU attention kernel did not build: install a C++ compiler (g++)")
        self.backend = "native" if self.lib is not None else "torch"
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="kvtier-cpu-attn")

    def start(
        self,
        q: torch.Tensor,
        extents: list[torch.Tensor],
        length: int,
        ready: torch.cuda.Event | None = None,
    ) -> PendingDecode:
        """Attend q [H_q, D] (one token; any float dtype, CPU) over tokens [0, length) of the
        token-major `extents` (each [E, 2, G, D], CPU), non-causally. Returns at once; the work
        runs on the pool, each task first waiting for `ready` (e.g. q's copy to the host and the
        last write to the extents). length must be at least 1."""
        e, _, g, d = extents[0].shape
        hq = q.shape[0]
        r = hq // g
        if length < 1 or length > e * len(extents):
            raise ValueError(f"length {length} outside 1..{e * len(extents)}")
        step = max(64, TASK_BYTES // (2 * g * d * extents[0].element_size()))
        tasks = [
            _Task(i, a, min(a + step, end) - a)
            for i in range(-(-length // e))
            for end in (min(e, length - i * e),)  # tokens of extent i that are attended
            for a in range(0, end, step)
        ]
        out = torch.empty(len(tasks), g, r, d, dtype=torch.float32)
        lse = torch.empty(len(tasks), g, r, dtype=torch.float32)
        native = self.lib is not None and extents[0].dtype in (torch.float32, torch.bfloat16) and d % 8 == 0
        futures = [
            self._pool.submit(self._run, native and d <= 512, q, extents, t, out[n], lse[n], ready)
            for n, t in enumerate(tasks)
        ]
        return PendingDecode(futures, out, lse, hq)

    def attend(
        self, q: torch.Tensor, extents: list[torch.Tensor], length: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`start(...).result()`: (out [H_q, D] float32, lse [H_q] float32)."""
        return self.start(q, extents, length).result()

    def _run(
        self,
        native: bool,
        q: torch.Tensor,
        extents: list[torch.Tensor],
        t: _Task,
        out: torch.Tensor,
        lse: torch.Tensor,
        ready: torch.cuda.Event | None,
    ) -> None:
        """One task: every KV head over t.tokens tokens of extent t.extent -> out [G, r, D], lse [G, r]."""
        if ready is not None:
            ready.synchronize()  # NOTE: before q is read: it may still be in flight from the GPU
        # NOTE: inference mode is per thread; the model's tensors (q, out) may be inference tensors.
        with torch.inference_mode():
            self._attend_task(native, q, extents[t.extent], t, out, lse)

    def _attend_task(
        self, native: bool, q: torch.Tensor, ext: torch.Tensor, t: _Task, out: torch.Tensor, lse: torch.Tensor
    ) -> None:
        kv = ext[t.start : t.start + t.tokens]  # [n, 2, G, D], contiguous rows
        g, r, d = out.shape
        qs = q.float().view(g, r, d).contiguous()  # [G, r, D]
        if not native:
            k = kv[:, 0].transpose(0, 1).unsqueeze(0)  # [1, G, n, D]
            v = kv[:, 1].transpose(0, 1).unsqueeze(0)
            res = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qs.to(ext.dtype)[None], k, v)
            out.copy_(res[0][0])
            lse.copy_(res[1][0])
            return
        assert self.lib is not None
        fn = self.lib.kvtier_decode_bf16 if ext.dtype == torch.bfloat16 else self.lib.kvtier_decode_f32
        # NOTE: more than 8 query heads per KV head run 8 at a time (each pass reads the KV again).
        for h0 in range(0, r, MAX_NATIVE_HEADS):
            heads = slice(h0, min(h0 + MAX_NATIVE_HEADS, r))
            n_h = heads.stop - h0
            qc = qs[:, heads].contiguous()  # [G, n_h, D]
            oc = out if n_h == r else torch.empty(g, n_h, d)
            lc = lse if n_h == r else torch.empty(g, n_h)
            rc = fn(kv.data_ptr(), t.tokens, g, qc.data_ptr(), d**-0.5, n_h, d, oc.data_ptr(), lc.data_ptr())
            if rc != 0:
                raise RuntimeError(f"native CPU attention rejected G={g}, r={n_h}, D={d}, n={t.tokens}")
            if n_h < r:
                out[:, heads] = oc
                lse[:, heads] = lc

    def close(self) -> None:
        """Stop the worker threads (after the tasks already started)."""
        self._pool.shutdown(wait=True)
