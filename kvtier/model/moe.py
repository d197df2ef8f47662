"""DeepSeek's mixture-of-experts FFN, run as transformers runs it: a float32 softmax router picks
each token's experts, every expert that got tokens runs on just those, and the shared experts
run on every token. Module names follow HF's `DeepseekV2Moe` (per-expert `experts.N.*_proj`,
as its checkpoints store them).

With the routed experts in host memory (`MoEConfig.experts_on_host`; the loader calls
`attach_host_experts`), the experts' weights are views of one host tensor [E, 3, I * hidden]
per layer, pinned on CUDA machines, and a step copies in what its tokens chose: every expert at
once when more than half are chosen (a prefill chunk), else one copy per chosen expert (a
decode step: 6 of DeepSeek-V2-Lite's 64, ~104 MB a layer). The copies are stream-ordered and
exact; the result equals the on-device one."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvtier.config import ModelConfig, MoEConfig
from kvtier.model.layers import GatedMLP, gated_mlp


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
        self.act = cfg.hidden_act
        self.host_experts: torch.Tensor | None = None  # [E, 3, I * hidden] in host memory, if there

    def attach_host_experts(self, experts: nn.ModuleList, slab: torch.Tensor) -> None:
        """Keep the routed experts in `slab` [E, 3, I * hidden] (host memory): each expert's
        gate, up and down weights become views of its row, so loading fills the slab. Mutates."""
        assert slab.shape[:2] == (len(experts), 3), slab.shape
        for e, expert in enumerate(experts):
            assert isinstance(expert, GatedMLP)
            for k, proj in enumerate((expert.gate_proj, expert.up_proj, expert.down_proj)):
                proj.weight = nn.Parameter(slab[e, k].view(proj.weight.shape), requires_grad=False)
        self.experts = experts
        self.host_experts = slab

    def forward(self, x: torch.Tensor, max_tokens: int | None = None) -> torch.Tensor:
        # x: [T, hidden]
        weights, chosen = route(self.moe, F.linear(x.float(), self.gate.weight.float()))  # [T, k] each
        out = torch.zeros_like(x)
        used = chosen.unique().tolist()  # ascending, as transformers adds the experts up
        copied = self._copy_in(used, x.device)
        for e in used:
            tokens, slot = torch.where(chosen == e)
            xe = x[tokens]
            if copied is None:
                y = self.experts[e](xe, max_tokens)
            else:
                y = gated_mlp(xe, copied[e], self.act, max_tokens)
            out.index_add_(0, tokens, (y * weights[tokens, slot, None]).to(out.dtype))
        if self.shared_experts is not None:
            out = out + self.shared_experts(x, max_tokens)
        return out

    def _copy_in(self, used: list[int], device: torch.device) -> dict[int, torch.Tensor] | None:
        """The chosen experts' packed weights on `device`, by expert id (None: they live there)."""
        slab = self.host_experts
        if slab is None:
            return None
        # NOTE: copied on the CPU too (a memcpy), so CPU tests run the path CUDA runs.
        if 2 * len(used) > slab.shape[0]:
            whole = slab.to(device, non_blocking=True)  # [E, 3, I * h]
            return {e: whole[e] for e in used}
        part = torch.empty((len(used), *slab.shape[1:]), dtype=slab.dtype, device=device)
        for j, e in enumerate(used):
            part[j].copy_(slab[e], non_blocking=True)
        return {e: part[j] for j, e in enumerate(used)}


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
