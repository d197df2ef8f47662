"""kvtier.planner."""
