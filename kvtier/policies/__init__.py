"""The parts of lossy KV methods: codecs (quantization), evictors (window, StreamingLLM, H2O,
SnapKV, streaming heads), the Quest kernel and the scoring kernels.

`PolicyParts` is what a method hands the tiered store (`TieredKVStore(..., **parts.store_kwargs())`):

```
 method                          kernel            rotate_keys  codec     evictor
 (none)                          None (dense)      True         None      None
 --kv-quant int8|int4|fp8        None              True         KIVI/FP8  None
 --evict window|h2o|snapkv       None/ScoringK.    True         None      Window/H2O/SnapKV
 --evict streaming               CacheRopeKernel   False        None      Window(sinks=4)
 --attention quest               QuestKernel       True         None      None
 --head-sparsity R               None              True         None      HeadStreaming
```

Which options select which parts is the method registry's business (`kvtier.methods`), never
this package's. May import: the store's hooks (`kvtier.kv`), the model and attention interfaces.
Objects in `PolicyParts` hold per-sequence state: one store at a time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvtier.attention.interface import SliceKernel
from kvtier.kv.hooks import Evictor, KVCodec


@dataclass(frozen=True)
class PolicyParts:
    """Store keyword arguments for one policy; `describe` names it for logs and tables."""

    kernel: SliceKernel | None = None
    rotate_keys: bool = True
    codec: KVCodec | None = None
    evictor: Evictor | None = None
    describe: str = "lossless"

    def store_kwargs(self) -> dict[str, Any]:
        """`TieredKVStore(cfg, plan, ..., **parts.store_kwargs())`."""
        return {
            "kernel": self.kernel,
            "rotate_keys": self.rotate_keys,
            "codec": self.codec,
            "evictor": self.evictor,
        }
