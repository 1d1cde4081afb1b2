"""Sharded == unsharded on 4 simulated CPU devices: rules, forward logits (fp32 rel err <= 1e-5), NEXTN
generation token for token, and the Pallas kernels (interpreter) under shard_map, alone and inside the model."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from compile.mesh import make_mesh
from compile.runner import ShardedGenerator, sharded_params
from compile.sharding import (ShardedKernelCalls, ShardingRules, kernel_calls_for, param_specs, shardings_for,
                              state_shardings)
from ling_jax.model import RuntimeOptions, commit
from ling_jax.config import get_preset
from ling_jax.runner import Generator
from ling_jax.spec import SpecConfig
from ling_jax.state import init_state
from ling_jax.weights import init_params
from tests.conftest import jitted_forward, rel_err

F32 = jnp.float32


def test_rules_fail_on_collisions_unknown_axes_and_indivisible_dims():
    cfg = get_preset("test-wide")
    with pytest.raises(ValueError, match="one mesh axis"):
        param_specs(cfg, ShardingRules(expert="tp"))  # expert and expert_mlp both on tp
    with pytest.raises(KeyError, match="no sharding rule"):
        ShardingRules().spec(("nonsense",))
    with pytest.raises(ValueError, match="not divisible"):
        shardings_for(get_preset("test-qlora"), make_mesh(4))  # 2 heads over 4 devices
    specs = param_specs(cfg, ShardingRules.tensor_parallel(expert_parallel=True))
    assert specs[("layers", 1, "mlp", "w_gate")] == jax.sharding.PartitionSpec("tp", None, None)


def test_state_shardings_by_field():
    cfg = get_preset("test-wide")
    mesh = make_mesh(4)
    sh = state_shardings(init_state(cfg, 1, 16, F32), mesh)
    assert sh.kda_recurrent.spec == jax.sharding.PartitionSpec(None, None, "tp", None, None)
    assert sh.kda_conv.spec == jax.sharding.PartitionSpec(None, None, None, None, "tp")
    assert sh.mla_cache.spec == jax.sharding.PartitionSpec() and sh.lengths.spec == jax.sharding.PartitionSpec()


@pytest.mark.parametrize("tp,ep", [(4, False), (4, True)])
def test_sharded_prefill_decode_logits_match(tp, ep):
    cfg = get_preset("test-wide")
    mesh, rules = make_mesh(tp), ShardingRules.tensor_parallel(ep)
    params = init_params(cfg, 3, F32)
    sparams = sharded_params(cfg, mesh, rules, seed=3, dtype=F32)
    assert sparams["layers"][1]["attn"]["w_qkvfg"].sharding.spec == param_specs(cfg, rules)[("layers", 1, "attn", "w_qkvfg")]
    tokens = jax.random.randint(jax.random.key(1), (1, 12), 0, cfg.vocab_size)
    n = jnp.array([10], jnp.int32)
    st = init_state(cfg, 1, 32, F32)
    sst = jax.device_put(st, state_shardings(st, mesh, rules))
    pre, dec = jitted_forward(cfg, "prefill"), jitted_forward(cfg, "decode")
    la, oa = pre(params, tokens, st, n)
    lb, ob = pre(sparams, tokens, sst, n)
    assert rel_err(lb[:, :10], la[:, :10]) <= 1e-5
    for _ in range(2):
        tok = jnp.argmax(la[:, -1:], -1).astype(jnp.int32)
        la, oa = dec(params, tok, oa.state, jnp.array([1], jnp.int32))
        lb, ob = dec(sparams, tok, ob.state, jnp.array([1], jnp.int32))
        assert rel_err(lb, la) <= 1e-5
    assert rel_err(ob.state.kda_recurrent, oa.state.kda_recurrent) <= 1e-5
    assert rel_err(ob.state.mla_cache, oa.state.mla_cache) <= 1e-5


def test_sharded_pallas_model_matches_unsharded_jnp():
    """The model with its Pallas kernels (interpreter) under shard_map on 4 devices: prefill + 2 decode steps and a
    verify + commit give the unsharded jnp model's logits and states."""
    cfg = get_preset("test-wide")
    mesh, rules = make_mesh(4), ShardingRules.tensor_parallel()
    params = init_params(cfg, 3, F32)
    sparams = sharded_params(cfg, mesh, rules, seed=3, dtype=F32)
    opts = kernel_calls_for(RuntimeOptions(kernels="interpret"), mesh, rules)
    assert isinstance(opts.calls, ShardedKernelCalls)
    tokens = jax.random.randint(jax.random.key(1), (1, 8), 0, cfg.vocab_size)
    n = jnp.array([8], jnp.int32)
    st = init_state(cfg, 1, 32, F32)
    sst = jax.device_put(st, state_shardings(st, mesh, rules))
    la, oa = jitted_forward(cfg, "prefill")(params, tokens, st, n)
    lb, ob = jitted_forward(cfg, "prefill", opts)(sparams, tokens, sst, n)
    assert rel_err(lb, la) <= 1e-5
    one = jnp.array([1], jnp.int32)
    tok = jnp.argmax(la[:, -1:], -1).astype(jnp.int32)
    la, oa = jitted_forward(cfg, "decode")(params, tok, oa.state, one)
    lb, ob = jitted_forward(cfg, "decode", opts)(sparams, tok, ob.state, one)
    assert rel_err(lb, la) <= 1e-5
    assert rel_err(ob.state.kda_recurrent, oa.state.kda_recurrent) <= 1e-5
    drafts = jax.random.randint(jax.random.key(2), (1, 3), 0, cfg.vocab_size)
    la, oa = jitted_forward(cfg, "verify")(params, drafts, oa.state, None)
    lb, ob = jitted_forward(cfg, "verify", opts)(sparams, drafts, ob.state, None)
    assert rel_err(lb, la) <= 1e-5
    n_acc = jnp.array([2], jnp.int32)
    ca = jax.jit(commit)(oa.state, oa.pending, n_acc)
    cb = jax.jit(functools.partial(commit, opts=opts))(ob.state, ob.pending, n_acc)
    assert rel_err(cb.kda_recurrent, ca.kda_recurrent) <= 1e-5
    assert rel_err(cb.kda_conv, ca.kda_conv) <= 1e-5


