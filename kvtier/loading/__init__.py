"""Model loading: presets with random weights, Hugging Face folders, GGUF files.

May import: `kvtier.config`, `kvtier.errors`, `kvtier.model`.
"""

from kvtier.loading.resolve import LoadedModel, load_model

__all__ = ["LoadedModel", "load_model"]
