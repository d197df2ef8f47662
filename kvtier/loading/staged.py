"""Safetensors shards read in large sequential windows into pinned staging memory and copied to
the model's parameters asynchronously (`KVTIER_LOAD=staged`, opt-in).

safetensors' `safe_open(device="cuda")` reads a memory map tensor by tensor: each tensor's pages
are faulted in from the page cache one by one and copied from pageable memory. Loading
Llama-3.1-8B's 16 GB took 11.0-15.8 s of each 512K run's ~18-20 s before its setup on an H100
host (`phases_s` of bench/results/hip_cli_speed_512k_*_{alloc,huge}.json). Here a shard's data
is read front to back in `WINDOW_BYTES` windows by `READ_THREADS` threads (`os.preadv` into a
pinned buffer, the GIL released), two buffers in turn, while the main thread queues each
window's bytes to its tensors' parameters on a copy stream:

    window k -> buffer k % 2 -> for each tensor overlapping window k: its bytes there, copied
                                into the parameter's own bytes (same dtype, contiguous) or into
                                a device buffer of the tensor, converted into the parameter once
                                its last byte arrived (another dtype)

A buffer is read into again only after the copies out of it are done (an event). Off CUDA the
same windows are copied synchronously from one unpinned buffer. The values are the bytes of the
file: the same parameters as the default path, which `bench/load_speed.py` times against it.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from kvtier.errors import ConfigError, ModelLoadError

LOAD_MODES = ("safetensors", "staged")
WINDOW_BYTES = 256 << 20  # bytes a window: a pinned buffer each of two
READ_THREADS = 4  # threads that read one window's parts at once

_DTYPES: dict[str, torch.dtype] = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


def load_mode() -> str:
    """`KVTIER_LOAD`: "safetensors" (unset, the default: `safe_open` tensor by tensor) or
    "staged" (this module)."""
    raw = os.environ.get("KVTIER_LOAD", "").strip().lower() or "safetensors"
    if raw not in LOAD_MODES:
        raise ConfigError(f"KVTIER_LOAD={raw!r}: use safetensors (the default) or staged")
    return raw


@dataclass(frozen=True)
class Entry:
    """One tensor of a shard: its dtype and shape, and its bytes [start, end) in the file."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int


