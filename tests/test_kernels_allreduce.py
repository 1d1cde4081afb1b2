"""The peer-to-peer all-reduce + residual + RMSNorm (pallas_kernels/allreduce.py) on CPU.

(a) The whole collective kernel lowers for CUDA on 2 and 4 abstract H200s (remote stores and semaphores through
    XLA's collective metadata, no multimem). (b) Its arithmetic (step 3: the device-order fp32 sum, the residual
    add, the RMSNorm) runs in the Mosaic GPU interpreter on simulated CPU devices, on the slots every device
    would hold after the exchange, against the model's path (KernelCalls.allreduce_residual_norm with the
    switch off: psum, `x + y`, ling_jax.layers.norms.rms_norm). The exchange itself (remote refs, GMEM
    semaphores) cannot run in the interpreter (it has no semaphores); bench/kernels_allreduce.py checks the
    whole kernel against psum on two GPUs.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ling_jax.kernel_calls import KernelCalls
from ling_jax.layers.norms import rms_norm
from pallas_kernels.allreduce import AllReduceConfig, allreduce_residual_norm, combine, takes

S = jax.ShapeDtypeStruct
BF, F32 = jnp.bfloat16, jnp.float32
EPS = 1e-6
INTERPRET = AllReduceConfig(interpret=True)


def h200_mesh(n: int) -> AbstractMesh:
    return AbstractMesh((n,), ("tp",), abstract_device=AbstractDevice(device_kind="NVIDIA H200", num_cores=132,
                                                                      platform="cuda"))


@pytest.mark.parametrize("n,t,pdt", [(2, 1, F32), (2, 17, BF), (4, 6, F32), (4, 17, BF)])
def test_allreduce_lowers_for_cuda(n, t, pdt):
    mesh, d = h200_mesh(n), 2560

    def f(partials, residual, weight):
        body = lambda p, r, w: allreduce_residual_norm(p[0], r, w, eps=EPS, axis="tp")
        return jax.shard_map(body, mesh=mesh, in_specs=(P("tp"), P(), P()), out_specs=(P(), P()),
                             check_vma=False)(partials, residual, weight)

    args = (S((n, t, d), pdt, sharding=NamedSharding(mesh, P("tp"))), S((t, d), BF), S((d,), BF))
    with jax.sharding.use_abstract_mesh(mesh):
        text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("@mosaic_gpu_v2") == 1                  # one kernel, no XLA all-reduce
    assert "all-reduce" not in text and "all_reduce" not in text
    assert "uses_xla_collective_metadata = true" in text      # peers' buffers through remote refs
    assert "red.release.sys.global.add" in text               # the semaphore signal
    assert "multimem" not in text                             # never NVLink multicast


def _inputs(n, t, d, pdt, seed=0):
    k = jax.random.split(jax.random.key(seed), 3)
    partials = (4 * jax.random.normal(k[0], (n, t, d), F32)).astype(pdt)
    residual = (8 * jax.random.normal(k[1], (t, d), F32)).astype(BF)
    weight = (1 + 0.2 * jax.random.normal(k[2], (d,), F32)).astype(BF)
    return partials, residual, weight


def _on_devices(n, body, partials, residual, weight):
    """body(partial [T, D], residual, weight) on n CPU devices; outputs stacked per device [n, T, D]."""
    mesh = Mesh(jax.devices()[:n], ("tp",))
    per_device = lambda p, r, w: tuple(o[None] for o in body(p[0], r, w))
    f = jax.shard_map(per_device, mesh=mesh, in_specs=(P("tp"), P(), P()), out_specs=(P("tp"), P("tp")),
                      check_vma=False)
    return [np.asarray(o) for o in jax.jit(f)(partials, residual, weight)]


def _kernel_math(p, r, w):
    """Step 3 of the kernel on the slots the exchange leaves on this device (slot d = device d's partial)."""
    return combine(jax.lax.all_gather(p, "tp"), r, w, eps=EPS, config=INTERPRET)


def _model_path(p, r, w):
    return KernelCalls().allreduce_residual_norm(p, r, w, eps=EPS, axis="tp")


def _ulps(a, b):
    return np.abs(a.view(np.int16).astype(np.int32) - b.view(np.int16).astype(np.int32))


@pytest.mark.parametrize("n,t,pdt", [(2, 2, F32), (2, 2, BF), (4, 2, BF)])
def test_kernel_math_matches_model_psum_add_norm(n, t, pdt):
    if jax.device_count() < n:
        pytest.fail(f"needs {n} simulated CPU devices (tests/conftest.py sets 4), got {jax.device_count()}")
    args = _inputs(n, t, 512, pdt)
    x_k, normed_k = _on_devices(n, _kernel_math, *args)
    x_m, normed_m = _on_devices(n, _model_path, *args)
    for dev in range(1, n):  # replicated result: bit-identical on every device
        np.testing.assert_array_equal(x_k[dev].view(np.int16), x_k[0].view(np.int16))
        np.testing.assert_array_equal(normed_k[dev].view(np.int16), normed_k[0].view(np.int16))
    # the new residual: one fp32 sum in device order, one rounding, one add. Two partials: the same bits as
    # psum; four: psum may add in another order (f32) or round after each add (bf16), at most 1 bf16 ulp.
    diff = _ulps(x_k[0], x_m[0])
    assert diff.max() <= (0 if n == 2 else 1), diff.max()
    assert (diff > 0).mean() < 0.01
    # the norm of the same residual: fp32 sum of squares in the kernel's order vs XLA's, at most 1 bf16 ulp
    normed_of_x = np.asarray(rms_norm(jnp.asarray(x_k[0]), args[2], EPS))
    assert _ulps(normed_k[0], normed_of_x).max() <= 1
    assert (_ulps(normed_k[0], normed_of_x) > 0).mean() < 0.01
    np.testing.assert_allclose(np.float32(normed_k[0]), np.float32(normed_m[0]), rtol=2e-2, atol=2e-2)


def test_kernel_math_row_and_slot_order_invariant():
    """A row's result depends on its own row only (batch invariance), and the slots are summed in device
    order whatever rows sit beside them: row 1 of a 3-row call equals the same row called alone."""
    slots, residual, weight = _inputs(4, 3, 512, F32, seed=3)
    x3, n3 = combine(slots, residual, weight, eps=EPS, config=INTERPRET)
    x1, n1 = combine(slots[:, 1:2], residual[1:2], weight, eps=EPS, config=INTERPRET)
    np.testing.assert_array_equal(np.asarray(x3[1:2]).view(np.int16), np.asarray(x1).view(np.int16))
    np.testing.assert_array_equal(np.asarray(n3[1:2]).view(np.int16), np.asarray(n1).view(np.int16))
    # device order, not any other: ((s0 + s1) + s2) + s3 in fp32, then one rounding
    f = np.float32
    y = ((f(slots[0]) + f(slots[1])) + f(slots[2])) + f(slots[3])
    expect = (f(residual) + f(jnp.asarray(y).astype(BF))).astype(f)
    np.testing.assert_array_equal(np.asarray(x3).view(np.int16), np.asarray(jnp.asarray(expect).astype(BF)).view(np.int16))


@pytest.mark.parametrize("p2p", [True, False])
def test_kernel_calls_switch(p2p):
    """KernelCalls(p2p_allreduce=True) runs the kernel under TP (one Mosaic call, no XLA all-reduce); the
    default runs psum (an XLA all-reduce) and the model's jnp."""
    mesh, calls = h200_mesh(2), KernelCalls(p2p_allreduce=p2p)
    body = lambda p, r, w: calls.allreduce_residual_norm(p[0], r, w, eps=EPS, axis="tp")
    f = jax.shard_map(body, mesh=mesh, in_specs=(P("tp"), P(), P()), out_specs=(P(), P()), check_vma=False)
    args = (S((2, 6, 2560), F32, sharding=NamedSharding(mesh, P("tp"))), S((6, 2560), BF), S((2560,), BF))
    with jax.sharding.use_abstract_mesh(mesh):
        text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert ("@mosaic_gpu_v2" in text) == p2p
    assert ("all_reduce" in text) != p2p


def test_unsupported_inputs_are_rejected():
    _, residual, weight = _inputs(2, 3, 512, F32)
    cfg = AllReduceConfig()
    assert takes(S((3, 512), F32), residual, weight)
    for partial, res, w, msg in [
            (S((3, 500), F32), S((3, 500), BF), S((500,), BF), "multiple of 128"),
            (S((65, 512), F32), S((65, 512), BF), weight, "max_rows"),
            (S((3, 512), jnp.float16), residual, weight, "partial dtype"),
            (S((3, 512), F32), residual, weight.astype(F32), "share a dtype"),
            (S((3, 512), F32), residual[:2], weight, "residual shape"),
            (S((2, 3, 512), F32), residual, weight, "is not"),
    ]:
        assert not takes(partial, res, w)
        with pytest.raises(ValueError, match=msg):
            cfg.check(partial.shape, partial.dtype, res, w)
    with pytest.raises(ValueError, match="vec=3"):
        AllReduceConfig(vec=3)
    with pytest.raises(ValueError, match="interpret"):
        KernelCalls(interpret=True, p2p_allreduce=True)
