"""HiP prefill's two kernels alone, at the shapes of one 512K slice, under launch variants.

One prefill chunk of the llama-3-8b preset under the planned 24 GB HiP store runs, per slice
(4 KV heads x 4 query heads each, ~528K keys), the pruning of every 64-query block
(`run_block_stages`: three Triton bisection launches plus top-k and sorts) and one block-sparse
attention launch (`attend_blocks_triton`, keys rotated in the kernel). The whole-model profile
(`hip_offload.py --profile`) shows which dominates; this script times each alone, on random
keys, for several launch configurations, and checks every variant selects and attends the same:

    python bench/hip_kernels.py                      # on the H200; table last, JSON under $OUT
    python bench/hip_kernels.py --old-bisect F.py    # also time another bisect module (A/B)
    python bench/hip_kernels.py --smoke              # CPU interpreter, tiny shapes (checks the script)
    python bench/hip_kernels.py --exact-chunk 8      # also the fine stages scored on every key

Slice-level times x 64 slices = the chunk's kernel time (e.g. 0.72 s of bisection for a 16K
chunk at 512K before the paired probes).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
if "--smoke" in sys.argv:  # before anything imports triton
    os.environ["TRITON_INTERPRET"] = "1"

import torch

from kvtier.units import parse_count


class Rows(list[dict[str, Any]]):
    """The rows so far, each printed and the results file rewritten as it comes, so a run the
    device call's limit cuts keeps what it measured."""

    def __init__(self, save: Callable[[list[dict[str, Any]]], object]) -> None:
        super().__init__()
        self.save = save

    def append(self, row: dict[str, Any]) -> None:
        super().append(row)
        print(row, flush=True)
        self.save(list(self))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", default="512K")
    ap.add_argument("--chunk", type=int, default=16384, help="prefill chunk (queries) per slice")
    ap.add_argument("--heads", type=int, default=4, help="KV heads per slice")
    ap.add_argument("--old-bisect", default="", help="another triton_bisect.py to time against")
    ap.add_argument("--model", default="llama-3-8b", help="preset whose head shapes to use")
    ap.add_argument("--preset", default="fast", help="HiP preset (budgets, window, chunks)")
    ap.add_argument(
        "--head-score",
        default=None,
        choices=("max", "softmax"),
        help="replace the preset's head score (lean with max: what its per-row maxima cost)",
    )
    ap.add_argument(
        "--exact-chunk",
        type=int,
        default=0,
        help="also time the pruning with HipConfig.exact_chunk=N (stages of chunks <= N scored "
        "on every key) and how much of the bisection's selection it keeps",
    )
    ap.add_argument(
        "--landmarks",
        action="store_true",
        help="also time stage 0 on landmark keys (HipConfig.stage0_landmarks; random landmarks: "
        "its speed, not its selection), its stages, the chunk's landmark key scores, and profile them",
    )
    ap.add_argument(
        "--strides",
        default=None,
        help="replace the preset's query strides, a stage each joined by '/' (as --hip-strides: 4/4/2 "
        "pools the last stage's queries in pairs)",
    )
    ap.add_argument(
        "--bisect-sweep",
        action="store_true",
        help="also time each stage with the bisection's chunks a program and warps swept (128 and "
        "256 chunks, 4 and 16 warps: the sweep above tries 16-64 and 2)",
    )
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--name", default="hip_kernels")
    args = ap.parse_args()
    from bench.common import write_results
    from kvtier.loading.presets import preset_config
    from kvtier.model.rope import Rotary
    from kvtier.sparse import HIP_PRESETS, triton_attn, triton_bisect
    from kvtier.sparse import prefill as prefill_module
    from kvtier.sparse.prefill import attended_prefix, run_block_stages
    from kvtier.sparse.prune_memory import bisect_block_c
    from kvtier.sparse.rope_ext import RopeTable

    dev = torch.device("cpu" if args.smoke else "cuda")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    cfg = preset_config(args.model)
    hip = HIP_PRESETS[args.preset]
    if args.head_score is not None:
        hip = replace(hip, head_score=args.head_score)
    if args.strides is not None:
        hip = replace(hip, query_strides=tuple(int(x) for x in args.strides.split("/")))
    r = cfg.num_heads // cfg.num_kv_heads
    past = 0 if args.context == "0" else parse_count(args.context)  # 0: a prompt's first chunk
    context, chunk, g, d = past, args.chunk, args.heads, cfg.head_dim
    if args.smoke:
        context, chunk, g = (2048 if args.context == "512K" else past), 128, 2
        hip = replace(hip, chunk_sizes=(32, 16, 8), budgets=(512, 256, 128), sink=16, window=64)
    s = context + chunk
    gen = torch.Generator(device=dev).manual_seed(0)
    kv = torch.randn(s, 2, g, d, device=dev, dtype=dtype, generator=gen)  # [S, 2, G, D]
    b = chunk // hip.block_q
    q = torch.randn(b, hip.block_q, g * r, d, device=dev, dtype=dtype, generator=gen)
    pos = (context + torch.arange(chunk, device=dev)).view(b, hip.block_q)
    w0 = (pos[:, 0] - hip.window + 1).clamp(min=hip.sink)
    table = RopeTable(Rotary(cfg.rope, d, dev))

    def prune(
        exact_chunk: int = 0, stages: int | None = None, group: int = 1, landmarks: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The pruning of every block: all stages, or the first `stages` of them; stage 0 per
        `group` blocks (`HipConfig.stage0_block_q`) or on `landmarks` [C, G]."""
        n = len(hip.chunk_sizes) if stages is None else stages
        return run_block_stages(
            q, pos, kv[:, 0], hip.sink, w0, chunk_sizes=hip.chunk_sizes[:n], budgets=hip.budgets[:n],
            strides=hip.query_strides[:n], mode="relative", rotary=table, window=hip.window, triton=True,
            head_score=hip.head_score, exact_chunk=exact_chunk, stage0_group=group, landmarks=landmarks,
        )  # fmt: skip

    def shared(sel: torch.Tensor) -> float:
        """The share of the reference selection's keys that `sel` keeps too."""
        same = [
            len(set(a[a >= 0].tolist()) & set(e[e >= 0].tolist())) for a, e in zip(ref_sel, sel, strict=True)
        ]
        return round(sum(same) / max(1, int((ref_sel >= 0).sum())), 4)

    sel, _ = prune()
    # as prefill builds it: a block that ends among the sinks keeps only those before its end
    # (unmasked, the first blocks of a prompt's chunk attended keys past their queries: NaN
    # rows under the interpreter, an illegal memory access on the H100 in group 112)
    prefix = attended_prefix(sel, hip.sink, pos[:, -1] + 1)
    # keys the attention reads, all blocks: prefix entries and window (causal halves aside)
    keys = int((prefix >= 0).sum()) + int((pos[:, -1] + 1 - w0.clamp(max=pos[:, -1] + 1)).sum())
    attend_flop = 4 * keys * hip.block_q * g * r * d

    def attend() -> torch.Tensor:
        return triton_attn.attend_blocks_triton(
            q, pos, kv, prefix, w0, rotary=table, mode="streaming", limit=s
        )

    def clock(fn: Any, reps: int) -> float:
        fn()  # compile, warm
        if dev.type == "cuda":
            torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            if dev.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        return sorted(times)[len(times) // 2]

    reps = 1 if args.smoke else 5
    header = {
        "model": args.model,
        "context": context,
        "chunk": chunk,
        "kv_heads_per_slice": g,
        "preset": args.preset,
        "query_strides": list(hip.query_strides),
        "attend_keys": keys,
        "attend_flop": attend_flop,
    }
    rows = Rows(lambda done: write_results(args.name, {**header, "rows": done}))
    ref_sel = sel
    old = None
    if args.old_bisect:
        spec = importlib.util.spec_from_file_location("old_bisect", args.old_bisect)
        assert spec and spec.loader
        old = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(old)
    current = triton_bisect.bisect_triton
    variants = [(m, c, w) for m in ("pair", "old") for c in (64, 32, 16) for w in (None, 2)]
    for name, block_c, warps in variants if not args.smoke else [("pair", 32, None), ("pair", 16, 2)]:
        if name == "old" and (old is None or warps is not None):
            continue
        module = old if name == "old" else triton_bisect
        module.BLOCK_C, module.NUM_WARPS = block_c, warps
        triton_bisect.bisect_triton = module.bisect_triton  # prune_blocks imports it at call time
        prefill_module.FUSED_LSE = name != "old"  # an older file's kernel writes no logsumexp parts
        t = clock(prune, reps)
        same = bool(torch.equal(prune()[0], ref_sel))
        variant = f"{name} block_c={block_c} warps={warps}"
        rows.append({"kernel": "prune", "variant": variant, "s": t, "same": same})
    triton_bisect.bisect_triton = current
    triton_bisect.BLOCK_C, triton_bisect.NUM_WARPS = None, None
    bc = bisect_block_c(per_row=hip.head_score == "softmax")  # the default's
    prefill_module.FUSED_LSE = True
    if hip.head_score == "softmax":  # the head score's two Triton passes, and its torch passes
        prefill_module.FUSED_LSE = False
        t = clock(prune, reps)
        same = bool(torch.equal(prune()[0], ref_sel))
        prefill_module.FUSED_LSE = True
        variant = "pair block_c=32, two-pass head score"
        rows.append({"kernel": "prune", "variant": variant, "s": t, "same": same})
        prefill_module.TRITON_HEAD_SCORE = False
        t = clock(prune, reps)
        same = bool(torch.equal(prune()[0], ref_sel))
        prefill_module.TRITON_HEAD_SCORE = True
        rows.append({"kernel": "prune", "variant": "pair block_c=32, torch head score", "s": t, "same": same})
    # each stage's share: the first n stages timed, for each n (a stage's time is the difference)
    upto = [clock(lambda n=n: prune(stages=n), reps) for n in range(1, len(hip.chunk_sizes) + 1)]
    stage_s = [round(t - p, 6) for t, p in zip(upto, [0.0, *upto[:-1]], strict=True)]
    rows.append(
        {
            "kernel": "prune stages",
            "variant": f"pair block_c={bc}",
            "first_n_stages_s": upto,
            "stage_s": stage_s,
        }
    )
    sweep = [(128, None), (256, None), (64, 4), (64, 16), (128, 16)]
    for block_c, warps in sweep if args.bisect_sweep else []:
        triton_bisect.BLOCK_C, triton_bisect.NUM_WARPS = block_c, warps
        upto = [clock(lambda n=n: prune(stages=n), reps) for n in range(1, len(hip.chunk_sizes) + 1)]
        stage_s = [round(t - p, 6) for t, p in zip(upto, [0.0, *upto[:-1]], strict=True)]
        same = bool(torch.equal(prune()[0], ref_sel))
        variant = f"block_c={block_c} warps={warps}"
        row = {"kernel": "prune stages", "variant": variant, "stage_s": stage_s, "s": upto[-1]}
        rows.append({**row, "same": same})
    triton_bisect.BLOCK_C, triton_bisect.NUM_WARPS = None, None
    # fine stages on every key, and stage 0 once per group of blocks: each one's time and the
    # share of the selection it keeps
    changed = (
        [(f"exact_chunk={args.exact_chunk}", {"exact_chunk": args.exact_chunk})] if args.exact_chunk else []
    )
    group = next(g for g in (4, 2, 1) if b % g == 0)  # 4 (2 on the smoke run's 2 blocks)
    changed += [(f"stage 0 per {group} blocks", {"group": group})] if group > 1 else []
    for what, kw in changed:
        t = clock(lambda kw=kw: prune(**kw), reps)
        kept = shared(prune(**kw)[0])
        rows.append(
            {
                "kernel": "prune",
                "variant": f"pair block_c={bc}, {what}",
                "s": t,
                "same": kept == 1.0,
                "shared": kept,
            }
        )
    if args.landmarks:
        landmark_rows(rows, prune, clock, reps, q, kv, table, hip, context, dev)
    if args.exact_chunk and dev.type == "cuda":  # the exact kernel's chunks a program
        from kvtier.sparse import triton_chunk_max

        ref_exact = prune(args.exact_chunk)[0]
        for whole, block_c in ((False, 64), (False, 128), (False, 256), (True, 32), (True, 64), (True, 128)):
            triton_chunk_max.BLOCK_C, triton_chunk_max.WHOLE_ROWS = block_c, whole
            t = clock(lambda: prune(args.exact_chunk), reps)
            same = bool(torch.equal(prune(args.exact_chunk)[0], ref_exact))
            variant = f"pair block_c={bc}, exact_chunk={args.exact_chunk} with {block_c} chunks a program"
            variant += ", a head's rows in one tile" if whole else ""
            rows.append({"kernel": "prune", "variant": variant, "s": t, "same": same})
            triton_chunk_max.BLOCK_C, triton_chunk_max.WHOLE_ROWS = 32, False
    for exact in sorted({0, args.exact_chunk}) if dev.type == "cuda" else ():  # kernel by kernel
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            prune(exact)
            torch.cuda.synchronize()
        top = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:12]
        ms = {e.key[:80]: e.device_time_total / 1e3 for e in top}
        rows.append(
            {"kernel": "prune profile" + (f" exact_chunk={exact}" if exact else ""), "top_kernels_ms": ms}
        )
    ref_out = attend()
    tiles = [None, (128, 32, 4, 3), (128, 32, 8, 3), (128, 16, 4, 3), (128, 32, 4, 2), (256, 32, 8, 2)]
    tiles += [(256, 16, 8, 2), (256, 32, 8, 3), (128, 64, 8, 2)]
    if d <= 64:  # small heads (SmolLM2): wider key tiles and 64-row programs too
        tiles += [(256, 64, 8, 2), (256, 64, 8, 3), (64, 64, 4, 3), (128, 128, 8, 2), (256, 128, 8, 2)]
    for tile in tiles if not args.smoke else [None, (32, 32, 4, 1)]:
        triton_attn.TILES = tile
        t = clock(attend, reps)
        err = (attend().float() - ref_out.float()).abs().max().item()
        row = {"kernel": "attend", "variant": f"tiles={tile}", "s": t, "max_abs_diff": err}
        rows.append({**row, "tflop_per_s": round(attend_flop / t / 1e12, 2)})
    triton_attn.TILES = None
    path = write_results(args.name, {**header, "rows": rows})
    print(f"\nresults: {path}\n{'kernel':>7} {'variant':>40} {'ms/slice':>9} {'x64 slices s':>12}  check")
    for row in rows:
        if "s" not in row:
            continue
        check = row.get("same", row.get("max_abs_diff"))
        print(f"{row['kernel']:>7} {row['variant']:>40} {row['s'] * 1e3:9.2f} {row['s'] * 64:12.3f}  {check}")


def landmark_rows(
    rows: list[dict[str, Any]],
    prune: Any,
    clock: Any,
    reps: int,
    q: torch.Tensor,
    kv: torch.Tensor,
    table: Any,
    hip: Any,
    context: int,
    dev: torch.device,
) -> None:
    """Rows for stage 0 on landmark keys (`kvtier.sparse.landmarks`): the pruning with a random
    landmark in every stage-0 chunk of the context (its cost; which chunks it keeps is the
    quality runs' question), its stages one by one, the chunk's key scores (`key_scores`, what
    each prefill chunk adds), and on CUDA the kernels of both."""
    from kvtier.sparse.landmarks import key_scores

    s, g = kv.shape[0], kv.shape[2]
    c0 = hip.chunk_sizes[0]
    n_chunks = -(-(s - hip.sink) // c0)
    gen = torch.Generator(device=dev).manual_seed(1)
    offs = torch.randint(0, c0, (n_chunks, g), device=dev, generator=gen)
    marks = (hip.sink + torch.arange(n_chunks, device=dev)[:, None] * c0 + offs).clamp(max=s - 1)
    t = clock(lambda: prune(landmarks=marks), reps)
    rows.append({"kernel": "prune", "variant": "pair, stage 0 on landmarks", "s": t})
    if dev.type == "cuda":  # the A/B of the landmarks' kernel against torch's float32 products
        from kvtier.sparse import prefill

        ref = prune(landmarks=marks)[0]
        prefill.LANDMARK_TRITON = False
        t = clock(lambda: prune(landmarks=marks), reps)
        same = bool(torch.equal(prune(landmarks=marks)[0], ref))
        prefill.LANDMARK_TRITON = True
        rows.append({"kernel": "prune", "variant": "landmarks by torch products", "s": t, "same": same})
    upto = [
        clock(lambda n=n: prune(stages=n, landmarks=marks), reps) for n in range(1, len(hip.chunk_sizes) + 1)
    ]
    stage_s = [round(t - p, 6) for t, p in zip(upto, [0.0, *upto[:-1]], strict=True)]
    rows.append(
        {
            "kernel": "prune stages",
            "variant": "stage 0 on landmarks",
            "first_n_stages_s": upto,
            "stage_s": stage_s,
        }
    )
    qs = q.reshape(-1, q.shape[2], q.shape[3])  # [T, H_q, D]: the chunk's queries
    keys = kv[context:, 0]  # [T, G, D]
    t = clock(lambda: key_scores(qs, keys, context, table), reps)
    rows.append({"kernel": "landmark key scores", "variant": f"{qs.shape[0]} queries", "s": t})
    if dev.type != "cuda":
        return
    t = clock(lambda: key_scores(qs, keys, context, table, triton=True), reps)
    diff = key_scores(qs, keys, context, table, triton=True) - key_scores(qs, keys, context, table)
    rows.append(
        {
            "kernel": "landmark key scores",
            "variant": f"{qs.shape[0]} queries, Triton",
            "s": t,
            "max_abs_diff": diff.abs().max().item(),
        }
    )
    from torch.profiler import ProfilerActivity, profile

    for what, fn in (
        ("prune on landmarks", lambda: prune(landmarks=marks)),
        ("key scores", lambda: key_scores(qs, keys, context, table)),
        ("key scores by Triton", lambda: key_scores(qs, keys, context, table, triton=True)),
    ):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        top = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:12]
        rows.append(
            {
                "kernel": f"{what} profile",
                "top_kernels_ms": {e.key[:80]: e.device_time_total / 1e3 for e in top},
            }
        )


if __name__ == "__main__":
    main()
