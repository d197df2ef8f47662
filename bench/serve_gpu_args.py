"""The command line of `bench/serve_gpu.py`: the engine's settings (as `kvtier serve` takes
them), the cases and their sizes, and the mixed and prefix cases' own options."""

from __future__ import annotations

import argparse

from bench.serve_cases import CASES
from kvtier.serve.engine import ServeConfig
from kvtier.units import parse_count


def parser(description: str) -> argparse.ArgumentParser:
    """`bench/serve_gpu.py`'s options; `description`: the script's first docstring line."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument(
        "--model", default="llama-3.1-8b", help="preset or HF folder (default: Llama-3.1-8B shapes)"
    )
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    ap.add_argument("--gpu-memory", default=None, help="the server's GPU budget (default: the whole GPU)")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument(
        "--num-pages", type=int, default=None, help="the page pool (default: what the budget leaves)"
    )
    ap.add_argument("--no-graphs", action="store_true", help="decode steps eagerly (no CUDA graphs)")
    ap.add_argument("--no-fuse", action="store_true", help="separate q/k/v and gate/up matmuls")
    ap.add_argument(
        "--tiered-lookahead-layers",
        type=int,
        default=ServeConfig.tiered_lookahead_layers,
        help="how far a tiered run's launcher may run ahead of the device (0: unpaced)",
    )
    ap.add_argument(
        "--tiered-share",
        type=float,
        default=ServeConfig.tiered_share,
        help="share of the page pool tiered runs may borrow for their buffers (0: the reserve only)",
    )
    ap.add_argument(
        "--offload-reserve",
        default=None,
        help="GPU memory kept for requests over stores of their own (as kvtier serve's; default: "
        "a quarter of the pool's room, at most 4 GiB)",
    )
    ap.add_argument(
        "--tiered-keep-tokens",
        type=int,
        default=ServeConfig.tiered_keep_tokens,
        help="tokens per --max-num-seqs sequence the batch keeps before tiered runs may borrow pages",
    )
    ap.add_argument(
        "--tiered-release-after-prefill",
        action="store_true",
        help="free the allocator's unused cached blocks once a tiered run's prefill ends",
    )
    ap.add_argument("--long-tokens", type=parse_count, default=256 * 1024, help="mixed: the long prompt")
    ap.add_argument("--long-new-tokens", type=int, default=16, help="mixed: the long request's new tokens")
    ap.add_argument(
        "--long-method",
        default=None,
        help="mixed: a method the long request names, e.g. hip or quest,kv_budget=2k (default: lossless)",
    )
    ap.add_argument("--pcie-gbps", type=float, default=54.8, help="mixed: the host->GPU rate of the floor")
    ap.add_argument(
        "--mixed-timeout", type=float, default=240.0, help="mixed: seconds to wait for the long prefill"
    )
    ap.add_argument(
        "--mixed-profile-steps",
        default=None,
        help="mixed: FIRST,LAST batch steps whose device ops are tabled (the shorts join at 0); "
        "off by default, as the profiler slows the steps it records",
    )
    ap.add_argument(
        "--switch-interval",
        type=float,
        default=None,
        help="the interpreter's thread switch interval in seconds (sys.setswitchinterval; "
        "Python's default 0.005): how long a thread may wait for the GIL the launcher holds",
    )
    ap.add_argument(
        "--trace", action="store_true", help="mixed: those steps' Chrome trace to $OUT/<name>_trace.json.gz"
    )
    ap.add_argument("--prefix-tokens", type=parse_count, default=32 * 1024)
    ap.add_argument(
        "--prefix-pool-tokens",
        type=parse_count,
        default=None,
        help="prefix: a page pool of its own (default: the main pool if it holds the prefix and is "
        "under 3x it, else 2.5x --prefix-tokens)",
    )
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for a check of the script at small sizes")
    ap.add_argument("--small", action="store_true", help="cases at 1/16 of their prompt and new tokens")
    ap.add_argument(
        "--tokenizer",
        default="none",
        help="a preset has no tokenizer, so no step decodes text; 'embedded' (or a folder holding "
        "its tokenizer files) gives the engine SmolLM2's (ids past its vocabulary decode to "
        "nothing), as a served HF folder would have one",
    )
    ap.add_argument(
        "--decode-steps",
        type=int,
        default=ServeConfig.decode_steps,
        help="decode tokens a decode-only batch step computes before reading them back",
    )
    ap.add_argument(
        "--temperature", type=float, default=0.0, help="the c* cases' sampling (0: greedy, the default)"
    )
    ap.add_argument("--top-p", type=float, default=1.0, help="the c* cases' top_p (with --temperature)")
    ap.add_argument(
        "--no-freeze",
        action="store_true",
        help="leave the start-up heap to the garbage collector (kvtier serve freezes it)",
    )
    ap.add_argument("--name", default="serve_gpu")
    return ap
