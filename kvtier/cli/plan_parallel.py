"""`kvtier plan --tensor-parallel N` / `--pipeline-parallel N`: the rank it plans, and what all
the ranks do together."""

from __future__ import annotations

import argparse
from typing import Any

from kvtier.config import ModelConfig
from kvtier.errors import ConfigError
from kvtier.planner.report import PlanReport
from kvtier.planner.sharding import rank_config, stage_config, stage_layers


def rank_of(args: argparse.Namespace, whole: ModelConfig) -> tuple[ModelConfig, int, str]:
    """The config `kvtier plan` plans (one tensor-parallel rank, or the first and largest pipeline
    stage), the number of ranks and how the report names the rank."""
    tp, pp = int(getattr(args, "tensor_parallel", 1)), int(getattr(args, "pipeline_parallel", 1))
    if tp > 1 and pp > 1:
        raise ConfigError("--tensor-parallel and --pipeline-parallel cannot be combined yet; choose one")
    if pp > 1:
        layers = stage_layers(whole.num_layers, pp, 0)
        return stage_config(whole, pp, 0), pp, f"stage 1 of {pp}, layers {layers.start}-{layers.stop - 1}"
    return rank_config(whole, tp), tp, f"one rank of {tp}"


def parallel_lines(args: argparse.Namespace, rep: PlanReport, whole: ModelConfig) -> dict[str, Any] | None:
    """What the ranks add to the report: the split, and the plan's streaming over all N links
    (None for one rank)."""
    _, ranks, _ = rank_of(args, whole)
    if ranks == 1:
        return None
    req, plan = rep.request, rep.plan
    pipeline = int(getattr(args, "pipeline_parallel", 1)) > 1
    out: dict[str, Any] = {
        "kind": "pipeline_parallel" if pipeline else "tensor_parallel",
        "ranks": ranks,
        "gpu_memory_per_rank_gb": req.gpu_budget / 1e9,
        "host_memory_per_rank_gb": req.host_budget / 1e9,
    }
    if pipeline:
        out["layers_per_stage"] = [len(stage_layers(whole.num_layers, ranks, r)) for r in range(ranks)]
    else:
        out.update(
            query_heads_per_rank=req.cfg.num_heads,
            kv_heads_per_rank=req.cfg.num_kv_heads,
            mlp_width_per_rank=req.cfg.intermediate_size,
            all_reduce_gb_per_decode_token=2 * whole.num_layers * whole.hidden_size * req.dtype_bytes / 1e9,
        )
    if plan is not None and rep.decode is not None:
        # NOTE: tensor-parallel ranks stream at the same time; pipeline stages one after the other
        # (the first stage is the largest, so N of its times bound the sum).
        out.update(
            host_kv_all_ranks_gb=ranks * plan.host_kv_bytes / 1e9,
            pcie_gb_per_decode_token_all_ranks=ranks * plan.pcie_bytes_per_decode_token / 1e9,
            decode_s_per_token=rep.decode.total_s * (ranks if pipeline else 1),
        )
    return out


def format_parallel(p: dict[str, Any]) -> str:
    """The ranks' lines of the plain-text report."""
    n = p["ranks"]
    if p["kind"] == "pipeline_parallel":
        text = (
            f"\npipeline parallel: {n} stages of {'/'.join(map(str, p['layers_per_stage']))} layers, each "
            f"on its own GPU with 1/{n} of the host memory: every number above is the first stage's"
        )
        if "decode_s_per_token" in p:
            text += (
                f"\n  all stages: at most {p['pcie_gb_per_decode_token_all_ranks']:.3f} GB over {n} links "
                f"per decode token, one stage after the other (~{p['decode_s_per_token']:.4g} s/token at "
                "most), plus one [tokens, hidden] send per stage boundary"
            )
        return text
    text = (
        f"\ntensor parallel: {n} ranks, each with {p['query_heads_per_rank']} query / "
        f"{p['kv_heads_per_rank']} KV heads and {p['mlp_width_per_rank']:,} MLP channels on its own GPU "
        f"and 1/{n} of the host memory: every number above is one rank's"
    )
    if "decode_s_per_token" in p:
        text += (
            f"\n  all ranks: {p['pcie_gb_per_decode_token_all_ranks']:.3f} GB over {n} links "
            f"per decode token, in parallel (~{p['decode_s_per_token']:.4g} s/token), plus 2 all-reduces "
            f"per layer ({p['all_reduce_gb_per_decode_token'] * 1e3:.2f} MB per decode token, not in "
            "the estimate)"
        )
    return text
