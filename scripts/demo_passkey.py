"""Long-context passkey demo on the embedded SmolLM2-135M-Instruct (`make demo`).

A five-digit pass key is hidden in the middle of ~2.7K tokens of filler. The prompt is run with
head-wise offload (`kv="head"`, one KV head per group, 1024-token prefill chunks): every
(layer, KV head) slice of the cache lives in the host tier and is streamed through two staging
buffers, even on a CPU, where "gpu" is the compute device's memory. The script prints the answer,
whether it holds the key, the KV memory by tier and the prefill and decode speed.

    .venv/bin/python scripts/demo_passkey.py            # ~1-2 minutes on 2 CPU cores
    .venv/bin/python scripts/demo_passkey.py --compare  # also run kv="gpu" and compare tokens
"""

from __future__ import annotations

import argparse
import sys
import time

from kvtier import LLM, KvtierError, RequestOutput, SamplingParams

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
PASS_KEY = "68423"
MIB = 1 << 20


def passkey_prompt(key: str = PASS_KEY, repeats: int = 55) -> str:
    """The passkey retrieval prompt (Landmark Attention's format): key between two fillers."""
    return (
        "There is important info hidden inside a lot of irrelevant text. Find it and memorize it.\n"
        + FILLER * repeats
        + f"The pass key is {key}. Remember it. {key} is the pass key. "
        + FILLER * repeats
        + "\nWhat is the pass key? The pass key is"
    )


def run(
    kv: str, head_group: int | None, chunk_size: int, device: str, params: SamplingParams
) -> RequestOutput:
    """Load the embedded model with one KV policy and answer the passkey prompt."""
    t = time.perf_counter()
    llm = LLM(kv=kv, head_group=head_group, chunk_size=chunk_size, device=device)
    print(f"loaded {llm.loaded.name} on {llm.device} in {time.perf_counter() - t:.1f} s; kv={kv}", flush=True)
    return llm.generate(passkey_prompt(), params, progress=True)[0]


def report(out: RequestOutput) -> bool:
    """Print the answer, memory by tier and speed; True when the answer holds the key."""
    s = out.stats
    plan = s.plan
    correct = out.text.strip().startswith(PASS_KEY)
    print(f"\nanswer: {out.text!r}")
    print(f"correct: {'yes' if correct else 'no'} (expected {PASS_KEY})")
    print(
        f"plan: policy {plan['policy']}, {plan['group_size']} KV head(s) per group, "
        f"{plan['num_slices']} slices ({plan['resident_slices']} resident, "
        f"{plan['num_slices'] - plan['resident_slices']} in the host tier), "
        f"{plan['staging_buffers']} staging buffer(s) x {plan['staging_tokens']} tokens, "
        f"chunk {plan['chunk_size']}"
    )
    print("KV peak memory by tier:")
    for tier, nbytes in s.peak_bytes.items():
        print(f"  {tier:<9} {nbytes / MIB:8.2f} MiB")
    total = sum(v for k, v in s.peak_bytes.items() if k in ("gpu_kv", "host_kv"))
    if total:
        print(f"  on the compute device: {100 * s.peak_bytes.get('gpu_kv', 0) / total:.1f}% of the KV bytes")
    print(
        f"prefill: {s.prompt_tokens} tokens in {s.prefill_s:.1f} s ({s.prefill_tokens_per_s:.0f} tok/s); "
        f"decode: {s.generated_tokens} tokens, {s.decode_tokens_per_s:.2f} tok/s"
    )
    print(f"host->device copies: {s.h2d_bytes / MIB:.1f} MiB; device->host: {s.d2h_bytes / MIB:.1f} MiB")
    return correct


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", help="cpu (default), cuda or auto")
    ap.add_argument("--head-group", type=int, default=1, help="KV heads per streamed group (default 1)")
    ap.add_argument("--chunk-size", type=int, default=1024, help="prefill chunk in tokens (default 1024)")
    ap.add_argument("--compare", action="store_true", help='also run kv="gpu" and compare the token ids')
    args = ap.parse_args(argv)
    params = SamplingParams(max_tokens=8)
    try:
        out = run("head", args.head_group, args.chunk_size, args.device, params)
        correct = report(out)
        if args.compare:
            ref = run("gpu", None, args.chunk_size, args.device, params)
            same = ref.token_ids == out.token_ids
            print(f"\nkv=gpu answer: {ref.text!r}; same token ids as kv=head: {'yes' if same else 'no'}")
            correct = correct and same
    except KvtierError as e:
        print(f"demo: error: {e}", file=sys.stderr)
        return 2
    return 0 if correct else 1


if __name__ == "__main__":
    sys.exit(main())
