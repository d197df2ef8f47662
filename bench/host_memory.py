"""How fast pinned host memory is made three ways, and how fast kernels read each in place.

A 512K store pins ~68 GB of host memory before its prefill: ~30 s on an H100 host through
PyTorch's `cudaHostAlloc` (`setup_s` of bench/results/hip_cli_speed_512k_*.json), ~2.3 GB/s.
PyTorch's `cudaHostRegister` path pinned faster but the host tier's in-place reads by kernels
were slower over it (`kvtier.engine.host_pin`'s docstring). One guess for both: registered
malloc memory is mapped in 4 KiB pages, which the kernel pins one by one and the GPU's MMU maps
one by one. This script pins `--total` bytes in `--piece` pieces each way:

- `alloc`: `torch.empty(pin_memory=True)` (PyTorch's cached `cudaHostAlloc`);
- `register`: an anonymous mapping with MADV_NOHUGEPAGE, its pages faulted in by `--threads`
  threads, then `cudaHostRegister` (portable, mapped);
- `register_huge`: the same with MADV_HUGEPAGE on a 2 MiB-aligned mapping (transparent huge
  pages where the kernel allows them: `thp` in the results says what it allows).

and for each measures `pin_gb_per_s` (the whole making), `seq_read_gb_per_s` (a device view of
one piece copied into device memory by a kernel) and `rows_read_gb_per_s` (random 256-byte rows,
one key row of a 128-dim bf16 head, gathered from a device view of one piece: stage 0's reads of
host keys). CUDA only.

    python bench/host_memory.py --total 8GiB --piece 1GiB --name host_memory
"""

from __future__ import annotations

import argparse
import mmap
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import write_results
from kvtier.units import parse_size

MODES = ("alloc", "register", "register_huge")
HUGE = 2 << 20  # a transparent huge page
ROW = 256  # bytes of a gathered row


def thp() -> dict[str, str]:
    """The kernel's transparent-huge-page settings ("[madvise]" marks the one in force)."""
    out = {}
    for name in ("enabled", "defrag"):
        try:
            out[name] = Path(f"/sys/kernel/mm/transparent_hugepage/{name}").read_text().strip()
        except OSError as e:
            out[name] = f"unreadable: {e}"
    return out


class Registered:
    """`nbytes` of an anonymous mapping, faulted in by `threads` threads and `cudaHostRegister`ed;
    `huge`: MADV_HUGEPAGE on a 2 MiB-aligned start, else MADV_NOHUGEPAGE."""

    def __init__(self, nbytes: int, threads: int, huge: bool) -> None:
        import torch

        self.map = mmap.mmap(-1, nbytes + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        whole = torch.frombuffer(self.map, dtype=torch.uint8)
        skip = (-whole.data_ptr()) % HUGE
        self.map.madvise(mmap.MADV_HUGEPAGE if huge else mmap.MADV_NOHUGEPAGE)
        self.tensor = whole[skip : skip + nbytes]
        parts = self.tensor.chunk(threads)
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(lambda p: p.fill_(0), parts))
        flags = 1 | 2  # cudaHostRegisterPortable | cudaHostRegisterMapped
        rc = int(torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), nbytes, flags))
        if rc != 0:
            raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed: cudaError {rc}")

    def close(self) -> None:
        import torch

        torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
        del self.tensor
        self.map.close()


def huge_share(t: Any) -> float | None:
    """The share of `t`'s pages that are huge pages, from /proc/self/smaps (None: unreadable)."""
    lo = t.data_ptr()
    try:
        text = Path("/proc/self/smaps").read_text()
    except OSError:
        return None
    rss = anon_huge = 0
    inside = False
    for line in text.splitlines():
        head = line.split()[0] if line else ""
        if "-" in head and not head.endswith(":"):
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= lo < end
        elif inside and head == "Rss:":
            rss = int(line.split()[1])
        elif inside and head == "AnonHugePages:":
            anon_huge = int(line.split()[1])
    return round(anon_huge / rss, 3) if rss else None


def reads(piece: Any, dev: Any) -> dict[str, float]:
    """In-place read rates of one pinned piece through its device view."""
    import torch

    from kvtier.kv.mapped import device_view

    view = device_view(piece, dev)
    out = torch.empty_like(view)
    rows = view.view(-1, ROW)
    gen = torch.Generator(device=dev).manual_seed(0)
    idx = torch.randint(0, rows.shape[0], (1 << 20,), device=dev, generator=gen)

    def clock(fn: Any, nbytes: int) -> float:
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        return round(3 * nbytes / (time.perf_counter() - t0) / 1e9, 2)

    return {
        "seq_read_gb_per_s": clock(lambda: out.copy_(view), view.numel()),
        "rows_read_gb_per_s": clock(lambda: rows.index_select(0, idx), idx.numel() * ROW),
    }


def measure(mode: str, piece: int, total: int, threads: int) -> dict[str, Any]:
    import torch

    dev = torch.device("cuda")
    torch.cuda.synchronize()
    count = max(1, total // piece)
    t0 = time.perf_counter()
    if mode == "alloc":
        held: list[Any] = [torch.empty(piece, dtype=torch.uint8, pin_memory=True) for _ in range(count)]
        pieces = held
    else:
        held = [Registered(piece, threads, huge=mode == "register_huge") for _ in range(count)]
        pieces = [h.tensor for h in held]
    made = time.perf_counter() - t0
    row = {
        "mode": mode,
        "threads": threads if mode != "alloc" else 1,
        "pinned_bytes": count * piece,
        "seconds": round(made, 3),
        "pin_gb_per_s": round(count * piece / made / 1e9, 2),
        "huge_share": huge_share(pieces[0]),
        **reads(pieces[0], dev),
    }
    del pieces
    for h in held:
        if isinstance(h, Registered):
            h.close()
    del held
    torch._C._host_emptyCache()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--total", default="8GiB", help="bytes pinned each way")
    ap.add_argument("--piece", default="1GiB", help="bytes a piece (the host tier's slabs)")
    ap.add_argument("--threads", type=int, default=8, help="threads that fault a registered piece in")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma list of: {', '.join(MODES)}")
    ap.add_argument("--name", default="host_memory")
    args = ap.parse_args()
    piece, total = parse_size(args.piece, "--piece"), parse_size(args.total, "--total")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or set(modes) - set(MODES):
        sys.exit(f"--modes {args.modes!r}: use some of {', '.join(MODES)}")
    if args.threads < 1 or piece % ROW:
        sys.exit("--threads must be 1 or more and --piece a multiple of 256 bytes")
    import torch

    if not torch.cuda.is_available():
        sys.exit("host_memory.py measures CUDA's pinned host memory: run it on a machine with a GPU")
    rows = []
    for mode in modes:
        rows.append(measure(mode, piece, total, args.threads))
        print(rows[-1], flush=True)
    print("results:", write_results(args.name, {"piece": piece, "total": total, "thp": thp(), "rows": rows}))


if __name__ == "__main__":
    main()
