"""kvtier.loading."""
