"""kvtier: long-context inference with a tiered KV cache."""

__version__ = "0.1.0"
