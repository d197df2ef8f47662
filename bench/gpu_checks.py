"""GPU correctness checks (CI has no GPU): policies bitwise-equal on CUDA kernels, the
sequence-block path within rounding, CPU-attended slices at decode (same tokens, logits within
rounding), the prefill by layer against the chunk order, and the lower-right causal flash path
against a reference.

    python bench/gpu_checks.py
"""

from __future__ import annotations

import os
import sys
from dataclasses import fields, replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import write_results
from kvtier.attention.dense import attend
from kvtier.config import ModelConfig
from kvtier.engine.runner import prefill
from kvtier.kv.store import StoreOptions, TieredKVStore
from kvtier.loading.presets import preset_config
from kvtier.loading.weights import build_empty, random_model, with_experts_on_host
from kvtier.model.moe import MoE
from kvtier.planner.placement import KVPlan
from kvtier.policies.quant import KiviCodec
from kvtier.sparse import HIP_PRESETS, HipConfig, make_hip_kernel

DEV = torch.device("cuda")


def run(model, cfg, plan, ids, decode=6, feed=None, codec=None, unpack_stream=False, kernel=None):  # type: ignore[no-untyped-def]
    """Logits of `ids` then `decode` greedy steps, and the argmax of each step. With `feed`
    (the reference's tokens) the steps decode those tokens instead of their own argmax, so the
    logits compare like for like even where a near tie flips an argmax. `kernel`: a slice
    kernel (HiP's), with the keys it needs (un-rotated where it rotates them itself)."""
    store = TieredKVStore(
        cfg,
        plan,
        device=DEV,
        dtype=torch.bfloat16,
        capacity=ids.shape[0] + decode,
        options=StoreOptions(block_size=64, extent_blocks=3, unpack_stream=unpack_stream),
        codec=codec,
        **({} if kernel is None else {"kernel": kernel, "rotate_keys": not kernel.needs_unrotated_keys}),
    )
    logits, toks = [], []
    for s in range(0, ids.shape[0], plan.chunk_size):
        part = ids[s : s + plan.chunk_size]
        store.begin_step(part.shape[0])
        logits.append(model(part, store, logits_at=torch.arange(part.shape[0], device=DEV)))
        store.end_step()
    for i in range(decode):
        tok = logits[-1][-1].argmax()
        toks.append(int(tok))
        if feed is not None:
            tok = torch.tensor(feed[i], device=DEV)
        store.begin_step(1)
        logits.append(model(tok.view(1), store))
        store.end_step()
    store.close()
    return torch.cat(logits), toks


def experts_on_host_check() -> dict[str, object]:
    """A tiny DeepSeek-V2 (MLA + MoE) with its routed experts in pinned host memory, copied in per
    step, against the same weights all on the GPU: the copies are exact, so bitwise equal."""
    big = preset_config("deepseek-v2-lite")
    assert big.moe is not None and big.mla is not None
    mla = replace(big.mla, kv_lora_rank=64)
    cfg = replace(
        big,
        vocab_size=1000,
        hidden_size=256,
        num_layers=3,
        num_heads=4,
        head_dim=mla.entry // 2,
        moe=replace(big.moe, num_experts=16, intermediate_size=128),
        mla=mla,
    )
    gpu = random_model(cfg, DEV, torch.bfloat16)
    host_cfg = with_experts_on_host(cfg, True)
    host = build_empty(host_cfg, DEV, torch.bfloat16)
    state = gpu.state_dict()
    with torch.no_grad():
        for name, t in host.state_dict().items():
            t.copy_(state[name])
    ids = torch.randint(0, 1000, (700,), device=DEV, generator=torch.Generator(DEV).manual_seed(1))
    plan = KVPlan("gpu", 1, cfg.num_layers, 256, 0, 0)
    ref, ref_t = run(gpu, cfg, plan, ids)
    lg, t = run(host, host_cfg, plan, ids)
    slabs = [m.host_experts for m in host.modules() if isinstance(m, MoE) and m.host_experts is not None]
    return {
        "tokens_equal": t == ref_t,
        "bitwise": bool(torch.equal(lg, ref)),
        "pinned": bool(slabs) and all(x.is_pinned() for x in slabs) if DEV.type == "cuda" else None,
    }


