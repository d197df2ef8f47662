"""kvtier: long-context inference with a tiered (GPU / host) KV cache.

>>> from kvtier import LLM, SamplingParams
>>> LLM().generate("Hello", SamplingParams(max_tokens=8))[0].text
"""

from kvtier.engine.llm import LLM
from kvtier.engine.outputs import GenerationStats, RequestOutput
from kvtier.engine.sampling import SamplingParams
from kvtier.errors import KvtierError

__version__ = "0.1.0"
__all__ = ["LLM", "GenerationStats", "KvtierError", "RequestOutput", "SamplingParams", "__version__"]
