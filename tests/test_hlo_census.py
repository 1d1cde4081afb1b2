"""bench/hlo_census.py: kernel launches counted from optimized HLO text (the offline census of the step)."""

import jax
import jax.numpy as jnp
import pytest

from bench.hlo_census import count_launches, opcode

# The shape of XLA GPU's optimized HLO (abridged from a compiled demo step): a tuple-typed Pallas custom call,
# fusions of three kinds, bookkeeping that launches nothing, a while whose trip count XLA proved.
GPU_HLO = """HloModule jit_step, is_scheduled=true

%fused_add (param_0: f32[8]) -> f32[8] {
  %param_0 = f32[8]{0} parameter(0)
  ROOT %add.1 = f32[8]{0} add(%param_0, %param_0), metadata={op_name="jit(step)/add"}
}

%fused_reduce (param_0.1: f32[8]) -> f32[] {
  %param_0.1 = f32[8]{0} parameter(0)
  %constant.1 = f32[] constant(0)
  ROOT %reduce.1 = f32[] reduce(%param_0.1, %constant.1), dimensions={0}, to_apply=%sum, metadata={op_name="jit(step)/reduce_sum"}
}

%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p = (s32[], f32[8]{0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[8]{0} get-tuple-element(%p), index=1
  %loop_add_fusion.2 = f32[8]{0} fusion(%x), kind=kLoop, calls=%fused_add
  %input_reduce_fusion.3 = f32[] fusion(%loop_add_fusion.2), kind=kInput, calls=%fused_reduce
  %bitcast.1 = f32[8]{0} bitcast(%loop_add_fusion.2)
  ROOT %t = (s32[], f32[8]{0}) tuple(%i, %bitcast.1)
}

%cond (p.1: (s32[], f32[8])) -> pred[] {
  %p.1 = (s32[], f32[8]{0}) parameter(0)
  %i.1 = s32[] get-tuple-element(%p.1), index=0
  ROOT %loop_compare_fusion = pred[] fusion(%i.1), kind=kLoop, calls=%fused_add
}

ENTRY %main.9 (a: f32[8], b: s32[1]) -> (f32[8], s32[1]) {
  %a = f32[8]{0} parameter(0)
  %b = s32[1]{0} parameter(1)
  %pallas_call.7 = (f32[8]{0}, s32[1]{0}) custom-call(%a, %b), custom_call_target="__gpu$xla.gpu.triton", backend_config={grid_x = 1 : i32, name = "kda_verify", num_warps = 4 : i32}, metadata={op_name="jit(step)/jit(kda_verify)/kda_verify/pallas_call"}
  %g0 = f32[8]{0} get-tuple-element(%pallas_call.7), index=0
  %copy.4 = s32[1]{0} copy(%b)
  %loop_add_fusion.5 = f32[8]{0} fusion(%g0), kind=kLoop, calls=%fused_add
  %init = (s32[], f32[8]{0}) tuple(%b, %loop_add_fusion.5)
  %while.3 = (s32[], f32[8]{0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"4"}}
  %out = f32[8]{0} get-tuple-element(%while.3), index=1
  ROOT %r = (f32[8]{0}, s32[1]{0}) tuple(%out, %copy.4)
}
"""


def test_counts_the_launches_of_gpu_hlo_by_hand():
    c = count_launches(GPU_HLO)
    # entry: custom call, copy, fusion = 3; while x4: 2 fusions a trip = 8; its condition runs 5 times = 5
    assert c.total == 16
    kinds = c.by_kind
    assert kinds["custom:__gpu$xla.gpu.triton:kda_verify"] == 1
    assert kinds["copy"] == 1
    assert kinds["fusion:kLoop:loop_add_fusion"] == 1 + 4
    assert kinds["fusion:kInput:input_reduce_fusion"] == 4
    assert kinds["fusion:kLoop:loop_compare_fusion"] == 5
    assert c.by_group()["pallas:kda_verify"] == 1
    first = c.launches[0][0]
    assert (first.name, first.op_name) == ("pallas_call.7", "jit(kda_verify)/kda_verify/pallas_call")
    # a fusion's op is its root's: what the sequence print shows
    reduce = next(l for l, _ in c.launches if l.name == "input_reduce_fusion.3")
    assert reduce.op_name == "reduce_sum"


def test_opcode_skips_tuple_types():
    assert opcode('  %x = (f32[8]{0}, s32[1]{0}) custom-call(%a), custom_call_target="t"') == "custom-call"
    assert opcode("  ROOT %y = f32[8]{0} fusion(%x), kind=kLoop, calls=%f") == "fusion"
    assert opcode("  %z = s32[] get-tuple-element(%p), index=0") == "get-tuple-element"


def test_a_loop_without_a_trip_count_is_an_error():
    text = GPU_HLO.replace(', backend_config={"known_trip_count":{"n":"4"}}', "")
    with pytest.raises(ValueError, match="known trip count"):
        count_launches(text)


def test_scan_length_multiplies_the_body_in_compiled_hlo():
    """On XLA's own output (CPU here): a scan of 6 steps launches 3 bodies more than one of 3, and the rest of the
    program is the same."""
    def program(n):
        f = lambda x: jax.lax.scan(lambda c, _: (jnp.tanh(c) * 2 + jnp.sum(c), None), x, None, length=n)[0] + 1
        return count_launches(jax.jit(f).lower(jnp.ones(16)).compile().as_text())

    three, six = program(3), program(6)
    body = sum(1 for _, n in three.launches if n == 3)
    condition = sum(1 for _, n in three.launches if n == 4)  # runs once more than the body
    assert body > 0
    assert six.total - three.total == 3 * (body + condition)
    assert sum(1 for _, n in six.launches if n == 1) == sum(1 for _, n in three.launches if n == 1)
