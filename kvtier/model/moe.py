"""DeepSeek's mixture-of-experts FFN, run as transformers runs it: a float32 softmax router picks
each token's experts, every expert that got tokens runs on just those, and the shared experts
run on every token. Module names follow HF's `DeepseekV2Moe` (per-expert `experts.N.*_proj`,
as its checkpoints store them)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvtier.config import ModelConfig, MoEConfig
from kvtier.model.layers import GatedMLP


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        moe = cfg.moe
        assert moe is not None
        self.moe = moe
        h = cfg.hidden_size
        self.gate = nn.Linear(h, moe.num_experts, bias=False)  # the router
        self.experts = nn.ModuleList(
            GatedMLP(h, moe.intermediate_size, cfg.hidden_act) for _ in range(moe.num_experts)
        )
        self.shared_experts = (
            GatedMLP(h, moe.intermediate_size * moe.num_shared, cfg.hidden_act) if moe.num_shared else None
        )

    def forward(self, x: torch.Tensor, max_tokens: int | None = None) -> torch.Tensor:
        # x: [T, hidden]
        weights, chosen = route(self.moe, F.linear(x.float(), self.gate.weight.float()))  # [T, k] each
        out = torch.zeros_like(x)
        for e in chosen.unique().tolist():  # ascending, as transformers adds the experts up
            tokens, slot = torch.where(chosen == e)
            y = self.experts[e](x[tokens], max_tokens) * weights[tokens, slot, None]
            out.index_add_(0, tokens, y.to(out.dtype))
        if self.shared_experts is not None:
            out = out + self.shared_experts(x, max_tokens)
        return out


def route(moe: MoEConfig, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] float32 -> (weights [T, k] float32, expert ids [T, k]): softmax
    scores, top-k (within the best `topk_group` groups for group_limited_greedy), times
    `routed_scaling_factor` (transformers' `DeepseekV2TopkRouter`; no renormalization)."""
    scores = logits.softmax(dim=-1)
    if moe.topk_method == "group_limited_greedy":
        groups = scores.view(-1, moe.n_group, moe.num_experts // moe.n_group).max(dim=-1).values  # [T, G]
        best = torch.topk(groups, k=moe.topk_group, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(groups).scatter_(1, best, 1).bool()  # [T, G]
        keep = keep[:, :, None].expand(-1, -1, moe.num_experts // moe.n_group).reshape(-1, moe.num_experts)
        scores = scores.masked_fill(~keep, 0.0)
    weights, chosen = torch.topk(scores, k=moe.experts_per_token, dim=-1, sorted=False)
    return weights * moe.routed_scaling_factor, chosen