def hip_graph_check(model, cfg, plan, ids) -> dict[str, object]:  # type: ignore[no-untyped-def]
    """HiP decode of streamed slices with each layer's cached steps replayed as CUDA graphs
    (`KVTIER_HIP_GRAPHS=1`, `kvtier.sparse.decode_graph`) against the same steps run operator by
    operator: the budgets of `HipConfig.scaled` to the prompt (so it prunes), lean's refresh,
    stage 0 streamed or (`probes`) read in place on its probes. Bitwise the same logits."""
    hip = HipConfig.scaled(ids.shape[0], refresh=HIP_PRESETS["lean"].refresh)
    out: dict[str, object] = {}
    for name, extra in {
        "hip-graphs": {},
        "hip-graphs-probes": {"probe_scoring": True, "host_scoring": True},
    }.items():
        runs = []
        for graphs in ("0", "1"):
            os.environ["KVTIER_HIP_GRAPHS"] = graphs
            fields_ = {f.name: getattr(hip, f.name) for f in fields(HipConfig)} | extra
            kernel, _ = make_hip_kernel(cfg, DEV, "default", **fields_)
            lg, t = run(model, cfg, plan, ids, decode=40, kernel=kernel)
            graphs_ = kernel._graphs  # type: ignore[attr-defined]
            counts = None if graphs_ is None else {"captures": graphs_.captures, "replays": graphs_.replays}
            runs.append((lg, t, counts))
        os.environ.pop("KVTIER_HIP_GRAPHS")
        (base, bt, _), (lg, t, counts) = runs
        out[name] = {"tokens_equal": t == bt, "bitwise": bool(torch.equal(lg, base)), **(counts or {})}
    return out


def layer_order_check(model, cfg, plans, ids) -> dict[str, object]:  # type: ignore[no-untyped-def]
    """The prefill by layer (`kvtier.engine.layer_prefill`: its hidden states through pinned
    memory on two copy streams) against the chunk order, then 6 greedy steps: bitwise the same
    logits, dense and HiP (`HipConfig.scaled`, so it prunes), and the H2D bytes of each."""
    out: dict[str, object] = {}
    for name, (plan, hip) in plans.items():
        runs = []
        for by_layer in (False, True):
            extra = {}
            if hip:
                scaled = HipConfig.scaled(ids.shape[0])
                kernel, _ = make_hip_kernel(
                    cfg, DEV, "default", **{f.name: getattr(scaled, f.name) for f in fields(HipConfig)}
                )
                extra = {"kernel": kernel, "rotate_keys": not kernel.needs_unrotated_keys}
            store = TieredKVStore(
                cfg, plan, device=DEV, dtype=torch.bfloat16, capacity=ids.shape[0] + 6,
                options=StoreOptions(block_size=64, extent_blocks=3), **extra,
            )  # fmt: skip
            last, layered = prefill(model, store, ids, plan.chunk_size, by_layer=by_layer)
            prefill_h2d = store.account.h2d_bytes
            logits = [last]
            for _ in range(6):
                store.begin_step(1)
                logits.append(model(logits[-1].argmax().view(1), store)[-1])
                store.end_step()
            store.close()
            runs.append((torch.stack(logits), layered, prefill_h2d))
        (base, _, base_h2d), (lg, layered, h2d) = runs
        out[name] = {
            "ran_by_layer": layered,
            "bitwise": bool(torch.equal(lg, base)),
            "prefill_h2d_bytes": {"chunk": base_h2d, "layer": h2d},
        }
    return out


