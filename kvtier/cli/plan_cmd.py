"""`kvtier plan`: memory table, maximum context, recommended KV placement and roofline.

kvtier plan --model llama-3-8b --context 1M --gpu-memory 24GiB --host-memory 512GiB
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from kvtier.cli.options import (
    count_type,
    cpu_attention_type,
    float_type,
    int_type,
    output_path_type,
    size_type,
    text_type,
)
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
from kvtier.cli.plan_parallel import format_parallel, parallel_lines, rank_of
from kvtier.config import ModelConfig
from kvtier.errors import CapacityError, ModelLoadError
from kvtier.loading.gguf import gguf_model_config, is_gguf_file
from kvtier.loading.presets import PRESETS, preset_config
from kvtier.methods import OPTIONS, REGISTRY, choices, names
from kvtier.methods.registry import MethodEntry
from kvtier.planner.hardware import HARDWARE, hardware_preset
from kvtier.planner.memory import (
    DTYPE_BYTES,
    EXPERT_PLACES,
    expert_layer_bytes,
    host_weight_bytes,
    place_experts,
)
from kvtier.planner.methods import ACTIVATION_MODELS
from kvtier.planner.placement import POLICIES
from kvtier.planner.report import PlanRequest, build_report, format_report, report_json
from kvtier.planner.sharding import rank_host_budget
from kvtier.units import parse_count


def add_parser(subparsers: Any) -> None:
    """Register `kvtier plan` and its options."""
    p = subparsers.add_parser(
        "plan",
        help="predict memory, maximum context and the KV placement for a model",
        description="Memory table of each KV method, their maximum contexts, kvtier's recommended "
        "placement and the roofline of prefill and decode. Sizes: 24GiB, '24 GB' (1e9), 24g.",
        allow_abbrev=False,
    )
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
    p.set_defaults(func=run)


def resolve_model(spec: str) -> ModelConfig:
    """A preset name, a folder holding config.json, a config.json path or a .gguf file (its
    metadata: no weights are read or converted)."""
    if spec in PRESETS:
        return preset_config(spec)
    path = Path(spec).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return ModelConfig.from_json(path / "config.json")
    if path.is_file():
        if is_gguf_file(path):
            return gguf_model_config(path)
        return _config_json_file(path)
    raise ModelLoadError(
        f"--model {spec!r} is neither a preset, a folder with config.json, a config.json file nor "
        f"a .gguf file; known presets: {', '.join(sorted(PRESETS))}"
    )


def _config_json_file(path: Path) -> ModelConfig:
    """The config.json at `path`; any other file is a ModelLoadError saying what plan reads."""
    not_config = f"--model {path} is not a config.json (not UTF-8 JSON) nor a .gguf file"
    try:
        d = json.loads(path.read_bytes().decode("utf-8"))
    except OSError as e:
        raise ModelLoadError(f"cannot read --model {path}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise ModelLoadError(not_config) from None
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{not_config}: {e}") from None
    if not isinstance(d, dict):
        raise ModelLoadError(f"--model {path} holds JSON but not an object; is it a config.json?")
    return ModelConfig.from_hf_dict(d)


def build_request(args: argparse.Namespace) -> PlanRequest:
    """Parse and check the options (ConfigError / ModelLoadError on bad input)."""
    whole = resolve_model(args.model)
    cfg, ranks, label = rank_of(args, whole)
    hw = hardware_preset(
        args.gpu,
        tflops=args.tflops,
        hbm_bw=args.hbm_bw,
        pcie_bw=args.pcie_bw,
        cpu_attention_bw=args.cpu_attention_bw,
    )
    gpu = hw.memory_bytes if args.gpu_memory is None else args.gpu_memory
    cfg = place_experts(cfg, gpu, DTYPE_BYTES[args.dtype], args.experts)
    host = rank_host_budget(args.host_memory, ranks)
    assert host is not None
    host -= host_weight_bytes(cfg, DTYPE_BYTES[args.dtype])  # the experts' host memory, if there
    return PlanRequest(
        cfg=cfg,
        model=args.model if ranks == 1 else f"{args.model} ({label})",
        context=args.context,
        gpu_budget=gpu,
        host_budget=host,
        disk_budget=args.disk,
        dtype_bytes=DTYPE_BYTES[args.dtype],
        hardware=hw,
        chunk_size=args.chunk_size,
        group_size=args.group_size,
        policy=args.policy,
        block_size=args.block_size,
        activation_model=args.activations,
        cpu_attention=args.cpu_attention if ranks == 1 else "off",  # NOTE: one CPU, N ranks: not modelled
    )


PLANNED_OPTIONS = frozenset({"kv_budget"})  # method options `kvtier plan` takes (`--kv-budget`)


def planned_attention() -> tuple[str, ...]:
    """`--attention` values `kvtier plan` can plan: dense and the methods with a planner hook
    whose required options it takes."""

    def planned(entry: MethodEntry) -> bool:
        return entry.plan is not None and set(entry.requires) <= PLANNED_OPTIONS

    return tuple(n for n in choices("attention") if n not in REGISTRY or planned(REGISTRY[n]))


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
