"""`TieredCache`: a transformers `Cache` whose KV lives in kvtier's tiered store.

```python
cache = kvtier.hf.TieredCache(model, kv="head", gpu_memory="24GiB")   # any method spec
out = model.generate(**inputs, past_key_values=cache, max_new_tokens=64)
```

The planner places the cache (`kvtier.methods.plan_for`, as `kvtier.LLM` does) and the store is
built the way `LLM.make_store` builds it, with the method's parts from the registry. The model's
attention is switched to the "kvtier" implementation (`kvtier.hf.attention`), which runs each
layer's attention inside the store; `update` stores nothing itself and returns only the step's
own K/V.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any, NoReturn

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kvtier.config import ModelConfig
from kvtier.errors import CapacityError, ConfigError
from kvtier.hf.attention import NAME, HandOver, drop, hand_over, install
from kvtier.hf.config import model_config
from kvtier.kv.cpu_attend import hardware_for
from kvtier.kv.store import StoreOptions, TieredKVStore
from kvtier.methods import MethodChoice, Placement, PlanInputs, parse_choice, plan_for
from kvtier.planner.cpu_split import parse_mode
from kvtier.planner.hardware import Hardware, host_memory_available
from kvtier.planner.placement import KVPlan
from kvtier.policies import PolicyParts
from kvtier.units import parse_count, parse_size


class _StoreLayer(CacheLayerMixin):
    """The per-layer view transformers asks for lengths; the KV itself is in the store."""

    def __init__(self, cache: TieredCache) -> None:
        super().__init__()
        self._cache = cache
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        return None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        raise ConfigError("TieredCache layers are updated through TieredCache.update")

    def get_seq_length(self) -> int:
        return self._cache.get_seq_length()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self._cache.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return self._cache.context

    def offload(self) -> None:
        return None  # the store places the KV

    def prefetch(self) -> None:
        return None

    def reset(self) -> None:
        return None  # TieredCache.reset rebuilds the store


class TieredCache(Cache):
    """KV cache of one sequence (batch size 1, no padding) for a transformers causal LM.

    `kv` is a method spec, as `LLM.generate(method=...)` takes: a placement ("auto", "gpu",
    "layer", "head", "head,head_group=2") and at most one lossy method ("int8",
    "window,kv_budget=512", "quest,kv_budget=1k", "kv=layer,kv_quant=int4"), or a
    `MethodChoice`. `gpu_memory` is the budget the planner fits weights, one prefill chunk's
    activations (HF's forward's, `hf_activation_bytes`) and the KV into (default: the whole GPU;
    unlimited on the CPU); it does not cap the process. `context` is the most tokens the cache
    will hold (prompt plus new tokens; default: the model's `max_position_embeddings`): the plan
    is made for it, and a longer sequence is refused. `new_tokens`: how many of them `generate`
    will add (its `max_new_tokens`); SnapKV keeps every decoded token, so without it its plan
    holds the whole context. `plan` replaces the planner's placement
    with one of your own. `cpu_attention` ("auto", "off" or a number of slices) lets decode
    attend some streamed slices on the CPU where the KV already is, as
    `kvtier.LLM(cpu_attention=)` does.

    Lossless specs give the same greedy tokens as transformers' `DynamicCache`. Methods that
    keep keys un-rotated (StreamingLLM eviction, HiP's context extension) or that calibrate
    kvtier's own model (head sparsity) are not available here: HF rotates keys before the cache.
    """

    def __init__(
        self,
        model: Any,
        kv: str | MethodChoice = "auto",
        *,
        gpu_memory: str | int | None = None,
        context: int | str | None = None,
        new_tokens: int | None = None,
        chunk_size: int | None = None,
        block_size: int = 256,
        plan: KVPlan | None = None,
        cpu_attention: str | int = "auto",
    ) -> None:
        self.method = parse_choice(kv) if isinstance(kv, str) else kv
        self.model_config: ModelConfig = model_config(model)
        self.device = torch.device(model.device)
        self.dtype: torch.dtype = model.dtype
        default = self.model_config.max_position_embeddings
        self.context = parse_count(context, "context") if context is not None else default
        if self.context < 1:
            raise ConfigError(f"context must be at least 1 token, got {self.context}")
        if new_tokens is not None and not 0 <= new_tokens <= self.context:
            raise ConfigError(f"new_tokens must be between 0 and context ({self.context}), got {new_tokens}")
        self.new_tokens = new_tokens
        self.gpu_memory = None if gpu_memory is None else parse_size(gpu_memory, "gpu_memory")
        if chunk_size is not None and chunk_size < 1:
            raise ConfigError(f"chunk_size must be at least 1, got {chunk_size}")
        self.chunk_size = chunk_size
        self.block_size = block_size
        self.cpu_attention = parse_mode(cpu_attention)
        self.placement = Placement(plan) if plan is not None else plan_for(self.plan_inputs(), self.method)
        self.parts = self._build_parts()
        install(model)
        self._hf_config = model.config
        super().__init__(layers=[_StoreLayer(self) for _ in range(self.model_config.num_layers)])
        self.store = self._make_store()
        self._open = False  # a forward is between its layer-0 update and its last layer's attention
        self._next_layer = 0
        self._step_tokens = 0

    # -- planning ------------------------------------------------------------------------------

    @property
    def plan(self) -> KVPlan:
        """The store's placement."""
        return self.placement.plan

    def plan_inputs(self) -> PlanInputs:
        """What the planner plans this cache with (as `LLM.plan_inputs` does)."""
        cuda = self.device.type == "cuda"
        budget = self.gpu_memory
        if budget is None and cuda:
            budget = int(torch.cuda.get_device_properties(self.device).total_memory)
        return PlanInputs(
            self.model_config,
            self.context,
            hardware=self.hardware(),
            dtype_bytes=self.dtype.itemsize,
            gpu_budget=budget,
            host_budget=host_memory_available() if cuda else None,
            kv=self.method.kv,
            head_group=self.method.head_group,
            chunk_size=self.chunk_size,
            block_size=self.block_size,
            cpu_attention=self.cpu_attention,
            new_tokens=self.new_tokens,
            # NOTE: HF's own forward runs the chunks: it keeps more [T, h] tensors alive than
            # kvtier's runner and its norms make fp32 copies (`hf_activation_bytes`).
            activations="hf",
        )

    def hardware(self) -> Hardware:
        """The device's hardware numbers, with this host's CPU rates measured when CPU attention
        is `auto` on CUDA (`kvtier.kv.cpu_attend.hardware_for`)."""
        return hardware_for(self.device, self.cpu_attention, self.dtype, self.model_config)

    def _build_parts(self) -> PolicyParts:
        if self.method.head_sparsity is not None:
            raise ConfigError(
                "head sparsity classifies heads by running kvtier's own model on a calibration "
                "prompt; it is not available through kvtier.hf: use kvtier.LLM"
            )
        parts = self.method.build(
            self.model_config,
            self.device,
            None,
            self.placement.cache_tokens,
            context=self.context,
            hip_prune_bytes=self.placement.prune_bytes,
        )
        if not parts.rotate_keys:
            raise ConfigError(
                f"{parts.describe} keeps keys un-rotated and applies RoPE itself, but transformers "
                "rotates keys before they reach the cache; run this method with kvtier.LLM"
            )
        return parts

    def _make_store(self) -> TieredKVStore:
        # NOTE: rotate_keys=False: the keys HF hands over are already rotated (and so are the
        # queries), which is what every method whose parts say rotate_keys=True expects.
        kwargs = {**self.parts.store_kwargs(), "rotate_keys": False}
        return TieredKVStore(
            self.model_config,
            self.plan,
            device=self.device,
            dtype=self.dtype,
            capacity=self.context,
            options=StoreOptions(block_size=self.block_size),
            **kwargs,
        )

    def describe(self) -> dict[str, Any]:
        """The plan and method, as `GenerationStats.plan` shows them."""
        return {**asdict(self.plan), "method": self.parts.describe}

    # -- transformers' Cache API ---------------------------------------------------------------

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Hand layer `layer_idx`'s step K/V ([1, H_kv, T, D], rotated) to the attention call
        that follows; the store appends them there. Returns them unchanged (not the context)."""
        b, t = key_states.shape[0], key_states.shape[2]
        if b != 1:
            raise ConfigError(
                f"TieredCache holds one sequence: batch size must be 1, got {b} (a batch of prompts, "
                "num_beams > 1 or num_return_sequences > 1); run one sequence per cache"
            )
        if key_states.dtype != self.dtype or key_states.device != self.device:
            raise ConfigError(
                f"keys arrive as {key_states.dtype} on {key_states.device}, but the cache was built for "
                f"{self.dtype} on {self.device}; build it after moving the model (one device, one dtype)"
            )
        if layer_idx == 0:
            self._begin(t)
        elif not self._open or layer_idx != self._next_layer or t != self._step_tokens:
            self._broken(f"layer {layer_idx} updated out of order")
        hand_over(HandOver(self, layer_idx, key_states, value_states))
        return key_states, value_states

    def attend(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """Append the step's K/V of `layer` to the store and attend: query [1, H_q, T, D], key and
        value [1, H_kv, T, D], all rotated; returns [1, T, H_q, D]. Called by "kvtier" attention."""
        # NOTE: contiguous, the layout kvtier's own model hands the store (HF's is head-major).
        q = query[0].transpose(0, 1).contiguous()  # [T, H_q, D]
        k = key[0].transpose(0, 1)  # [T, H_kv, D]
        v = value[0].transpose(0, 1)
        out = self.store(layer, q, k, v)  # [T, H_q, D]
        self._next_layer = layer + 1
        if self._next_layer == self.model_config.num_layers:
            self.store.end_step()
            self._open = False
        return out.unsqueeze(0)

    def _begin(self, tokens: int) -> None:
        if self._open:
            self._broken("the previous forward through this cache stopped before its last layer")
        if self._hf_config._attn_implementation != NAME:
            raise ConfigError(
                f"the model's attention was switched to {self._hf_config._attn_implementation!r} after "
                "this TieredCache was built; build a new TieredCache (it switches it back to 'kvtier')"
            )
        end = self.store.position + tokens
        if end > self.context:
            raise CapacityError(
                f"this TieredCache was planned for {self.context} tokens, and this step would make "
                f"{end}; build it with context= the prompt plus the new tokens (at least {end})"
            )
        self.store.begin_step(tokens)
        self._open, self._next_layer, self._step_tokens = True, 0, tokens

    def _broken(self, what: str) -> NoReturn:
        drop()
        raise ConfigError(
            f"{what}; the cache's contents are incomplete: call cache.reset() or build a new one"
        )

    def get_seq_length(self, layer_idx: int | None = 0) -> int:
        """Tokens seen so far (absolute positions; an evictor may keep fewer)."""
        return int(self.store.position)

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return self.context

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def is_croppable(self) -> bool:
        return False

    def reset(self) -> None:
        """Empty the cache (a fresh store of the same plan)."""
        drop()
        self.store.close()
        self.parts = self._build_parts()
        self.store = self._make_store()
        self._open = False

    def close(self) -> None:
        """Free every tier; the cache is unusable afterwards."""
        self.store.close()

    def crop(self, tokens_to_remove: int) -> None:
        self._unsupported("crop (assisted or speculative decoding)")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._unsupported("reorder_cache (beam search)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._unsupported("batch_repeat_interleave (num_return_sequences > 1 or beam search)")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._unsupported("batch_select_indices")

    def offload(self, layer_idx: int, only_non_sliding: bool = True) -> None:
        return None

    def prefetch(self, layer_idx: int, only_non_sliding: bool = True) -> None:
        return None

    def _unsupported(self, what: str) -> NoReturn:
        raise ConfigError(
            f"TieredCache does not support {what}: it holds one sequence and never rolls back; "
            "use greedy or sampled generation with num_beams=1"
        )

    def __repr__(self) -> str:
        p = self.plan
        return (
            f"TieredCache(kv={p.policy}, group={p.group_size}, resident={p.resident_slices}/{p.num_slices}, "
            f"method={self.parts.describe!r}, tokens={self.get_seq_length()}/{self.context})"
        )
