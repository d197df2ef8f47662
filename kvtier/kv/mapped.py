"""CUDA views of pinned host memory: kernels read the host's bytes over PCIe, no copy engine.

A layer's CPU-attended results are a few KB (`kvtier.kv.cpu_attend`). Copied to the device they
are one more H2D copy on the copy engines, where at decode the link's 64 MiB-class loads run: a
small copy queued behind one waits up to ~1.2 ms at 55 GB/s, and the CPU's threads wait with it
for the next layer's query. Read in place by the merge's kernels (a mapped view) they take no
copy engine at all. `StoreOptions.cpu_results` (or `KVTIER_CPU_RESULTS`) chooses: "mapped" (the
default on CUDA since the forty-seventh session, where libcuda's calls are there; with the
stream's wait 0.2389-0.2446 s/token at 512K over int4 KV against 0.2572-0.2618 copied, one
H100 start, `kvtier.kv.host_flag`) or "copy".
"""

from __future__ import annotations

import os
from typing import Any

import torch

from kvtier.errors import ConfigError
from kvtier.kv.host_flag import driver_available, driver_pointer

RESULTS = ("auto", "copy", "mapped")


def results_mode(choice: str, device: torch.device) -> str:
    """ "copy" or "mapped" for `device`: `choice`, or for "auto" `KVTIER_CPU_RESULTS` (default:
    "mapped" where libcuda's calls are there, else "copy"); always "copy" off CUDA, where the
    results already are where the merge runs."""
    mode = choice if choice != "auto" else os.environ.get("KVTIER_CPU_RESULTS", "auto")
    if mode not in RESULTS:
        raise ConfigError(f"CPU results {mode!r}: use copy or mapped (or auto)")
    if device.type != "cuda":
        return "copy"
    if mode == "auto":
        mode = "mapped" if driver_available() else "copy"
    return mode


class _Interface:
    """The `__cuda_array_interface__` of `nbytes` bytes at a device pointer."""

    def __init__(self, dptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__: dict[str, Any] = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (dptr, False),
            "version": 3,
            "strides": None,
        }


def device_view(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A tensor on `device` over the same bytes as `host` (pinned, contiguous), of its dtype and
    shape. NOTE: it does not keep `host` alive; the caller keeps both. A kernel reading it reads
    host memory as it is then: order reads after the host's writes with the stream (an event, a
    `HostFlag` wait)."""
    if not host.is_pinned() or not host.is_contiguous():
        raise ValueError("a device view needs a pinned, contiguous host tensor")
    nbytes = host.numel() * host.element_size()
    with torch.cuda.device(device):
        raw = torch.as_tensor(_Interface(driver_pointer(host.data_ptr()), nbytes), device=device)
    return raw.view(host.dtype).view(host.shape)
