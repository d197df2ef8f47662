"""Offline long-context evaluation (`kvtier eval`): passkey, needle in a haystack, RULER-style.

Everything is generated locally from a seed and sized in the model's own tokens; nothing is
downloaded. The modules, in the order data flows through them:

- `haystack`: filler text (the passkey noise sentence, or prose in `data/*.txt`) cut to `n`
  tokens, needles put in at sentence boundaries.
- `words`: needle keys, values, variable names and word lists.
- `tasks` / `ruler`: the generators; each returns a `prompts.Draft` (random choices made).
- `prompts`: chat template, fitting a draft to a length, measuring needle depths -> `Sample`.
- `methods`: `--method` specs -> `LLM(...)` keyword arguments (a registry lossy methods join).
- `runner`: load the model once, run every sample under every method, score (`scoring`).
- `results` / `plots`: records, aggregates, JSON, tables, heatmaps and accuracy lines.

May import: the engine (`LLM`), the methods registry and below. Imported by the CLI.
"""