def main() -> None:
    cfg = ModelConfig(
        vocab_size=1000,
        hidden_size=512,
        intermediate_size=1024,
        num_layers=4,
        num_heads=8,
        num_kv_heads=4,
        head_dim=64,
        max_position_embeddings=8192,
    )
    torch.manual_seed(0)
    model = random_model(cfg, DEV, torch.bfloat16)
    ids = torch.randint(0, 1000, (1500,), device=DEV)
    n = cfg.num_layers

    def p(policy: str, g: int, r: int, st: int, b: int = 2) -> KVPlan:
        return KVPlan(policy, g, r, 512, b if st else 0, st)

    ref, ref_t = run(model, cfg, p("gpu", 4, n, 0), ids)
    results = {}
    for name, plan in {
        "layer": p("layer", 4, 0, 1536),
        "head-g1": p("head", 1, 0, 1536),
        "head-g2": p("head", 2, 0, 1536),
        "auto-g1-r7": p("auto", 1, 7, 1536),
        "head-g1-3buf": p("head", 1, 0, 1536, 3),
    }.items():
        lg, t = run(model, cfg, plan, ids)
        results[name] = {
            "tokens_equal": t == ref_t,
            "bitwise": bool(torch.equal(lg, ref)),
            "max_abs": float((lg - ref).abs().max()),
        }
    for name, plan in {"blocks-256": p("head", 1, 0, 256), "blocks-640-g2": p("head", 2, 0, 640)}.items():
        lg, t = run(model, cfg, plan, ids, feed=ref_t)
        results[name] = {"tokens_equal": t == ref_t, "rel": float((lg - ref).norm() / ref.norm())}
    # CPU attention of some streamed slices at decode (issue 23): same tokens, logits within
    # bf16 rounding of the merge (the CPU accumulates in fp32 over the host's bf16 KV).
    for name, plan in {
        "cpu-layer-2": replace(p("layer", 4, 0, 1536), num_slices=4, cpu_slices=2),
        "cpu-head-g1-6": replace(p("head", 1, 0, 1536), num_slices=16, cpu_slices=6),
        "cpu-auto-g1-r7-5": replace(p("auto", 1, 7, 1536), num_slices=16, cpu_slices=5),
        "cpu-blocks-256-4": replace(p("head", 1, 0, 256), num_slices=16, cpu_slices=4),
    }.items():
        lg, t = run(model, cfg, plan, ids, feed=ref_t)
        results[name] = {"tokens_equal": t == ref_t, "rel": float((lg - ref).norm() / ref.norm())}
    # CPU attention over a quantized cache's packed rows (issue 23's int4 host KV): against the
    # same int4 cache with every slice loaded to the GPU, which unpacks the same rows.
    int4 = KiviCodec(bits=4)
    q_ref, q_t = run(model, cfg, p("head", 1, 0, 1536), ids, codec=int4)
    for name, plan in {
        "int4-cpu-head-g1-6": replace(p("head", 1, 0, 1536), num_slices=16, cpu_slices=6),
        "int4-cpu-layer-2": replace(p("layer", 4, 0, 1536), num_slices=4, cpu_slices=2),
    }.items():
        lg, t = run(model, cfg, plan, ids, feed=q_t, codec=int4)
        results[name] = {"tokens_equal": t == q_t, "rel": float((lg - q_ref).norm() / q_ref.norm())}
    # The same int4 cache with its loads unpacked on a stream of their own (StoreOptions.
    # unpack_stream), some slices packed on the device: the same kernels on other streams, so
    # bitwise equal if the events order them right.
    for name, plan in {
        "int4-unpack-stream-g1": p("head", 1, 0, 1536),
        "int4-unpack-stream-auto-g1-r7": replace(p("auto", 1, 7, 1536), num_slices=16),
    }.items():
        base, bt = run(model, cfg, plan, ids, codec=int4)
        lg, t = run(model, cfg, plan, ids, codec=int4, unpack_stream=True)
        results[name] = {"tokens_equal": t == bt, "bitwise": bool(torch.equal(lg, base))}
    results["moe-experts-on-host"] = experts_on_host_check()
    results.update(hip_graph_check(model, cfg, p("head", 1, 0, 1536 + 40), ids))
    by_layer = {
        "by-layer-layer": (p("layer", 4, 0, 1536), False),
        "by-layer-head-g2": (p("head", 2, 0, 1536), False),
        "by-layer-auto-g1-r7": (p("auto", 1, 7, 1536, 4), False),
        "by-layer-hip-head-g2": (p("head", 2, 0, 1536), True),
    }
    results.update(layer_order_check(model, cfg, by_layer, ids))
    # lower-right causal flash path vs an fp32 reference
    q = torch.randn(300, 32, 128, device=DEV, dtype=torch.bfloat16)
    kv = torch.randn(2000, 2, 8, 128, device=DEV, dtype=torch.bfloat16)
    out = attend(q, kv).float()
    k = kv[:, 0].float().repeat_interleave(4, 1).transpose(0, 1)
    v = kv[:, 1].float().repeat_interleave(4, 1).transpose(0, 1)
    s = q.float().transpose(0, 1) @ k.transpose(-1, -2) / 128**0.5
    s = s.masked_fill(~torch.ones(300, 2000, dtype=torch.bool, device=DEV).tril(1700), float("-inf"))
    r = (s.softmax(-1) @ v).transpose(0, 1)
    results["attend_lower_right_rel"] = {"rel": float((out - r).norm() / r.norm())}
    path = write_results(
        "gpu_checks",
        {
            "results": results,
            "how": "seeded prompt of 1,500 random ids, 6 decode steps; rows with rel decode the "
            "reference's tokens (tokens_equal: every step's argmax is the reference's)",
        },
    )
    for k2, v2 in results.items():
        print(f"{k2:>24}: {v2}")
    print(path)


if __name__ == "__main__":
    main()
