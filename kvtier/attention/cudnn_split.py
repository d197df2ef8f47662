"""Chunk-vs-prefix causal attention on cuDNN's fused kernel, as two calls merged by log-sum-exp.

PyTorch's cuDNN attention aligns its causal mask top-left, so a chunk of T queries after a
prefix of P keys cannot be one cuDNN call. It is two kinds of call, both exact:

```
 keys:        [ prefix 0 .. P-1 ][ chunk P .. P+T-1 ]
 queries T:   [  all visible    ][ causal, square   ]   square: top-left == lower-right
 call:          non-causal          causal
```

merged per query and head by the parts' log-sum-exp (softmax over the union of the key sets).
A long prefix is cut into blocks of a fixed size (`prefix_blocks`), so the shapes cuDNN sees
repeat from chunk to chunk. The prefix calls fold each KV head's r query heads into the query
axis, so they need no K/V expansion; the square part expands the chunk's own K/V (T tokens).

On the H200 cuDNN's kernel runs near twice as fast as the flash kernel PyTorch ships (FA2), so
prefill at long context, where attention dominates, gains most. `kvtier.attention.dense`
uses it on Hopper and newer unless `KVTIER_ATTN_BACKEND=flash`.
"""

from __future__ import annotations

import torch

PREFIX_BLOCK = 65536  # keys per cuDNN call over the prefix (rounded to a multiple of the chunk)


def attend_split(q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    """Causal attention of the last T positions, q [T, H_q, D] over kv [S, 2, H_kv, D] (CUDA,
    16-bit); returns [T, H_q, D] in q's dtype."""
    t, hq, d = q.shape
    s, _, hkv, _ = kv.shape
    r, p = hq // hkv, s - t
    k = kv[:, 0].transpose(0, 1).unsqueeze(0)  # [1, H_kv, S, D]
    v = kv[:, 1].transpose(0, 1).unsqueeze(0)
    ks, vs = k[:, :, p:], v[:, :, p:]  # the chunk's own keys [1, H_kv, T, D]
    if r > 1:
        ks, vs = ks.repeat_interleave(r, dim=1), vs.repeat_interleave(r, dim=1)  # [1, H_q, T, D]
    o_s, lse = _cudnn(q.transpose(0, 1).unsqueeze(0), ks, vs, causal=True)  # [H_q, T, D], [H_q, T]
    del ks, vs
    if p == 0:
        return o_s.transpose(0, 1)
    qf = q.view(t, hkv, r, d).permute(1, 2, 0, 3).reshape(1, hkv, r * t, d)  # [1, H_kv, r T, D]
    out = o_s.float()  # running result [H_q, T, D]
    del o_s
    for a, b in prefix_blocks(p, t):
        o_p, l_p = _cudnn(qf, k[:, :, a:b], v[:, :, a:b], causal=False)  # [H_kv, r T, D], [H_kv, r T]
        l_p = l_p.reshape(hq, t)
        # out <- out + w (o_p - out), w = exp(l_p - logaddexp(lse, l_p)): the parts' softmax weights.
        out.lerp_(o_p.reshape(hq, t, d).float(), torch.sigmoid(l_p - lse)[..., None])
        lse = torch.logaddexp(lse, l_p)
    return out.to(q.dtype).transpose(0, 1)


def prefix_blocks(prefix: int, chunk: int) -> list[tuple[int, int]]:
    """Key ranges [a, b) covering the prefix, in blocks of a fixed multiple of the chunk near
    `PREFIX_BLOCK` keys. cuDNN builds (and caches) a graph per shape: on the H200 a step whose
    key length was new every time cost ~40 ms more host time (bench/host_overhead.py before it
    held shapes constant), and a chunked prefill meets a new prefix length every chunk. Blocks
    leave only full blocks and remainders that are multiples of the chunk: a handful of shapes."""
    size = chunk * max(1, round(PREFIX_BLOCK / chunk))
    return [(a, min(a + size, prefix)) for a in range(0, prefix, size)]


def _cudnn(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [1, H, T, D], k/v [1, H, S, D] -> (out [H, T, D], natural-log lse [H, T] float32)."""
    res = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal)
    h, t = q.shape[1], q.shape[2]
    return res[0][0], res[1].reshape(h, t).float()
