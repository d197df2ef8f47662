"""kvtier.cli."""
