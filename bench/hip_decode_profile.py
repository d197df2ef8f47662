"""Per-slice cost of HiP decode over offloaded KV, without the model (CPU or GPU).

Builds a store of `--layers` x `--kv-heads` / `--group` slices (offloaded, nothing resident),
fills `--context` tokens of synthetic KV, then times `--steps` decode steps through the store
directly (random q, k, v per layer), split into refresh steps (a slice streamed whole) and
cached steps (served from the GPU block cache). Counts host-device syncs of the cached steps as
the Python conversions of tensors (`item`, `tolist`, `__bool__`, `__int__`, `__index__`,
`nonzero`, `unique`). Then, over one more refresh interval, counts per slice and by the first
stage a step reruns (stage0/stage1/stage2/none) the torch operators (non-view aten ops: kernel
launches on a GPU) and the syncs (`OpCounter.syncs`: scalar reads, data-sized outputs, boolean
masks; plus `tolist`). On the CPU every tensor is a host tensor, so index arithmetic that runs
on host tensors on a GPU run (`PackedKV.read_runs_into`'s) counts as syncs there too.
`--kv-quant int4` packs the host KV (the 1M plan's). `--graphs` replays each layer's steps as
CUDA graphs (`KVTIER_HIP_GRAPHS=1`): those that rerun nothing, and with `--probe-scoring` those
that rerun stages 1..

`--profile` prints the cProfile of the steps of `--profile-steps` (cached: no stage reruns;
stage1/stage2: the steps whose first rerun stage is that one) and keeps its top lines in the
JSON; `--kernels` adds torch.profiler's device time per kernel over the same steps (the GPU's
side of them). Step times are also split by the first stage a step reruns, with each step's
H2D bytes (`--name` writes them to JSON). `--as-preset` runs the preset's own budgets
(default: `HipConfig.scaled` to the context, with the preset's refresh intervals).

    python bench/hip_decode_profile.py --context 32768 --steps 40
    python bench/hip_decode_profile.py --as-preset --preset lean --context 512K --layers 4 \
        --head-dim 128 --group 8 --cache-tokens 16384 --steps 34 --profile --kernels --profile-steps stage1
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time
from collections import Counter
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import torch
from torch.profiler import profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import KV_FILLS, fill_store, write_results
from bench.profiling import count_syncs, merged_kernels, run_profiled
from kvtier.kv.store import TieredKVStore
from kvtier.loading.presets import preset_config
from kvtier.methods.spec import parse_choice
from kvtier.planner.placement import KVPlan
from kvtier.sparse import HIP_PRESETS, HipConfig, HipKernel, cached_decode, decode_buffer, make_hip_kernel
from kvtier.sparse.graph_recorders import ReplayRecorder
from kvtier.sparse.opcount import OpCounter
from kvtier.units import parse_count


def build(
    layers: int,
    kv_heads: int,
    head_dim: int,
    context: int,
    steps: int,
    hip: HipConfig,
    device: torch.device,
    group: int = 1,
    kv_fill: str = "synthetic",
    kv_quant: str | None = None,
) -> tuple[TieredKVStore, HipKernel]:
    """An offloaded store of `context` synthetic tokens in slices of `group` KV heads, with a
    HiP kernel; `kv_quant` (e.g. "int4"): host KV packed by that method's codec."""
    base = preset_config("llama-3-8b")
    cfg = replace(base, num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim, num_heads=4 * kv_heads)
    overrides = {f.name: getattr(hip, f.name) for f in fields(HipConfig)}
    kernel, unrotated = make_hip_kernel(cfg, device, "default", **overrides)
    assert isinstance(kernel, HipKernel)
    plan = KVPlan(
        policy="head" if group < kv_heads else "layer",
        group_size=group,
        resident_slices=0,
        chunk_size=256,
        staging_buffers=2,
        staging_tokens=context + steps,
    )
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    store = TieredKVStore(
        cfg,
        plan,
        device=device,
        dtype=dtype,
        capacity=context + steps,
        kernel=kernel,
        rotate_keys=not unrotated,
        codec=parse_choice(kv_quant).codec() if kv_quant else None,
    )
    fill_store(store, context, kv_fill)
    return store, kernel


def step(store: TieredKVStore, layers: int, q: torch.Tensor, kv: torch.Tensor) -> None:
    """One decode step through every layer of the store."""
    store.begin_step(1)
    for layer in range(layers):
        store(layer, q, kv, kv)
    store.end_step()


STEP_KINDS = ("stage0", "stage1", "stage2", "none")


