"""How fast pinned host memory is made, and whether making it stalls the GPU.

A long prompt's tiered run pins its host tier before the prefill (64 GiB for Llama-3-8B at 512K)
and the prefill by layer pins its hidden states (4.3 GB, a 128 MiB piece a 16K chunk, during
layer 0, which took 4.06 s against 0.94 s for a later layer: bench/results/
hip_cli_speed_512k_fast_landmarks_triton.json). Each row here runs in a fresh process under a
PYTORCH_CUDA_ALLOC_CONF (pinned memory made by `cudaHostAlloc`, PyTorch's default, or by
`malloc` + `cudaHostRegister` with N threads touching the pages) and measures:

- `gb_per_s`: pinned bytes a second, `--total` made in `--piece` pieces with the GPU idle;
- `busy_stall_s`: how long one piece's allocation takes while the GPU runs ~`--busy-ms` of
  queued matmuls, against `idle_piece_s` with it idle: near busy-ms more, and the allocation
  waited for the device (the GPU then idles while the host pins);
- `beside_*`: a small GPU step repeated on another thread while up to 4 pieces are pinned
  (`steps_beside_pinning`): whether pinning holds other threads' CUDA calls.

    python bench/pin_rate.py            # bench/results/pin_rate.json (CUDA only)
    python bench/pin_rate.py --configs cudaHostAlloc --threads 1,8 --total 8GiB --piece 1GiB \
        --name pin_rate_threads       # the host tier's 1 GiB slabs, from 8 threads at once
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import write_results
from kvtier.units import parse_size

# name -> the pinned allocator's settings (beside the CLI's expandable_segments)
CONFIGS: dict[str, str] = {
    "cudaHostAlloc": "",
    "cudaHostRegister x8": "pinned_use_cuda_host_register:True,pinned_num_register_threads:8",
    "cudaHostRegister x16": "pinned_use_cuda_host_register:True,pinned_num_register_threads:16",
}


def measure(piece: int, total: int, busy_ms: float, threads: int = 1) -> dict[str, Any]:
    """One configuration's numbers (run inside its own process: the settings are read once),
    `total` pinned in pieces from `threads` threads at once."""
    import torch

    dev = torch.device("cuda")
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        a @ a
    torch.cuda.synchronize()
    per_matmul = (time.perf_counter() - t0) / 10
    count = max(1, total // piece)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:  # 1: one after another on one thread
        held = list(pool.map(lambda _: torch.empty(piece, dtype=torch.uint8, pin_memory=True), range(count)))
    made = time.perf_counter() - t0
    made_bytes = len(held) * piece
    t0 = time.perf_counter()
    held.append(torch.empty(piece, dtype=torch.uint8, pin_memory=True))
    idle_piece = time.perf_counter() - t0
    for _ in range(max(1, round(busy_ms / 1e3 / per_matmul))):
        a @ a
    t0 = time.perf_counter()
    held.append(torch.empty(piece, dtype=torch.uint8, pin_memory=True))
    busy_piece = time.perf_counter() - t0
    torch.cuda.synchronize()
    beside = steps_beside_pinning(piece, min(count, 4))
    return {
        **beside,
        "pinned_bytes": made_bytes,
        "seconds": round(made, 3),
        "gb_per_s": round(made_bytes / made / 1e9, 2),
        "idle_piece_s": round(idle_piece, 4),
        "busy_piece_s": round(busy_piece, 4),
        "busy_stall_s": round(busy_piece - idle_piece, 4),
        "matmul_ms": round(per_matmul * 1e3, 3),
    }


def steps_beside_pinning(piece: int, pieces: int) -> dict[str, Any]:
    """A GPU step (a 2048^2 matmul, then a host sync) repeated on a second thread, alone and
    then while this thread pins `pieces` pieces: whether pinning holds other threads' CUDA calls
    (a store's slabs pinned beside a running prefill; in the CLI a warm-up thread ended only as
    the setup's pinning did, hip_cli_speed_512k_fast_landmarks_layer_*_warm_pin8.json). A step's
    wall near a piece's pinning time while it pins: held."""
    import torch

    small = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
    walls: list[tuple[float, float]] = []  # (start, seconds)
    stop = threading.Event()

    def stepper() -> None:
        while not stop.is_set():
            t = time.perf_counter()
            small @ small
            torch.cuda.synchronize()
            walls.append((t, time.perf_counter() - t))

    thread = threading.Thread(target=stepper)
    thread.start()
    time.sleep(0.5)
    t0 = time.perf_counter()
    held = [torch.empty(piece, dtype=torch.uint8, pin_memory=True) for _ in range(pieces)]
    t1 = time.perf_counter()
    time.sleep(0.2)
    stop.set()
    thread.join()
    del held
    alone = sorted(w for t, w in walls if t + w <= t0)
    beside = sorted(w for t, w in walls if t < t1 and t + w > t0)  # overlapping the pinning
    return {
        "beside_pin_s": round(t1 - t0, 3),
        "beside_steps": len(beside),
        "beside_step_p50_s": round(beside[len(beside) // 2], 5) if beside else None,
        "beside_step_max_s": round(beside[-1], 4) if beside else None,
        "alone_step_p50_s": round(alone[len(alone) // 2], 5) if alone else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--piece", default="128MiB", help="bytes an allocation (a 16K chunk of hidden states)")
    ap.add_argument("--total", default="4GiB", help="bytes pinned a configuration")
    ap.add_argument("--busy-ms", type=float, default=300.0, help="GPU work queued before the busy allocation")
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"comma list of: {', '.join(CONFIGS)}")
    ap.add_argument(
        "--threads",
        default="1",
        help="comma list: threads that pin the pieces at once (1,8: each config twice)",
    )
    ap.add_argument("--name", default="pin_rate")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    piece, total = parse_size(args.piece, "--piece"), parse_size(args.total, "--total")
    if args.child is not None:
        print(json.dumps(measure(piece, total, args.busy_ms, int(args.threads))))
        return
    threads = [int(t) for t in args.threads.split(",") if t.strip()]
    if not threads or min(threads) < 1:
        sys.exit(f"--threads {args.threads!r}: give thread counts of 1 or more, e.g. 1,8")
    import torch

    if not torch.cuda.is_available():
        sys.exit("pin_rate.py measures CUDA's pinned memory: run it on a machine with a GPU")
    names = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in names if c not in CONFIGS]
    if unknown:
        sys.exit(f"--configs: unknown {unknown}; use some of {', '.join(CONFIGS)}")
    rows = []
    for name in names:
        conf = ",".join(x for x in ("expandable_segments:True", CONFIGS[name]) if x)
        env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": conf}
        for n in threads:
            cmd = [sys.executable, __file__, "--child", name, "--piece", args.piece, "--total", args.total]
            cmd += ["--busy-ms", str(args.busy_ms), "--threads", str(n)]
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
            if done.returncode:
                row: dict[str, Any] = {"error": done.stderr.strip().splitlines()[-1:]}
            else:
                row = json.loads(done.stdout.strip().splitlines()[-1])
            rows.append({"config": name, "alloc_conf": conf, "threads": n, **row})
            print(rows[-1], flush=True)
    print("results:", write_results(args.name, {"piece": piece, "total": total, "rows": rows}))


if __name__ == "__main__":
    main()
