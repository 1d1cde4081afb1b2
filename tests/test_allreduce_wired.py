"""The peer-to-peer all-reduce wired into the TP step at the MoE layer boundary (KernelCalls.p2p_allreduce).

(a) With the switch on, the TP2 plain and NEXTN steps lower for CUDA on two abstract H200s with one
    pallas_kernels/allreduce.py kernel per MoE layer pass in place of the MoE's psum (none left); with it off,
    one psum per MoE layer pass and no such kernel. A width the kernel rejects (the demo's D = 320) stays on psum.
(b) On 2 simulated CPU devices (fp32), the restructured model (the MoE's partial sums, the residual add and the
    next layer's RMSNorm in one `moe_residual_norm` call, the next block reading that normed input) run through
    the method's psum fallback gives today's TP2 model's logits and states: the restructuring is exact. The
    Mosaic kernel itself cannot run in the CPU interpreter (no GMEM semaphores); tests/test_kernels_allreduce.py
    checks its combine math against the same fallback.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, AxisType

from compile.mesh import make_mesh
from compile.sharding import ShardedKernelCalls, ShardingRules, kernel_calls_for, shardings_for, state_shardings
from compile.stages import Program, slice_config, trace
from ling_jax.config import get_preset
from ling_jax.kernel_calls import KernelCalls
from ling_jax.model import RuntimeOptions
from ling_jax.state import init_state
from ling_jax.weights import abstract_params
from tests.conftest import jitted_forward

F32 = jnp.float32
H200X2 = AbstractMesh((2,), ("tp",), axis_types=(AxisType.Auto,),
                      abstract_device=AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="cuda"))
ALLREDUCE_KERNEL = "uses_xla_collective_metadata = true"  # only the peer-to-peer kernel reads peers' buffers


def _lowered_step(cfg, mode: str, p2p: bool, steps: int = 3) -> str:
    prog = Program(cfg, mode=mode, steps=steps, max_len=256, dtype="bfloat16",
                   opts=RuntimeOptions(kernels=KernelCalls(p2p_allreduce=p2p)))
    with jax.sharding.use_abstract_mesh(H200X2):
        traced, _ = trace(prog, H200X2)
        return traced.lower(lowering_platforms=("cuda",)).as_text()


def _moe_passes(cfg, mode: str, steps: int) -> int:
    """MoE layer calls in one step: the target's MoE layers once, plus (NEXTN) the MTP layer once per draft."""
    target = sum(cfg.is_moe(i) for i in range(cfg.num_hidden_layers))
    return target + (steps if mode == "nextn" else 0)


@pytest.mark.parametrize("mode", ["plain", "nextn"])
def test_tp2_step_lowers_with_one_allreduce_kernel_per_moe_layer(mode):
    cfg = get_preset("test-tiny")  # D = 128: the kernel takes it
    n = _moe_passes(cfg, mode, steps=3)
    off, on = _lowered_step(cfg, mode, False), _lowered_step(cfg, mode, True)
    # off: today's program, each MoE layer's partial sums summed by one psum (the only explicit all-reduces;
    # XLA inserts the attention's after partitioning, below this text)
    assert off.count("stablehlo.all_reduce") == n and ALLREDUCE_KERNEL not in off
    # on: every one of them is the fused kernel (psum + residual add + next norm), no psum left
    assert on.count(ALLREDUCE_KERNEL) == n
    assert "stablehlo.all_reduce" not in on
    assert "red.release.sys.global.add" in on and "multimem" not in on  # semaphore signals, never multicast


def test_width_the_kernel_rejects_stays_on_psum():
    """D not a multiple of 128 (the demo's 320; here 192 so that TP2 divides the heads): the kernel does not take
    the boundary, psum serves it."""
    cfg = get_preset("test-tiny").replace(hidden_size=192)
    on = _lowered_step(cfg, "plain", True)
    assert ALLREDUCE_KERNEL not in on
    assert on.count("stablehlo.all_reduce") == _moe_passes(cfg, "plain", 0)


class _FusedBoundaryOnPsum(ShardedKernelCalls):
    """The fused boundary with p2p_allreduce off: moe_residual_norm runs allreduce_residual_norm's fallback
    (psum, the add, rms_norm) per device. Records each call's residual shape to show the path was taken."""

    seen: list = []

    @property
    def fuses_layer_boundary(self) -> bool:
        return True

    def moe_residual_norm(self, *a, residual, **kw):
        self.seen.append(residual.shape)
        return super().moe_residual_norm(*a, residual=residual, **kw)


def _random_params(cfg, mesh, rules):
    """Small random fp32 parameters (norm weights near 1) put in their shardings: numpy draws, no init programs
    to compile (the boundary's restructuring is all this test checks)."""
    rng = np.random.default_rng(4)

    def draw(path, a):
        near_one = "norm" in jax.tree_util.keystr(path)
        x = (near_one + 0.1 * rng.standard_normal(a.shape)).astype(np.float32)
        return jax.device_put(x, a.sharding)

    return jax.tree_util.tree_map_with_path(draw, abstract_params(cfg, F32, shardings_for(cfg, mesh, rules)))


def test_fused_boundary_fallback_equals_tp2_model():
    cfg = slice_config(get_preset("test-tiny"), 3)  # KDA, KDA, MLA; dense, MoE, MoE (the last into the final norm)
    mesh, rules = make_mesh(2), ShardingRules.tensor_parallel()
    params = _random_params(cfg, mesh, rules)
    today = kernel_calls_for(RuntimeOptions(kernels="interpret"), mesh, rules)
    fused = today.replace(kernels=_FusedBoundaryOnPsum(interpret=True, mesh=mesh, rules=rules))
    assert not today.calls.fuses_layer_boundary
    st = init_state(cfg, 1, 32, F32)
    st = jax.device_put(st, state_shardings(st, mesh, rules))
    tok = jnp.array([[7]], jnp.int32)
    n_moe, d = _moe_passes(cfg, "plain", 0), cfg.hidden_size

    outs = {}
    for name, opts in (("today", today), ("fused", fused)):
        _FusedBoundaryOnPsum.seen.clear()
        logits, out = jitted_forward(cfg, "decode", opts)(params, tok, st, jnp.array([1], jnp.int32))
        outs[name] = (logits, out.hidden, *jax.tree.leaves(out.state))
        assert all(np.isfinite(np.asarray(o)).all() for o in outs[name])
        # one boundary per MoE layer on the fused path, none today
        assert _FusedBoundaryOnPsum.seen == ([(1, d)] * n_moe if name == "fused" else [])
    for got, want in zip(outs["fused"], outs["today"]):  # the same arithmetic (measured: equal to the bit)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-7)
