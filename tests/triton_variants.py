"""The variants of every launched Triton kernel of kvtier: the constexpr values and argument
specializations each kernel's Python wrapper can pass, for `tests.triton_compile_variants`
(compiled to TTIR for sm90) and `tests.triton_shared_fit` (compiled to cubin for smaller GPUs).

A variant is every argument of one launch as the wrapper passes it: pointers as `Ptr` (the
tensor's dtype), integers and floats as values, constexprs as values. Triton's own specializer
(`native_specialize_impl`, in the compiling module) turns them into the signature a real launch
compiles, so an integer argument equal to 1 becomes a constexpr there as it does on the GPU (a
stride of 1, one ring extent, a single KV head), and 16-divisible values and pointers get their
alignment hints. The wrappers' choices (dtypes, BLOCK sizes, strides, flags) are mirrored here by
hand, each builder naming its wrapper: change the builder with the wrapper. Importing this module
does not import triton (the test process lists the kernels and counts their variants with it).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

from tests.triton_variant_parts import ACT, HALF, ROOT, Ptr, Variant, _cases, _named, _p2, _strides
from tests.triton_variants_sparse import (
    _bisect,
    _buffers_attn_fwd,
    _chunk_max,
    _combine_lse,
    _gather_key_params,
    _head_score,
    _key_scores,
    _merge_splits,
    _put_rows,
    _sparse_attn_fwd,
)

__all__ = ["KERNELS", "ROOT", "Ptr", "Variant", "variants"]

# kernel -> its module; each one is launched by a wrapper in that module (or a sibling)
KERNELS: dict[str, str] = {
    "_rms_norm_kernel": "kvtier.model.fused",
    "_rope_kernel": "kvtier.model.fused",
    "_silu_mul_kernel": "kvtier.model.fused",
    "_paged_decode_split": "kvtier.attention.paged_decode",
    "_combine_splits": "kvtier.attention.paged_decode",
    "put_rows": "kvtier.sparse.triton_decode",
    "buffers_attn_fwd": "kvtier.sparse.triton_decode",
    "_row_lse": "kvtier.sparse.triton_head_score",
    "_chunk_score": "kvtier.sparse.triton_head_score",
    "_combine_lse": "kvtier.sparse.triton_head_score",
    "sparse_attn_fwd": "kvtier.sparse.triton_attn_kernels",
    "merge_splits": "kvtier.sparse.triton_attn_kernels",
    "_unpack_kivi": "kvtier.policies.quant_triton",
    "_unpack_fp8": "kvtier.policies.quant_triton",
    "_gather_rows": "kvtier.kv.host_gather",
    "_bisect_kernel": "kvtier.sparse.triton_bisect",
    "_chunk_max_kernel": "kvtier.sparse.triton_chunk_max",
    "_gather_key_params": "kvtier.sparse.triton_keys",
    "_key_scores_kernel": "kvtier.sparse.triton_landmarks",
}


# --- kvtier.model.fused ---------------------------------------------------------------------


def _rms_norm() -> Iterator[Variant]:
    # `_rms_norm_launch`: x [M, N] 16-bit; M 1 in a decode step of one sequence
    for c in _cases(dtype=HALF, HAS_DELTA=(False, True), N=(128, 576, 4096, 8192), M=(1, 7)):
        n, x = c["N"], Ptr(c["dtype"])
        block_n = _p2(n)
        block_m = max(1, 4096 // block_n)
        args = dict(
            x=x, delta=x, weight=x, out=x, summed=x, M=c["M"], N=n, inv_n=1.0 / n, eps=1e-5,
            HAS_DELTA=c["HAS_DELTA"], BLOCK_M=block_m, BLOCK_N=block_n, INTERPRET=False,
        )  # fmt: skip
        warps = 8 if block_m * block_n >= 4096 else 4
        yield Variant("_rms_norm_kernel", c, args, dict(num_warps=warps, enable_fp_fusion=False))


def _rope() -> Iterator[Variant]:
    # `rope`: x [T, H, D] a slice of heads of a fused [T, 2 * H + 8, D] projection
    for c in _cases(dtype=HALF, D=(64, 128, 256), H=(1, 3, 32)):
        d, h, p = c["D"], c["H"], Ptr(c["dtype"])
        args = dict(
            x=p, cos=p, sin=p, out=p, H=h, stride_xt=(2 * h + 8) * d, stride_xh=d, stride_ct=d, stride_st=d,
            HALF=d // 2, BLOCK_H=min(_p2(h), 16), BLOCK_HALF=_p2(d // 2), INTERPRET=False,
        )  # fmt: skip
        yield Variant("_rope_kernel", c, args, dict(num_warps=4, enable_fp_fusion=False))


def _silu_mul() -> Iterator[Variant]:
    # `silu_mul`: gate and up the halves of a [T, 2I] gate-up output
    for c in _cases(dtype=HALF, I=(64, 1536, 14336)):
        width, p = c["I"], Ptr(c["dtype"])
        args = dict(
            gate=p, up=p, out=p, width=width, stride_g=2 * width, stride_u=2 * width,
            BLOCK=min(4096, _p2(width)), INTERPRET=False,
        )  # fmt: skip
        yield Variant("_silu_mul_kernel", c, args, dict(num_warps=8, enable_fp_fusion=False))


# --- kvtier.attention.paged_decode ----------------------------------------------------------


def _paged_decode_split() -> Iterator[Variant]:
    # `paged_decode_splits`: q [B, H_q, D], pages [N, P, 2, H_kv, D] of q's dtype, int32 tables
    # and lengths; S splits (1: a full batch; lse's head stride is then 1)
    hkv, page, blocks = 2, 16, 64
    for c in _cases(dtype=ACT, D=(64, 128), R=(1, 3, 8), S=(1, 16)):
        d, r, s, p = c["D"], c["R"], c["S"], Ptr(c["dtype"])
        hq = hkv * r
        args = dict(
            Q=p, PAGES=p, TABLES=Ptr("int32"), LENS=Ptr("int32"), OUT=Ptr("float32"), LSE=Ptr("float32"),
            stride_qb=hq * d, stride_qh=d, stride_qd=1,
            **_named("stride_pn stride_ps stride_pkv stride_ph stride_pd", _strides(100, page, 2, hkv, d)),
            stride_tb=blocks, stride_tn=1,
            stride_ob=hq * s * d, stride_oh=s * d, stride_os=d, stride_lb=hq * s, stride_lh=s,
            sm_scale_log2=math.log2(math.e) / math.sqrt(d),
            PAGE=page, R=r, BLOCK_H=max(16, _p2(r)), D=d, BLOCK_D=max(16, _p2(d)), BLOCK_N=64,
            IEEE=c["dtype"] == "float32", INTERPRET=False,
        )  # fmt: skip
        yield Variant("_paged_decode_split", c, args, dict(num_warps=4))


def _combine_splits() -> Iterator[Variant]:
    # `combine_splits_fused`: fp32 partials [B, H, S, D] (S > 1) into [B, H, D] of q's dtype
    h = 8
    for c in _cases(dtype=ACT, D=(64, 128), S=(2, 33)):
        d, s = c["D"], c["S"]
        args = dict(
            PART=Ptr("float32"), LSE=Ptr("float32"), OUT=Ptr(c["dtype"]),
            **_named("stride_pb stride_ph stride_ps stride_pd", _strides(4, h, s, d)),
            **_named("stride_lb stride_lh stride_ls", _strides(4, h, s)),
            **_named("stride_ob stride_oh stride_od", _strides(4, h, d)),
            S=s, D=d, BLOCK_S=_p2(s), BLOCK_D=_p2(d),
        )  # fmt: skip
        yield Variant("_combine_splits", c, args, dict(num_warps=1 if d <= 64 else 2))


# --- kvtier.policies.quant_triton -----------------------------------------------------------


def _unpack_kivi() -> Iterator[Variant]:
    # `unpack_kivi_into`: KIVI rows of `group` 32 tokens, bits 2, 4 or 8
    t = 32
    for c in _cases(dtype=ACT, BITS=(2, 4, 8), GD=((8, 128), (1, 64))):
        (g, d), bits = c["GD"], c["BITS"]
        cg = t if d % t == 0 else d  # `KiviCodec.channel_group`
        n_codes = t * g * d * bits // 8
        row_bytes = 2 * n_codes + 2 * g * d * 2 + 2 * t * g * (d // cg) * 2
        args = dict(
            rows=Ptr("uint8"), scales=Ptr("float16", aligned=n_codes % 8 == 0), out=Ptr(c["dtype"]),
            stride_row=row_bytes, stride_prow=row_bytes // 2, n_elem=t * g * d, gd=g * d, value_codes=n_codes,
            vp=t * g * d // cg, cg=cg, BITS=bits, BLOCK=1024,
        )  # fmt: skip
        yield Variant("_unpack_kivi", c, args)


def _unpack_fp8() -> Iterator[Variant]:
    # `unpack_fp8_into`: rows [m, 2 * G * D + 4 * G] bytes
    for c in _cases(dtype=ACT, GD=((8, 128), (1, 64))):
        g, d = c["GD"]
        n = 2 * g * d
        args = dict(
            rows=Ptr("uint8"), scales=Ptr("float16"), out=Ptr(c["dtype"]), stride_row=n + 4 * g,
            stride_srow=(n + 4 * g) // 2, first_scale=n // 2, n_elem=n, d=d, BLOCK=1024,
        )  # fmt: skip
        yield Variant("_unpack_fp8", c, args)


# --- kvtier.kv.host_gather ------------------------------------------------------------------


def _gather_rows() -> Iterator[Variant]:
    # `gather_tiles`: rows [E, 2, G, D] (all of a row, or with `keys` its first half) or packed
    # rows of bytes; a ring of one extent or several
    kinds = [(dtype, keys) for dtype in HALF for keys in (False, True)] + [("uint8", False)]
    for c in _cases(rows=kinds, GD=((8, 128), (1, 64)), ring=(1, 4)):
        (dtype, keys), (g, d) = c["rows"], c["GD"]
        row = 2 * g * d if dtype != "uint8" else 2 * g * d + 4 * g  # an FP8 row's bytes
        cols = g * d if keys else row
        args = dict(
            REF=Ptr(dtype), OFFSETS=Ptr("int64"), TILES=Ptr("int64"), OUT=Ptr(dtype), extent_tokens=4096,
            ring=c["ring"], ROW=row, COLS=cols, TILE=16, BLOCK_C=min(1024, _p2(cols)),
        )  # fmt: skip
        yield Variant("_gather_rows", c, args, dict(num_warps=4))


BUILDERS: dict[str, Callable[[], Iterator[Variant]]] = {
    "_rms_norm_kernel": _rms_norm,
    "_rope_kernel": _rope,
    "_silu_mul_kernel": _silu_mul,
    "_paged_decode_split": _paged_decode_split,
    "_combine_splits": _combine_splits,
    "put_rows": _put_rows,
    "buffers_attn_fwd": _buffers_attn_fwd,
    "_row_lse": lambda: _head_score("_row_lse"),
    "_chunk_score": lambda: _head_score("_chunk_score"),
    "_combine_lse": _combine_lse,
    "sparse_attn_fwd": _sparse_attn_fwd,
    "merge_splits": _merge_splits,
    "_unpack_kivi": _unpack_kivi,
    "_unpack_fp8": _unpack_fp8,
    "_gather_rows": _gather_rows,
    "_bisect_kernel": _bisect,
    "_chunk_max_kernel": _chunk_max,
    "_gather_key_params": _gather_key_params,
    "_key_scores_kernel": _key_scores,
}


def variants(kernels: list[str] | None = None) -> list[Variant]:
    """Every variant of `kernels` (None: all), in a fixed order."""
    return [v for name in kernels or list(KERNELS) for v in BUILDERS[name]()]
