"""Sliding-window slices of the tiered store, and which store parts a model's attention allows.

A layer whose window binds at the store's capacity (`ModelConfig.window_of`) needs only its last
`window - 1` tokens before a step. Its slices are always resident, in a buffer of
`kvtier.planner.memory.window_tokens` tokens (the window plus one step), whatever the plan
places; the plan's resident count applies to the other layers' slices. Tokens past the window
are dropped when the next step would not fit:

```
 buffer of C tokens:  [ t0 .................. t(n-1) ]     n + step > C
 trim:                [ t(n-w+1) .. t(n-1) | free      ]   the last w - 1 tokens moved to the front
```

The kernel gets the slice's stored tokens and the layer's `LayerAttention` (in `SliceStep`):
`kvtier.attention.dense.attend` crops and masks by the window, so which older tokens are still
stored does not change the result.
"""

from __future__ import annotations

import torch

from kvtier.attention.interface import DenseKernel, SliceKernel
from kvtier.attention.spec import LayerAttention
from kvtier.config import ModelConfig
from kvtier.errors import ConfigError
from kvtier.kv.layout import KVLayout


def windowed_slices(cfg: ModelConfig, layout: KVLayout, context: int) -> dict[int, int]:
    """Slice id -> window, for the slices of layers whose window binds at `context` tokens."""
    out = {}
    for layer in cfg.windowed_layers(context):
        window = cfg.window_of(layer, context)
        assert window is not None
        for g in range(layout.num_groups):
            out[layout.slice_index(layer, g)] = window
    return out


def trim(buf: torch.Tensor, stored: int, window: int) -> int:
    """Keep the last `window - 1` of the `stored` tokens of buf [C, 2, G, D], moved to the
    front; returns how many it keeps."""
    keep = min(stored, window - 1)
    if keep < stored:
        buf[:keep] = buf[stored - keep : stored].clone()  # NOTE: the ranges may overlap
    return keep


def plain_limit(cfg: ModelConfig, context: int) -> int | None:
    """The longest sequence the store may grow to when it treats sliding-window layers as plain
    causal because their window does not bind at `context` (None: no such layer)."""
    if cfg.sliding_window is None or not cfg.sliding_layers or cfg.windowed_layers(context):
        return None
    return cfg.sliding_window


def check_parts(
    specs: tuple[LayerAttention, ...],
    kernel: SliceKernel | None,
    rotate_keys: bool,
    has_codec: bool,
    has_evictor: bool,
) -> None:
    """Raise ConfigError when a method's store parts meet attention they are not exact for: the
    lossy kernels, codecs and evictors know plain causal attention only (windowed slices are
    the store's own, and soft-capping needs the dense kernel's scores)."""
    special = [s for s in specs if not s.plain]
    if not special:
        return
    parts = []
    if kernel is not None and not isinstance(kernel, DenseKernel):
        parts.append(f"the attention kernel {type(kernel).__name__}")
    if not rotate_keys:
        parts.append("un-rotated keys")
    if has_codec:
        parts.append("a KV codec (--kv-quant)")
    if has_evictor:
        parts.append("an evictor (--evict, --head-sparsity)")
    if not parts:
        return
    what = []
    if any(s.window is not None for s in special):
        what.append(f"sliding windows of {next(s.window for s in special if s.window is not None)} tokens")
    if any(s.softcap is not None for s in special):
        what.append("logit soft-capping")
    if any(s.latent is not None for s in special):
        what.append("latent attention (MLA)")
    elif any(s.scale is not None for s in special):
        what.append("a custom query scale")
    raise ConfigError(
        f"{' and '.join(parts)} cannot run this model's attention ({', '.join(what)}) yet; "
        "run it lossless (no --attention/--kv-quant/--evict/--head-sparsity)"
        + (", or keep prompt plus output within the window" if what[0].startswith("sliding") else "")
    )
