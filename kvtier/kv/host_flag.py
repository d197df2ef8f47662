"""A counter in pinned host memory that CPU threads advance and a CUDA stream waits on.

With CPU-attended slices (`kvtier.kv.cpu_attend`) a layer's output needs the CPU's partial
results. Waiting for them on the host thread puts everything the host then issues (the merge,
the layer's dense work, the next layer's projections and query copy) on the CPU's critical
path: ~1.5-1.9 ms a layer on the H200 machine, while the GPU itself needs ~0.2 ms of it
(`bench/tiered_store.py --trace-cpu`). With a `HostFlag` the host instead queues a wait on the
GPU's stream (the driver's `cuStreamWaitValue32`) and goes on issuing, up to one CPU layer
ahead (`CpuSlices`); the CPU's last job of the layer advances the counter, and the stream,
already holding the layer's remaining work, runs it at once:

```
 host:   [issue layer l ... wait(l) results->GPU merge dense, issue layer l+1 ...]
 CPU:    [wait q(l)][attend l .......][set(l)] [wait q(l+1)][attend l+1 ...]
 GPU:    [q(l)->host][GPU slices of l][wait(l)]......[merge, dense, q(l+1)->host][...]
```

`HostFlag.make(device)` returns a flag on CUDA, the default since the forty-seventh session:
with the merge reading the results in place (`kvtier.kv.mapped`) int4 KV at 512K decoded at
0.2389-0.2446 s/token on one H100 start against 0.2572-0.2618 with the host's wait's usual
copy, three rounds interleaved (bench/results/int4_512k_g2_cpu32_gpu_*_12steps_*.json), and
none of 21 runs with it hung after its two suspects were removed (pinned allocations in the
loop, an unbounded run-ahead; three of four early runs had hung). "host" (or
`KVTIER_CPU_HANDOFF=host`) keeps the host's wait; "auto" falls back to it, and "gpu" raises,
where the driver's stream waits fail a self-test.
"""

from __future__ import annotations

import ctypes
import functools
import os
import time
from typing import Any

import torch

_GEQ = 0x0  # CU_STREAM_WAIT_VALUE_GEQ: (int32)(*addr - value) >= 0, so the counter may wrap
HANDOFFS = ("auto", "gpu", "host")


class HostFlag:
    """A uint32 counter in pinned, device-mapped host memory. `set` (any CPU thread) stores a
    value; `gpu_wait` makes the current CUDA stream wait until the counter reaches a value
    (cyclic comparison). Make one with `HostFlag.make`."""

    def __init__(self, device: torch.device, driver: _Driver) -> None:
        self._cell = torch.zeros(1, dtype=torch.int32, pin_memory=True)  # kept alive: the stream reads it
        self._value = ctypes.c_uint32.from_address(self._cell.data_ptr())
        self._dptr = driver.device_pointer(self._cell.data_ptr())
        self._driver = driver
        self.device = device

    @classmethod
    def make(cls, device: torch.device, handoff: str = "auto") -> HostFlag | None:
        """A flag for `device` on CUDA unless `handoff` (else, for "auto", `KVTIER_CPU_HANDOFF`)
        is "host"; None off CUDA, and for "auto" where the driver's stream waits fail the
        self-test (`_stream_waits_work`), where "gpu" raises."""
        choice = handoff if handoff != "auto" else os.environ.get("KVTIER_CPU_HANDOFF", "auto")
        if choice not in HANDOFFS:
            raise ValueError(f"CPU handoff {choice!r}: use one of {', '.join(HANDOFFS)}")
        if device.type != "cuda" or choice == "host":
            return None
        driver = _driver()
        if driver is None or not _stream_waits_work(device.index or 0):
            if choice == "auto":
                return None
            raise RuntimeError("this CUDA driver's stream waits (cuStreamWaitValue32) do not work here")
        return cls(device, driver)

    def set(self, value: int) -> None:
        """Store `value` (mod 2**32). NOTE: x86 stores are seen in program order, so a stream
        whose wait this releases reads every result the thread wrote before."""
        self._value.value = value & 0xFFFFFFFF

    def get(self) -> int:
        return int(self._value.value)

    def gpu_wait(self, value: int) -> None:
        """Make the current stream wait until the counter reaches `value` (no host blocking)."""
        stream = torch.cuda.current_stream(self.device).cuda_stream
        self._driver.wait(stream, self._dptr, value & 0xFFFFFFFF)


class _Driver:
    """The few driver calls a flag needs, through ctypes on the libcuda torch already loaded."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._wait = _function(lib, "cuStreamWaitValue32_v2", "cuStreamWaitValue32")
        self._wait.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
        self._ptr = _function(lib, "cuMemHostGetDevicePointer_v2", "cuMemHostGetDevicePointer")
        self._ptr.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p, ctypes.c_uint]

    def device_pointer(self, host: int) -> int:
        out = ctypes.c_uint64()
        _check(self._ptr(ctypes.byref(out), ctypes.c_void_p(host), 0), "cuMemHostGetDevicePointer")
        return out.value

    def wait(self, stream: int, dptr: int, value: int) -> None:
        _check(self._wait(ctypes.c_void_p(stream), dptr, value, _GEQ), "cuStreamWaitValue32")


def _function(lib: ctypes.CDLL, *names: str) -> Any:
    for name in names:
        fn = getattr(lib, name, None)
        if fn is not None:
            fn.restype = ctypes.c_int
            return fn
    raise AttributeError(f"libcuda has none of {', '.join(names)}")


def _check(code: int, what: str) -> None:
    if code != 0:
        raise RuntimeError(f"{what} failed with CUDA driver error {code}")


@functools.cache
def _driver() -> _Driver | None:
    """The driver's calls, or None where libcuda or its stream memory operations are missing."""
    try:
        return _Driver(ctypes.CDLL("libcuda.so.1"))
    except (OSError, AttributeError):
        return None


def driver_available() -> bool:
    """Whether libcuda's calls a flag and a mapped view need are there (`_driver`)."""
    return _driver() is not None


def driver_pointer(host: int) -> int:
    """The device address of pinned host memory at `host` (its own address where CUDA maps host
    and device into one address space)."""
    driver = _driver()
    if driver is None:
        raise RuntimeError("libcuda's cuMemHostGetDevicePointer is not available here")
    return driver.device_pointer(host)


_tested: list[HostFlag] = []  # the self-tests' flags, alive for good (see `_stream_waits_work`)


@functools.cache
def _stream_waits_work(index: int, timeout_s: float = 2.0) -> bool:
    """Whether a stream of device `index` waits for a flag and goes on once the host sets it
    (once per process, a few milliseconds). NOTE: on a new stream, so a driver that ignores the
    wait stalls none of the caller's streams; one that never sees the store leaves that stream
    waiting (the flag is kept, so its memory is never reused), and a device-wide synchronize
    would then hang: `make` raises instead of handing out flags."""
    device = torch.device("cuda", index)
    driver = _driver()
    assert driver is not None
    try:
        flag = HostFlag(device, driver)
        _tested.append(flag)
        stream = torch.cuda.Stream(device)
        with torch.cuda.stream(stream):
            flag.gpu_wait(1)
            done = torch.cuda.Event()
            done.record()
        time.sleep(0.002)
        held = not done.query()  # the stream waits while the counter is 0
        flag.set(1)
        deadline = time.perf_counter() + timeout_s
        while not done.query():
            if time.perf_counter() > deadline:
                return False
            time.sleep(0.0001)
        return held
    except RuntimeError:
        return False
