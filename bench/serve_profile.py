"""Where a decode step of the server's engine spends GPU time: torch.profiler over a few eager
decode steps of B sequences (the kernels a CUDA graph replays), and wall time per step with and
without the graphs. Llama-3.1-8B shapes, random bf16 weights, random prompt ids (synthetic).

    python bench/serve_profile.py --batch 64 --context 1024
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvtier.engine.llm import LLM
from kvtier.engine.sampling import SamplingParams
from kvtier.serve.engine import ServeConfig, ServeEngine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args()
    llm = LLM(args.model, device="cuda", dtype="bf16")
    engine = ServeEngine(llm, ServeConfig(max_num_seqs=args.batch, max_num_batched_tokens=16384))
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=10_000, ignore_eos=True)
    for _ in range(args.batch):
        ids = torch.randint(100, llm.model_config.vocab_size, (args.context,), generator=gen).tolist()
        engine.submit(ids, params, lambda d: None)
    engine._drain(block=False)
    while any(
        s.num_computed < len(s.prompt) for s in engine.scheduler.running + list(engine.scheduler.waiting)
    ):
        engine.step()
    decoder = engine.decoder
    assert decoder is not None
    for graphs in (True, False):
        decoder.graphs = graphs
        for _ in range(3):
            engine.step()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        torch.cuda.synchronize()
        print(
            f"graphs={graphs}: {(time.perf_counter() - t0) / args.steps * 1e3:.2f} ms/step at B={args.batch}"
        )
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            engine.step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60))


if __name__ == "__main__":
    main()
