"""The serve bench's `mixed` case: one long request served tiered beside short streams, and
where the short streams' time goes (`bench/serve_gpu.py --cases mixed`)."""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any

import torch

from bench.serve_loop import FIRST_STEPS, GcPauses, Stream, ThreadClock, ms_p50, ms_quantile, step_loop, sync
from kvtier.engine.sampling import SamplingParams
from kvtier.methods import parse_choice
from kvtier.serve.engine import ServeEngine


def run_mixed(
    engine: ServeEngine,
    long_tokens: int,
    long_new: int,
    vocab: int,
    pcie_gbps: float,
    timeout_s: float,
    shorts_case: tuple[int, int, int],
    profile_steps: tuple[int, int] | None = None,
    trace: str | None = None,
    long_method: str | None = None,
) -> dict[str, Any]:
    """One long request (served tiered) plus short streams (`shorts_case`: requests, prompt
    and new tokens, as serve_gpu's c32), submitted once it decodes. `long_method`: a method
    spec the long request names (as a client's `extra_body={"method": ...}`; None: lossless).
    `profile_steps`: the batch steps whose device ops are tabled (and traced to `trace`); the
    profiler slows the steps it records, so a run that profiles is not a timing of the case."""
    n, prompt, new = shorts_case
    gen = torch.Generator().manual_seed(5)
    long = Stream()
    params = SamplingParams(max_tokens=long_new, ignore_eos=True)
    long_ids = torch.randint(100, vocab, (long_tokens,), generator=gen).tolist()
    if not engine.needs_offload(long_ids, params):
        raise SystemExit(
            f"mixed: {long_tokens} tokens fit the pool of {engine.pool_tokens}; give a longer "
            "--long-tokens or a smaller --num-pages, so the long request is served tiered"
        )
    engine.submit(long_ids, params, long, method=None if long_method is None else parse_choice(long_method))
    sync(engine)
    t0 = time.perf_counter()
    engine._drain(block=False)
    engine.step_tiered()  # plans its store: tiered (streams) or its own on the device (joins the batch)
    run = next(iter(engine._tiered.values()), None)
    if run is None:
        raise SystemExit(
            f"mixed: the {long_tokens}-token request got a store that fits the device, so it joined "
            "the batch instead of streaming from the host tier; give a longer --long-tokens or a "
            "smaller --gpu-memory"
        )
    lent = engine.kv.pool.num_lent  # pool pages its buffers live in (0: all in the offload reserve)
    route = (
        f"tiered: {run.plan.policy} g{run.plan.group_size} chunk {run.plan.chunk_size}, "
        f"{run.plan.resident_slices} resident slices, {lent} pool pages borrowed"
    )
    print(f"mixed: long request {route}", flush=True)
    launcher = ThreadClock(run._queue_step)  # NOTE: `launch` looks the method up at each call
    run._queue_step = launcher  # type: ignore[method-assign]
    memory = {"long_planned": memory_gb(engine)}
    shown, built_s = t0, None
    while not long.tokens:  # its prefill (the tiered run alone)
        engine.step_tiered()
        engine._idle_wait()
        now = time.perf_counter()
        if built_s is None and not run.opening:
            built_s = now - t0
            print(f"mixed: store built after {built_s:.1f} s; {len(run.spans)} prefill chunks", flush=True)
        if now - t0 > timeout_s:
            raise SystemExit(
                f"mixed: no first token after {timeout_s:.0f} s ({run.done_spans}/{len(run.spans)} "
                "prefill chunks launched); raise --mixed-timeout or shorten --long-tokens"
            )
        if now - shown >= 10:
            done = f"{run.done_spans}/{len(run.spans)}"
            print(f"mixed: prefill {done} chunks after {now - t0:.0f} s", flush=True)
            shown = now
    prefill_s = time.perf_counter() - t0
    memory["long_first_token"] = memory_gb(engine)
    launcher.calls.clear()  # from here: its decode tokens, beside the shorts
    h2d_at_first = engine.transfer_bytes()[("h2d", "tiered")]
    shorts = [Stream() for _ in range(n)]
    short_params = SamplingParams(max_tokens=new, ignore_eos=True)
    for s in shorts:
        engine.submit(torch.randint(100, vocab, (prompt,), generator=gen).tolist(), short_params, s)
    retries = torch.cuda.memory_stats().get("num_alloc_retries", 0) if engine.device.type == "cuda" else 0
    times: dict[str, list[Any]] = {"step": [], "tiered": []}
    cuda = engine.device.type == "cuda"
    t_loop = time.perf_counter()
    preempted = engine.scheduler.num_preemptions
    with GcPauses() as gcp:
        steps, kernels = step_loop(engine, times, profile_steps=profile_steps if cuda else None, trace=trace)
    memory["end"] = memory_gb(engine)
    shorts_end = max(s.times[-1] for s in shorts)
    preempted = engine.scheduler.num_preemptions - preempted
    max_waiting = max(times.get("waiting", [0]), default=0)  # shorts queued for pages or seats
    loop_s = time.perf_counter() - t_loop
    if engine.device.type == "cuda":
        retries = torch.cuda.memory_stats().get("num_alloc_retries", 0) - retries
    decode_bytes = engine.transfer_bytes()[("h2d", "tiered")] - h2d_at_first
    long_tpot = long.tpot()
    tpots = [t for s in shorts if (t := s.tpot()) is not None]
    per_token = decode_bytes / max(1, len(long.tokens) - 1)
    floor = per_token / (pcie_gbps * 1e9)
    return {
        "long_prompt_tokens": long_tokens,
        "long_method": long_method or "lossless",
        "long_route": route,
        "long_lent_pages": lent,
        "short_waiting_at_most": max_waiting,
        "short_preemptions": preempted,
        "long_new_tokens": len(long.tokens),
        "long_prefill_s": round(prefill_s, 2),  # from its arrival: building its store, then its chunks
        "long_store_build_s": round(built_s, 2) if built_s is not None else None,
        "long_decode_s_per_token": round(long_tpot, 4) if long_tpot else None,
        "long_decode_h2d_bytes_per_token": int(per_token),
        "long_pcie_floor_s": round(floor, 4),
        "long_x_pcie_floor": round(long_tpot / floor, 3) if long_tpot and floor else None,
        "pcie_gbps_assumed": pcie_gbps,
        "short_requests": n,
        "short_prompt_tokens": prompt,
        "short_new_tokens": new,
        "short_tpot_p50_ms": round(1e3 * statistics.median(tpots), 3) if tpots else None,
        "short_tpot_mean_ms": round(1e3 * statistics.fmean(tpots), 3) if tpots else None,
        # where a short stream's time goes: the host time of each batch step (graph replays
        # and its token read-back) and of each call that collects and launches the long
        # request's step; allocator retries free cached blocks (a device-wide sync)
        "batch_step_ms_p50": ms_p50(times["step"]),
        "batch_step_ms_p90": ms_quantile(times["step"], 0.9),
        "batch_step_ms_max": round(1e3 * max(times["step"], default=0.0), 3),
        "batch_steps_over_15ms": sum(t > 0.015 for t in times["step"]),
        "batch_step_s_over_15ms": round(sum(t for t in times["step"] if t > 0.015), 3),
        "batch_steps_over_50ms": sum(t > 0.05 for t in times["step"]),
        "batch_step_s_over_50ms": round(sum(t for t in times["step"] if t > 0.05), 3),
        # each batch step over 50 ms: [step, ms, then during it and since the step before:
        # cudaMalloc, cudaFree, allocation retries, pinned host allocs, pinned host frees]
        "slow_steps": times["slow"],
        "first_steps_ms": [round(1e3 * t, 1) for t in times["step"][:FIRST_STEPS]],
        "shorts_span_s": round(max(s.times[-1] for s in shorts) - min(s.times[0] for s in shorts), 3),
        "tiered_call_ms_p50": ms_p50(times["tiered"]),
        "tiered_call_ms_max": round(1e3 * max(times["tiered"], default=0.0), 3),
        "alloc_retries": int(retries),
        "short_batch_steps": steps,
        "short_loop_s": round(loop_s, 3),
        # where the shorts' time goes beyond their batch steps (every batch step is theirs): the
        # loop's other work per pass that stepped the batch, and the loop thread's CPU time in
        # the steps (less than their wall time by what it waited: the device, or the GIL)
        "gap_ms_p50": ms_p50(times.get("gap", [])),
        "gap_ms_p90": ms_quantile(times.get("gap", []), 0.9),
        "gap_s_total": round(sum(times.get("gap", [])), 3),
        "batch_steps_s_total": round(sum(times["step"]), 3),
        "batch_steps_cpu_s_total": round(sum(times.get("step_cpu", [])), 3),
        "shorts_last_token_s": round(shorts_end - t_loop, 3),
        # the long request's launcher thread: each decode token's queuing, wall and CPU
        "launcher_token_ms_p50": ms_p50([w for w, _ in launcher.calls]),
        "launcher_token_cpu_ms_p50": ms_p50([c for _, c in launcher.calls]),
        "launcher_tokens": len(launcher.calls),
        "switch_interval_s": sys.getswitchinterval(),
        "memory_gb": memory,
        "gc": gcp.summary(),
        # every stream's kernels and copies over the profiled batch steps
        "profiled_steps": list(profile_steps) if profile_steps else None,
        "overlap_top_device_ops": kernels,
    }


def memory_gb(engine: ServeEngine) -> dict[str, float] | None:
    """The caching allocator's allocated and reserved GB now, and the peak allocated so far."""
    if engine.device.type != "cuda":
        return None
    return {
        "allocated": round(torch.cuda.memory_allocated() / 1e9, 3),
        "reserved": round(torch.cuda.memory_reserved() / 1e9, 3),
        "peak_allocated": round(torch.cuda.max_memory_allocated() / 1e9, 3),
    }
