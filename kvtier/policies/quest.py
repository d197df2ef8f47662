"""Quest: query-aware page selection at decode (Tang et al. 2024), as a `SliceKernel`.

Per page of `page` tokens the kernel keeps channel-wise key minima m and maxima M (post-RoPE).
A decode query q scores each page with the upper bound of q.k over its keys,

    U(page) = sum_i max(q_i * m_i, q_i * M_i)

and attends only to the top `max(3, budget // page)` pages, per query head. Prefill steps and the
first `dense_layers` layers are dense; a context within the budget is dense (bitwise equal).

NOTE: this simulates Quest's selection for quality: the selected keys are masked, not gathered,
so the store still reads every token. `read_tokens / total_tokens` counts what Quest would read.
Page metadata is cached per slice for full pages (tokens are append-only under Quest).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvtier.attention.dense import attend
from kvtier.attention.interface import SliceStep
from kvtier.errors import ConfigError


class QuestKernel:
    """Dense prefill, top-page sparse decode under a token `budget`."""

    def __init__(self, budget: int, page: int = 16, dense_layers: int = 2) -> None:
        if page < 1 or budget < page:
            raise ConfigError(f"--kv-budget {budget} for Quest must be at least one page of {page} tokens")
        self.budget, self.page, self.dense_layers = budget, page, dense_layers
        self._meta: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}  # full pages' min, max
        self.read_tokens = 0
        self.total_tokens = 0

    def _minmax(self, kv: torch.Tensor, step: SliceStep) -> tuple[torch.Tensor, torch.Tensor]:
        """Key minima and maxima per page, [P, G, D] each; the last page may be partial."""
        key = (step.layer, step.group)
        s, p = kv.shape[0], self.page
        full = s // p
        lo, hi = self._meta.get(key, (kv.new_empty(0, *kv.shape[2:]), kv.new_empty(0, *kv.shape[2:])))
        if lo.shape[0] < full:
            keys = kv[lo.shape[0] * p : full * p, 0].unflatten(0, (-1, p))  # [P', p, G, D]
            lo, hi = torch.cat((lo, keys.amin(1))), torch.cat((hi, keys.amax(1)))
            self._meta[key] = (lo, hi)
        if s > full * p:
            tail = kv[full * p :, 0]
            lo, hi = torch.cat((lo, tail.amin(0, keepdim=True))), torch.cat((hi, tail.amax(0, keepdim=True)))
        return lo, hi

    def __call__(self, q: torch.Tensor, kv: torch.Tensor, step: SliceStep) -> torch.Tensor:
        t, hq, d = q.shape
        s, _, g, _ = kv.shape
        pages = -(-s // self.page)
        top_k = min(max(3, self.budget // self.page), pages)
        if step.start == 0:
            self._meta.pop((step.layer, step.group), None)  # a new sequence
        if t == 1:
            self.total_tokens += s * hq
        if t > 1 or step.layer < self.dense_layers or s <= self.budget or top_k >= pages:
            if t == 1:
                self.read_tokens += s * hq
            return attend(q, kv)
        lo, hi = self._minmax(kv, step)
        r = hq // g
        qh = q[0].view(g, r, 1, d)  # [G, r, 1, D]
        bound = torch.maximum(qh * lo.permute(1, 0, 2)[:, None], qh * hi.permute(1, 0, 2)[:, None]).sum(-1)
        bound[..., -1] = float("inf")  # NOTE: the current token's page is always read
        top = bound.topk(top_k, dim=-1).indices  # [G, r, K]
        chosen = torch.zeros(g, r, pages, dtype=torch.bool, device=q.device)
        chosen.scatter_(-1, top, True)
        mask = chosen.repeat_interleave(self.page, dim=-1)[..., :s].reshape(1, hq, 1, s)
        self.read_tokens += int(mask.sum())
        keys = kv[:, 0].repeat_interleave(r, dim=1).transpose(0, 1)[None]  # [1, H_q, S, D]
        values = kv[:, 1].repeat_interleave(r, dim=1).transpose(0, 1)[None]
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys, values, attn_mask=mask)
        return out[0].transpose(0, 1)  # [1, H_q, D]
