"""kvtier.attention."""
