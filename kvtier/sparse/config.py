"""Configuration of InfiniteHiP-style sparse attention: one frozen, validated dataclass.

Every key a query attends is one of three kinds (per query block of `block_q` queries):

    [0, sink)                     sink tokens, always kept
    [sink, w0)                    the middle: pruned by the stages to at most `budgets[-1]` tokens
    [w0, query]                   the recent window, always kept; w0 = first query - window + 1

Each pruning stage i splits its candidates into chunks of `chunk_sizes[i]` tokens, scores every
chunk by a bisection-found representative key, and keeps the top `budgets[i] // chunk_sizes[i]`
chunks; the kept chunks are the next stage's candidates. The published defaults ("3K": sink 256,
window 1024, chunks 256 -> 32 -> 8, budgets 32K -> 8K -> 2K, 4K for the first 4 layers) are the
defaults here; `HipConfig.scaled` shrinks them for small contexts and tests.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvtier.errors import ConfigError

PRUNING_ROPE = ("relative", "chunk_indexed", "absolute")
ATTENTION_ROPE = ("streaming", "absolute")
HEAD_SCORE = ("max", "softmax")
# `HipConfig.exact_chunk`'s largest value: a tile of the exact scoring kernel holds whole chunks
# of 64 candidates (`kvtier.sparse.triton_chunk_max`)
EXACT_CHUNK_MAX = 64

# Decode refresh intervals per stage (steps between recomputations of a stage's selection).
REFRESH_PRESETS: dict[str, tuple[int, ...]] = {
    "default": (16, 8, 4),  # paper, Appendix F
    # `lean`'s: stage 0, the only stage that reads a whole offloaded slice's keys, every 128
    # steps; stages 1 and 2 as the paper, whose staleness does cost (bench/results/
    # hip_cli_speed_512k_hip_steps.json: `lean` with `fast`'s 32/16/8 decoded 2.5x `lean` with
    # 16/8/4 at 512K, but changed 3 of 66 NIAH answers, two in a late digit). Stage 0 at 128
    # rather than 32 steps: 1M over int4 on an H100 decoded 31.59 and 30.93 tok/s against 19.52
    # (hip_cli_speed_1m_int4_probes_graphs_161_{refresh128,refresh128_run2,probe}.json); a
    # 256-token copy from 36K tokens back at 70K, teacher-forced, scored 0.578 against 0.574
    # next-token accuracy (hip_decode_fidelity_cuda_copy70k.json); prose NIAH 16K/32K the same
    # 59 of 66 (niah_smollm2_cuda_prose_hip_refresh128_x3.json)
    "lean": (128, 8, 4),
    "fast": (32, 16, 8),  # code default at fea42c7
    "flash": (96, 24, 8),  # used by every official SGLang launch example
    "always": (1, 1, 1),  # recompute every step (the paper's "AR" rows)
}


def refresh_intervals(text: str, what: str = "hip refresh") -> tuple[int, ...]:
    """Decode refresh intervals from a REFRESH_PRESETS name or positive steps joined by '/'
    (a stage each, "64/8/4"; a shorter list repeats its last). ConfigError otherwise, naming
    the value as `what` (the CLI's flag)."""
    if text in REFRESH_PRESETS:
        return REFRESH_PRESETS[text]
    parts = text.split("/")
    if all(p.isdigit() and int(p) > 0 for p in parts):
        return tuple(int(p) for p in parts)
    raise ConfigError(
        f"unknown {what} {text!r}; use one of {', '.join(REFRESH_PRESETS)} or decode steps "
        "between reruns of each pruning stage joined by '/', e.g. 64/8/4"
    )


@dataclass(frozen=True)
class HipConfig:
    """InfiniteHiP pruning + block-sparse attention settings. Validated at construction.

    `extend` = context extension: keys are stored un-rotated (`rotate_keys=False` in the store)
    and RoPE is applied inside the kernel at remapped positions — `pruning_rope` while scoring
    chunks ("relative" in most layers, "chunk_indexed" in `chunk_indexed_layers`) and
    `attention_rope` in the final attention ("streaming": the attended keys get contiguous
    positions ending at the query's). With `extend=False` the store rotates q and k at their true
    positions and the kernel uses them as they are.
    """

    sink: int = 256
    window: int = 1024
    block_q: int = 64
    chunk_sizes: tuple[int, ...] = (256, 32, 8)
    budgets: tuple[int, ...] = (32768, 8192, 2048)
    query_strides: tuple[int, ...] = (4, 4, 1)  # queries mean-pooled per score, per stage
    refresh: tuple[int, ...] = REFRESH_PRESETS["default"]
    wide_layers: tuple[int, ...] = (0, 1, 2, 3)
    wide_budget: int = 4096  # final-stage budget in `wide_layers`
    per_head: bool = False  # False: one selection per slice (scores max-pooled over heads)
    head_score: str = "max"  # "max": raw q.k max-pooled (published); "softmax": see pruning.py
    extend: bool = True
    pruning_rope: str = "relative"
    chunk_indexed_layers: tuple[int, ...] = (0, 1, 2, 3)
    attention_rope: str = "streaming"
    max_context: int | None = None  # when known: the longest context this config must serve
    # The prompt's last token (whose logits give the first answer token) as a step of its own,
    # selected for that query alone as in decode, not pooled into a block of `block_q` queries.
    last_query_alone: bool = True
    # Offloaded (streamed) slices: the GPU block cache that serves decode between stage-0
    # refreshes (see `kvtier.sparse.gpu_cache`). Tokens per block, and tokens per slice
    # (None = `offload_cache_tokens()`: everything a refresh interval reads, so all hit).
    cache_block: int = 16
    cache_tokens: int | None = None
    # The request's tokens (prompt and output), when known: a block cache covers no more
    # stage-0 chunks than they hold and no more sink or window blocks than they fill, and no
    # decode query gathers more rows than there are tokens, so a short request's decode memory
    # shrinks with it (`offload_cache_tokens`, `decode_buffer_tokens`); None: the preset's
    # budgets alone size them.
    capacity: int | None = None
    # Decode steps that rerun stage 0 on a streamed slice: score the keys read from the host
    # tier range by range (only keys cross PCIe; `kvtier.sparse.host_keys`), then read the
    # sinks, the new selection and the window through the block cache (misses fetched), instead
    # of streaming the slice (keys and values) whole. Same outputs. Off until measured on a GPU.
    host_scoring: bool = False
    # Decode steps that rerun stages (on CUDA, with Triton): score only the keys the bisection
    # probes (`kvtier.sparse.triton_bisect`, as prefill does), not every candidate: stage 0 with
    # `host_scoring` reads them in place from the pinned host tier (~2 keys a level of each
    # chunk: 1/16 of the keys at 256-token chunks; full-precision or KIVI rows, else
    # `HostKeys`), later stages from the block cache by address. The scores' summation order
    # differs from the torch path's, so a near-tie may pick another chunk. Off until measured on
    # a GPU (speed and NIAH).
    probe_scoring: bool = False
    # GPU bytes one batch of a prefill chunk's query blocks may take while a stage prunes them
    # (`prefill.run_block_stages`), which HiP's plan reserves; None: `PRUNE_BATCH_BYTES`. The
    # plan raises it to prune a whole chunk at once where the GPU holds every slice and has the
    # room (`kvtier.methods.hip`): SmolLM2's 16K chunk pruned in six batches a stage otherwise,
    # ~25 launches each, and its HiP prefill is bound by launches.
    prune_bytes: int | None = None
    # Decode: the window starts at a stage-0 chunk boundary (sink + k * chunk_sizes[0], at or
    # below where `window` tokens back would start it), so stage 0 scores whole chunks only and
    # the window holds window .. window + chunk_sizes[0] - 1 tokens. Every slice's selection
    # then has the same size (no partial chunk): no host sync trims one, and the layer's decode
    # graphs never decline for sizes that differ. Lossy differently (a few more recent tokens
    # attended): off until measured on a GPU (speed and NIAH).
    align_window: bool = False
    # Prefill: stages of chunks of at most this many tokens score every key of a chunk (its
    # true maximum, one tensor-core product a tile: `kvtier.sparse.triton_chunk_max`), not
    # the bisection's probes, ~6 of an 8-token chunk's keys read in dependent steps. 0: every
    # stage bisects (the paper's). A power of two up to EXACT_CHUNK_MAX. Decode keeps the
    # bisection.
    exact_chunk: int = 0
    # Prefill: consecutive queries that share stage 0's selection, a multiple of `block_q` (0:
    # `block_q`, each block its own, the paper's setting). hip-attention's stages each take a
    # query block size (`ScanStage.stage_block_size_q`); a wider first one runs stage 0, whose
    # work grows with the context, once per group of blocks, and the later stages per block on
    # the group's candidates. The group's candidates end where its first block's do, so a later
    # block's last few hundred middle tokens before its window are never candidates. Lossy
    # differently; a request's `--hip-stage0` (experimental; off until RULER runs with it).
    stage0_block_q: int = 0
    # Prefill: stage 0 scores each chunk by one landmark key, the key its next 512 queries
    # attended most when its prefill chunk ran (`kvtier.sparse.landmarks`, hip-attention's
    # later scan stage), in one dense product, not by bisection. Lossy differently; a request's
    # `--hip-landmarks on` (experimental; off until timed and scored on a GPU).
    stage0_landmarks: bool = False
    # With `stage0_landmarks`: the first query after a prefill (the prompt's last token) scores
    # stage 0 on the same landmarks, not by bisection (`kvtier.sparse.prompt_stage0`): over
    # streamed slices only landmark rows and kept chunks cross PCIe, not every key. A request's
    # `--hip-landmarks all`. Off: one query's selection on one key a chunk found fewer needles
    # (SmolLM2 prose NIAH at 64K on an H100: 11 of 33 against 15 with its last token bisecting,
    # bench/results/niah_smollm2_cuda_prose_64k_fast_landmarks_all_x3.json).
    prompt_landmarks: bool = False

    def __post_init__(self) -> None:
        n = len(self.chunk_sizes)
        if n == 0:
            raise ConfigError("hip chunk_sizes: at least one pruning stage is needed (got zero chunks)")
        for name in ("budgets", "query_strides", "refresh"):
            if len(getattr(self, name)) != n:
                raise ConfigError(
                    f"hip {name}: needs one value per stage ({n} stages from chunk_sizes), "
                    f"got {getattr(self, name)}"
                )
        if self.cache_tokens is not None and self.cache_tokens <= 0:
            raise ConfigError(f"hip cache_tokens must be positive, got {self.cache_tokens}")
        if self.prune_bytes is not None and self.prune_bytes <= 0:
            raise ConfigError(f"hip prune_bytes must be positive, got {self.prune_bytes}")
        for name in ("window", "block_q", "cache_block"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"hip {name} must be positive, got {getattr(self, name)}")
        if self.sink < 0:
            raise ConfigError(f"hip sink must not be negative, got {self.sink}")
        for name in ("chunk_sizes", "budgets", "query_strides", "refresh"):
            if min(getattr(self, name)) <= 0:
                raise ConfigError(f"hip {name} must all be positive, got {getattr(self, name)}")
        for i in range(1, n):
            prev, cur = self.chunk_sizes[i - 1], self.chunk_sizes[i]
            if cur >= prev or prev % cur:
                raise ConfigError(
                    f"hip chunk_sizes must decrease and each must divide the one before: "
                    f"{self.chunk_sizes} (stage {i}: {cur} vs {prev})"
                )
            if self.budgets[i] >= self.budgets[i - 1]:
                raise ConfigError(f"hip budgets must decrease stage by stage, got {self.budgets}")
        for c, k in zip(self.chunk_sizes, self.budgets, strict=True):
            if k % c:
                raise ConfigError(f"hip budgets: {k} is not a whole number of {c}-token chunks")
        if self.block_q % max(self.query_strides) and max(self.query_strides) <= self.block_q:
            raise ConfigError(f"hip query_strides {self.query_strides} must divide block_q {self.block_q}")
        if max(self.query_strides) > self.block_q:
            raise ConfigError(f"hip query_strides {self.query_strides} exceed block_q {self.block_q}")
        if self.stage0_block_q < 0 or self.stage0_block_q % self.block_q:
            raise ConfigError(
                f"hip stage0_block_q must be 0 or a multiple of block_q ({self.block_q}), "
                f"got {self.stage0_block_q}"
            )
        last = self.chunk_sizes[-1]
        if self.wide_budget % last or self.wide_budget < self.budgets[-1]:
            raise ConfigError(
                f"hip wide_budget ({self.wide_budget}) must be a multiple of the last chunk size "
                f"({last}) and at least the final budget ({self.budgets[-1]})"
            )
        if self.exact_chunk and (
            self.exact_chunk > EXACT_CHUNK_MAX or self.exact_chunk & (self.exact_chunk - 1)
        ):
            raise ConfigError(
                f"hip exact_chunk must be 0 (off) or a power of two up to {EXACT_CHUNK_MAX}, "
                f"got {self.exact_chunk}"
            )
        if self.prompt_landmarks and not self.stage0_landmarks:
            raise ConfigError(
                "hip prompt_landmarks needs stage0_landmarks (the prefill's landmarks it scores on)"
            )
        if self.pruning_rope not in PRUNING_ROPE:
            raise ConfigError(f"hip pruning_rope {self.pruning_rope!r}: use one of {', '.join(PRUNING_ROPE)}")
        if self.head_score not in HEAD_SCORE:
            raise ConfigError(f"hip head_score {self.head_score!r}: use one of {', '.join(HEAD_SCORE)}")
        if self.attention_rope not in ATTENTION_ROPE:
            raise ConfigError(
                f"hip attention_rope {self.attention_rope!r}: use one of {', '.join(ATTENTION_ROPE)}"
            )
        # NOTE: only a *maximum* context is checked; a running context is shorter than the window
        # at first, and then attention is simply dense.
        if self.max_context is not None and self.sink + self.window >= self.max_context:
            raise ConfigError(
                f"hip window ({self.window}) plus sink ({self.sink}) covers the whole context "
                f"({self.max_context}): nothing is left to prune; use a smaller window"
            )

    def final_budget(self, layer: int) -> int:
        """Tokens the last stage keeps in `layer`."""
        return self.wide_budget if layer in self.wide_layers else self.budgets[-1]

    def stage_budgets(self, layer: int) -> tuple[int, ...]:
        """Per-stage budgets of `layer` (the final one widened in `wide_layers`)."""
        return (*self.budgets[:-1], self.final_budget(layer))

    def scoring_rope(self, layer: int) -> str:
        """The RoPE mode used while scoring chunks in `layer`."""
        if not self.extend:
            return "absolute"
        if self.pruning_rope == "relative" and layer in self.chunk_indexed_layers:
            return "chunk_indexed"
        return self.pruning_rope

    @property
    def exact_tokens(self) -> int:
        """The longest context (prompt plus output) whose every query keeps every key: the
        candidates between the sinks and a query's window (at most context - sink - window) fit
        every stage's budget in every layer: the final stage's outside `wide_layers`, the
        smallest (budgets decrease, are whole chunks, and `wide_budget` is at least the final
        one). Up to it HiP computes dense attention (up to rounding: with `extend` the kernel
        rotates keys at their own positions, which "streaming" RoPE leaves unchanged when
        nothing is dropped)."""
        return self.sink + self.window + self.budgets[-1]

    @property
    def attended_tokens(self) -> int:
        """Keys one query attends at most outside `wide_layers`: sink + selected + window + block."""
        return self.sink + self.budgets[-1] + self.window + self.block_q

    def offload_cache_tokens(self, heads: int = 1) -> int:
        """Tokens of one streamed slice's GPU block cache (`cache_tokens` when set).

        The default holds everything the decode steps of one stage-0 refresh interval read, with
        `heads` independent selections (KV heads of the slice when `per_head`): the sink blocks,
        the stage-0 chunks (each may straddle one more block than it covers), the window grown by
        refresh[0] tokens (new tokens included). Proportional to budgets, not context; with a
        `capacity`, no more stage-0 chunks than it holds and no more sink or window blocks than
        it fills, so the default still covers a refresh interval (`refresh_blocks` fits it).
        `cache_tokens` above that default is cut to it.
        """
        b, c0 = self.cache_block, self.chunk_sizes[0]
        chunks = self.budgets[0] // c0
        sinks = -(-self.sink // b)
        window = -(-(self.window + self.refresh[0]) // b) + 1
        if self.align_window:  # up to c0 - 1 tokens more, in whole blocks
            window += -(-(c0 - 1) // b)
        if self.capacity is not None:
            filled = -(-self.capacity // b)
            chunks, sinks, window = (
                min(chunks, -(-self.capacity // c0)),
                min(sinks, filled),
                min(window, filled + 1),
            )
        cover = b * (sinks + heads * chunks * (-(-c0 // b) + 1) + window + 1)
        return cover if self.cache_tokens is None else min(self.cache_tokens, cover)

    def offload_cache_slots(self, heads: int = 1) -> int:
        """Blocks of `cache_block` tokens in one streamed slice's GPU block cache: its
        `offload_cache_tokens(heads)` rounded up to whole blocks."""
        return -(-self.offload_cache_tokens(heads) // self.cache_block)

    def decode_buffer_tokens(self) -> int:
        """Rows of one decode query's gathered attention buffer (`AttendBuffer`), at most: sinks,
        the widest final selection, the window grown until stage 0 reruns, and one spare; never
        more than `capacity` tokens and the spare."""
        rows = self.sink + max(self.wide_budget, self.budgets[-1]) + self.window + self.refresh[0] + 1
        rows += self.chunk_sizes[0] - 1 if self.align_window else 0
        return rows if self.capacity is None else min(rows, self.capacity + 1)

    def with_refresh(self, preset: str) -> HipConfig:
        """This config with the decode refresh intervals of a named preset, or of an explicit
        list such as "64/8/4" (`refresh_intervals`)."""
        ref = refresh_intervals(preset)
        n = len(self.chunk_sizes)
        return replace(self, refresh=ref[:n] if len(ref) >= n else ref + (ref[-1],) * (n - len(ref)))

    @classmethod
    def scaled(cls, context: int, **overrides: object) -> HipConfig:
        """The published defaults shrunk in proportion for a model or test of `context` tokens.

        The 3K preset is sized for 128K-token models: sink 1/512, window 1/128, final budget 1/64
        of 128K. Here those fractions of `context`, rounded to whole chunks, with floors so a few
        hundred tokens still give three real stages. For `context` >= 128K the defaults are kept.
        """
        if context <= 0:
            raise ConfigError(f"hip scaled: context must be positive, got {context}")
        f = min(1.0, context / 131072)
        final = max(16, _round(2048 * f, 8))
        c = (256, 32, 8) if f > 0.25 else (32, 16, 4) if context >= 2048 else (16, 8, 2)
        b1 = max(4 * final, _round(8192 * f, c[1]), 2 * c[1])
        b0 = max(16 * final, _round(32768 * f, c[0]), 2 * b1)
        block_q = max(8, min(64, _round(64 * f * 4, 8)))
        fields: dict[str, object] = {
            "sink": max(4, _round(256 * f, 4)),
            "window": max(16, _round(1024 * f, 8)),
            "block_q": block_q,
            "chunk_sizes": c,
            "budgets": (b0, b1, final),
            "query_strides": (4, 4, 1),
            "wide_budget": 2 * final,
        }
        fields.update(overrides)
        return cls(**fields)  # type: ignore[arg-type]


def _round(x: float, multiple: int) -> int:
    return max(multiple, round(x / multiple) * multiple)
