"""Lossless tiered-store benchmark (issue: head-wise offload) on a CUDA GPU.

llama-3-8b preset (random weights, bf16; `--model` another preset, e.g. gemma-2-9b), GPU capped
with set_per_process_memory_fraction.
For each context and policy: peak GPU memory (measured and planned), prefill tokens/s, decode
s/token, bytes over PCIe per token and the PCIe floor. Contexts up to --full-prefill-max are
prefilled for real; longer ones are filled with synthetic KV and then timed on real prefill
chunks and decode steps at that length. HF transformers' layer-wise offload runs alongside.

    python bench/tiered_store.py --contexts 32K,128K --policies gpu,layer,head,auto --hf

A policy may carry a lossy KV method after a "+": `head+int4`, `head+int8`, `head+fp8` (packed
quantized host tier) or `head+heads50` (head-wise sparsity, ratio 50%: streaming heads keep
sinks + recent on the GPU, the others are offloaded), or `head+quest4096p16` (Quest, budget
4096 tokens, 16-token pages: only selected pages are gathered from host memory). With random
weights head scores mean nothing, so heads50 classifies heads by seeded random scores; the
costs are the same. A policy may end in "@N" to prefill in chunks of N tokens instead of the
planner's chunk, so policies compare at the same chunk size: `gpu@8192,head@8192`.

    python bench/tiered_store.py --contexts 128K,512K --full-prefill-max 0 \
        --policies head,head+int8,head+int4,head+heads50 --name kv_policies_offload

`--cpu-attention off,auto` runs each policy twice: streaming every offloaded slice, then with the
planner's share of them attended on the CPU at decode (issue 23; lossless).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import itertools
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import KV_FILLS, fill_store, median, pinned_h2d_gbps, timed, write_results
from bench.cpu_split_trace import cpu_counters, cpu_split_row, cpu_timeline
from bench.hip_offload_steps import profiled_step
from bench.step_trace import traced_step
from bench.tiered_hf import run_hf
from bench.tiered_methods import kv_fill, method_choice, method_parts, method_reserve
from bench.tiered_report import add_speedups, print_table
from bench.watchdog import arm as arm_watchdog
from kvtier.engine.runner import prefill as runner_prefill
from kvtier.errors import CapacityError
from kvtier.kv.cpu_attend import measured_packed_rates
from kvtier.kv.hooks import StoreOptions
from kvtier.kv.store import TieredKVStore
from kvtier.loading.presets import preset_config
from kvtier.loading.weights import random_model
from kvtier.model.fuse import fuse_projections_
from kvtier.planner.cpu_split import parse_mode
from kvtier.planner.hardware import Hardware, hardware_preset
from kvtier.planner.memory import (
    EXPERT_PLACES,
    activation_bytes,
    expert_copy_bytes,
    host_weight_bytes,
    place_experts,
    weight_bytes,
)
from kvtier.planner.placement import plan_kv
from kvtier.units import parse_count, parse_size

DEV = torch.device("cuda")


def _hardware(cfg: Any, cpu: str, unpack_stream: bool = False) -> Hardware:
    """The H200 preset (its fitted CPU attention and contention rates); with `--cpu-attention
    auto` on CUDA, this host's measured rates over packed rows, which a quantized cache's split
    takes; with `--unpack-stream`, no unpack on the link's stream (`Hardware.unpack_bw` 0), as
    that store runs its loads."""
    hw = hardware_preset("h200")
    if cpu == "auto" and torch.cuda.is_available():
        hw = dataclasses.replace(hw, cpu_packed_bw=measured_packed_rates(cfg.head_dim, cfg.q_per_kv))
    return dataclasses.replace(hw, unpack_bw=0.0) if unpack_stream else hw


def run_policy(
    model: Any,
    cfg: Any,
    spec: str,
    context: int,
    args: argparse.Namespace,
    bw: float,
    cpu: str = "off",
    order: str | None = None,
) -> dict[str, Any]:
    # spec: POLICY[+METHOD][@CHUNK], e.g. "head+int4" or "head@8192" (a fixed prefill chunk).
    spec_chunk = spec.partition("@")
    policy, _, method = spec_chunk[0].partition("+")
    chunk_size = int(spec_chunk[2]) if spec_chunk[2] else args.chunk_size
    row: dict[str, Any] = {"policy": spec if cpu == "off" else f"{spec} cpu={cpu}", "context": context}
    total = context + args.decode_steps
    try:
        plan = plan_kv(
            cfg,
            total,
            policy=policy,
            gpu_budget=args.budget,
            dtype_bytes=2,
            chunk_size=chunk_size,
            group_size=args.head_group if policy in ("head", "auto") else None,
            hardware=(hw := _hardware(cfg, cpu, args.unpack_stream)),
            codec=method_choice(method).codec(),  # packed host tier of a quantized method
            cpu_attention=parse_mode(cpu),
            unpack_scratches=None if args.unpack_planned else 1,
        )
    except CapacityError as e:
        row["skipped"] = str(e)
        return row
    if args.staging_buffers and plan.staging_buffers:
        plan = dataclasses.replace(plan, staging_buffers=args.staging_buffers)
        row["policy"] = f"{spec}/b{args.staging_buffers}"
    if hw.cpu_packed_bw:  # the CPU rates a quantized cache's split took (measured here)
        row["cpu_packed_bw"] = dict(hw.cpu_packed_bw)
    row["plan"] = {
        k: getattr(plan, k)
        for k in (
            "group_size",
            "resident_slices",
            "chunk_size",
            "staging_buffers",
            "staging_tokens",
            "num_slices",
            "cpu_slices",
        )
    }
    predicted = (
        weight_bytes(cfg, 2)
        + activation_bytes(cfg, plan.chunk_size, 2, group_size=plan.group_size, context=total)
        + plan.gpu_kv_bytes
        + method_reserve(cfg, method, total, policy)
    )
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    store = None
    try:
        store = TieredKVStore(
            cfg,
            plan,
            device=DEV,
            dtype=torch.bfloat16,
            capacity=total,
            options=StoreOptions(
                unpack_stream=None if args.unpack_planned else args.unpack_stream,
                cpu_handoff=args.cpu_handoff,
                cpu_results=args.cpu_results,
            ),
            **method_parts(cfg, model, method),
        )
        gen = torch.Generator(device=DEV).manual_seed(0)
        # NOTE: a plan's chunk may exceed a short context (DeepSeek-V2-Lite's 9,216 at the 8K
        # warm-up): the synthetic fill would then start at a negative length.
        chunk = min(plan.chunk_size, context)
        if context <= args.full_prefill_max:
            ids = torch.randint(0, cfg.vocab_size, (context,), device=DEV, generator=gen)
            none = torch.empty(0, dtype=torch.long, device=DEV)

            def prefill() -> torch.Tensor:
                if order is not None:  # through the runner, as `kvtier generate` runs it
                    done = runner_prefill(model, store, ids, chunk, by_layer=order == "layer")
                    row["prefill_order"] = "layer" if done.by_layer else "chunk"
                    return done.logits.view(1, -1)
                logits = torch.empty(0)
                for s in range(0, context, chunk):
                    part = ids[s : s + chunk]
                    store.begin_step(part.shape[0])
                    logits = model(
                        part, store, logits_at=None if s + chunk >= context else none, mlp_chunk=chunk
                    )
                    store.end_step()
                return logits

            dt, logits = timed(prefill)
            row["prefill_tok_s"] = context / dt
            row["prefill_mode"] = "full"
        else:
            start = context - args.measure_chunks * chunk
            row["kv_fill"] = kv_fill(args.kv_fill, method)
            fill_store(store, start, row["kv_fill"])
            ids = torch.randint(0, cfg.vocab_size, (args.measure_chunks * chunk,), device=DEV, generator=gen)
            times = []
            for i in range(args.measure_chunks):
                part = ids[i * chunk : (i + 1) * chunk]
                store.begin_step(chunk)
                dt, logits = timed(lambda part=part: model(part, store, mlp_chunk=chunk))
                store.end_step()
                times.append(dt)
            row["prefill_tok_s"] = chunk / median(times)
            row["prefill_mode"] = (
                f"{args.measure_chunks} chunk(s) of {chunk} at the end of a synthetic {start}"
            )
        token = logits[-1].argmax()
        h2d0 = store.account.h2d_bytes
        cpu0 = cpu_counters(store)
        steps = []
        for _ in range(args.decode_steps):
            store.begin_step(1)
            dt, logits = timed(lambda: model(token.view(1), store))
            store.end_step()
            token = logits[-1].argmax()
            steps.append(dt)
        row["decode_s_per_token"] = median(steps[1:] if len(steps) > 2 else steps)
        row["decode_steps_s"] = steps
        row["h2d_bytes_per_token"] = (store.account.h2d_bytes - h2d0) / max(1, len(steps))
        if store.cpu is not None:
            row["cpu_split"] = cpu_split_row(store, cpu0, len(steps))
            row["cpu_handoff"] = "gpu" if store.cpu.flag is not None else "host"
            row["cpu_results"] = store.cpu.results
        if args.trace_step:
            row["trace_step"] = traced_step(store, model, token)
        if args.trace_cpu and store.cpu is not None:
            row["cpu_timeline"] = cpu_timeline(store, model, token)
        if args.profile_step:
            row["profile_step"] = profiled_step(model, store, token.view(1), DEV)[1]
        row["host_kv_bytes"] = store.account.peak["host"]
        # NOTE: every streamed slice over the link, as without CPU attention (the floor it beats)
        # NOTE: with a MoE model's routed experts on the host, a token also copies in its chosen
        # experts (`expert_copy_bytes`): part of the floor, not of the store's own bytes.
        row["expert_bytes_per_token"] = expert_copy_bytes(cfg, 1, 2)
        row["pcie_floor_s"] = (
            store.length * plan.slice_token_bytes * plan.streamed_slices + row["expert_bytes_per_token"]
        ) / (bw * 1e9)
        row["decode_vs_floor"] = (
            (row["decode_s_per_token"] / row["pcie_floor_s"]) if row["pcie_floor_s"] else None
        )
        row["peak_gpu_bytes"] = torch.cuda.max_memory_allocated()
        row["predicted_gpu_bytes"] = predicted
        row["predicted_error"] = predicted / row["peak_gpu_bytes"] - 1
    except torch.OutOfMemoryError as e:
        row["oom"] = str(e).splitlines()[0]
    finally:
        if store is not None:
            store.close()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="llama-3-8b", help="a preset (random weights)")
    ap.add_argument("--contexts", default="32K,128K")
    ap.add_argument("--policies", default="gpu,layer,head,auto")
    ap.add_argument("--gpu-memory", default="24GB")
    ap.add_argument("--chunk-size", type=int, default=None)
    ap.add_argument(
        "--head-group", type=int, default=None, help="KV heads per slice (default: the policy's choice)"
    )
    ap.add_argument("--decode-steps", type=int, default=4)
    ap.add_argument("--measure-chunks", type=int, default=1)
    ap.add_argument("--staging-buffers", type=int, default=0, help="override the plan's ping-pong depth")
    ap.add_argument(
        "--full-prefill-max",
        type=lambda s: 0 if s.strip() == "0" else parse_count(s),  # 0: no context prefills in full
        default=131072,
    )
    ap.add_argument("--hf", action="store_true", help="also run HF transformers on the same weights")
    ap.add_argument(
        "--hf-cache",
        choices=("offloaded", "gpu"),
        default="offloaded",
        help="HF's cache with --hf: its layer-wise offload (default) or its default cache on the GPU",
    )
    ap.add_argument(
        "--cpu-attention",
        default="off",
        help="comma list of modes (off, auto, a slice count): each policy runs with each; with auto "
        "the planner gives the H200 preset's CPU attention some streamed slices at decode",
    )
    ap.add_argument(
        "--experts",
        choices=EXPERT_PLACES,
        default="auto",
        help="a MoE preset's routed experts: on the GPU, in pinned host memory, or auto (as LLM)",
    )
    ap.add_argument(
        "--kv-fill",
        choices=("auto", *KV_FILLS),
        default="auto",
        help="the stored context's KV: auto (structured for quest rows, whose page selection "
        "reads it; synthetic for the rest, whose speed does not), structured or synthetic",
    )
    ap.add_argument(
        "--unpack-stream",
        action="store_true",
        help="a quantized cache's loads unpacked on a stream of their own (StoreOptions."
        "unpack_stream; its second scratch is not in the plan). Without it or --unpack-planned: "
        "unpacked on the link's stream, one scratch planned",
    )
    ap.add_argument(
        "--unpack-planned",
        action="store_true",
        help="as the library does by default: the plan chooses (KVPlan.unpack_scratches: two, "
        "unpacking off the link's stream, where its link model says that pays) and the store follows",
    )
    ap.add_argument(
        "--profile-step",
        action="store_true",
        help="one more decode step under cProfile and torch.profiler: where the host's time goes "
        "(with CPU slices, between a layer's CPU results and the next query: --trace-cpu)",
    )
    ap.add_argument(
        "--trace-cpu",
        action="store_true",
        help="one more decode step with its CPU-attended layers timed: the CPU's jobs, the query's "
        "way to them, the host's waits and its work between layers (bench/cpu_split_trace.py)",
    )
    ap.add_argument(
        "--trace-step",
        action="store_true",
        help="one more decode step under torch.profiler: its wall time, the link's busy time and "
        "copies, and each stream's kernel time (is the link idle, or slow?)",
    )
    ap.add_argument(
        "--fuse",
        action="store_true",
        help="q/k/v and gate/up as one matmul each, as LLM and the CLI run them (kvtier.model.fuse); "
        "without it, the unfused model every earlier row of this bench ran",
    )
    ap.add_argument(
        "--cpu-handoff",
        choices=("auto", "gpu", "host"),
        default="host",
        help="who waits for CPU slices' results: the CUDA stream (gpu; the host goes on issuing), the "
        "main thread (host: this bench's default, so earlier rows' commands keep their meaning), or "
        "the library's default (auto: the stream since 2026-12-07, where the driver's waits work)",
    )
    ap.add_argument(
        "--cpu-results",
        choices=("auto", "copy", "mapped"),
        default="copy",
        help="how CPU slices' results reach the merge: an H2D copy (copy: this bench's default, as "
        "every row before 2026-12-07 ran), read in place from pinned memory by the merge's kernels "
        "(mapped), or the library's default (auto: mapped since 2026-12-07)",
    )
    ap.add_argument(
        "--watchdog",
        type=float,
        default=0,
        help="after this many seconds print every thread's stack and the CPU handoff's state, and "
        "exit 3 (bench/watchdog.py: evidence from a hang; 0: off)",
    )
    ap.add_argument(
        "--prefill-orders",
        default=None,
        help="full prefills through kvtier's runner in each of these orders (chunk, layer: "
        "`--prefill-order`), a row each; default: the chunks in a loop of this script's own",
    )
    ap.add_argument("--name", default="tiered_store")
    args = ap.parse_args()
    if args.watchdog > 0:
        arm_watchdog(args.watchdog)
    args.budget = parse_size(args.gpu_memory)
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(args.budget / total)
    contexts = [parse_count(c) for c in args.contexts.split(",")]
    bw = pinned_h2d_gbps()
    cfg = place_experts(preset_config(args.model), args.budget, 2, args.experts)
    model = random_model(cfg, DEV, torch.bfloat16)
    if args.fuse:
        fuse_projections_(model)
    run_policy(model, cfg, "gpu", 8192, args, bw)  # warm-up: kernels, allocator, host threads
    rows = []
    for context in contexts:
        orders = args.prefill_orders.split(",") if args.prefill_orders else [None]
        for policy, cpu, order in itertools.product(
            args.policies.split(","), args.cpu_attention.split(","), orders
        ):
            row = run_policy(model, cfg, policy, context, args, bw, cpu, order)
            rows.append(row)
            # Rewritten after every row, so a run cut short by a time limit keeps what it measured.
            write_results(args.name, {"gpu_budget_bytes": args.budget, "pinned_h2d_gbps": bw, "rows": rows})
            print(
                {
                    k: (round(v, 4) if isinstance(v, float) else v)
                    for k, v in row.items()
                    if k not in ("decode_steps_s",)
                },
                flush=True,
            )
    if args.hf:
        rows += run_hf(model, cfg, [c for c in contexts if c <= args.full_prefill_max], args)
    add_speedups(rows)
    head = {"gpu_budget_bytes": args.budget, "pinned_h2d_gbps": bw}
    if cfg.moe is not None:
        head["experts_on_host"] = cfg.moe.experts_on_host
        head["host_weight_bytes"] = host_weight_bytes(cfg, 2)
    path = write_results(args.name, {**head, "rows": rows})
    print(f"\npinned H2D {bw:.1f} GB/s; budget {args.budget / 1e9:.1f} GB; results: {path}")
    print_table(rows)


if __name__ == "__main__":
    main()
