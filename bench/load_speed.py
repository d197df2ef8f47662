"""How long a model's safetensors take to load onto the GPU, each `KVTIER_LOAD` way.

Loading Llama-3.1-8B's 16 GB took 11.0-15.8 s of each 512K CLI run's ~18-20 s before its setup
on an H100 host (`phases_s` of bench/results/hip_cli_speed_512k_*_{alloc,huge}.json), ~1-1.5
GB/s. Each row here loads the folder in a fresh process (`load_safetensors_folder`, bf16, CUDA)
under one mode, the modes alternating for `--rounds` rounds so that neither always finds the
page cache the other filled; the first row may read from disk. A row: `seconds`, `gb_per_s`, and
whether its parameters equal the first row's (a checksum of every parameter).

    python bench/load_speed.py                     # the 8B folder hip_cli_speed.py writes
    python bench/load_speed.py --folder /models/x --rounds 3 --name load_speed_x
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import write_results
from kvtier.loading.staged import LOAD_MODES


def child(folder: Path) -> dict[str, Any]:
    """One load in this process: its seconds and a checksum of the parameters."""
    import torch

    from kvtier.loading.weights import load_safetensors_folder

    dev = torch.device("cuda")
    torch.cuda.init()
    t0 = time.perf_counter()
    model, _ = load_safetensors_folder(folder, dev, torch.bfloat16)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    total = torch.zeros((), dtype=torch.float64, device=dev)
    for i, p in enumerate(model.parameters()):
        total += p.double().sum() * (i + 1)
    return {"seconds": round(seconds, 3), "checksum": float(total)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--folder", type=Path, default=Path("/tmp/kvtier-smoke/llama-3.1-8b-random"))
    ap.add_argument("--modes", default=",".join(LOAD_MODES), help=f"comma list of: {', '.join(LOAD_MODES)}")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--name", default="load_speed")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.folder)))
        return
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or set(modes) - set(LOAD_MODES) or args.rounds < 1:
        sys.exit(f"--modes {args.modes!r}: use some of {', '.join(LOAD_MODES)}; --rounds 1 or more")
    files = sorted(args.folder.glob("*.safetensors"))
    if not files:
        sys.exit(f"{args.folder} holds no *.safetensors (hip_cli_speed.py writes the 8B folder there)")
    nbytes = sum(f.stat().st_size for f in files)
    rows: list[dict[str, Any]] = []
    for r in range(args.rounds):
        for mode in modes:
            env = {**os.environ, "KVTIER_LOAD": mode}
            cmd = [sys.executable, __file__, "--child", "--folder", str(args.folder)]
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
            if done.returncode:
                row: dict[str, Any] = {"error": done.stderr.strip().splitlines()[-3:]}
            else:
                row = json.loads(done.stdout.strip().splitlines()[-1])
                row["gb_per_s"] = round(nbytes / row["seconds"] / 1e9, 2)
                row["same_as_first"] = row["checksum"] == next(
                    (x["checksum"] for x in rows if "checksum" in x), row["checksum"]
                )
            rows.append({"round": r, "mode": mode, **row})
            print(rows[-1], flush=True)
    result = {"folder": str(args.folder), "bytes": nbytes, "shards": len(files), "rows": rows}
    print("results:", write_results(args.name, result))


if __name__ == "__main__":
    main()
