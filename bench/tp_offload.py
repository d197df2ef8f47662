"""Offloaded decode over N tensor-parallel GPUs against the single-GPU PCIe floor / N (issue 22).

Each N in --tensor-parallel runs as N processes started here, torchrun-style (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_* in their environment), each an `LLM(tensor_parallel=N)` rank on its own
GPU under --gpu-memory (per GPU). Per --policies entry every rank plans its context
(`LLM.plan`: the rank's config and budget), fills its own store with synthetic KV up to one
chunk before --context, runs that chunk as a real prefill and then --decode-steps decode steps;
rank 0 times them (the ranks run in lock step: two all-reduces per layer). Before the runs
every rank measures its pinned host-to-device bandwidth at the same time as the others (links
behind one PCIe switch share it). Per rank: the bytes it streams per token and its own floor
(those bytes / its measured bandwidth); per run the slowest rank's floor, and the target: the
N=1 run's floor / N (the issue asks decode <= 1.2x of it).

    python bench/tp_offload.py --tensor-parallel 1,2,4,8 --context 512K --gpu-memory 24GB
    python bench/tp_offload.py --tensor-parallel 1,2 --policies layer,auto --name tp_offload_2gpu

With --full-prefill-max at least --context the prefill is real and each run's greedy tokens are
checked against the N=1 run's (`tokens_equal_n1`; a folder or `tiny`: a random preset is another
random model under N ranks), a check of NCCL:

    python bench/tp_offload.py --model tiny --context 4K --full-prefill-max 4K --tensor-parallel 1,2,4,8 \
        --policies gpu,layer,head --name tp_offload_tokens

On the CPU (gloo; the "GPU" tier is host memory, so floors and bandwidths are not measured), a
tiny random model checks that the script runs:

    python bench/tp_offload.py --device cpu --model tiny --context 2K --full-prefill-max 2K \
        --tensor-parallel 1,2 --decode-steps 4 --name tp_offload_cpu_tiny
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import median, pinned_h2d_gbps, write_results
from kvtier.engine.llm import LLM
from kvtier.kv.synthetic import fill_synthetic
from kvtier.methods import MethodChoice
from kvtier.units import parse_count

TINY = {  # --model tiny: a random Llama small enough for a CPU, 8 KV heads so N can be 1, 2, 4, 8
    "model_type": "llama",
    "vocab_size": 512,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "max_position_embeddings": 1 << 20,
    "rope_theta": 500000.0,
}


def tiny_folder() -> str:
    """A Hugging Face folder of the TINY config with random weights, written once per run."""
    from safetensors.torch import save_file

    from kvtier.config import ModelConfig
    from kvtier.loading.weights import random_model

    folder = Path(tempfile.mkdtemp(prefix="kvtier-tp-tiny-"))
    (folder / "config.json").write_text(json.dumps(TINY))
    model = random_model(ModelConfig.from_hf_dict(TINY), torch.device("cpu"), torch.float32)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(folder / "model.safetensors"))
    return str(folder)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_policy(llm: LLM, policy: str, args: argparse.Namespace, bw: float | None) -> dict[str, Any]:
    """One rank's run of `policy`: plan, a prefill (real up to --full-prefill-max tokens, else
    synthetic KV and one real chunk at the end), decode steps."""
    dev, total = llm.device, args.context + args.decode_steps
    plan = llm.plan(total, MethodChoice(kv=policy))
    full = args.context <= args.full_prefill_max
    chunk = plan.chunk_size if full else min(plan.chunk_size, args.context // 2)
    row: dict[str, Any] = {
        "rank": 0 if llm.parallel is None else llm.parallel.rank,
        "plan": {
            k: getattr(plan, k)
            for k in ("group_size", "num_slices", "resident_slices", "chunk_size", "staging_tokens")
        },
        "gpu_kv_bytes_planned": plan.gpu_kv_bytes,
        "host_kv_bytes_planned": plan.host_kv_bytes,
    }
    store, _ = llm.make_store(plan, total)
    try:
        start = 0 if full else args.context - chunk
        fill_synthetic(store, start)
        gen = torch.Generator().manual_seed(0)  # the same tokens on every rank
        ids = torch.randint(0, llm.model_config.vocab_size, (args.context - start,), generator=gen).to(dev)
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        sync(dev)
        t = time.perf_counter()
        for s in range(0, ids.shape[0], chunk):
            store.begin_step(ids[s : s + chunk].shape[0])
            logits = llm.model(ids[s : s + chunk], store, mlp_chunk=chunk)
            store.end_step()
        sync(dev)
        row["prefill_tok_s"] = ids.shape[0] / (time.perf_counter() - t)
        row["prefill_mode"] = "full" if full else f"one {chunk}-token chunk after {start} synthetic"
        token = logits[-1].argmax()
        tokens = [int(token)]
        h2d0, steps = store.account.h2d_bytes, []
        for _ in range(args.decode_steps):
            sync(dev)
            t = time.perf_counter()
            store.begin_step(1)
            logits = llm.model(token.view(1), store)
            store.end_step()
            token = logits[-1].argmax()
            if llm.parallel is not None:
                llm.parallel.broadcast_(token)
            sync(dev)
            steps.append(time.perf_counter() - t)
            tokens.append(int(token))
        # NOTE: after a full prefill the tokens must be the N=1 run's (same weights: a folder);
        # after synthetic KV they differ (each rank's store draws its own random values).
        row["tokens"] = tokens
        row["decode_steps_s"] = steps
        row["decode_s_per_token"] = median(steps[1:] if len(steps) > 2 else steps)
        row["h2d_bytes_per_token"] = (store.account.h2d_bytes - h2d0) / max(1, len(steps))
        row["peak_host_kv_bytes"] = store.account.peak["host"]
        row["pinned_h2d_gbps"] = bw
        row["pcie_floor_s"] = row["h2d_bytes_per_token"] / (bw * 1e9) if bw else None
        if dev.type == "cuda":
            row["peak_gpu_bytes"] = torch.cuda.max_memory_allocated(dev)
    except torch.OutOfMemoryError as e:
        row["oom"] = str(e).splitlines()[0]
    finally:
        store.close()
    return row


def rank_main(rank: int, size: int, port: int, args: argparse.Namespace, results: Any) -> None:
    """One rank of a run of `size` ranks: every policy; rank 0 puts every rank's rows in `results`."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(size))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    llm = LLM(
        args.model,
        device=args.device,
        gpu_memory=args.gpu_memory,
        chunk_size=args.chunk_size,
        max_model_len=args.context + args.decode_steps,
        tensor_parallel=size if size > 1 else None,
    )
    bw = None
    if llm.device.type == "cuda":
        if llm.parallel is not None:
            llm.parallel.all_gather_object(None)  # every rank measures at the same time
        bw = pinned_h2d_gbps()
    rows = []
    for policy in args.policies.split(","):
        row = run_policy(llm, policy, args, bw)
        ranks = [row] if llm.parallel is None else llm.parallel.all_gather_object(row)
        rows.append({"policy": policy, "ranks": ranks})
    if llm.is_rank0:
        results.put(rows)
    llm.close()


