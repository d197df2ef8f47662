"""The "kvtier" attention implementation registered with transformers.

HF's attention modules compute q, k, v, apply RoPE, call `cache.update(k, v, layer_idx)` and then
the attention function named by `config._attn_implementation`. A `TieredCache` appends nothing
in `update`: it hands the step's (already rotated) k and v over to this function, which runs
the step's attention inside the tiered store, where the KV lives.

```
LlamaAttention.forward(layer i)
  q, k = rope(q, k)
  k, v = cache.update(k, v, i)      TieredCache: hand_over(cache, i, k, v); return k, v
  out  = kvtier_attention(q, k, v)  takes the hand-over whose key *is* k -> cache.attend(i, q, k, v)
```

With any other cache (or none) the function is HF's SDPA attention, and the mask function is
HF's SDPA mask, so a model switched to "kvtier" runs as before without a `TieredCache`.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from kvtier.errors import ConfigError

NAME = "kvtier"
"""The attention implementation's name (`model.set_attn_implementation("kvtier")`)."""


class StoreAttention(Protocol):
    """What a hand-over is attended by (`TieredCache.attend`)."""

    def attend(
        self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> torch.Tensor: ...


@dataclass(frozen=True)
class HandOver:
    """One layer's step K/V, from `TieredCache.update` to the attention call that follows it."""

    cache: StoreAttention
    layer: int
    key: torch.Tensor  # [1, H_kv, T, D], rotated
    value: torch.Tensor  # [1, H_kv, T, D]


_LOCAL = threading.local()


def hand_over(item: HandOver) -> None:
    """Leave `item` for the attention call of its layer (on this thread)."""
    if getattr(_LOCAL, "pending", None) is not None:
        stale: HandOver = _LOCAL.pending
        _LOCAL.pending = None
        raise ConfigError(
            f"layer {stale.layer}'s attention did not run through kvtier after its cache update; "
            "this model calls its attention in a way kvtier.hf does not support"
        )
    _LOCAL.pending = item


def take(key: torch.Tensor) -> HandOver | None:
    """The hand-over whose key is `key` (the tensor `update` returned), None if there is none."""
    item: HandOver | None = getattr(_LOCAL, "pending", None)
    if item is None or item.key is not key:
        return None
    _LOCAL.pending = None
    return item


def drop() -> None:
    """Forget a hand-over left by a forward that failed midway."""
    _LOCAL.pending = None


def kvtier_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """`AttentionInterface` function: query [B, H_q, T, D], key/value [B, H_kv, S, D].

    Returns ([B, T, H_q, D], None) as HF's attention functions do.
    """
    item = take(key)
    if item is None:
        return _sdpa(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    if attention_mask is not None:
        raise ConfigError(
            "TieredCache runs causal attention over one unpadded sequence; this forward has an "
            "attention mask with padding (or a custom mask): pass one sequence without padding"
        )
    if dropout:
        raise ConfigError("TieredCache is for inference: call model.eval() (attention dropout is on)")
    head_dim = query.shape[-1]
    if scaling is not None and abs(scaling - head_dim**-0.5) > 1e-9 * head_dim**-0.5:
        raise ConfigError(
            f"this model scales attention scores by {scaling}, not 1/sqrt(head_dim); kvtier's "
            "kernels use 1/sqrt(head_dim)"
        )
    out = item.cache.attend(item.layer, query, item.key, item.value)  # [1, T, H_q, D]
    return out, None


def _sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float,
    scaling: float | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """HF's SDPA attention. `kvtier_mask` returns no mask for a causal step without padding;
    SDPA's own `is_causal` aligns the mask top-left, right only when the step is the whole key
    range, so a step after cached tokens gets the lower-right causal mask here."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    t, s = query.shape[2], key.shape[2]
    if attention_mask is None and 1 < t != s:
        attention_mask = torch.ones(t, s, dtype=torch.bool, device=query.device).tril(s - t)[None, None]
    out, _ = sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    return out, None


def kvtier_mask(**kwargs: Any) -> torch.Tensor | None:
    """`AttentionMaskInterface` function: None for a plain causal mask without padding (the
    store is causal by itself, so no [T, S] mask is built at long contexts), else HF's SDPA mask."""
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    mask = kwargs.get("attention_mask")
    plain = kwargs.get("mask_function", causal_mask_function) is causal_mask_function
    if plain and (mask is None or (mask.dim() == 2 and bool(mask.all()))):
        return None
    result: torch.Tensor | None = sdpa_mask(**kwargs)
    return result


_registered = False


def install(model: Any) -> None:
    """Register "kvtier" with transformers (once) and switch `model`'s attention to it."""
    global _registered
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    if not _registered:
        AttentionInterface.register(NAME, kvtier_attention)
        AttentionMaskInterface.register(NAME, kvtier_mask)
        _registered = True
    if model.config._attn_implementation != NAME:
        model.set_attn_implementation(NAME)
    if model.config._attn_implementation != NAME:
        raise ConfigError(
            f"{type(model).__name__} does not let its attention implementation be set; kvtier.hf "
            "needs a model built on transformers' AttentionInterface"
        )