def test_sharded_nextn_generation_matches_unsharded():
    cfg = get_preset("test-wide")
    mesh = make_mesh(4)
    spec = SpecConfig("NEXTN", num_steps=3)
    kw = dict(spec=spec, max_len=64, dtype=F32)
    ref = Generator(cfg, init_params(cfg, 5, F32), **kw)
    gen = ShardedGenerator(cfg, sharded_params(cfg, mesh, seed=5, dtype=F32), mesh, **kw)
    prompt = [int(t) for t in np.random.default_rng(0).integers(2, cfg.vocab_size, 9)]
    want, _ = ref.generate(prompt, max_new_tokens=20)
    got, stats = gen.generate(prompt, max_new_tokens=20)
    assert got == want
    assert stats.verify_steps > 0


def _moe_inputs(T=3, D=64, E=16, I=32, A=4):
    ks = jax.random.split(jax.random.key(0), 9)
    x = jax.random.normal(ks[0], (T, D), F32)
    ids = jax.random.randint(ks[1], (T, A), 0, E).astype(jnp.int32)
    w = jax.random.uniform(ks[2], (T, A), F32)
    wg, wu = (jax.random.normal(k, (E, I, D), F32) * D**-0.5 for k in ks[3:5])
    wd = jax.random.normal(ks[5], (E, D, I), F32) * I**-0.5
    sg, su = (jax.random.normal(k, (I, D), F32) * D**-0.5 for k in ks[6:8])
    sd = jax.random.normal(ks[8], (D, I), F32) * I**-0.5
    return x, ids, w, wg, wu, wd, (sg, su, sd)


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_sharded_moe_kernel_under_shard_map(expert_parallel):
    """The Pallas MoE (interpreter) run per device under shard_map, TP over the expert width or EP over the
    experts, equals the unsharded model (ling_jax.layers.moe.moe_experts)."""
    from tests.kernel_oracles import moe as moe_model

    mesh = make_mesh(4)
    rules = ShardingRules.tensor_parallel(expert_parallel=expert_parallel)
    x, ids, w, wg, wu, wd, sh = _moe_inputs()
    want = moe_model(x, ids, w, wg, wu, wd, limit=0.7, shared=sh, shared_limit=0.5)
    calls = ShardedKernelCalls(interpret=True, mesh=mesh, rules=rules)
    got = jax.jit(lambda *a: calls.moe(*a[:6], limit=0.7, shared=a[6], shared_limit=0.5))(x, ids, w, wg, wu, wd, sh)
    assert got.shape == want.shape
    assert rel_err(got, want) <= 1e-5


def _kda_inputs(B=1, T=4, H=4, K=16, W=4, L=2):
    C = H * K
    ks = jax.random.split(jax.random.key(1), 12)
    proj = jax.random.normal(ks[0], (B, T, 5, C), F32)
    b = jax.random.normal(ks[4], (B, T, H), F32)
    A_log = jnp.log(jax.random.uniform(ks[5], (H,), F32, 1.0, 8.0))
    dt = 0.5 * jax.random.normal(ks[6], (C,), F32)
    cw = 0.5 * jax.random.normal(ks[7], (3, C, 1, W), F32)
    conv = jax.random.normal(ks[10], (L, B, W - 1, 3, C), F32)
    rec = 0.1 * jax.random.normal(ks[11], (L, B, H, K, K), F32)
    return proj, b, A_log, dt, cw, conv, rec