def summarize(
    n: int, policy: str, ranks: list[dict[str, Any]], floor_1: float | None, one_tokens: list[int] | None
) -> dict[str, Any]:
    """A run's row: rank 0's time (the ranks move in lock step), the slowest rank's floor, the target."""
    r0 = ranks[0]
    out: dict[str, Any] = {"tensor_parallel": n, "policy": policy, "plan": r0["plan"]}
    if "oom" in r0:
        return {**out, "oom": r0["oom"]}
    if one_tokens is not None and r0["prefill_mode"] == "full":
        out["tokens_equal_n1"] = r0["tokens"] == one_tokens
    floors = [r["pcie_floor_s"] for r in ranks if r.get("pcie_floor_s") is not None]
    out.update(
        decode_s_per_token=r0["decode_s_per_token"],
        prefill_tok_s=r0["prefill_tok_s"],
        prefill_mode=r0["prefill_mode"],
        h2d_gb_per_token_per_rank=[r["h2d_bytes_per_token"] / 1e9 for r in ranks],
        pinned_h2d_gbps_per_rank=[r["pinned_h2d_gbps"] for r in ranks],
        peak_gpu_gb_per_rank=[r.get("peak_gpu_bytes", 0) / 1e9 for r in ranks],
        floor_s=max(floors) if floors else None,
    )
    if floor_1 is not None:
        target = floor_1 / n
        out.update(target_s=target, decode_vs_target=out["decode_s_per_token"] / target)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-3-8b", help="a preset, an HF folder, or 'tiny' (CPU)")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--context", type=parse_count, default=parse_count("512K"))
    ap.add_argument("--tensor-parallel", default="1,2", help="comma-separated N; include 1 for the target")
    ap.add_argument("--policies", default="layer,auto", help="comma-separated --kv placements")
    ap.add_argument("--gpu-memory", default="24GB", help="per GPU (ignored on the CPU: no budget there)")
    ap.add_argument("--chunk-size", type=int, default=None)
    ap.add_argument("--decode-steps", type=int, default=6)
    ap.add_argument(
        "--full-prefill-max",
        type=parse_count,
        default=0,
        help="prefill contexts up to this for real, and check the tokens against N=1 (a folder or tiny)",
    )
    ap.add_argument("--name", default="tp_offload")
    args = ap.parse_args()
    if args.model == "tiny":
        args.model = tiny_folder()
    if args.device == "cpu":
        args.gpu_memory = None
    sizes = [int(n) for n in args.tensor_parallel.split(",")]
    gpus = torch.cuda.device_count()
    if args.device == "cuda" and max(sizes) > gpus:
        raise SystemExit(f"--tensor-parallel {max(sizes)} needs that many GPUs; this machine has {gpus}")
    ctx = mp.get_context("spawn")
    runs: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for n in sizes:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        results = ctx.SimpleQueue()
        procs = [ctx.Process(target=rank_main, args=(r, n, port, args, results)) for r in range(n)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        if any(p.exitcode for p in procs):
            raise SystemExit(f"a rank of the {n}-rank run failed: exit codes {[p.exitcode for p in procs]}")
        for entry in results.get():
            runs[(n, entry["policy"])] = entry["ranks"]
    rows = []
    for (n, policy), ranks in runs.items():
        one = runs.get((1, policy))
        floor_1 = one[0].get("pcie_floor_s") if one else None
        rows.append(summarize(n, policy, ranks, floor_1, one[0].get("tokens") if one else None))
        print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in rows[-1].items()}, flush=True)
    model = TINY if args.model.startswith(tempfile.gettempdir()) else args.model
    path = write_results(
        args.name,
        {
            "model": model,
            "context": args.context,
            "device": args.device,
            "gpus": gpus if args.device == "cuda" else 0,
            "gpu_memory_per_gpu": args.gpu_memory,
            "rows": rows,
            "per_rank": [{"tensor_parallel": n, "policy": p, "ranks": r} for (n, p), r in runs.items()],
        },
    )
    print(f"results: {path}")


if __name__ == "__main__":
    main()
