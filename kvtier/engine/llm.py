"""`LLM`: the offline generation API, shaped like vLLM's (`LLM(model=...).generate(prompts, params)`)."""

from __future__ import annotations

import time
import weakref
from dataclasses import fields

import torch

from kvtier.attention.interface import ReplaysGraphs
from kvtier.engine.batched import generate_batched, runs_batched
from kvtier.engine.config import EngineConfig
from kvtier.engine.load import fuse_llm_model, load_llm_model
from kvtier.engine.outputs import RequestOutput
from kvtier.engine.prompts import Prompt, check_length, encode_prompt, prompt_list, text_and_reason, tokenize
from kvtier.engine.ranks import start_llm_ranks
from kvtier.engine.sampling import SamplingParams
from kvtier.engine.tiered import generate_tiered
from kvtier.errors import ConfigError, KvtierError
from kvtier.kv.cpu_attend import hardware_for
from kvtier.kv.device_memory import DeviceMemory
from kvtier.kv.store import StoreOptions, TieredKVStore
from kvtier.loading import LoadedModel
from kvtier.methods import MethodChoice, Placement, PlanInputs, parse_choice, plan_for
from kvtier.model.llama import CausalLM
from kvtier.planner.hardware import Hardware, host_memory_available
from kvtier.planner.placement import KVPlan
from kvtier.planner.sharding import rank_host_budget
from kvtier.policies import PolicyParts


