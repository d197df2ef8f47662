"""kvtier inside Hugging Face transformers: a `Cache` over kvtier's tiered store.

```python
import kvtier.hf
cache = kvtier.hf.TieredCache(model, kv="head", gpu_memory="24GiB")
model.generate(**inputs, past_key_values=cache, max_new_tokens=64)
```

- `versions`: the transformers versions supported (checked on import).
- `config`: a HF model's `ModelConfig`, and what the store cannot run.
- `attention`: the "kvtier" attention implementation, which attends inside the store.
- `cache`: `TieredCache`, planned like `kvtier.LLM` plans a request.
- `prefill`: `prefill_in_chunks`, chunked prefill through `model(...)` calls.

A high layer (beside eval and serve): may import the engine, methods, store, planner, loading
and model packages; nothing in kvtier imports it.
"""

from kvtier.hf.versions import SUPPORTED, TESTED, check_version, installed_version

check_version(installed_version())

# isort: off
from kvtier.hf.cache import TieredCache  # noqa: E402
from kvtier.hf.prefill import cache_keyword, prefill_in_chunks  # noqa: E402

# isort: on

__all__ = [
    "SUPPORTED",
    "TESTED",
    "TieredCache",
    "cache_keyword",
    "check_version",
    "installed_version",
    "prefill_in_chunks",
]
