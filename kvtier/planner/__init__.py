"""Byte formulas, hardware presets, the roofline, `PlanInputs` and `plan_kv` (the placement of one context
on one budget: `placement`, with its candidates' bytes in `placement_sizes` and its choices by
simulated decode step in `decode_choice`), the bytes of lossy methods over a plan, and the report
behind `kvtier plan`.
Pure arithmetic: nothing here allocates. `kvtier.methods.plan_for` is the entry point that adds
a method's own planning on top.

May import: `kvtier.errors`, `kvtier.config`, `kvtier.attention`.
"""
