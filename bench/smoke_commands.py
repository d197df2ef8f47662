"""The one-shot commands `bench/gpu_smoke.py` checks: `generate` with each `--kv`, with and
without `--gpu-memory`, each lossy flag, `--json`, a text prompt and stdin; `plan`; a small `eval`.
Each is a `kvtier` subprocess run through `Smoke.cli` (`bench/smoke_checks.py`)."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from bench.smoke_checks import Check, Smoke
from bench.smoke_serve import CAP, CAP_BYTES

LOSSLESS = ("gpu", "layer", "head", "auto")
PROBED = ["--hip-probes", "on", "--hip-refresh", "default"]  # stage 2 reruns at decode step 4
# The row that runs HiP's decode steps as CUDA graphs (the default on CUDA) and the one its
# tokens must equal, the same command op by op (KVTIER_HIP_GRAPHS=0)
GRAPHED = ("lossy hip probes head cap", "lossy hip probes head graphs cap")
# The prefill by chunk and by layer (`--prefill-order layer`, the hidden states between layers in
# pinned host pieces on copy streams), the same streamed plan and chunk: the same tokens. 1K
# chunks give the short prompt three.
ORDERED = ("prefill by chunk, kv=layer cap", "prefill by layer, kv=layer cap")
ORDER_ARGS = ["--kv", "layer", "--chunk-size", "1024", "--ignore-eos"]
# HiP with stage 0 on landmarks over a prompt past stage 0's 32K budget (else no key is scored):
# with `--hip-landmarks all` the first query after the prefill scores stage 0 on the prompt's
# landmarks, over resident slices and over streamed ones (`kvtier.sparse.prompt_stage0`, its
# landmark rows read from the host tier): the same tokens; the kernel counts the slices that did
LANDMARKED = ("hip landmarks 36K, kv=gpu", "hip landmarks 36K, kv=head cap")
LANDMARK_ARGS = ["--attention", "hip", "--hip-preset", "fast", "--hip-landmarks", "all", "--ignore-eos",
                 "--max-model-len", "64K"]  # fmt: skip
LANDMARK_WORDS = 14_000  # ~36K tokens of prose (2.6 a word)
LOSSY: dict[str, list[str]] = {
    "hip": ["--attention", "hip"],
    "hip-fast": ["--attention", "hip", "--hip-preset", "fast"],
    "hip-lean": ["--attention", "hip", "--hip-preset", "lean"],
    "hip+int4": ["--attention", "hip", "--kv-quant", "int4"],  # the pair that composes
    "hip+int4 head": ["--attention", "hip", "--kv-quant", "int4", "--kv", "head"],  # packed fetches
    # offloaded slices scored on their probes, stage 2 rerun at the 4th decode step: a layer's
    # slices rerun it in one batch (`CachedDecode._refresh_layer`, CUDA only). --ignore-eos: on
    # the medium prompt the model may answer EOS at once (it did at 7972508), and no decode step
    # would run: the row and its graphs twin must run all 8
    "hip probes head": ["--attention", "hip", "--kv", "head", *PROBED, "--ignore-eos"],
    "quest": ["--attention", "quest", "--kv-budget", "1024"],
    "int8": ["--kv-quant", "int8"],
    "int4": ["--kv-quant", "int4"],
    "fp8": ["--kv-quant", "fp8"],
    "window": ["--evict", "window", "--kv-budget", "1024"],
    "streaming": ["--evict", "streaming", "--kv-budget", "1024"],
    "h2o": ["--evict", "h2o", "--kv-budget", "1024"],
    "snapkv": ["--evict", "snapkv", "--kv-budget", "1024"],
    "heads50": ["--head-sparsity", "0.5"],
}


def generate_checks(
    smoke: Smoke,
    label: str,
    model: list[str],
    short: Path,
    long: Path | None,
    jobs: int = 1,
    medium: Path | None = None,
    landmarked: Path | None = None,
) -> None:
    """Each --kv with and without the cap, each lossy flag under the cap, a long prompt under it;
    `jobs` of them at once (each process's peak is its own torch counter, and capped ones cap
    themselves, so they may share a large GPU: 4 x 24 GiB fit an H200). HiP's rows take the
    `medium` prompt: on the short one (2,903 tokens) HiP drops nothing and runs lossless on CUDA
    (`EngineConfig.exact_lossless`), which one row checks."""
    base = ["generate", *model, "--prompt-file", str(short), "--max-new-tokens", "8", "--json"]
    hip_args = None if medium is None else [*base[:-4], str(medium), *base[-3:]]
    tokens: dict[str, list[int]] = {}
    graphed: dict[str, list[int]] = {}  # GRAPHED's rows
    ordered: dict[str, list[int]] = {}  # ORDERED's rows
    marked: dict[str, list[int]] = {}  # LANDMARKED's rows
    pool = ThreadPoolExecutor(max(1, jobs))
    futures: list[Future[None]] = []

    def gen(
        name: str,
        extra: list[str],
        cap: bool,
        prompt_args: list[str] | None = None,
        exact: bool | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        futures.append(pool.submit(run_gen, name, extra, cap, prompt_args, exact, env))

    def run_gen(
        name: str,
        extra: list[str],
        cap: bool,
        prompt_args: list[str] | None,
        exact: bool | None,
        env: dict[str, str] | None,
    ) -> None:
        """One generate command; `exact`: whether it must (True) or must not (False) have run a
        lossy method lossless (`ran_lossless` in its plan)."""
        args = (prompt_args or base) + extra + (["--gpu-memory", CAP] if cap else [])
        check, data = smoke.cli(label, name, args, parse_json=True, env=env)
        if check is None or data is None:
            return
        with smoke.lock:  # other checks' threads add and write the JSON meanwhile
            peak = data["stats"]["peak_bytes"].get("gpu_total")
            check.peak_gb = None if peak is None else round(peak / 1e9, 2)
            plan = data["stats"]["plan"]
            check.detail = (
                f"{data['prompt_tokens']} tok, prefill {data['stats']['prefill_tokens_per_s']:.0f} tok/s, "
                f"{plan.get('policy')} g{plan.get('group_size')} res {plan.get('resident_slices')} "
                f"chunk {plan.get('chunk_size')}, {plan.get('method')}"
            )
            if exact is not None and ("ran_lossless" in plan) != exact:
                check.ok = False
                check.detail += f"; ran_lossless {'missing' if exact else 'present'}"
            if cap and (peak is None or peak > CAP_BYTES):
                check.ok = False
                check.detail += f"; peak {peak} B over the {CAP} cap"
            if name.startswith("kv=") and prompt_args is None:
                tokens[name] = data["token_ids"]
                agree()  # kept current: a run cut short still says whether the policies agreed
            if name in GRAPHED:
                graphed[name] = data["token_ids"]
            if name in ORDERED:
                ordered[name] = data["token_ids"]
                want = "layer" if name == ORDERED[1] else "chunk"
                ran = data["stats"].get("prefill_order")
                check.detail += f"; prefill_order {ran}"
                if ran != want:
                    check.ok = False
            if name in LANDMARKED:
                marked[name] = data["token_ids"]
                used = data["stats"].get("kernel", {}).get("prompt_landmarks")
                check.detail += f"; prompt_landmarks {used}"
                if not used:
                    check.ok = False
            if name == GRAPHED[1]:  # the graphs replayed (stats.kernel: `CountingKernel`)
                counted = data["stats"].get("kernel", {}).get("decode_graphs", {})
                check.detail += f"; decode graphs {counted}"
                if not counted.get("replays"):
                    check.ok = False
        if smoke.on_add is not None:
            with smoke.lock:
                smoke.on_add()

    def agree() -> None:
        reference = tokens.get("kv=gpu")
        differ = sorted(k for k, v in tokens.items() if v != reference)
        smoke.agreement[label] = {
            "policies": sorted(tokens),
            "differ_from_kv=gpu": differ,
            "tokens": reference,
        }

    def must_agree(name: str) -> bool:
        """The tiered store's placements run the same kernels: their tokens must be equal. `auto`
        runs a prompt that fits the GPU through the batch engine (paged kernels, CUDA graphs),
        whose rounding differs; random bf16 weights leave near-ties everywhere (see the serve
        checks), so only real weights assert that it equals the tiered `--kv gpu`."""
        return label == "embedded" or not name.startswith("kv=auto")

    for kv in LOSSLESS:
        gen(f"kv={kv}", ["--kv", kv], cap=False)
        gen(f"kv={kv} cap", ["--kv", kv], cap=True)
    gen("kv=head group=1 cap", ["--kv", "head", "--head-group", "1"], cap=True)
    # README: `--cpu-attention auto|N`; a count, since `auto` gives a small model's CPU nothing.
    # Lossless, so its tokens join the agreement; on CUDA with the library's defaults since
    # 2026-12-07 (the stream waits for the CPU, the merge reads its results in place)
    gen("kv=head cpu-attention=8 cap", ["--kv", "head", "--cpu-attention", "8"], cap=True)
    gen("default (no --kv, no cap)", [], cap=False)
    for name, flags in LOSSY.items():
        hip = name.startswith("hip")
        gen(
            f"lossy {name} cap",
            flags,
            cap=True,
            prompt_args=hip_args if hip else None,
            exact=False if hip else None,
            # the graphs row's reference runs op by op (the default replays graphs on CUDA)
            env={"KVTIER_HIP_GRAPHS": "0"} if f"lossy {name} cap" == GRAPHED[0] else None,
        )
    gen("lossy hip short cap: ran lossless", LOSSY["hip"], cap=True, exact=True)
    # HiP's decode steps as CUDA graphs, the default on CUDA (KVTIER_HIP_GRAPHS unset: "auto"):
    # they must replay, and give the tokens of the same steps op by op
    gen(GRAPHED[1], LOSSY["hip probes head"], cap=True, prompt_args=hip_args, exact=False)
    gen(ORDERED[0], ORDER_ARGS, cap=True)
    gen(ORDERED[1], [*ORDER_ARGS, "--prefill-order", "layer"], cap=True)
    if landmarked is not None:
        marked_args = [*base[:-4], str(landmarked), *base[-3:]]
        gen(LANDMARKED[0], [*LANDMARK_ARGS, "--kv", "gpu"], cap=False, prompt_args=marked_args)
        gen(LANDMARKED[1], [*LANDMARK_ARGS, "--kv", "head"], cap=True, prompt_args=marked_args)
    if long is not None:
        long_args = ["generate", *model, "--prompt-file", str(long), "--max-new-tokens", "4", "--json"]
        gen("long prompt, auto, cap", [], cap=True, prompt_args=long_args)
    for f in futures:
        f.result()  # re-raises a check's own failure (not a failed command: that is a Check)
    pool.shutdown()
    if len(graphed) == 2:
        same = graphed[GRAPHED[0]] == graphed[GRAPHED[1]]
        detail = "the same tokens" if same else f"{graphed[GRAPHED[1]]} vs {graphed[GRAPHED[0]]}"
        smoke.add(Check(label, "hip graphs: tokens as op by op", [], same, 0.0, 0, detail=detail))
    if len(marked) == 2:
        same = marked[LANDMARKED[0]] == marked[LANDMARKED[1]]
        detail = "the same tokens" if same else f"{marked[LANDMARKED[1]]} vs {marked[LANDMARKED[0]]}"
        smoke.add(Check(label, "hip landmarks: streamed tokens as resident", [], same, 0.0, 0, detail=detail))
    if len(ordered) == 2:
        same = ordered[ORDERED[0]] == ordered[ORDERED[1]]
        detail = "the same tokens" if same else f"{ordered[ORDERED[1]]} vs {ordered[ORDERED[0]]}"
        smoke.add(Check(label, "prefill by layer: tokens as by chunk", [], same, 0.0, 0, detail=detail))
    agree()
    reference = tokens.get("kv=gpu")
    differ = smoke.agreement[label]["differ_from_kv=gpu"]
    if not tokens:
        return
    failing = [d for d in differ if must_agree(d)]
    smoke.add(
        Check(
            label,
            "lossless policies agree",
            [],
            reference is not None and not failing,
            0.0,
            detail=f"{len(tokens)} runs, differ: {differ or 'none'}"
            + ("" if failing == differ else " (batched auto on random weights: recorded, not asserted)"),
        )
    )
    # The text path and stdin, as the README types them.
    smoke.cli(
        label,
        "text prompt, stats line",
        ["generate", *model, "--prompt", "The capital of France is", "--max-new-tokens", "16"],
    )
    smoke.cli(
        label,
        "--prompt-file - (stdin)",
        [
            "generate",
            *model,
            "--prompt-file",
            "-",
            "--max-new-tokens",
            "4",
            "--kv",
            "head",
            "--head-group",
            "1",
            "--gpu-memory",
            CAP,
        ],
        stdin=short,
    )


def plan_checks(smoke: Smoke, label: str, model: list[str]) -> None:
    smoke.cli(
        label,
        "plan 1M",
        [
            "plan",
            *(model or ["--model", "llama-3-8b"]),
            "--context",
            "1M",
            "--gpu-memory",
            CAP,
            "--host-memory",
            "512GiB",
        ],
    )
    smoke.cli(
        label,
        "plan --attention hip 512K",
        [
            "plan",
            *(model or ["--model", "llama-3-8b"]),
            "--context",
            "512K",
            "--gpu-memory",
            CAP,
            "--attention",
            "hip",
        ],
    )


def eval_checks(smoke: Smoke, label: str, model: list[str]) -> None:
    out = smoke.workdir / f"eval_{label}.json"
    smoke.cli(
        label,
        "eval niah 2k",
        [
            "eval",
            "niah",
            *model,
            "--lengths",
            "2k",
            "--depths",
            "25,75",
            "--method",
            "auto",
            "--method",
            "head,head_group=1",
            "--out",
            str(out),
            "--no-progress",
        ],
    )
    smoke.cli(
        label,
        "eval passkey (README)",
        [
            "eval",
            "passkey",
            *model,
            "--lengths",
            "2k,4k",
            "--samples",
            "5",
            "--method",
            "gpu",
            "--method",
            "head,head_group=1",
            "--no-progress",
        ],
        timeout=600,
    )
