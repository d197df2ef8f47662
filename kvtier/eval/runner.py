"""Running an eval: load the model, generate the samples once, run them under each method."""

from __future__ import annotations

import copy
import dataclasses
import inspect
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from kvtier import __version__
from kvtier.engine.config import EngineConfig
from kvtier.engine.sampling import SamplingParams
from kvtier.errors import ConfigError
from kvtier.eval.methods import MethodSpec
from kvtier.eval.prompts import Sample
from kvtier.eval.results import EvalResult, Record, machine_info
from kvtier.eval.scoring import score
from kvtier.eval.tasks import DEFAULT_HAYSTACK, TaskSpec, generate_samples

_LOAD_KEYS = ("device", "dtype", "gpu_memory", "seed")
"""Engine options that change the loaded weights or the process (see `reuse_llm`)."""


@dataclass(frozen=True)
class EvalConfig:
    """A whole run: the task, the methods to compare, and how to load the model."""

    spec: TaskSpec
    methods: tuple[MethodSpec, ...]
    model: str | None = None  # None: the embedded SmolLM2-135M-Instruct
    device: str = "auto"
    max_model_len: int | None = None

    def __post_init__(self) -> None:
        if not self.methods:
            raise ConfigError("give at least one --method")

    def llm_kwargs(self, method: MethodSpec) -> dict[str, Any]:
        """Keyword arguments of `LLM(model, ...)` for `method`."""
        return {"device": self.device, "max_model_len": self.max_model_len, **method.kwargs}


def check_lengths(lengths: tuple[int, ...], max_model_len: int, method: str = "") -> None:
    """ConfigError when a length is longer than the model (under `method`) takes."""
    too_long = [n for n in lengths if n > max_model_len]
    if too_long:
        under = f" under --method {method}" if method else ""
        raise ConfigError(
            f"--lengths {', '.join(str(n) for n in too_long)} is longer than the model's context of "
            f"{max_model_len} tokens{under}. --max-model-len N extends it past the trained context at "
            "a risk to quality; --method hip (sparse attention with context extension) is meant for "
            "such lengths"
        )


def reuse_llm(base: Any, kwargs: Mapping[str, Any], base_kwargs: Mapping[str, Any]) -> Any | None:
    """`base` with its engine options replaced by `kwargs` (sharing the weights), or None.

    NOTE: `LLM` reads its KV placement, chunk and block sizes from `llm.config` at each request,
    so a shallow copy with another `EngineConfig` runs the same loaded weights under another
    placement. Anything else that differs (a load option in `_LOAD_KEYS`, or a lossy method
    option such as `attention` or `kv_quant`, which `LLM` turns into other state) returns None:
    load a new `LLM`.
    """
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    changed = {k for k in {*kwargs, *base_kwargs} if kwargs.get(k) != base_kwargs.get(k)}
    if changed - (fields - set(_LOAD_KEYS)) or not isinstance(getattr(base, "config", None), EngineConfig):
        return None
    params = inspect.signature(type(base).__init__).parameters
    merged = {n: p.default for n, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}
    merged.update(kwargs)
    config = EngineConfig.with_sizes(**{k: v for k, v in merged.items() if k in fields})
    clone = copy.copy(base)
    clone.config = config
    clone.max_model_len = config.max_model_len or base.model_config.max_position_embeddings
    return clone


def run_sample(llm: Any, sample: Sample, method: str) -> Record:
    """Generate greedily for `sample` and score the answer."""
    params = SamplingParams(max_tokens=sample.max_tokens, temperature=0.0, stop=sample.stop)
    out = llm.generate([list(sample.prompt_ids)], params, chat=False)[0]
    return Record(
        method=method,
        task=sample.task,
        length=sample.length,
        depth=sample.depth,
        index=sample.index,
        prompt_tokens=sample.prompt_tokens,
        needle_depths=sample.needle_depths,
        expected=sample.expected,
        answer=out.text,
        score=score(sample.scorer, out.text, sample.expected),
        prefill_s=round(out.stats.prefill_s, 3),
        decode_s=round(out.stats.decode_s, 3),
    )


def run_eval(
    cfg: EvalConfig,
    *,
    command: str = "",
    progress: bool = True,
    llm_factory: Callable[..., Any] | None = None,
) -> EvalResult:
    """Run every sample of `cfg.spec` under every method; the model is loaded once if it can be."""
    if llm_factory is None:
        from kvtier.engine.llm import LLM

        llm_factory = LLM
    t0 = time.perf_counter()
    first_kwargs = cfg.llm_kwargs(cfg.methods[0])
    base = llm_factory(cfg.model, **first_kwargs)
    if base.tokenizer is None:
        raise ConfigError(f"model {cfg.model!r} has no tokenizer (a random-weight preset); eval needs text")
    check_lengths(cfg.spec.lengths, base.max_model_len, cfg.methods[0].label)
    samples = generate_samples(cfg.spec, base.tokenizer)
    result = EvalResult(_meta(cfg, base, command, samples))
    from tqdm import tqdm

    bar = tqdm(total=len(samples) * len(cfg.methods), unit="sample", file=sys.stderr, disable=not progress)
    try:
        for i, method in enumerate(cfg.methods):
            kwargs = cfg.llm_kwargs(method)
            llm = (
                base if i == 0 else reuse_llm(base, kwargs, first_kwargs) or llm_factory(cfg.model, **kwargs)
            )
            check_lengths(cfg.spec.lengths, llm.max_model_len, method.label)
            scores: list[float] = []
            for sample in samples:
                bar.set_description(f"{method.label} {sample.task} {sample.length}")
                record = run_sample(llm, sample, method.label)
                result.records.append(record)
                scores.append(record.score)
                bar.set_postfix(score=f"{sum(scores) / len(scores):.2f}")
                bar.update()
    finally:
        bar.close()
    result.meta["elapsed_s"] = round(time.perf_counter() - t0, 1)
    return result


def _meta(cfg: EvalConfig, llm: Any, command: str, samples: list[Sample]) -> dict[str, Any]:
    spec = cfg.spec
    loaded = getattr(llm, "loaded", None)
    return {
        "task": spec.task,
        "subtasks": list(spec.names),
        "model": cfg.model if cfg.model is not None else getattr(loaded, "name", "embedded"),
        "methods": [
            {"label": m.label, "kwargs": dict(m.kwargs), "lossless": m.lossless} for m in cfg.methods
        ],
        "lengths": list(spec.lengths),
        "depths": [d for d in spec.grid_depths],  # null: drawn at random per sample
        "samples": spec.samples,
        "seed": spec.seed,
        "haystack": {n: spec.haystack or DEFAULT_HAYSTACK[n] for n in spec.names},
        "max_model_len": llm.max_model_len,
        "num_prompts": len(samples),
        "machine": machine_info(str(getattr(llm, "device", cfg.device))),
        "kvtier_version": __version__,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": command,
    }
