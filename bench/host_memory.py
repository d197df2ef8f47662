"""How fast pinned host memory is made three ways, and how fast kernels read each in place.

A 512K store pins ~68 GB of host memory before its prefill: ~30 s on an H100 host through
PyTorch's `cudaHostAlloc` (`setup_s` of bench/results/hip_cli_speed_512k_*.json), ~2.3 GB/s.
PyTorch's `cudaHostRegister` path pinned faster but the host tier's in-place reads by kernels
were slower over it (`kvtier.engine.host_pin`'s docstring). One guess for both: registered
malloc memory is mapped in 4 KiB pages, which the kernel pins one by one and the GPU's MMU maps
one by one. This script pins `--total` bytes in `--piece` pieces each way:

- `alloc`: `torch.empty(pin_memory=True)` (PyTorch's cached `cudaHostAlloc`);
- `register`: `torch.zeros` (its pages faulted in on torch's threads), then `cudaHostRegister`,
  as KVTIER_HIDDEN_PIN=register's pieces;
- `register_huge`: an anonymous 2 MiB-aligned mapping with MADV_HUGEPAGE, filled the same way,
  registered portable and mapped, as KVTIER_HOST_PIN=huge's slabs (`kvtier.kv.host_register`;
  transparent huge pages where the kernel allows them: `thp` and `huge_share` say).

and for each measures `pin_gb_per_s` (the whole making), `seq_read_gb_per_s` (a device view of
one piece copied into device memory by a kernel) and `rows_read_gb_per_s` (random 256-byte rows,
one key row of a 128-dim bf16 head, gathered from a device view of one piece: stage 0's reads of
host keys). CUDA only.

    python bench/host_memory.py --total 8GiB --piece 1GiB --name host_memory
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import write_results
from kvtier.units import parse_size

MODES = ("alloc", "register", "register_huge")
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


def measure(mode: str, piece: int, total: int) -> dict[str, Any]:
    import torch

    from kvtier.kv.host_register import registered_empty, unregister

    dev = torch.device("cuda")
    torch.cuda.synchronize()
    count = max(1, total // piece)
    t0 = time.perf_counter()
    if mode == "alloc":
        pieces = [torch.empty(piece, dtype=torch.uint8, pin_memory=True) for _ in range(count)]
    else:
        pieces = [registered_empty((piece,), torch.uint8, huge=mode == "register_huge") for _ in range(count)]
    made = time.perf_counter() - t0
    row = {
        "mode": mode,
        "torch_threads": torch.get_num_threads(),
        "pinned_bytes": count * piece,
        "seconds": round(made, 3),
        "pin_gb_per_s": round(count * piece / made / 1e9, 2),
        "huge_share": huge_share(pieces[0]),
        **reads(pieces[0], dev),
    }
    if mode != "alloc":
        for p in pieces:
            unregister(p)
    del pieces
    torch._C._host_emptyCache()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--total", default="8GiB", help="bytes pinned each way")
    ap.add_argument("--piece", default="1GiB", help="bytes a piece (the host tier's slabs)")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma list of: {', '.join(MODES)}")
    ap.add_argument("--name", default="host_memory")
    args = ap.parse_args()
    piece, total = parse_size(args.piece, "--piece"), parse_size(args.total, "--total")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or set(modes) - set(MODES):
        sys.exit(f"--modes {args.modes!r}: use some of {', '.join(MODES)}")
    if piece % ROW:
        sys.exit(f"--piece must be a multiple of {ROW} bytes")
    import torch

    if not torch.cuda.is_available():
        sys.exit("host_memory.py measures CUDA's pinned host memory: run it on a machine with a GPU")
    rows = []
    for mode in modes:
        rows.append(measure(mode, piece, total))
        print(rows[-1], flush=True)
    print("results:", write_results(args.name, {"piece": piece, "total": total, "thp": thp(), "rows": rows}))


if __name__ == "__main__":
    main()
