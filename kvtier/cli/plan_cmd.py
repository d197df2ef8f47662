"""`kvtier plan`: memory table, maximum context, recommended KV placement and roofline.

kvtier plan --model llama-3-8b --context 1M --gpu-memory 24GiB --host-memory 512GiB

This file registers the subcommand and prints its plan; its options are
`kvtier.cli.plan_options`, the model and request they name `kvtier.cli.plan_request`, and the
plans beside lossless `kvtier.cli.plan_methods` and `kvtier.cli.plan_parallel`.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from kvtier.cli.plan_methods import (
    evict_lines,
    format_evict,
    format_hip,
    format_lossy,
    format_quest,
    hip_lines,
    lossy_lines,
    quest_lines,
)
from kvtier.cli.plan_options import add_plan_options
from kvtier.cli.plan_parallel import format_parallel, parallel_lines
from kvtier.cli.plan_request import build_request, resolve_model
from kvtier.errors import CapacityError
from kvtier.planner.memory import expert_layer_bytes, host_weight_bytes
from kvtier.planner.report import build_report, format_report, report_json


def add_parser(subparsers: Any) -> None:
    """Register `kvtier plan` and its options."""
    p = subparsers.add_parser(
        "plan",
        help="predict memory, maximum context and the KV placement for a model",
        description="Memory table of each KV method, their maximum contexts, kvtier's recommended "
        "placement and the roofline of prefill and decode. Sizes: 24GiB, '24 GB' (1e9), 24g.",
        allow_abbrev=False,
    )
    add_plan_options(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Print the plan; exit 2 (through CapacityError) when the context fits nowhere."""
    req = build_request(args)
    rep = build_report(req)
    # A method may fit where lossless does not (packed KV takes less host memory): planned
    # either way; the command fails only when what was asked for fits nowhere.
    lossy = (
        lossy_lines(req, rep.plan, args.kv_quant, args.head_sparsity) if args.attention == "dense" else None
    )
    hip = hip_lines(
        req,
        args.attention,
        args.hip_preset,
        args.kv_quant,
        args.head_sparsity,
        args.hip_refresh,
        args.hip_host_keys,
        args.hip_probes,
        args.hip_strides,
    )
    quest = quest_lines(req, args.attention, args.kv_budget, args.quest_page, args.kv_quant)
    evict = evict_lines(
        req,
        args.evict,
        args.kv_budget,
        args.max_new_tokens,
        others=bool(lossy or hip or quest),
        budget_used=quest is not None,
    )
    parallel = parallel_lines(args, rep, resolve_model(args.model))
    if args.json:
        out = report_json(rep)
        if parallel:
            out[parallel["kind"]] = parallel
        if lossy:
            out["lossy"] = lossy
        if hip:
            out["hip"] = hip
        if quest:
            out["quest"] = quest
        if evict:
            out["evict"] = evict
        print(json.dumps(out, indent=2))
    else:
        print(format_report(rep))
        on_host = host_weight_bytes(req.cfg, req.dtype_bytes)
        if on_host:
            print(
                f"\nrouted experts in host memory: {on_host / 1e9:.2f} GB (the weights column counts "
                f"one MoE layer's experts, {expert_layer_bytes(req.cfg, req.dtype_bytes) / 1e9:.2f} GB, "
                "copied in per step; --experts gpu keeps them on the GPU)"
            )
        if parallel:
            print(format_parallel(parallel))
        if lossy:
            print(format_lossy(lossy))
        if hip:
            print(format_hip(hip))
        if quest:
            print(format_quest(quest))
        if evict:
            print(format_evict(evict))
    if args.plot:
        from kvtier.planner.plot import plot_memory

        plot_memory(req, args.plot)
    if rep.error is not None and hip is None and quest is None and lossy is None and evict is None:
        raise CapacityError(rep.error)
    if rep.error is not None and not args.json:
        print("\nlossless does not fit (above); the method's plan does")
    return 0
