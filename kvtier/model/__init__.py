"""kvtier.model."""
