"""Running an eval: load the model, generate the samples once, run them under each method."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from kvtier import __version__
from kvtier.engine.sampling import SamplingParams
from kvtier.errors import ConfigError
from kvtier.eval.prompts import Sample
from kvtier.eval.results import EvalResult, Record, machine_info
from kvtier.eval.scoring import score
from kvtier.eval.specs import MethodSpec
from kvtier.eval.tasks import DEFAULT_HAYSTACK, TaskSpec, generate_samples


@dataclass(frozen=True)
class EvalConfig:
    """A whole run: the task, the methods to compare, and how to load the model."""

    spec: TaskSpec
    methods: tuple[MethodSpec, ...]
    model: str | None = None  # None: the embedded SmolLM2-135M-Instruct
    device: str = "auto"
    max_model_len: int | None = None
    gpu_memory: str | None = None  # every method's GPU budget unless it names its own

    def __post_init__(self) -> None:
        if not self.methods:
            raise ConfigError("give at least one --method")

    def llm_kwargs(self, method: MethodSpec) -> dict[str, Any]:
        """Keyword arguments of `LLM(model, ...)` that load the model for `method` (its engine
        options; the method itself is chosen per request)."""
        budget = {} if self.gpu_memory is None else {"gpu_memory": self.gpu_memory}
        return {"device": self.device, "max_model_len": self.max_model_len, **budget, **method.engine()}


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


def run_sample(llm: Any, sample: Sample, method: MethodSpec) -> Record:
    """Generate greedily for `sample` under `method` and score the answer."""
    params = SamplingParams(max_tokens=sample.max_tokens, temperature=0.0, stop=sample.stop)
    out = llm.generate([list(sample.prompt_ids)], params, chat=False, method=method.choice())[0]
    return Record(
        method=method.label,
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
        ran_lossless="ran_lossless" in (getattr(out.stats, "plan", None) or {}),
    )


def run_eval(
    cfg: EvalConfig,
    *,
    command: str = "",
    progress: bool = True,
    llm_factory: Callable[..., Any] | None = None,
    after_each: Callable[[EvalResult], None] | None = None,
    done: Sequence[Record] = (),
) -> EvalResult:
    """Run every sample of `cfg.spec` under every method, on one loaded model (a method that
    changes an engine option, such as `chunk_size` or `dtype`, loads its own).

    `after_each` sees the result after every sample, its `meta["complete"]` False until the
    last (the CLI saves `--out` there, so a long run that stops keeps what it finished).
    `done`: records of an earlier run of the same grid (`--resume`): a sample whose method,
    cell and index, prompt length and expected answer match one is not run again."""
    if llm_factory is None:
        from kvtier.engine.llm import LLM

        llm_factory = LLM
    t0 = time.perf_counter()
    first_kwargs = cfg.llm_kwargs(cfg.methods[0])
    base = llm_factory(cfg.model, **first_kwargs)
    if base.tokenizer is None:
        raise ConfigError(f"model {cfg.model!r} has no tokenizer (a random-weight preset); eval needs text")
    check_lengths(cfg.spec.lengths, base.max_model_len_for(cfg.methods[0].choice()), cfg.methods[0].label)
    samples = generate_samples(cfg.spec, base.tokenizer)
    result = EvalResult(_meta(cfg, base, command, samples))
    result.meta["complete"] = False
    earlier = {_key(r.method, r.task, r.length, r.depth, r.index): r for r in done}
    result.meta["resumed"] = 0
    from tqdm import tqdm

    bar = tqdm(total=len(samples) * len(cfg.methods), unit="sample", file=sys.stderr, disable=not progress)
    try:
        for method in cfg.methods:
            kwargs = cfg.llm_kwargs(method)
            llm = base if kwargs == first_kwargs else llm_factory(cfg.model, **kwargs)
            check_lengths(cfg.spec.lengths, llm.max_model_len_for(method.choice()), method.label)
            scores: list[float] = []
            for sample in samples:
                bar.set_description(f"{method.label} {sample.task} {sample.length}")
                key = _key(method.label, sample.task, sample.length, sample.depth, sample.index)
                prev = earlier.get(key)
                if prev is not None and (prev.expected, prev.prompt_tokens) == (
                    sample.expected,
                    sample.prompt_tokens,
                ):
                    record = prev
                    result.meta["resumed"] += 1
                else:
                    record = run_sample(llm, sample, method)
                result.records.append(record)
                scores.append(record.score)
                bar.set_postfix(score=f"{sum(scores) / len(scores):.2f}")
                bar.update()
                result.meta["elapsed_s"] = round(time.perf_counter() - t0, 1)
                if after_each is not None and len(result.records) < bar.total:
                    after_each(result)
    finally:
        bar.close()
    result.meta["elapsed_s"] = round(time.perf_counter() - t0, 1)
    result.meta["complete"] = True
    return result


def _key(method: str, task: str, length: int, depth: float | None, index: int) -> tuple[Any, ...]:
    return method, task, length, depth, index


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
        "first_sample": spec.first_sample,
        "seed": spec.seed,
        "haystack": {n: spec.haystack or DEFAULT_HAYSTACK[n] for n in spec.names},
        "max_model_len": llm.max_model_len_for(cfg.methods[0].choice()),
        "num_prompts": len(samples),
        "machine": machine_info(str(getattr(llm, "device", cfg.device))),
        "kvtier_version": __version__,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": command,
    }
