"""How HiP is planned with host keys (`--hip-host-keys on`, or `auto` from 256K): decode never
streams a slice, the store gives its staging buffers back while it decodes, so the block caches
may take their bytes (`plan_hip(staging_idle_in_decode=True)`). No weights: Llama-3.1-8B's
shapes on the H200's numbers under a 24 GiB cap, as `kvtier generate --gpu-memory 24GiB` plans them."""

from __future__ import annotations

from dataclasses import replace

from kvtier.loading.presets import preset_config
from kvtier.methods import parse_choice, plan_for
from kvtier.methods.hip import host_keys
from kvtier.planner.hardware import hardware_preset
from kvtier.planner.inputs import PlanInputs
from kvtier.sparse import hip_phase_bytes
from kvtier.units import parse_size

CFG = preset_config("llama-3.1-8b")
CONTEXT = 526_087  # the 512K CLI bench's prompt plus 64 new tokens


def inputs(context: int = CONTEXT) -> PlanInputs:
    return PlanInputs(
        CFG, context, hardware=hardware_preset("h200"), dtype_bytes=2, gpu_budget=parse_size("24GiB")
    )


def test_host_keys_give_512k_block_caches_that_cover_a_refresh_interval() -> None:
    """At 512K the staging buffers of two whole layer slices (4.3 GB) leave room for 16K-token
    caches only; with host keys the same layer slices get caches of a whole refresh interval
    (None), which the freed staging bytes hold: the caches' bytes beyond the 16K ones are less
    than two staging buffers."""
    plain = plan_for(inputs(), parse_choice("hip,hip_host_keys=off"))
    keys = plan_for(inputs(), parse_choice("hip,hip_host_keys=on"))
    assert plain.plan.group_size == keys.plan.group_size == CFG.num_kv_heads
    assert plain.cache_tokens is not None and plain.cache_tokens <= 16384
    assert keys.cache_tokens is None
    staging = 2 * keys.plan.staging_tokens * keys.plan.group_size * 2 * CFG.head_dim * 2
    covering, _ = hip_phase_bytes(CFG, "lean", 2, CONTEXT, None)
    small, _ = hip_phase_bytes(CFG, "lean", 2, CONTEXT, plain.cache_tokens)
    assert 0 < covering - small < staging


def test_without_freed_staging_host_keys_plan_as_streaming() -> None:
    """A server's request over lent pages keeps its staging buffers (carved from the run), so
    its plan takes no credit for them: the same placement as without host keys."""
    base = replace(inputs(), staging_freed_in_decode=False)
    on, off = parse_choice("hip,hip_host_keys=on"), parse_choice("hip,hip_host_keys=off")
    assert plan_for(base, on) == plan_for(base, off)


def test_auto_plans_host_keys_from_256k_without_a_quantized_tier() -> None:
    """The default (`--hip-host-keys auto`) plans as `on` at 512K and as `off` at 128K (where
    streaming decoded faster on the H200) and over an int4 tier (whose rows hold keys and
    values together); the kernel built for the same context agrees with its plan."""
    on, off = parse_choice("hip,hip_host_keys=on"), parse_choice("hip,hip_host_keys=off")
    assert plan_for(inputs(), parse_choice("hip")) == plan_for(inputs(), on)
    assert plan_for(inputs(), parse_choice("hip")) != plan_for(inputs(), off)
    short = inputs(131_136)
    assert plan_for(short, parse_choice("hip")) == plan_for(short, off)
    int4 = parse_choice("hip,kv_quant=int4")
    assert plan_for(inputs(), int4) == plan_for(inputs(), parse_choice("hip,kv_quant=int4,hip_host_keys=off"))
    assert host_keys(parse_choice("hip").options(), CONTEXT)
    assert not host_keys(parse_choice("hip").options(), 131_136)
    assert not host_keys(parse_choice("hip").options(), None)  # context not known
    assert not host_keys(int4.options(), CONTEXT)


def test_auto_plans_host_keys_over_an_int4_tier_when_stage_0_reads_probes_alone() -> None:
    """With `--hip-probes on` a stage-0 rerun over an int4 tier reads its probes' codes alone,
    so auto takes host keys there from 256K too (and not at 128K, nor when asked off); the plan
    then frees the staging buffers in decode and gives block caches that cover an interval."""
    probes = parse_choice("hip,kv_quant=int4,hip_probes=on")
    assert host_keys(probes.options(), CONTEXT)
    assert not host_keys(probes.options(), 131_136)
    assert not host_keys(parse_choice("hip,kv_quant=int4,hip_probes=on,hip_host_keys=off").options(), CONTEXT)
    on = parse_choice("hip,kv_quant=int4,hip_probes=on,hip_host_keys=on")
    assert plan_for(inputs(), probes) == plan_for(inputs(), on)
    assert plan_for(inputs(), probes) != plan_for(inputs(), parse_choice("hip,kv_quant=int4"))


def test_caches_below_the_steps_are_tried_only_where_nothing_else_fits() -> None:
    """`SMALL_CACHE_TOKEN_STEPS`: at 512K under 18 GiB no slicing holds whole slices beside an
    8K-token block cache; a 4K one (a step then fetches what its final selection misses) fits.
    At 24 GiB, where the steps fit, the plan keeps its 8K-or-larger cache."""
    from kvtier.sparse import CACHE_TOKEN_STEPS, SMALL_CACHE_TOKEN_STEPS

    tight = plan_for(replace(inputs(), gpu_budget=parse_size("18GiB")), parse_choice("hip"))
    assert tight.cache_tokens in SMALL_CACHE_TOKEN_STEPS and tight.plan.streamed_slices
    roomy = plan_for(inputs(), parse_choice("hip"))
    assert roomy.cache_tokens is None or roomy.cache_tokens >= CACHE_TOKEN_STEPS[-1]