def test_sharded_kda_verify_and_commit_under_shard_map():
    """KDA verify (both layers of the stacked states, rows stacked in place) + the all-layer commit (interpreter)
    split by heads over 4 devices equal the unsharded model (ling_jax.layers.kda: kda_inputs + kda_recurrent,
    kda_replay + slide_window)."""
    from tests import kernel_oracles as model

    mesh = make_mesh(4)
    args = _kda_inputs()
    calls = ShardedKernelCalls(interpret=True, mesh=mesh)
    verify = jax.jit(lambda *a: calls.kda_verify(*a, lower_bound=-5.0))
    want_rows = got_rows = None
    for layer in (1, 0):
        want, want_rows = model.kda_verify(*args, layer, want_rows)
        got, got_rows = verify(*args, layer, got_rows)
        assert rel_err(got, want) <= 1e-5
    for g_, w_ in zip(got_rows, want_rows):
        assert rel_err(g_, w_) <= 1e-5
    n_accept = jnp.array([3], jnp.int32)
    want_s = model.kda_commit(args[-1], args[-2], want_rows, n_accept)
    got_s = jax.jit(calls.kda_commit)(args[-1], args[-2], got_rows, n_accept)
    for g_, w_ in zip(got_s, want_s):
        assert rel_err(g_, w_) <= 1e-5


def test_sharded_kda_verify_with_the_epilogue_under_shard_map():
    """The verify with the output epilogue folded in (o_norm given: kda_output_gate's [B, T, H*V]) split by heads
    over 4 devices (o_norm replicated, the V norm per head) equals the unsharded model's, rows stacked in place."""
    from tests import kernel_oracles as model

    mesh = make_mesh(4)
    args = _kda_inputs()
    o_norm = 1 + 0.3 * jax.random.normal(jax.random.key(3), (args[-1].shape[-1],), F32)
    calls = ShardedKernelCalls(interpret=True, mesh=mesh)
    verify = jax.jit(lambda *a: calls.kda_verify(*a[1:], lower_bound=-5.0, o_norm=a[0], eps=1e-6))
    want_rows = got_rows = None
    for layer in (1, 0):
        want, want_rows = model.kda_verify(*args, layer, want_rows, o_norm=o_norm, eps=1e-6)
        got, got_rows = verify(o_norm, *args, layer, got_rows)
        assert got.shape == want.shape == args[0].shape[:2] + (args[0].shape[-1],)
        assert rel_err(got, want) <= 1e-5
    for g_, w_ in zip(got_rows, want_rows):
        assert rel_err(g_, w_) <= 1e-5


def test_sharded_mla_triton_model_matches_unsharded_jnp():
    """mla_triton (on the GPU by default: GPU_DEFAULTS) under shard_map on 4 devices, heads split over "tp": a decode
    step and a verify over the prefilled cache give the unsharded jnp model's logits (fp32)."""
    from ling_jax.kernel_calls import KernelCalls

    cfg = get_preset("test-wide")
    mesh, rules = make_mesh(4), ShardingRules.tensor_parallel()
    params = init_params(cfg, 3, F32)
    sparams = sharded_params(cfg, mesh, rules, seed=3, dtype=F32)
    opts = kernel_calls_for(RuntimeOptions(kernels=KernelCalls(interpret=True, mla_triton=True)), mesh, rules)
    assert isinstance(opts.calls, ShardedKernelCalls) and opts.calls.mla_triton
    tokens = jax.random.randint(jax.random.key(4), (1, 8), 0, cfg.vocab_size)
    st = init_state(cfg, 1, 32, F32)
    sst = jax.device_put(st, state_shardings(st, mesh, rules))
    la, oa = jitted_forward(cfg, "prefill")(params, tokens, st, jnp.array([8], jnp.int32))
    lb, ob = jitted_forward(cfg, "prefill", opts)(sparams, tokens, sst, jnp.array([8], jnp.int32))
    assert rel_err(lb, la) <= 1e-5
    tok = jnp.argmax(la[:, -1:], -1).astype(jnp.int32)
    decode = jitted_forward(cfg, "decode", opts)
    assert "mla_triton" in str(jax.make_jaxpr(decode)(sparams, tok, ob.state, jnp.array([1], jnp.int32)))
    la, oa = jitted_forward(cfg, "decode")(params, tok, oa.state, jnp.array([1], jnp.int32))
    lb, ob = decode(sparams, tok, ob.state, jnp.array([1], jnp.int32))
    assert rel_err(lb, la) <= 1e-5
    drafts = jax.random.randint(jax.random.key(5), (1, 3), 0, cfg.vocab_size)
    la, _ = jitted_forward(cfg, "verify")(params, drafts, oa.state, None)
    lb, _ = jitted_forward(cfg, "verify", opts)(sparams, drafts, ob.state, None)
    assert rel_err(lb, la) <= 1e-5
