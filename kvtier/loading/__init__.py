"""Model loading: presets with random weights, Hugging Face folders, GGUF files."""

from kvtier.loading.resolve import LoadedModel, load_model

__all__ = ["LoadedModel", "load_model"]
