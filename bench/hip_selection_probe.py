"""Is the needle in HiP's decode selection? Per layer, how many needle tokens each stage keeps.

Prefills a pass-key prompt (`bench/hip_quality.py`'s, key at depth 0.5) through the embedded
SmolLM2-135M with HiP (softmax chunk scores), decodes a few tokens, and prints, for the first
answer token, the needle tokens kept by each pruning stage in every layer. Reads the kernel's
decode state (`HipKernel._cache`), so it is a diagnostic, not an API. On 1 CPU thread a 16K
prompt takes about 5 minutes:

    .venv/bin/python bench/hip_selection_probe.py --length 16384 --preset 5k
    .venv/bin/python bench/hip_selection_probe.py --length 16384 --preset 5k --set "chunk_indexed_layers=()"
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.hip_quality import passkey_prompt
from kvtier.kv.store import TieredKVStore
from kvtier.loading.embedded import embedded_gguf_path
from kvtier.loading.gguf import gguf_to_hf_folder
from kvtier.loading.weights import load_safetensors_folder
from kvtier.planner.placement import plan_kv
from kvtier.sparse import HipKernel, make_hip_kernel

CPU = torch.device("cpu")
KEY = 68423


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--length", type=int, default=16384)
    ap.add_argument("--preset", default="5k")
    ap.add_argument("--set", action="append", default=[], help="HipConfig field=python literal")
    ap.add_argument("--new-tokens", type=int, default=6)
    args = ap.parse_args()
    torch.set_num_threads(1)
    from transformers import AutoTokenizer

    folder = gguf_to_hf_folder(embedded_gguf_path())
    model, cfg = load_safetensors_folder(folder, CPU, torch.float32)
    tok = AutoTokenizer.from_pretrained(folder)
    prompt = passkey_prompt(tok, args.length, 0.5, KEY)
    ids = torch.tensor(tok(prompt)["input_ids"])
    first = len(tok(prompt[: prompt.index("The pass key is")])["input_ids"])
    last = len(tok(prompt[: prompt.index(" is the pass key. ") + 18])["input_ids"])
    overrides = {"head_score": "softmax"}
    for item in args.set:
        name, _, value = item.partition("=")
        overrides[name] = ast.literal_eval(value)
    kernel, unrotated = make_hip_kernel(cfg, CPU, args.preset, **overrides)
    assert isinstance(kernel, HipKernel)
    ctx = ids.numel() + args.new_tokens
    plan = plan_kv(cfg, ctx, policy="gpu", gpu_budget=None, dtype_bytes=4, chunk_size=2048)
    store = TieredKVStore(
        cfg, plan, device=CPU, dtype=torch.float32, capacity=ctx, kernel=kernel, rotate_keys=not unrotated
    )
    kept: dict[int, list[torch.Tensor]] = {}
    out: list[int] = []
    with torch.inference_mode():
        for s in range(0, ids.numel(), 2048):
            part = ids[s : s + 2048]
            store.begin_step(part.numel())
            logits = model(part, store)
            store.end_step()
        for i in range(args.new_tokens):
            token = logits[-1].argmax()
            out.append(int(token))
            store.begin_step(1)
            logits = model(token.view(1), store)
            store.end_step()
            if i == 0:
                kept = {layer: [o.clone() for o in st.outputs] for (layer, _, _), st in kernel._cache.items()}
    needle = set(range(first, last))
    print(f"{ids.numel()} tokens, needle tokens {first}..{last - 1}; answer {tok.decode(out)!r}")
    for layer in sorted(kept):
        per_stage = [len(needle & set(o.tolist())) for o in kept[layer]]
        print(f"layer {layer:>2}: needle tokens kept per stage {per_stage} of {len(needle)}")


if __name__ == "__main__":
    main()
