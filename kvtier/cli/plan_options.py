"""`kvtier plan`'s options, in the order `kvtier plan --help` lists them: the model, context
and budgets, the placement and hardware, the opt-in methods it plans beside lossless
(`kvtier.cli.plan_methods`), the ranks (`kvtier.cli.plan_parallel`) and the output."""

from __future__ import annotations

import argparse

from kvtier.cli.options import (
    count_type,
    cpu_attention_type,
    float_type,
    int_type,
    output_path_type,
    size_type,
    text_type,
)
from kvtier.methods import OPTIONS, REGISTRY, choices, names
from kvtier.methods.registry import MethodEntry
from kvtier.planner.hardware import HARDWARE
from kvtier.planner.memory import DTYPE_BYTES, EXPERT_PLACES
from kvtier.planner.methods import ACTIVATION_MODELS
from kvtier.planner.placement import POLICIES
from kvtier.units import parse_count


def add_plan_options(p: argparse.ArgumentParser) -> None:
    """Register `kvtier plan`'s options on its parser `p`."""
    p.add_argument(
        "--model",
        required=True,
        type=text_type("--model", allow_empty=False),
        help="preset name, HF model folder, .gguf file or config.json path",
    )
    p.add_argument(
        "--context",
        type=count_type("--context"),
        default="1M",
        help="tokens, e.g. 131072, 128K, 1M (binary K/M)",
    )
    p.add_argument(
        "--gpu-memory",
        type=size_type("--gpu-memory"),
        default=None,
        help="GPU memory budget (default: the --gpu's memory)",
    )
    p.add_argument(
        "--host-memory",
        type=size_type("--host-memory", positive=False),
        default="512GiB",
        help="pinned host memory for KV",
    )
    p.add_argument(
        "--disk",
        type=size_type("--disk", positive=False),
        default="0",
        help="disk space that extends the host tier for KV",
    )
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPE_BYTES), help="weights/KV dtype")
    p.add_argument(
        "--chunk-size",
        type=lambda text: None if text == "auto" else parse_count(text, "--chunk-size"),
        default="auto",
        help="prefill chunk tokens, or 'auto' (roofline)",
    )
    p.add_argument(
        "--head-group",
        "--group-size",
        dest="group_size",
        type=int_type("--head-group"),
        default=None,
        help="KV heads per streamed group (head/auto), as `generate --head-group`",
    )
    p.add_argument(
        "--kv",
        "--policy",
        dest="policy",
        default="auto",
        choices=POLICIES,
        help="KV placement to plan, as `generate --kv` (--policy: the old name)",
    )
    p.add_argument("--block-size", type=int_type("--block-size"), default=256, help="KV block size in tokens")
    p.add_argument("--gpu", default="rtx4090", choices=sorted(HARDWARE), help="hardware preset")
    p.add_argument(
        "--tflops",
        type=float_type("--tflops", 0.0, lo_open=True),
        default=None,
        help="override peak bf16 TFLOP/s",
    )
    p.add_argument(
        "--hbm-bw",
        type=size_type("--hbm-bw"),
        default=None,
        help="override HBM bandwidth per second, e.g. 3.35TB",
    )
    p.add_argument(
        "--pcie-bw",
        type=size_type("--pcie-bw"),
        default=None,
        help="override host link bandwidth per second, e.g. 25GB",
    )
    p.add_argument(
        "--cpu-attention",
        type=cpu_attention_type,
        default="off",
        help="streamed slices a decode step attends on the host CPU: off (default), auto (rate "
        "model) or a number",
    )
    p.add_argument(
        "--experts",
        choices=EXPERT_PLACES,
        default="auto",
        help="a mixture-of-experts model's routed experts: gpu, host (copied in per step), or auto "
        "(default: host when the weights would leave under a quarter of the GPU memory)",
    )
    p.add_argument(
        "--cpu-attention-bw",
        type=size_type("--cpu-attention-bw"),
        default=None,
        help="override the host CPU's attention rate (KV bytes per second), e.g. 40GB",
    )
    p.add_argument(
        "--activations",
        default="runner",
        choices=ACTIVATION_MODELS,
        help="baselines' activation model: runner (kvtier's runner) or paper (reproduces Table 10)",
    )
    p.add_argument(
        "--kv-quant",
        default=None,
        choices=names("kv_quant"),
        help="also plan the cache packed: resident slices, host KV and PCIe bytes per decode step",
    )
    p.add_argument(
        "--head-sparsity",
        type=OPTIONS["head_sparsity"].parse,
        default=None,
        metavar="R",
        help="also predict head-wise sparsity: a fraction R of KV heads keep 64 sinks + 256 recent tokens",
    )
    p.add_argument(
        "--evict",
        default=None,
        choices=names("evict"),
        help="also plan token eviction under --kv-budget: every slice keeps its budget on the GPU",
    )
    p.add_argument(
        "--kv-budget",
        type=OPTIONS["kv_budget"].parse,
        default=None,
        metavar="N",
        help="--evict's or --attention quest's budget: " + OPTIONS["kv_budget"].help,
    )
    p.add_argument(
        "--max-new-tokens",
        type=count_type("--max-new-tokens"),
        default=None,
        metavar="N",
        help="of --context, the tokens generated (SnapKV keeps every one; default: unknown, so up to "
        "the whole context)",
    )
    p.add_argument(
        "--attention",
        default="dense",
        choices=planned_attention(),
        help="also plan a sparse attention method with its own planner (HiP: its slices, block "
        "cache per offloaded slice and prefill chunk; Quest: its page bounds, under --kv-budget)",
    )
    p.add_argument(
        "--hip-preset", type=OPTIONS["hip_preset"].parse, default="auto", help=OPTIONS["hip_preset"].help
    )
    p.add_argument(
        "--quest-page", type=OPTIONS["quest_page"].parse, default=None, help=OPTIONS["quest_page"].help
    )
    p.add_argument(
        "--hip-refresh", type=OPTIONS["hip_refresh"].parse, default=None, help=OPTIONS["hip_refresh"].help
    )
    p.add_argument(
        "--hip-host-keys",
        type=OPTIONS["hip_host_keys"].parse,
        default=None,
        metavar="{on,off,auto}",
        help=OPTIONS["hip_host_keys"].help,
    )
    p.add_argument(
        "--hip-strides", type=OPTIONS["hip_strides"].parse, default=None, help=OPTIONS["hip_strides"].help
    )
    p.add_argument(
        "--hip-probes",
        type=OPTIONS["hip_probes"].parse,
        default=False,
        metavar="{on,off}",
        help=OPTIONS["hip_probes"].help,
    )
    p.add_argument(
        "--tensor-parallel",
        type=int_type("--tensor-parallel"),
        default=1,
        metavar="N",
        help="plan one of N tensor-parallel ranks (its KV heads, weights and KV tiers): --gpu-memory "
        "is one rank's GPU, --host-memory the machine's, split evenly; no CPU co-attention",
    )
    p.add_argument(
        "--pipeline-parallel",
        type=int_type("--pipeline-parallel"),
        default=1,
        metavar="N",
        help="plan the first (largest) of N pipeline stages instead, as --tensor-parallel",
    )
    p.add_argument("--json", action="store_true", help="print JSON (GB = 1e9 bytes)")
    p.add_argument(
        "--plot",
        type=output_path_type("--plot"),
        default=None,
        metavar="F.png",
        help="save GPU memory vs context to F",
    )


PLANNED_OPTIONS = frozenset({"kv_budget"})  # method options `kvtier plan` takes (`--kv-budget`)


def planned_attention() -> tuple[str, ...]:
    """`--attention` values `kvtier plan` can plan: dense and the methods with a planner hook
    whose required options it takes."""

    def planned(entry: MethodEntry) -> bool:
        return entry.plan is not None and set(entry.requires) <= PLANNED_OPTIONS

    return tuple(n for n in choices("attention") if n not in REGISTRY or planned(REGISTRY[n]))
