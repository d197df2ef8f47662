"""Head-wise sparsity (DuoAttention style): retrieval heads keep every token, streaming heads keep
sinks + a recent window. Heads are classified without training, RazorAttention style.

Calibration: BOS + a random segment of `segment` token ids repeated `repeats` times, one prefill.
For each query head, over queries i in the repeats (i >= segment):

    echo(h)      = mean_i sum_m A_h[i, i - m * segment]        (attends to the same token earlier)
    induction(h) = mean_i sum_m A_h[i, i - m * segment + 1]    (attends to the token after it)

A KV head's score is max over its query heads of echo + induction; the `ratio` lowest-scoring
slices (layer, KV-head group; a group scores as its best head) become streaming heads. Scores are
cached per model on disk, keyed by the model's config and a weight fingerprint.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import torch

from kvtier.attention.dense import attend
from kvtier.config import ModelConfig
from kvtier.errors import ConfigError
from kvtier.kv.layout import KVLayout
from kvtier.model.llama import CausalLM
from kvtier.model.rope import Rotary
from kvtier.policies.evict import check_budget

DEFAULT_CACHE = Path.home() / ".cache" / "kvtier" / "head_scores"


class _ScoringAttention:
    """An `Attention` for one calibration prefill from position 0: exact output, plus scores."""

    def __init__(self, cfg: ModelConfig, segment: int, n: int) -> None:
        self.rotary = Rotary(cfg.rope, cfg.head_dim)
        self.cos, self.sin = self.rotary.cos_sin(torch.arange(n), torch.float32)
        self.cfg, self.segment = cfg, segment
        self.scores = torch.zeros(cfg.num_layers, cfg.num_kv_heads)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        cos, sin = self.cos.to(q.device), self.sin.to(q.device)
        q = Rotary.apply(q, cos.to(q.dtype), sin.to(q.dtype))  # [T, H_q, D]
        k = Rotary.apply(k, cos.to(k.dtype), sin.to(k.dtype))  # [T, H_kv, D]
        t, hq, d = q.shape
        r, dev = hq // k.shape[1], q.device
        kk = k.float().repeat_interleave(r, dim=1)  # [T, H_q, D]
        logits = torch.einsum("thd,shd->hts", q.float(), kk) / math.sqrt(d)  # [H_q, T, T]
        logits.masked_fill_(torch.ones(t, t, dtype=torch.bool, device=dev).triu(1), float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        rows = torch.arange(1 + self.segment, t, device=dev)  # queries in the repeats (0 is BOS)
        echo = torch.zeros(hq, rows.shape[0], device=dev)
        induction = torch.zeros(hq, rows.shape[0], device=dev)
        for m in range(1, (t - 1) // self.segment):
            earlier = rows - m * self.segment
            ok = earlier >= 1
            echo[:, ok] += probs[:, rows[ok], earlier[ok]]
            induction[:, ok] += probs[:, rows[ok], earlier[ok] + 1]
        per_q = (echo + induction).mean(dim=1)  # [H_q]
        self.scores[layer] = per_q.view(-1, r).amax(dim=1).cpu()
        return attend(q, torch.stack((k, v), dim=1))


def _fingerprint(model: CausalLM, segment: int, repeats: int, seed: int) -> str:
    h = hashlib.sha256(json.dumps(model.config.to_dict(), sort_keys=True, default=str).encode())
    h.update(f"{segment}/{repeats}/{seed}".encode())
    for p in list(model.parameters())[:8]:
        h.update(p.detach().flatten()[:4096].float().cpu().numpy().tobytes())
    return h.hexdigest()[:20]


def head_scores(
    model: CausalLM,
    *,
    segment: int = 256,
    repeats: int = 4,
    seed: int = 0,
    cache_dir: Path | None = DEFAULT_CACHE,
) -> torch.Tensor:
    """Retrieval scores [num_layers, num_kv_heads] (float32) of `model`; deterministic."""
    key = _fingerprint(model, segment, repeats, seed)
    path = cache_dir / f"{key}.json" if cache_dir is not None else None
    if path is not None and path.is_file():
        return torch.tensor(json.loads(path.read_text())["scores"])
    cfg = model.config
    lo, hi = min(10000, cfg.vocab_size // 2), min(12500, cfg.vocab_size)
    gen = torch.Generator().manual_seed(seed)
    seg = torch.randint(lo, hi, (segment,), generator=gen)
    bos = torch.tensor([cfg.bos_token_id if cfg.bos_token_id is not None else 0])
    ids = torch.cat((bos, seg.repeat(repeats)))
    attention = _ScoringAttention(cfg, segment, ids.shape[0])
    model(ids.to(next(model.parameters()).device), attention)  # calibration ids are made on the CPU
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"scores": attention.scores.tolist()}))
    return attention.scores


class HeadStreamingEvictor:
    """Evicts only the streaming slices: they keep `sinks` first and `recent` newest tokens;
    retrieval slices keep everything (original positions: keys stay rotated)."""

    def __init__(
        self,
        scores: torch.Tensor,
        ratio: float,
        sinks: int = 64,
        recent: int = 256,
        strict_budget: bool = False,
    ) -> None:
        if not 0.0 < ratio < 1.0:
            raise ConfigError(f"--head-sparsity must be a fraction between 0 and 1, got {ratio}")
        if recent < 1 or sinks < 0:
            raise ConfigError(f"streaming heads need a recent window of at least 1 token, got {recent}")
        self.scores, self.ratio = scores, ratio  # [L, H_kv]
        self.sinks, self.recent, self.strict = sinks, recent, strict_budget
        self.streaming: frozenset[int] = frozenset()
        self.group_size = 1

    def streaming_slices(self, layout: KVLayout) -> frozenset[int]:
        """The `ratio` lowest-scoring slices (ties by index): deterministic."""
        per_slice = (
            self.scores.view(layout.num_layers, layout.num_groups, layout.group_size).amax(-1).flatten()
        )
        n = round(self.ratio * layout.num_slices)
        order = sorted(range(layout.num_slices), key=lambda s: (float(per_slice[s]), s))
        return frozenset(order[:n])

    def bind(self, layout: KVLayout, capacity: int) -> frozenset[int]:
        if self.strict:
            check_budget(self.sinks + self.recent, capacity, "--head-sparsity")
        self.group_size = layout.group_size
        self.streaming = self.streaming_slices(layout)
        return self.streaming

    def keep(self, slice_id: int, length: int, new_tokens: int) -> torch.Tensor | None:
        if slice_id not in self.streaming or length <= self.sinks + self.recent:
            return None
        idx = torch.cat((torch.arange(self.sinks), torch.arange(length - self.recent, length)))
        return idx.expand(self.group_size, -1)