def first_due(i: int, refresh: tuple[int, ...]) -> int:
    """The first stage decode step i reruns (all at step 0), or len(refresh) for none: stage k
    reruns every refresh[k] steps (the kernel's schedule, `tests/test_hip.py`)."""
    return next((k for k, r in enumerate(refresh) if i % r == 0), len(refresh))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--context", type=parse_count, default=16384, help="tokens (16384, 512K)")
    ap.add_argument("--steps", type=int, default=34)
    ap.add_argument("--preset", default="fast", choices=tuple(HIP_PRESETS))
    ap.add_argument("--group", type=int, default=1, help="KV heads per slice (--kv-heads: whole layers)")
    ap.add_argument("--cache-tokens", type=int, default=None, help="block cache per slice, tokens")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument(
        "--profile-steps",
        default="cached",
        choices=("cached", "stage0", "stage1", "stage2"),
        help="which steps --profile/--kernels profile (stage0: its reruns after the first step, "
        "which also compiles)",
    )
    ap.add_argument("--kernels", action="store_true", help="device time per kernel (--profile-steps)")
    ap.add_argument("--as-preset", action="store_true", help="the preset's own budgets, not scaled")
    ap.add_argument("--kv-fill", default="synthetic", choices=KV_FILLS, help="benchmark KV (bench.common)")
    ap.add_argument("--name", default=None, help="write bench/results/NAME.json ($OUT when set)")
    ap.add_argument(
        "--prefill-chunk", type=int, default=0, help="also time one prefill chunk of this many tokens (last)"
    )
    ap.add_argument("--kv-quant", default=None, help="pack the host KV with this method's codec (int4, int8)")
    ap.add_argument(
        "--host-scoring", action="store_true", help="stage-0 reruns score keys read from the host"
    )
    ap.add_argument(
        "--probe-scoring",
        action="store_true",
        help="stage 0 scores the bisection's probes with Triton (HipConfig.probe_scoring; with "
        "--host-scoring read in place from host memory); on the CPU only under TRITON_INTERPRET=1",
    )
    ap.add_argument(
        "--slice-at-a-time",
        action="store_true",
        help="serve every decode step a slice at a time, as before the layer path "
        "(HipKernel.attend_cached_layer declines): the A/B of serving a layer's slices at once, "
        "in steps that rerun nothing and, with --probe-scoring, in those that rerun stages 1..",
    )
    ap.add_argument(
        "--graphs",
        action="store_true",
        help="KVTIER_HIP_GRAPHS=1: a layer's steps replay CUDA graphs (kvtier.sparse.decode_graph): "
        "those that rerun nothing and, with --probe-scoring, those that rerun stages 1..",
    )
    ap.add_argument(
        "--triton-buffers",
        action="store_true",
        help="on the CPU under TRITON_INTERPRET=1: decode buffers attended by their Triton kernels, "
        "as on CUDA (else torch's attention a buffer at a time)",
    )
    ap.add_argument(
        "--emulate-graphs",
        action="store_true",
        help="with --graphs and --triton-buffers: each graph's replay runs its body unseen by the "
        "operator count, which counts it as one launch: the host operators a graphed step leaves",
    )
    ap.add_argument(
        "--align-window",
        action="store_true",
        help="HipConfig.align_window: decode's window starts at a stage-0 chunk boundary (whole "
        "chunks: selections of one size, no partial chunk's sync)",
    )
    ap.add_argument(
        "--key-params",
        default="first",
        choices=("first", "per-probe"),
        help="stage 0 in place over KIVI rows: the rows' key minima and steps copied to the GPU "
        "first (the default) or read with every probe (triton_bisect.KEY_PARAMS_FIRST's A/B)",
    )
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seed", type=int, default=0, help="of the random queries and new rows")
    args = ap.parse_args()
    torch.manual_seed(args.seed)  # which chunks the stages keep depends on the queries
    # read when the kernel is made; without --graphs op by op (on CUDA the default replays them)
    os.environ["KVTIER_HIP_GRAPHS"] = "1" if args.graphs else "0"
    if args.key_params != "first":  # (triton_bisect needs Triton: imported only here)
        from kvtier.sparse import triton_bisect

        triton_bisect.KEY_PARAMS_FIRST = False
    if args.triton_buffers:
        if args.device != "cpu" or os.environ.get("TRITON_INTERPRET") != "1":
            sys.exit("--triton-buffers: on the CPU, under TRITON_INTERPRET=1 (CUDA takes that path anyway)")
        for module in (decode_buffer, cached_decode):
            module.buffer_kernel = lambda q: True  # type: ignore[attr-defined]
    if args.emulate_graphs and not (args.graphs and args.triton_buffers):
        sys.exit("--emulate-graphs: with --graphs and --triton-buffers")
    dev = torch.device(args.device)
    base = HIP_PRESETS[args.preset]
    if args.as_preset:
        hip = replace(base, cache_tokens=args.cache_tokens)
    else:
        hip = HipConfig.scaled(args.context, refresh=base.refresh, cache_tokens=args.cache_tokens)
    hip = replace(
        hip, host_scoring=args.host_scoring, probe_scoring=args.probe_scoring, align_window=args.align_window
    )
    # the op-counting interval and the prefill chunk run after the timed steps
    extra = args.steps + hip.refresh[0] + args.prefill_chunk
    shape = (args.layers, args.kv_heads, args.head_dim, args.context)
    store, kernel = build(*shape, extra, hip, dev, args.group, args.kv_fill, args.kv_quant)
    if args.slice_at_a_time:
        kernel.attend_cached_layer = lambda *_: None  # type: ignore[method-assign]
    if args.emulate_graphs:
        assert kernel._graphs is not None
        kernel._graphs.recorder = ReplayRecorder(unseen=True)
    dtype = store.layout.dtype
    q = torch.randn(1, 4 * args.kv_heads, args.head_dim, dtype=dtype, device=dev)
    kv = torch.randn(1, args.kv_heads, args.head_dim, dtype=dtype, device=dev)
    slices = args.layers * (args.kv_heads // args.group)
    times: dict[str, list[float]] = {"refresh": [], "cached": []}
    by_stage: dict[str, list[float]] = {}  # step times by the first stage the step reruns
    rows: list[dict[str, Any]] = []
    syncs: dict[str, int] = {}
    prof = cProfile.Profile()
    kernel_profs: list[profile] = []  # one a profiled step (--kernels)
    for i in range(args.steps):
        kind = STEP_KINDS[first_due(i, hip.refresh)]
        refresh = kind == "stage0"
        chosen = kind == args.profile_steps.replace("cached", "none")
        profiled = args.profile and chosen and (not refresh or i > 0)
        h2d, fetched = store.account.h2d_bytes, kernel.stats.cache.fetched_bytes
        t = time.perf_counter()
        if refresh and not profiled:
            step(store, args.layers, q, kv)
        else:
            with count_syncs(syncs if not refresh else {}):
                if profiled:
                    run_profiled(
                        lambda: step(store, args.layers, q, kv),
                        prof if args.profile else None,
                        kernel_profs if args.kernels else None,
                        dev.type == "cuda",
                    )
                else:
                    step(store, args.layers, q, kv)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t
        times["refresh" if refresh else "cached"].append(dt)
        by_stage.setdefault(kind, []).append(dt)
        rows.append({
            "step": i, "reruns_from": kind, "s": round(dt, 5), "h2d_bytes": store.account.h2d_bytes - h2d,
            "fetched_bytes": kernel.stats.cache.fetched_bytes - fetched,
        })  # fmt: skip
    # Operators and host conversions per slice, by the first stage a step reruns: one more
    # refresh interval (steps numbered on from the timed ones).
    ops = {kind: OpCounter(by_function=True) for kind in STEP_KINDS}
    kind_syncs: dict[str, dict[str, int]] = {kind: {} for kind in STEP_KINDS}
    kind_steps = dict.fromkeys(STEP_KINDS, 0)
    for i in range(args.steps, args.steps + hip.refresh[0]):
        kind = STEP_KINDS[first_due(i, hip.refresh)]
        kind_steps[kind] += 1
        with ops[kind], count_syncs(kind_syncs[kind], ("tolist",)):  # the rest: OpCounter.syncs
            step(store, args.layers, q, kv)
        kind_syncs[kind].update(ops[kind].syncs)
    prefill = None
    if args.prefill_chunk:
        qp = torch.randn(args.prefill_chunk, 4 * args.kv_heads, args.head_dim, dtype=dtype, device=dev)
        kvp = torch.randn(args.prefill_chunk, args.kv_heads, args.head_dim, dtype=dtype, device=dev)
        with OpCounter() as pops:
            t = time.perf_counter()
            store.begin_step(args.prefill_chunk)
            for layer in range(args.layers):
                store(layer, qp, kvp, kvp)
            store.end_step()
            if dev.type == "cuda":
                torch.cuda.synchronize()
            prefill = (time.perf_counter() - t, pops.total)
    store.close()
    cached = len(times["cached"])
    profile_lines: list[str] = []
    if args.profile and prof.getstats() == []:
        print(f"--profile: no {args.profile_steps} step to profile in {args.steps} steps")
    elif args.profile:
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(40)
        profile_lines = [line for line in text.getvalue().splitlines() if line.strip()]
        print("\n".join(profile_lines[:24]))
    kernels: list[dict[str, Any]] = []
    if kernel_profs:
        kernels = merged_kernels(kernel_profs, 25)
        n = len(kernel_profs)
        busy = sum(r["device_ms"] for r in merged_kernels(kernel_profs, 10**6)) / n
        print(f"device time per {args.profile_steps} step ({n} steps): {busy:.1f} ms busy")
        for row in kernels[:12]:
            print(f"  {row['device_ms'] / n:9.3f} ms  {row['calls'] / n:7.1f} calls  {row['name']}")
    print(f"{slices} slices, context {args.context}, head_dim {args.head_dim}, {dev}, preset {args.preset}")
    for kind, ts in times.items():
        if ts:
            mean = sum(ts) / len(ts)
            per_slice = mean / slices * 1e3
            print(f"{kind:>8} steps: {len(ts):3d}  {mean * 1e3:8.1f} ms/step {per_slice:6.3f} ms/slice")
    counted = {}
    for kind in STEP_KINDS:
        n = kind_steps[kind] * slices
        where = ops[kind].by_function or Counter()
        if n:
            counted[kind] = {
                "steps": kind_steps[kind],
                "ops_per_slice": round(ops[kind].total / n, 1),
                "syncs_per_slice": round(sum(kind_syncs[kind].values()) / n, 2),
                "syncs": {k: round(v / n, 2) for k, v in sorted(kind_syncs[kind].items())},
                "top_ops": {k: round(v / n, 1) for k, v in ops[kind].counts.most_common(12)},
                "by_function": {k: round(v / n, 1) for k, v in where.most_common(14)},
            }
            c = counted[kind]
            line = f"{kind:>8}: {c['ops_per_slice']:7.1f} ops/slice {c['syncs_per_slice']:6.2f} syncs/slice"
            print(line, c["syncs"])
            print(" " * 10 + ", ".join(f"{k} {v}" for k, v in list(c["by_function"].items())[:6]))
    per = {k: round(v / max(1, cached) / slices, 3) for k, v in sorted(syncs.items())}
    print(
        f"host conversions per slice on cached steps: {sum(syncs.values()) / max(1, cached) / slices:.3f}",
        per,
    )
    print(f"cache hit rate {kernel.stats.hit_rate:.3f}, decode recomputes {kernel.stats.decode_recomputes}")
    if kernel._graphs is not None:
        g = kernel._graphs
        print(f"layer graphs: {g.captures} captures, {g.replays} replays, {g.eager} eager bodies")
        print(f"layer steps declined: {dict(sorted(g.declined.items()))}")
    summary = {
        kind: {"steps": len(ts), "mean_s": round(sum(ts) / len(ts), 5), "max_s": round(max(ts), 5)}
        for kind, ts in sorted(by_stage.items())
    }
    for kind, v in summary.items():
        mean, worst = v["mean_s"] * 1e3, v["max_s"] * 1e3
        print(f"steps rerunning from {kind}: {v['steps']:3d}  mean {mean:8.1f} ms  max {worst:8.1f} ms")
    if args.name:
        config = {
            "preset": args.preset, "as_preset": args.as_preset, "refresh": hip.refresh,
            "host_scoring": hip.host_scoring, "key_params": args.key_params, "align_window": hip.align_window,
            "probe_scoring": hip.probe_scoring, "layer_at_once": not args.slice_at_a_time,
            "triton_buffers": args.triton_buffers or dev.type == "cuda",
            "graphs": None if kernel._graphs is None else {
                "emulated": args.emulate_graphs,
                "captures": kernel._graphs.captures, "replays": kernel._graphs.replays,
                "eager": kernel._graphs.eager, "declined": dict(sorted(kernel._graphs.declined.items())),
            },
        }  # fmt: skip
        info = {"layers": args.layers, "kv_heads": args.kv_heads, "group": args.group}
        out = write_results(args.name, {
            "device": str(dev), "context": args.context, "hip": {**config, "budgets": hip.budgets},
            "shape": {**info, "head_dim": args.head_dim}, "cache_tokens": args.cache_tokens,
            "hit_rate": round(kernel.stats.hit_rate, 4), "by_first_rerun": summary, "steps": rows,
            "profiled": args.profile_steps if args.profile or args.kernels else None,
            "cprofile": profile_lines, "kernels": kernels, "kv_quant": args.kv_quant, "counted": counted,
        })  # fmt: skip
        print(f"-> {out}")
    if prefill is not None:
        dt, n_ops = prefill
        print(
            f"prefill chunk of {args.prefill_chunk}: {dt * 1e3:.1f} ms, {dt / slices * 1e3:.3f} ms/slice,",
            f"{n_ops / slices:.1f} ops/slice",
        )


if __name__ == "__main__":
    main()