class LLM:
    """A loaded model, and the method its requests run with unless they name another.

    >>> llm = LLM()                      # the embedded SmolLM2-135M-Instruct, offline
    >>> out = llm.generate("The capital of France is", SamplingParams(max_tokens=8))[0]
    >>> out.text, out.stats.peak_bytes

    Options: `device` ("auto", "cpu", "cuda"), `dtype` ("auto" = bf16 on GPU, fp32 on CPU),
    `kv` ("auto", "gpu", "layer", "head"), `gpu_memory` (e.g. "24GiB": the budget the planner
    fits weights, activations and KV into; on CUDA it also caps this process), `head_group`
    (KV heads per streamed group), `chunk_size` (prefill chunk; default from the planner),
    `max_model_len` (allow prompts past the model's trained context), `cpu_attention` ("off", the
    default; "auto": the planner gives the CPU the streamed slices it can decode in time,
    measured on this machine; or a number of slices: `kvtier.planner.cpu_split`),
    `fuse_projections` (q/k/v and gate/up as one matmul each, the default; False keeps the
    separate ones, for comparisons), `single_batched` (one prompt
    with a lossless method and `kv="auto"` runs through the batch engine, its decode steps
    replayed as CUDA graphs, when its KV fits the device; None: on CUDA), `exact_lossless` (a
    request whose lossy method drops nothing at its length, such as HiP under 3,328 tokens with
    `fast`, runs lossless and says so in `stats.plan["ran_lossless"]`; None: on CUDA),
    `prefill_order` ("chunk", the default; "layer": a long prompt's chunks through each layer
    in turn where its KV streams, so no chunk loads the stored prefix again; one process only;
    `stats.prefill_order` says which ran). The placement
    (`kv`, `head_group`) and the opt-in lossy options make this LLM's default `MethodChoice`;
    `generate(..., method="head,head_group=1")` runs one request with another on the same weights.

    `tensor_parallel=N` splits the model over N ranks by KV heads (`kvtier.parallel`), each with
    its own GPU, KV tiers and plan (`gpu_memory` is per GPU; host memory is split evenly). In a
    plain process this LLM becomes rank 0 and starts ranks 1..N-1 itself (`close()` stops them);
    under `torchrun --nproc-per-node N` every process builds its LLM (None: as launched) and
    calls `generate` with the same arguments. Lossless methods only, prompts one at a time.
    `pipeline_parallel=N` instead splits it into N stages of contiguous layers
    (`kvtier.parallel.pipeline`), launched the same ways.
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        device: str = "auto",
        dtype: str = "auto",
        kv: str = "auto",
        gpu_memory: str | int | None = None,
        head_group: int | None = None,
        chunk_size: int | None = None,
        block_size: int = 256,
        max_model_len: int | None = None,
        seed: int = 0,
        attention: str = "dense",
        hip_preset: str = "auto",
        hip_refresh: str | None = None,
        hip_host_keys: bool | None = None,
        hip_probes: bool | None = None,
        hip_strides: str | None = None,
        hip_align_window: bool | None = None,
        hip_exact: int | None = None,
        hip_stage0: int | None = None,
        hip_landmarks: bool | str | None = None,
        kv_quant: str | None = None,
        evict: str | None = None,
        kv_budget: int | None = None,
        head_sparsity: float | None = None,
        cpu_attention: str | int = "off",
        fuse_projections: bool = True,
        experts: str = "auto",
        single_batched: bool | None = None,
        exact_lossless: bool | None = None,
        prefill_order: str = "chunk",
        tensor_parallel: int | None = None,
        pipeline_parallel: int | None = None,
    ) -> None:
        options = dict(locals())  # NOTE: first, so it holds the arguments alone (ranks 1..N-1 get them)
        del options["self"]
        started = time.perf_counter()
        self.collectives_started = False  # whether the current generate call has run the model
        self.config = EngineConfig.with_sizes(
            gpu_memory,
            device=device,
            dtype=dtype,
            chunk_size=chunk_size,
            block_size=block_size,
            max_model_len=max_model_len,
            seed=seed,
            cpu_attention=cpu_attention,
            fuse_projections=fuse_projections,
            experts=experts,
            single_batched=single_batched,
            exact_lossless=exact_lossless,
            prefill_order=prefill_order,
        )
        # The default method of this LLM's requests (its arguments named as MethodChoice's
        # fields); `generate(..., method=)` picks another.
        chosen = {f.name: options[f.name] for f in fields(MethodChoice) if f.name in options}
        self.method = MethodChoice(**chosen)
        self.device = self.config.torch_device()
        # The rank group (None: one process), the workers this process started (ranks 1..N-1),
        # and whether the ranks are pipeline stages (else tensor-parallel shards).
        self.parallel, self._workers, self.pipeline = start_llm_ranks(
            LLM, options, self.method, self.config, self.device
        )
        if self._workers is not None:
            weakref.finalize(self, self._workers.close)
        try:
            if self.parallel is not None:
                self.device = self.parallel.device
            self.dtype = self.config.torch_dtype(self.device)
            self.loaded: LoadedModel = load_llm_model(
                model, self.config, self.device, self.dtype, self.parallel, self.pipeline
            )
        except BaseException:
            if self._workers is not None:
                self._workers.close(timeout_s=5.0, notify=False)
            raise
        if self.config.fuse_projections:
            fuse_llm_model(self.loaded.model, self.device)
        self.model_config = self.loaded.config  # a rank's config under tensor parallelism
        self.tokenizer = self.loaded.tokenizer
        self.max_model_len = self.max_model_len_for(self.method)
        # Fail on budgets the model rejects now, before the first request.
        self.method.build(self.model_config, self.device, self.loaded.model, context=self.max_model_len)
        self.load_s = time.perf_counter() - started  # seconds this took: mostly the model's load

    @property
    def tensor_parallel(self) -> int:
        """The number of tensor-parallel ranks the model is split over (1: none)."""
        return 1 if self.parallel is None or self.pipeline else self.parallel.size

    @property
    def pipeline_parallel(self) -> int:
        """The number of pipeline stages the model is split into (1: none)."""
        return self.parallel.size if self.parallel is not None and self.pipeline else 1

    @property
    def is_rank0(self) -> bool:
        """Whether this process is rank 0 (or the only one): the one that prints."""
        return self.parallel is None or self.parallel.is_rank0

    def close(self) -> None:
        """Stop the tensor-parallel ranks this LLM started and leave their group (a no-op for
        one process). The LLM cannot generate afterwards."""
        if self._workers is not None:
            self._workers.close()
        elif self.parallel is not None:
            self.parallel.close()
        self._workers = None

    @property
    def model(self) -> CausalLM:
        """The loaded decoder (under tensor parallelism, this rank's shard)."""
        return self.loaded.model

    @property
    def name(self) -> str:
        """The model's name (its folder, file or preset)."""
        return self.loaded.name

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return frozenset(self.loaded.eos_token_ids)

    @property
    def budget_given(self) -> bool:
        """Whether `gpu_memory` was given (else the planner may use the whole GPU)."""
        return self.config.gpu_memory is not None

    def max_model_len_for(self, method: MethodChoice) -> int:
        """The longest prompt plus output a request under `method` may have: `max_model_len` when
        given, else the trained length, lifted by a method with context extension (HiP)."""
        if self.config.max_model_len is not None:
            return self.config.max_model_len
        if method.extends_context:
            return 1 << 24
        return int(self.model_config.max_position_embeddings)

    def resolve_method(self, method: MethodChoice | str | None) -> MethodChoice:
        """A request's method: this LLM's default (None), a `MethodChoice`, or a spec such as
        "head,head_group=1" or "hip,hip_preset=fast" (`kvtier.methods.spec`)."""
        if method is None:
            return self.method
        if isinstance(method, str):
            return parse_choice(method)
        return method

    # -- planning ------------------------------------------------------------------------------

    def gpu_budget(self) -> int | None:
        """Bytes the planner may use on the GPU (None: unlimited, on the CPU)."""
        if self.config.gpu_memory is not None:
            return self.config.gpu_memory
        if self.device.type == "cuda":
            return int(torch.cuda.get_device_properties(self.device).total_memory)
        return None

    def plan(self, context: int, method: MethodChoice | None = None, new_tokens: int | None = None) -> KVPlan:
        """The KV placement for a sequence of `context` tokens under `method` (default: this
        LLM's), `new_tokens` of them decoded (None: unknown), from `kvtier.methods.plan_for`."""
        return self.placement(context, method or self.method, new_tokens).plan

    def placement(self, context: int, method: MethodChoice, new_tokens: int | None = None) -> Placement:
        """`plan_for` on this LLM's model, device, budget and options."""
        return plan_for(self.plan_inputs(context, method, new_tokens), method)

    def plan_inputs(self, context: int, method: MethodChoice, new_tokens: int | None = None) -> PlanInputs:
        """What `plan_for` plans a request of `context` tokens under `method` with, here
        (`new_tokens`: how many of them decode appends, the request's max_tokens; None: unknown)."""
        return PlanInputs(
            self.model_config,
            context,
            hardware=self.hardware(),
            dtype_bytes=self.dtype.itemsize,
            gpu_budget=self.gpu_budget(),
            host_budget=rank_host_budget(
                host_memory_available() if self.device.type == "cuda" else None,
                1 if self.parallel is None else self.parallel.local_size,
            ),
            kv=method.kv,
            head_group=method.head_group,
            chunk_size=self.config.chunk_size,
            block_size=self.config.block_size,
            cpu_attention=self.cpu_attention,
            new_tokens=new_tokens,
        )

    @property
    def cpu_attention(self) -> str | int:
        """The CPU co-attention mode the planner gets: this LLM's, or "off" under tensor
        parallelism (the ranks of a machine would share one CPU pool; not modelled yet)."""
        return self.config.cpu_attention if self.parallel is None else "off"

    def hardware(self) -> Hardware:
        """The device's hardware numbers, with this host's CPU rates measured when CPU attention
        is `auto` on CUDA (`kvtier.kv.cpu_attend.hardware_for`)."""
        return hardware_for(self.device, self.cpu_attention, self.dtype, self.model_config)

    # -- prompts -------------------------------------------------------------------------------

    def encode(self, prompt: Prompt, chat: bool = False) -> list[int]:
        """Token ids of a prompt (text is tokenized; a list of ids is taken as it is)."""
        return encode_prompt(prompt, self.tokenizer, self.loaded.name, self.model_config.vocab_size, chat)

    # -- generation ----------------------------------------------------------------------------

    def generate(
        self,
        prompts: Prompt | list[Prompt],
        params: SamplingParams | None = None,
        *,
        chat: bool = False,
        progress: bool = False,
        method: MethodChoice | str | None = None,
    ) -> list[RequestOutput]:
        """Generate for each prompt (text or token ids) under `method` (default: this LLM's; see
        `resolve_method`). A list of prompts with the KV on the device (`kv` auto or gpu) runs
        batched, through the continuous-batching engine `kvtier serve` uses: over the page pool
        for a lossless method, each over a store of its own for a lossy one; so does one prompt
        under a lossless method with `kv` auto on CUDA (`single_batched`). Otherwise (offloaded
        KV, a prompt too long for the pool, a store that would stream) the prompts run one after
        the other, each planned alone. Under tensor parallelism every rank runs the call (rank 0
        sends it to the ranks it started) and the prompts run one at a time."""
        self.collectives_started = False
        if self._workers is None:
            return self._generate(prompts, params, chat, progress, method)
        self._workers.call("generate", prompts, params, chat=chat, progress=False, method=method)
        try:
            return self._generate(prompts, params, chat, progress, method)
        except BaseException as e:
            # NOTE: a KvtierError before the model ran (a bad prompt, a plan that does not fit) is
            # met by every rank alike, before any collective; after it (or on an interrupt), a
            # worker may be waiting in one.
            if self.collectives_started or not isinstance(e, KvtierError):
                self._workers.broken = True
            raise

    def _generate(
        self,
        prompts: Prompt | list[Prompt],
        params: SamplingParams | None,
        chat: bool,
        progress: bool,
        method: MethodChoice | str | None,
    ) -> list[RequestOutput]:
        params = params or SamplingParams()
        chosen = self.resolve_method(method)
        if self.parallel is not None and not chosen.lossless:
            raise ConfigError(
                f"several ranks run the lossless placements only for now; method {method!r} is lossy"
            )
        batch = prompt_list(prompts)
        encoded, tokenize_s = tokenize(batch, lambda p: self.encode(p, chat))
        for ids in encoded:
            check_length(len(ids), params, self.max_model_len_for(chosen))
        exact = self.exact_note(chosen, max(len(ids) for ids in encoded) + params.max_tokens)
        if exact is not None:
            chosen = chosen.lossless_twin
        outputs = self._run(batch, encoded, params, progress, chosen)
        for out, seconds in zip(outputs, tokenize_s, strict=True):
            out.stats.tokenize_s = seconds
            if exact is not None:
                out.stats.plan["ran_lossless"] = exact
        return outputs

    def exact_note(self, method: MethodChoice, context: int) -> str | None:
        """`EngineConfig.exact_note` for this LLM's model and device."""
        return self.config.exact_note(method, self.model_config, self.device, context)

    def _run(
        self,
        batch: list[Prompt],
        encoded: list[list[int]],
        params: SamplingParams,
        progress: bool,
        chosen: MethodChoice,
    ) -> list[RequestOutput]:
        if runs_batched(self, len(batch), chosen):
            batched = generate_batched(self, batch, encoded, params, progress, chosen)
            if batched is not None:
                return batched
        return [
            generate_tiered(self, p, ids, params, progress, chosen)
            for p, ids in zip(batch, encoded, strict=True)
        ]

    def make_store(
        self,
        plan: KVPlan,
        context: int,
        hip_cache_tokens: int | None = None,
        method: MethodChoice | None = None,
        memory: DeviceMemory | None = None,
        hip_prune_bytes: int | None = None,
        graphs: bool = True,
    ) -> tuple[TieredKVStore, PolicyParts]:
        """A fresh KV store for one sequence of `context` tokens, with `method`'s parts (default:
        this LLM's; `hip_cache_tokens`: HiP's block cache per offloaded slice, None: the preset's;
        `memory`: where its whole-capacity buffers live, None: the caching allocator;
        `hip_prune_bytes`: HiP's prefill pruning batch as planned, `Placement.prune_bytes`;
        `graphs`: whether a kernel's default may replay decode steps as CUDA graphs,
        `ReplaysGraphs`; a server's requests pass False until measured there)."""
        method = method or self.method
        parts = method.build(
            self.model_config,
            self.device,
            self.loaded.model,
            hip_cache_tokens,
            context=context,
            hip_prune_bytes=hip_prune_bytes,
        )
        if not graphs and isinstance(parts.kernel, ReplaysGraphs):
            parts.kernel.allow_graphs(False)
        store = TieredKVStore(
            self.model_config,
            plan,
            device=self.device,
            dtype=self.dtype,
            capacity=context,
            options=StoreOptions(block_size=self.config.block_size),
            memory=memory,
            **parts.store_kwargs(),
        )
        return store, parts

    def text_and_reason(self, tokens: list[int], params: SamplingParams) -> tuple[str, str]:
        """The output text of `tokens` (cut at a stop string) and why generation ended."""
        return text_and_reason(tokens, params, self.loaded.eos_token_ids, self.tokenizer)
