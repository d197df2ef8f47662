"""kvtier.kv."""