def read_header(path: Path) -> list[Entry]:
    """The shard's tensors in file order (ModelLoadError for a header that is not safetensors')."""
    size = path.stat().st_size
    with path.open("rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise ModelLoadError(f"cannot read {path}: {size} bytes, too short for a safetensors header")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise ModelLoadError(f"cannot read {path}: its header claims {n} bytes of {size}")
        try:
            header = json.loads(fh.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ModelLoadError(f"cannot read {path}: its header is not JSON ({e})") from None
    base = 8 + n
    entries = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = _DTYPES.get(info.get("dtype", ""))
        a, b = info.get("data_offsets", (0, -1))
        shape = tuple(int(x) for x in info.get("shape", ()))
        count = 1
        for x in shape:
            count *= x
        if dtype is None or not 0 <= a <= b or base + b > size or b - a != count * dtype.itemsize:
            raise ModelLoadError(f"cannot read {path}: tensor {name}'s header entry does not fit: {info}")
        entries.append(Entry(name, dtype, shape, base + a, base + b))
    return sorted(entries, key=lambda e: e.start)


def _bytes_of(p: torch.Tensor) -> torch.Tensor:
    return p.view(-1).view(torch.uint8)


class _Sink:
    """Where a tensor's bytes go: the parameter's own bytes (same dtype, contiguous), or a buffer
    on the parameter's device that is converted into it once full."""

    def __init__(self, e: Entry, param: torch.Tensor) -> None:
        self.entry, self.param = e, param
        self.direct = param.dtype == e.dtype and param.is_contiguous()
        if self.direct:
            self.buf = _bytes_of(param)
        else:
            self.buf = torch.empty(e.end - e.start, dtype=torch.uint8, device=param.device)
        self.filled = 0

    def put(self, at: int, data: torch.Tensor) -> None:
        """Bytes `data` of the tensor from its byte `at`; converts into the parameter once full."""
        self.buf[at : at + data.numel()].copy_(data, non_blocking=True)
        self.filled += data.numel()
        if not self.direct and self.filled == self.buf.numel():
            with torch.no_grad():
                self.param.copy_(self.buf.view(self.entry.dtype).view(self.entry.shape))
            self.buf = torch.empty(0, dtype=torch.uint8)


def _read_into(fd: int, buf: torch.Tensor, offset: int, threads: ThreadPoolExecutor | None) -> None:
    """Fill `buf` (uint8, host) with the file's bytes from `offset`, in READ_THREADS parts."""
    n = buf.numel()
    parts = [(a, min(n, a + -(-n // READ_THREADS))) for a in range(0, n, -(-n // READ_THREADS))]

    def part(span: tuple[int, int]) -> None:
        a, b = span
        view = buf[a:b].numpy().data  # a memoryview of the buffer's bytes
        done = 0
        while done < b - a:
            got = os.preadv(fd, [view[done:]], offset + a + done)
            if got <= 0:
                raise ModelLoadError(f"the file ended {b - a - done} bytes early")
            done += got

    if threads is None:
        for span in parts:
            part(span)
    else:
        list(threads.map(part, parts))


def read_shard_staged(
    f: Path, params: Mapping[str, nn.Parameter], advance: Callable[[int], object]
) -> set[str]:
    """Copy shard `f`'s tensors that `params` names into them, window by window; the names
    copied. ModelLoadError for a shape the config does not imply or a file that cannot be read."""
    entries = [e for e in read_header(f) if e.name in params]
    for e in entries:
        if e.shape != tuple(params[e.name].shape):
            raise ModelLoadError(
                f"{f.name}: {e.name} has shape {e.shape}, the config implies {tuple(params[e.name].shape)}"
            )
    if not entries:
        return set()
    on_gpu = [params[e.name].device for e in entries if params[e.name].is_cuda]
    cuda = bool(on_gpu)  # else every tensor goes to host memory (a CPU model, host experts)
    stream = torch.cuda.Stream(on_gpu[0]) if cuda else None
    lo, hi = entries[0].start, max(e.end for e in entries)
    width = min(WINDOW_BYTES, hi - lo)
    bufs = [torch.empty(width, dtype=torch.uint8, pin_memory=cuda) for _ in range(2 if cuda else 1)]
    done: list[torch.cuda.Event | None] = [None] * len(bufs)
    sinks: dict[str, _Sink] = {}
    pending = list(entries)  # those not yet begun, in file order
    fd = os.open(f, os.O_RDONLY)
    try:
        on_stream = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
        with ThreadPoolExecutor(READ_THREADS) as threads, on_stream:
            for k, w0 in enumerate(range(lo, hi, width)):
                w1 = min(hi, w0 + width)
                j = k % len(bufs)
                if (event := done[j]) is not None:
                    event.synchronize()  # the copies out of this buffer are done
                buf = bufs[j][: w1 - w0]
                _read_into(fd, buf, w0, threads)
                while pending and pending[0].start < w1:
                    e = pending.pop(0)
                    sinks[e.name] = _Sink(e, params[e.name].data)
                for name, sink in list(sinks.items()):
                    e = sink.entry
                    a, b = max(e.start, w0), min(e.end, w1)
                    if a < b:
                        sink.put(a - e.start, buf[a - w0 : b - w0])
                        advance(b - a)
                    if e.end <= w1:
                        del sinks[name]
                if stream is not None:
                    done[j] = stream.record_event()
        if stream is not None:
            stream.synchronize()
    except OSError as e:
        raise ModelLoadError(f"cannot read {f}: {e}") from None
    except ModelLoadError as e:
        raise ModelLoadError(f"cannot read {f}: {e}") from None
    finally:
        os.close(fd)
    return {e.name for e in entries}
