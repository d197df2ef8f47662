"""kvtier.eval."""
