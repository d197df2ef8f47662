"""`/metrics`: the engine's numbers in Prometheus text format, named like vLLM's where they agree."""

from __future__ import annotations

from kvtier.serve.engine import ServeEngine

PREFIX = "kvtier:"


def render(engine: ServeEngine, model_name: str) -> str:
    """Prometheus exposition text (version 0.0.4) of the engine's current state and counters."""
    kv, sched = engine.kv, engine.scheduler
    label = f'model_name="{_escape(model_name)}"'
    rows: list[tuple[str, str, str, list[tuple[str, float]]]] = [
        ("num_requests_running", "gauge", "Requests in the running batch.", [("", len(sched.running))]),
        ("num_requests_waiting", "gauge", "Requests waiting to be scheduled.", [("", len(sched.waiting))]),
        (
            "generation_tokens_per_second",
            "gauge",
            "Tokens generated per second, last 10 s.",
            [("", engine.tokens_per_second())],
        ),
        (
            "prompt_tokens_total",
            "counter",
            "Prompt tokens of started requests.",
            [("", engine.prompt_tokens)],
        ),
        ("generation_tokens_total", "counter", "Tokens generated.", [("", engine.generation_tokens)]),
        ("request_success_total", "counter", "Requests finished (any reason).", [("", engine.finished)]),
        (
            "num_preemptions_total",
            "counter",
            "Preemptions (full pages come back from the prefix cache's device or host tier; only "
            "the partial last page is recomputed).",
            [("", sched.num_preemptions)],
        ),
        (
            "num_requests_tiered",
            "gauge",
            "Requests over a tiered store of their own (a method of their own, or too long for the pool).",
            [('state="running"', engine.num_tiered[0]), ('state="waiting"', engine.num_tiered[1])],
        ),
        (
            "own_store_requests_total",
            "counter",
            "Requests with a method of their own whose KV fit in device memory: their own store "
            "is attended inside the batch's forward.",
            [("", engine.own_store_requests)],
        ),
        (
            "requests_ran_lossless_total",
            "counter",
            "Requests naming a lossy method that drops nothing at their length (HiP below its "
            "budgets), run lossless instead.",
            [("", engine.exact_lossless_requests)],
        ),
        (
            "pages_compacted_total",
            "counter",
            "Pool pages of running requests moved down to free ids so that a tiered request could "
            "borrow one longer run of pages.",
            [("", engine.pages_compacted)],
        ),
        (
            "decode_ahead_steps_total",
            "counter",
            "Decode-only batch steps that queued more than one forward before reading tokens back "
            "(--decode-steps).",
            [("", engine.ahead_steps)],
        ),
        (
            "kv_transfer_bytes_total",
            "counter",
            "KV bytes over PCIe, by direction and source (prefix_cache: its host tier; tiered: the "
            "tiered stores' streaming and write-back).",
            [(f'direction="{d}",source="{src}"', n) for (d, src), n in engine.transfer_bytes().items()],
        ),
        (
            "kv_pages_used",
            "gauge",
            "KV pages in use per tier (gpu: referenced by sequences; gpu_lent: lent to tiered "
            "runs for their buffers; gpu_cached: idle prefix-cache pages; host: the host tier).",
            [
                ('tier="gpu"', kv.pool.num_used - kv.pool.num_lent),
                ('tier="gpu_lent"', kv.pool.num_lent),
                ('tier="gpu_cached"', len(kv.pool.lru)),
                ('tier="host"', kv.host.num_used),
            ],
        ),
        (
            "kv_tiered_bytes",
            "gauge",
            "KV bytes allocated by the running tiered runs' stores, per tier (gpu: resident slices and "
            "staging buffers, in lent pool pages where they borrowed some; host: pinned host slices).",
            [(f'tier="{t}"', n) for t, n in engine.tiered_bytes().items()],
        ),
        (
            "gpu_memory_bytes",
            "gauge",
            "This process's GPU memory by kind (allocated, reserved and their peaks; "
            "outside_allocator: the CUDA context and library handles; budget: --gpu-memory). "
            "No samples on the CPU.",
            [(f'kind="{k}"', n) for k, n in engine.gpu_memory().items()],
        ),
        (
            "kv_pages_total",
            "gauge",
            "KV pages per tier.",
            [('tier="gpu"', kv.pool.num_pages), ('tier="host"', kv.host.num_slots)],
        ),
        (
            "kv_cache_usage_perc",
            "gauge",
            "Fraction of device KV pages in use.",
            [("", kv.pool.num_used / kv.pool.num_pages)],
        ),
        (
            "prefix_cache_queries_total",
            "counter",
            "Prompt tokens looked up in the prefix cache.",
            [("", kv.stats.queries)],
        ),
        (
            "prefix_cache_hits_total",
            "counter",
            "Prompt tokens found in the prefix cache.",
            [("", kv.stats.hits)],
        ),
        (
            "prefix_cache_host_hits_total",
            "counter",
            "Prompt tokens copied back from the host tier.",
            [("", kv.stats.host_hits)],
        ),
        (
            "prefix_cache_hit_rate",
            "gauge",
            "Prefix-cache hits / queries, in tokens.",
            [("", kv.stats.hit_rate)],
        ),
        (
            "prefix_cache_evictions_total",
            "counter",
            "Cached device pages evicted.",
            [("", kv.pool.evictions)],
        ),
    ]
    lat = engine.latency
    histograms = [
        ("time_to_first_token_seconds", "Time from a request's arrival to its first token.", lat.ttft),
        ("time_per_output_token_seconds", "Time between a request's consecutive tokens.", lat.tpot),
        ("e2e_request_latency_seconds", "Time from a request's arrival to its end.", lat.e2e),
    ]
    for name, help_text, hist in histograms:
        samples: list[tuple[str, float]] = [(f'le="{le}"', n) for le, n in hist.cumulative()]
        rows.append((f"{name}_bucket", "histogram", help_text, samples))
        rows.append((f"{name}_sum", "", "", [("", hist.total)]))
        rows.append((f"{name}_count", "", "", [("", hist.count)]))
    lines = []
    for name, kind, help_text, samples in rows:
        if kind == "histogram":  # NOTE: one HELP/TYPE for the family, named without _bucket
            family = name.removesuffix("_bucket")
            lines.append(f"# HELP {PREFIX}{family} {help_text}")
            lines.append(f"# TYPE {PREFIX}{family} histogram")
            _samples(lines, name, label, samples)
            continue
        if not kind:  # a histogram's _sum or _count
            _samples(lines, name, label, samples)
            continue
        lines.append(f"# HELP {PREFIX}{name} {help_text}")
        lines.append(f"# TYPE {PREFIX}{name} {kind}")
        _samples(lines, name, label, samples)
    return "\n".join(lines) + "\n"


def _samples(lines: list[str], name: str, label: str, samples: list[tuple[str, float]]) -> None:
    for extra, value in samples:
        labels = ",".join(x for x in (label, extra) if x)
        v = float(value)
        lines.append(f"{PREFIX}{name}{{{labels}}} {int(v) if v.is_integer() else v!r}")


def _escape(s: str) -> str:
    return s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
