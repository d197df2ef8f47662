"""Exact attention kernels over token-major KV, built on PyTorch's fused SDPA.

KV is stored token-major, `kv[t, 0]` = keys and `kv[t, 1]` = values of token t: [S, 2, H_kv, D].
Queries are [T, H_q, D] with H_q = r * H_kv (query heads of one KV head are adjacent, as in
Hugging Face's `repeat_kv`). All functions are pure.

Chunk-vs-prefix causality is "lower-right": query i of a chunk of T sees keys 0 .. S - T + i.
It goes through `causal_lower_right`, which SDPA runs on a flash kernel on CUDA instead of an
explicit mask tensor.

A layer's `LayerAttention` may add a sliding window (query i also needs key j > S - T + i -
window: an explicit [T, S] mask over the window's keys, SDPA's masked kernel), or soft-capping
and a custom scale (Gemma-2), which no fused kernel takes: `scored_attention` computes those
scores itself, over blocks of keys with an online softmax, so memory stays one block of scores.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import replace
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from kvtier.attention.cudnn_split import attend_split
from kvtier.attention.spec import PLAIN, LayerAttention
from kvtier.errors import ConfigError

if TYPE_CHECKING:
    from torch.nn.attention.bias import CausalBias

DECODE_SPLIT = 16384  # keys per segment of split-KV decode
SCORE_ELEMENTS = 1 << 25  # scores per key block of `scored_attention` (x 12 B live per score)
# Prefill attention on CUDA: "flash" (one lower-right causal call to PyTorch's flash kernel),
# "cudnn" (cuDNN's kernel: prefix and chunk as calls merged by log-sum-exp, see
# kvtier.attention.cudnn_split) or "auto" (cuDNN on Hopper and newer, where the H200 measured it
# 1.7x faster: bench/results/attn_backends.json; flash elsewhere). Read once, at import.
ATTN_BACKEND = os.environ.get("KVTIER_ATTN_BACKEND", "auto")
if ATTN_BACKEND not in ("auto", "flash", "cudnn"):
    raise ConfigError(f"KVTIER_ATTN_BACKEND={ATTN_BACKEND!r}: use 'auto', 'flash' or 'cudnn'")


def attend(
    q: torch.Tensor, kv: torch.Tensor, attn: LayerAttention = PLAIN, cudnn: bool = True
) -> torch.Tensor:
    """Causal attention of the last T positions, q [T, H_q, D], over kv [S, 2, H_kv, D], S >= T,
    scored as `attn` says (window, soft-capping, scale).

    `cudnn=False` keeps prefill off cuDNN whatever ATTN_BACKEND says, for callers whose (T, S)
    shapes rarely repeat: cuDNN builds a graph and loads a kernel module per new shape, and the
    load waits for the whole device (see `kvtier.kv.paged`).

    Returns [T, H_q, D] (a latent spec: [T, H_q, latent]). The result of each head does not
    depend on how many heads share the call.
    """
    if attn.latent is not None:
        entry = _entries(kv)  # [S, 1, 2D]
        return scored_attention(q, entry, entry[..., : attn.latent], attn, causal=True)[0].to(q.dtype)
    if attn.window is not None:
        t, w = q.shape[0], attn.window
        kv = kv[max(0, kv.shape[0] - (w + t - 1)) :]  # keys older than every query's window go
        if kv.shape[0] <= w:  # the window hides none of the rest
            attn = replace(attn, window=None)
    hkv = kv.shape[2]
    if q.device.type == "cpu" and hkv > 1:
        # NOTE: the CPU kernels' reduction order depends on the number of heads in a call; one
        # call per KV head keeps results bitwise independent of the head-group size. CUDA kernels
        # compute each head in its own thread blocks, so they need no loop.
        r = q.shape[1] // hkv
        return torch.cat(
            [_attend(q[:, h * r : (h + 1) * r], kv[:, :, h : h + 1], attn, cudnn) for h in range(hkv)],
            dim=1,
        )
    return _attend(q, kv, attn, cudnn)


def _attend(q: torch.Tensor, kv: torch.Tensor, attn: LayerAttention, cudnn: bool) -> torch.Tensor:
    if attn.scored:
        return scored_attention(q, kv[:, 0], kv[:, 1], attn, causal=True)[0].to(q.dtype)
    if attn.window is not None:
        return _attend_windowed(q, kv, attn.window)
    t, hq, d = q.shape
    s, _, hkv, _ = kv.shape
    # NOTE: SDPA's fused (flash / memory-efficient) kernels take only 4-D [B, H, L, D] inputs;
    # 3-D inputs silently fall back to the math kernel, which materializes the scores.
    k = kv[:, 0].transpose(0, 1).unsqueeze(0)  # [1, H_kv, S, D]
    v = kv[:, 1].transpose(0, 1).unsqueeze(0)
    if t == 1:
        # A single query needs no mask; fold the r query heads of each KV head into the query
        # axis so no K/V expansion is needed.
        qf = q.view(1, hkv, hq // hkv, d)  # [1, H_kv, r, D]
        if s >= 2 * DECODE_SPLIT:
            return _split_kv_decode(qf, kv).reshape(1, hq, d)
        if _flash_ok(qf):
            # NOTE: not SDPA's dispatcher, which may pick cuDNN: it builds a graph per new key
            # length, i.e. every decode step (~40 ms on the H200).
            return torch.ops.aten._scaled_dot_product_flash_attention(qf, k, v)[0].reshape(1, hq, d)
        return F.scaled_dot_product_attention(qf, k, v).reshape(1, hq, d)
    qt = q.transpose(0, 1).unsqueeze(0)  # [1, H_q, T, D]
    if cudnn and _flash_ok(qt) and _use_cudnn(q.device.index or 0):
        return attend_split(q, kv)
    if _flash_ok(qt):
        # NOTE: the flash kernel's causal mask is aligned lower-right and it takes GQA K/V as
        # they are; calling it directly skips `causal_lower_right`'s Python dispatch (~50 us,
        # paid once per streamed slice: 256 per layer-chunk with head-wise offload).
        out = torch.ops.aten._scaled_dot_product_flash_attention(qt, k, v, 0.0, True)[0]
    else:
        mask = _lower_right(t, s)
        out = F.scaled_dot_product_attention(qt, k, v, attn_mask=mask, enable_gqa=hq != hkv)
    return out[0].transpose(0, 1)  # [T, H_q, D]


def _lower_right(t: int, s: int) -> CausalBias:
    """`causal_lower_right(t, s)`, imported on first use: its module imports torch._dynamo (1.6 s
    of every `kvtier` command's start on the dev CPU: `kvtier plan` took 4.5 s), which the CUDA
    paths, calling the flash kernel directly, never need."""
    from torch.nn.attention.bias import causal_lower_right

    return causal_lower_right(t, s)


def _entries(kv: torch.Tensor) -> torch.Tensor:
    """kv [S, 2, 1, D] of a latent layer -> its entries [S, 1, 2D] (K and V rows side by side: a
    view, since slices are token-major)."""
    return kv.reshape(kv.shape[0], 1, 2 * kv.shape[-1])


def window_mask(t: int, s: int, window: int | None, device: torch.device) -> torch.Tensor:
    """[T, S] bool: query i of the last T positions may see key j (lower-right causal, and
    within `window` tokens of itself when given)."""
    rows = torch.arange(t, device=device)[:, None] + (s - t)  # [T, 1] the query's position
    cols = torch.arange(s, device=device)[None, :]  # [1, S]
    keep = cols <= rows
    return keep if window is None else keep & (cols > rows - window)


def _attend_windowed(q: torch.Tensor, kv: torch.Tensor, window: int) -> torch.Tensor:
    """Sliding-window causal attention, q [T, H_q, D] over kv [S, 2, H_kv, D] -> [T, H_q, D].

    The r query heads of a KV head fold into the query axis (their rows of the mask repeat), so
    K/V are not expanded; the mask is [r T, S] with S <= window + T - 1 (`attend` crops the rest).
    """
    t, hq, d = q.shape
    s, _, hkv, _ = kv.shape
    r = hq // hkv
    k = kv[:, 0].transpose(0, 1).unsqueeze(0)  # [1, H_kv, S, D]
    v = kv[:, 1].transpose(0, 1).unsqueeze(0)
    qf = q.view(t, hkv, r, d).permute(1, 2, 0, 3).reshape(1, hkv, r * t, d)  # [1, H_kv, r T, D]
    mask = window_mask(t, s, window, q.device).repeat(r, 1)  # [r T, S]
    out = F.scaled_dot_product_attention(qf, k, v, attn_mask=mask)  # [1, H_kv, r T, D]
    return out[0].view(hkv, r, t, d).permute(2, 0, 1, 3).reshape(t, hq, d)


def scored_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn: LayerAttention, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention with scores computed here (soft-capping, a custom scale, a window), exact.

    q [T, H_q, D], k [S, H_kv, D], v [S, H_kv, Dv]. `causal`: query i is at key position
    S - T + i (lower-right) and sees keys up to it, within `attn.window`; else every key.
    Returns (out [T, H_q, Dv] float32, natural-log lse [T, H_q] float32). Scores are q.k in
    the inputs' dtype (as transformers' eager attention), then scaled and capped in float32; keys
    are taken in blocks of `SCORE_ELEMENTS` scores with an online softmax, so memory is one block
    whatever S is.
    """
    t, hq, d = q.shape
    s, hkv, _ = k.shape
    dv = v.shape[-1]
    r = hq // hkv
    scale = attn.scale if attn.scale is not None else d**-0.5
    qf = q.view(t, hkv, r, d).permute(1, 2, 0, 3)  # [H_kv, r, T, D]
    kt = k.permute(1, 2, 0)  # [H_kv, D, S]
    vt = v.transpose(0, 1)  # [H_kv, S, D]
    block = max(1, SCORE_ELEMENTS // (hq * t))
    rows = torch.arange(t, device=q.device)[:, None] + (s - t)  # [T, 1] each query's key position
    m = torch.full((hkv, r, t), -math.inf, device=q.device)  # running max
    total = torch.zeros((hkv, r, t), device=q.device)  # running sum of exp
    acc = torch.zeros((hkv, r, t, dv), device=q.device)  # running output, float32
    for a in range(0, s, block):
        b = min(a + block, s)
        sc = torch.matmul(qf, kt[:, None, :, a:b]).float() * scale  # [H_kv, r, T, n]
        if attn.softcap is not None:
            sc = torch.tanh(sc / attn.softcap) * attn.softcap
        if causal and (b - 1 > s - t or (attn.window is not None and a <= s - 1 - attn.window)):
            cols = torch.arange(a, b, device=q.device)[None, :]  # [1, n]
            keep = cols <= rows
            if attn.window is not None:
                keep &= cols > rows - attn.window
            sc = sc.masked_fill(~keep, -math.inf)
        m_new = torch.maximum(m, sc.amax(-1))
        # NOTE: a row whose keys were all masked so far has max -inf; shift it by 0 instead, so
        # exp gives 0 rather than NaN.
        shift = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        p = torch.exp(sc - shift[..., None])  # [H_kv, r, T, n]
        alpha = torch.exp(m - shift)
        total = total * alpha + p.sum(-1)
        acc = acc * alpha[..., None] + torch.matmul(p.to(v.dtype), vt[:, None, a:b]).float()
        m = m_new
    out = acc / total[..., None]
    lse = m + torch.log(total)
    return out.permute(2, 0, 1, 3).reshape(t, hq, dv), lse.permute(2, 0, 1).reshape(t, hq)


def _flash_ok(q: torch.Tensor) -> bool:
    """Whether SDPA's flash kernel takes q [1, H, T, D] (and K/V laid out like it): CUDA, 16-bit,
    head dim a multiple of 8 up to 256. Strides are fine: `attend`'s K/V views keep the last
    dimension contiguous."""
    d = q.shape[-1]
    return (
        q.is_cuda
        and q.dtype in (torch.float16, torch.bfloat16)
        and d % 8 == 0
        and d <= 256
        and _sm80(q.device.index or 0)
    )


@functools.cache
def _sm80(device: int) -> bool:
    return torch.cuda.get_device_capability(device) >= (8, 0)


@functools.cache
def _use_cudnn(device: int) -> bool:
    """Whether prefill attention runs on cuDNN (see ATTN_BACKEND)."""
    if ATTN_BACKEND != "auto":
        return ATTN_BACKEND == "cudnn"
    return torch.backends.cudnn.is_available() and torch.cuda.get_device_capability(device) >= (9, 0)


def _split_kv_decode(qf: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    """Decode attention over a long KV as a batch of KV segments, merged by log-sum-exp.

    qf [1, H_kv, r, D], kv [S, 2, H_kv, D] -> [1, H_kv, r, D]. Fused kernels parallelize over
    (batch, head, query block); one query over one head would run on a single SM, so the keys
    are cut into DECODE_SPLIT-token segments that run side by side (flash-decoding).
    """
    s, _, hkv, d = kv.shape
    p = s // DECODE_SPLIT
    main = kv[: p * DECODE_SPLIT].view(p, DECODE_SPLIT, 2, hkv, d)
    k = main[:, :, 0].transpose(1, 2)  # [P, H_kv, seg, D]
    v = main[:, :, 1].transpose(1, 2)
    out, lse = _sdpa_lse_batched(qf.expand(p, -1, -1, -1), k, v)  # [P, H_kv, r, D], [P, H_kv, r]
    outs, lses = [out.float()], [lse.float()]
    if s > p * DECODE_SPLIT:
        rest = kv[p * DECODE_SPLIT :]
        o2, l2 = _sdpa_lse_batched(qf, rest[:, 0].transpose(0, 1)[None], rest[:, 1].transpose(0, 1)[None])
        outs.append(o2.float())
        lses.append(l2.float())
    o_all, l_all = torch.cat(outs), torch.cat(lses)  # [P', H_kv, r, D], [P', H_kv, r]
    w = torch.softmax(l_all, dim=0)[..., None]
    return (o_all * w).sum(0, keepdim=True).to(qf.dtype)


def attend_prefix_lse(
    q: torch.Tensor, kv: torch.Tensor, attn: LayerAttention = PLAIN
) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-causal attention of all queries over a block of earlier keys, with log-sum-exp.

    q [T, H_q, D], kv [S, 2, H_kv, D] -> (out [T, H_q, D] float32, lse [T, H_q] float32).
    Used to stream a long prefix in sequence blocks and merge the parts exactly. `attn` may
    soft-cap or scale, not window (windowed layers are never streamed in blocks).
    """
    assert attn.window is None, "windowed layers are not streamed in sequence blocks"
    if attn.latent is not None:
        entry = _entries(kv)
        return scored_attention(q, entry, entry[..., : attn.latent], attn, causal=False)
    if attn.scored:
        return scored_attention(q, kv[:, 0], kv[:, 1], attn, causal=False)
    t, hq, d = q.shape
    hkv = kv.shape[2]
    r = hq // hkv
    # No mask, so the r query heads of a KV head fold into the query axis: [H_kv, r*T, D].
    qf = q.view(t, hkv, r, d).permute(1, 2, 0, 3).reshape(hkv, r * t, d)
    out, lse = _sdpa_lse(qf, kv[:, 0].transpose(0, 1), kv[:, 1].transpose(0, 1), causal=False)
    out = out.view(hkv, r, t, d).permute(2, 0, 1, 3).reshape(t, hq, d)
    lse = lse.view(hkv, r, t).permute(2, 0, 1).reshape(t, hq)
    return out.float(), lse.float()


def attend_self_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn: LayerAttention = PLAIN
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of a chunk over its own keys, k and v [T, H_kv, D], with log-sum-exp."""
    assert attn.window is None, "windowed layers are not streamed in sequence blocks"
    if attn.latent is not None:
        entry = torch.cat((k, v), dim=-1)  # [T, 1, 2D]
        return scored_attention(q, entry, entry[..., : attn.latent], attn, causal=True)
    if attn.scored:
        return scored_attention(q, k, v, attn, causal=True)
    hq, hkv = q.shape[1], k.shape[1]
    r = hq // hkv
    kk = k.repeat_interleave(r, dim=1).transpose(0, 1)  # [H_q, T, D]
    vv = v.repeat_interleave(r, dim=1).transpose(0, 1)
    out, lse = _sdpa_lse(q.transpose(0, 1), kk, vv, causal=True)
    return out.transpose(0, 1).float(), lse.transpose(0, 1).float()


def merge_into(
    acc: tuple[torch.Tensor, torch.Tensor] | None, part: tuple[torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fold a partial result (out [T, H, D] float32, lse [T, H]) into a running one.

    Exact up to rounding: softmax over the union of disjoint key sets. Memory stays one partial.
    """
    if acc is None:
        return part
    (o1, l1), (o2, l2) = acc, part
    lse = torch.logaddexp(l1, l2)
    out = o1 * torch.exp(l1 - lse)[..., None] + o2 * torch.exp(l2 - lse)[..., None]
    return out, lse


def merge_stacked(out: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Partial results of disjoint key sets stacked on dim 0, out [P, T, H, D] float32 and lse
    [P, T, H], merged in one pass: `merge_into` folded over them, up to rounding, in a fixed
    handful of operators whatever P (a layer's CPU parts at decode, on its critical path). Every
    (t, h) needs one partial with a finite lse."""
    total = torch.logsumexp(lse, dim=0)  # [T, H]
    weights = torch.exp(lse - total)  # [P, T, H]
    return (out * weights[..., None]).sum(0), total


def _sdpa_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """SDPA that also returns the log-sum-exp: q [H, T, D], k/v [H, S, D] -> ([H, T, D], [H, T])."""
    out, lse = _sdpa_lse_batched(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), causal)
    return out[0], lse[0]


def _sdpa_lse_batched(
    qb: torch.Tensor, kb: torch.Tensor, vb: torch.Tensor, causal: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, H, T, D], k/v [B, H, S, D] -> (out [B, H, T, D], lse [B, H, T])."""
    q = qb
    if q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16):
        res = torch.ops.aten._scaled_dot_product_flash_attention(qb, kb, vb, 0.0, causal)
        return res[0], res[1]
    if q.device.type == "cuda":
        res = torch.ops.aten._scaled_dot_product_efficient_attention(qb, kb, vb, None, True, 0.0, causal)
        return res[0], res[1][..., : q.shape[2]]
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qb, kb, vb, 0.0, causal)
        return out, lse
    return _math_lse(qb, kb, vb, causal)


def _math_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    scores = (q.float() @ k.float().transpose(-1, -2)) / q.shape[-1] ** 0.5  # [H, T, S]
    if causal:
        t, s = scores.shape[-2:]
        keep = torch.ones(t, s, dtype=torch.bool, device=q.device).tril(s - t)
        scores = scores.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return (torch.softmax(scores, dim=-1) @ v.float()).to(q.dtype), lse
