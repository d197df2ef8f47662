"""Host memory pinned by `cudaHostRegister`, and a pool that keeps it for reuse.

PyTorch's pinned allocator makes pinned memory with `cudaHostAlloc`: ~1.6-2.3 GB/s on the
device tool's hosts, so a 512K store's ~68 GB host tier took ~30 s to pin before its prefill.
Registering memory whose pages were faulted in first (a fill, on torch's threads) pins faster;
made with `huge`, the mapping asks the kernel for transparent huge pages (MADV_HUGEPAGE on a
2 MiB-aligned start), so the kernel pins, and the GPU maps, 512x fewer pages
(bench/host_memory.py measures pinning and in-place reads each way).

Users: the layer-order prefill's hidden pieces (`kvtier.engine.host_pin`, KVTIER_HIDDEN_PIN)
and the store's host slabs (`kvtier.kv.tiers.HostArena`, KVTIER_HOST_PIN=huge).
"""

from __future__ import annotations

import mmap
import threading
from collections.abc import Callable, Iterable

import torch

HUGE_PAGE = 2 << 20  # bytes of a transparent huge page on x86-64
_PORTABLE_MAPPED = 1 | 2  # cudaHostRegisterPortable | cudaHostRegisterMapped


def _huge_mapped(nbytes: int) -> torch.Tensor:
    """`nbytes` of an anonymous mapping starting on a huge-page boundary, MADV_HUGEPAGE asked
    for, as uint8 (the tensor keeps the mapping alive; it is unmapped with the last view)."""
    area = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(area, dtype=torch.uint8)
    skip = (-whole.data_ptr()) % HUGE_PAGE
    if hasattr(mmap, "MADV_HUGEPAGE"):
        area.madvise(mmap.MADV_HUGEPAGE)
    return whole[skip : skip + nbytes]


def registered_empty(shape: tuple[int, ...], dtype: torch.dtype, huge: bool = False) -> torch.Tensor:
    """A host tensor of `shape` (zeros) pinned by `cudaHostRegister` after a fill faulted its
    pages in on torch's threads; `huge`: in transparent huge pages where the kernel grants them.
    `unregister` it once no copy or kernel reads it any more (before it is freed)."""
    if huge:
        nbytes = dtype.itemsize
        for n in shape:
            nbytes *= n
        t = _huge_mapped(nbytes).view(dtype).view(shape).zero_()
    else:
        t = torch.zeros(shape, dtype=dtype)
    flags = _PORTABLE_MAPPED if huge else 0
    rc = int(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), flags))
    if rc != 0:
        raise RuntimeError(
            f"cudaHostRegister of {t.numel() * t.element_size()} bytes failed: cudaError {rc} "
            f"(KVTIER_HOST_PIN=huge or KVTIER_HIDDEN_PIN=register/huge asked for it: unset them to "
            f"pin with PyTorch's cudaHostAlloc)"
        )
    return t


def registered_huge(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """`registered_empty(shape, dtype, huge=True)`."""
    return registered_empty(shape, dtype, huge=True)


def unregister(t: torch.Tensor) -> None:
    """Undo `registered_empty` (its copies done: the caller synchronized)."""
    rc = int(torch.cuda.cudart().cudaHostUnregister(t.data_ptr()))
    if rc != 0:
        raise RuntimeError(f"cudaHostUnregister failed: cudaError {rc}")


class RegisteredPool:
    """Registered host tensors kept for reuse, by shape and dtype: `take` one (registering a new
    one when none is kept), `give` them back once no copy reads them (the caller synchronized);
    `close` unregisters every kept one. Takes from several threads at once are safe (a store's
    slabs made from `KVTIER_PIN_THREADS` threads)."""

    def __init__(
        self,
        make: Callable[[tuple[int, ...], torch.dtype], torch.Tensor] = registered_empty,
        release: Callable[[torch.Tensor], None] = unregister,
    ) -> None:
        self._make, self._release = make, release
        self._kept: dict[tuple[tuple[int, ...], torch.dtype], list[torch.Tensor]] = {}
        self._lock = threading.Lock()

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        with self._lock:
            kept = self._kept.get((shape, dtype))
            if kept:
                return kept.pop()
        return self._make(shape, dtype)

    def give(self, tensors: Iterable[torch.Tensor]) -> None:
        with self._lock:
            for t in tensors:
                self._kept.setdefault((tuple(t.shape), t.dtype), []).append(t)

    def kept_bytes(self) -> int:
        """Bytes of the tensors kept now."""
        with self._lock:
            return sum(t.numel() * t.element_size() for kept in self._kept.values() for t in kept)

    def close(self) -> None:
        with self._lock:
            kept, self._kept = self._kept, {}
        for tensors in kept.values():
            for t in tensors:
                self._release(t)
