"""The one-kernel KDA chain (pallas_kernels/kda_chain.py, Pallas Triton in interpret mode) vs the model's own jnp
layer (ling_jax/layers/kda.py: kda_layer's verify / decode paths and kda_commit), in fp32 and bf16.

The oracle is the model itself: with D = C and o_proj = I, kda_layer's output IS the gated, normed row the kernel
hands o_proj (an identity einsum is exact), and its KdaPending holds the rows the kernel returns as commit inputs.
The bf16 case also checks that the kernel rounds where the model does (conv output, l2-normed q/k, o before the
norm): it must sit much closer to the bf16 model than the same model computed without those roundings does.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ling_jax.config import ModelConfig
from ling_jax.layers import kda as model_kda
from pallas_kernels.kda_chain import KdaChainConfig, kda_chain

W = 4
INTERPRET = KdaChainConfig(interpret=True)


def rel_err(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def model_cfg(h, k):
  return ModelConfig(hidden_size=h * k, num_attention_heads=h, head_dim=k, qk_rope_head_dim=k // 2)


def make_params(seed, h, k, dtype):
  """KDA layer weights with D = C and o_proj = I (the layer's output is then the kernel's output)."""
  c = h * k
  ks = iter(jax.random.split(jax.random.key(seed), 8))
  n = lambda s, sc: jax.random.normal(next(ks), s, jnp.float32) * sc
  return dict(w_qkvfg=n((5, c, c), c ** -0.5).astype(dtype), conv_w=n((3, c, 1, W), 0.6).astype(dtype),
              b_proj=n((h, c), c ** -0.5).astype(dtype), A_log=n((h,), 0.5), dt_bias=n((c,), 1.0),
              o_norm=(1.0 + n((k,), 0.2)).astype(dtype), o_proj=jnp.eye(c, dtype=dtype))


def make_inputs(seed, b, t, h, k, dtype):
  ks = jax.random.split(jax.random.key(seed), 3)
  c = h * k
  x = jax.random.normal(ks[0], (b, t, c), jnp.float32).astype(dtype)
  window = jax.random.normal(ks[1], (b, W - 1, 3, c), jnp.float32).astype(dtype)
  state = 0.3 * jax.random.normal(ks[2], (b, h, k, k), jnp.float32)
  return x, window, state


def chain(p, x, window, state, cfg, **kw):
  """The kernel on the model's projection of x (the same einsums the model's fused path feeds its kernels)."""
  args, proj = model_kda._kernel_inputs(p, x, window, state)
  out = kda_chain(proj, args[4], p["A_log"], p["dt_bias"], p["conv_w"], p["o_norm"], window, state,
                  lower_bound=cfg.kda_lower_bound, eps=cfg.rms_norm_eps, config=INTERPRET, **kw)
  return out, proj


def model_verify(p, x, window, state, cfg):
  out, _, _, pending = model_kda.kda_layer(p, x, window, state, cfg, mode="verify", n_valid=None, chunked=False)
  return out, pending


def assert_commit_inputs(got, pending, tol):
  for name in ("k", "v", "g", "beta"):
    a, b = getattr(got, name), getattr(pending, name)
    assert a.shape == b.shape and a.dtype == jnp.float32, name
    assert rel_err(a, b) <= tol, (name, rel_err(a, b))


@pytest.mark.parametrize("t", [1, 6])
def test_verify_matches_model_fp32(t):
  h, k = 2, 16
  cfg, p = model_cfg(h, k), make_params(t, h, k, jnp.float32)
  x, window, state = make_inputs(10 + t, 2, t, h, k, jnp.float32)
  got, _ = chain(p, x, window, state, cfg)
  want, pending = model_verify(p, x, window, state, cfg)
  assert got.o.shape == (2, t, h * k) and got.o.dtype == jnp.float32
  assert rel_err(got.o, want) <= 1e-5
  assert_commit_inputs(got.commit, pending, 1e-5)
  assert got.rec_state is None and got.conv_window is None           # plain verify writes no state


def test_verify_matches_model_bf16_rounding_points():
  h, k, t = 2, 32, 4
  cfg, p = model_cfg(h, k), make_params(3, h, k, jnp.bfloat16)
  x, window, state = make_inputs(4, 1, t, h, k, jnp.bfloat16)
  got, _ = chain(p, x, window, state, cfg)
  want, pending = model_verify(p, x, window, state, cfg)
  assert got.o.dtype == jnp.bfloat16
  err = rel_err(got.o, want)
  assert err <= 1e-2
  assert_commit_inputs(got.commit, pending, 1e-2)
  for a in (got.commit.k, got.commit.v):                               # handed over in bf16 (R(.) points)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(a.astype(jnp.bfloat16).astype(jnp.float32)))
  # the same model without its bf16 rounding points (fp32 math on the same bf16 values)
  up = lambda tree: jax.tree.map(lambda a: a.astype(jnp.float32), tree)
  unrounded, _ = model_verify(up(p), up(x), up(window), state, cfg)
  assert err < 0.2 * rel_err(unrounded, want), (err, rel_err(unrounded, want))


def test_folded_commit_after_planted_mismatch():
  """Step 1 verifies Tp rows and accepts n_prev < Tp (0 and 2 of 4); step 2's kernel replays the accepted rows
  from the stored base, writes that base once and runs its new rows: base state and window equal the model's
  kda_commit, the new rows equal the model's verify on the committed state."""
  h, k, tp, t = 2, 16, 4, 3
  cfg, p = model_cfg(h, k), make_params(5, h, k, jnp.float32)
  x1, window, state = make_inputs(6, 2, tp, h, k, jnp.float32)
  x2 = jax.random.normal(jax.random.key(7), (2, t, h * k), jnp.float32)
  n_prev = jnp.array([0, 2], jnp.int32)
  _, pending = model_verify(p, x1, window, state, cfg)
  window1, state1 = model_kda.kda_commit(window, state, pending, n_prev)
  want, pending2 = model_verify(p, x2, window1, state1, cfg)
  got, _ = chain(p, x2, window, state, cfg, pending=pending, n_prev=n_prev)
  assert rel_err(got.rec_state, state1) <= 1e-5
  np.testing.assert_array_equal(np.asarray(got.rec_state[0]), np.asarray(state[0]))   # n_prev = 0: untouched
  np.testing.assert_array_equal(np.asarray(got.conv_window), np.asarray(window1))
  assert rel_err(got.o, want) <= 1e-5
  assert_commit_inputs(got.commit, pending2, 1e-5)
  # kernel-only chaining: step 1's pending from the kernel itself, its whole proj [B, Tp, 5, C] as qkv_raw
  first, proj1 = chain(p, x1, window, state, cfg)
  kernel_pending = model_kda.KdaPending(proj1, *first.commit)
  again, _ = chain(p, x2, window, state, cfg, pending=kernel_pending, n_prev=n_prev)
  assert rel_err(again.rec_state, state1) <= 1e-5 and rel_err(again.o, want) <= 1e-5
  np.testing.assert_array_equal(np.asarray(again.conv_window), np.asarray(window1))


def test_advance_matches_model_decode_and_verify_row():
  """advance=True (plain decode, T = 1): output, state and window equal the model's decode; the row is bitwise
  the verify kernel's row 0 of a 6-row verify (so NEXTN and plain decoding see the same numbers)."""
  h, k = 2, 16
  cfg, p = model_cfg(h, k), make_params(6, h, k, jnp.float32)
  x, window, state = make_inputs(12 + 6, 2, 6, h, k, jnp.float32)
  want, window1, state1, _ = model_kda.kda_layer(p, x[:, :1], window, state, cfg, mode="decode",
                                                 n_valid=jnp.ones((2,), jnp.int32), chunked=False)
  got, _ = chain(p, x[:, :1], window, state, cfg, advance=True)
  assert rel_err(got.o, want) <= 1e-5 and rel_err(got.rec_state, state1) <= 1e-5
  np.testing.assert_array_equal(np.asarray(got.conv_window), np.asarray(window1))
  verify6, _ = chain(p, x, window, state, cfg)
  np.testing.assert_array_equal(np.asarray(got.o[:, 0]), np.asarray(verify6.o[:, 0]))


def test_rows_independent_of_t():
  """Batch invariance: a row's output and commit inputs do not depend on how many rows the call runs."""
  h, k = 2, 16
  cfg, p = model_cfg(h, k), make_params(6, h, k, jnp.float32)
  x, window, state = make_inputs(12 + 6, 2, 6, h, k, jnp.float32)
  six, _ = chain(p, x, window, state, cfg)
  one, _ = chain(p, x[:, :1], window, state, cfg)
  for a, b in zip(jax.tree.leaves((one.o, one.commit)), jax.tree.leaves((six.o, six.commit))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b)[:, :1])


def test_bad_inputs_raise():
  h, k = 2, 16
  cfg, p = model_cfg(h, k), make_params(0, h, k, jnp.float32)
  x, window, state = make_inputs(0, 1, 2, h, k, jnp.float32)
  args, proj = model_kda._kernel_inputs(p, x, window, state)
  call = lambda **kw: kda_chain(**{**dict(proj=proj, b_raw=args[4], A_log=p["A_log"], dt_bias=p["dt_bias"],
                                          conv_w=p["conv_w"], o_norm=p["o_norm"], conv_window=window,
                                          rec_state=state), **kw}, lower_bound=-5.0, eps=1e-6, config=INTERPRET)
  with pytest.raises(ValueError, match="o_norm"):
    call(o_norm=jnp.ones((k + 1,)))
  with pytest.raises(ValueError, match="fp32"):
    call(rec_state=state.astype(jnp.bfloat16))
  with pytest.raises(ValueError, match="together"):
    call(n_prev=jnp.zeros((1,), jnp.int32))
  with pytest.raises(ValueError, match="prefetch"):
    KdaChainConfig(prefetch=0)


@pytest.mark.parametrize("t,mode", [(1, "advance"), (6, "folded"), (17, "verify")])
def test_chain_lowers_for_cuda(t, mode):
  """Full Ling-3.0-flash shapes (H = 32, K = V = 128): each mode lowers to exactly one Triton kernel."""
  from tests.cuda_lowering import H200, S
  h, k = 32, 128
  c, bf, f32 = h * k, jnp.bfloat16, jnp.float32
  args = (S((1, t, 5, c), bf), S((1, t, h), bf), S((h,), f32), S((c,), f32), S((3, c, 1, W), bf), S((k,), bf),
          S((1, W - 1, 3, c), bf), S((1, h, k, k), f32))
  tp = 6
  pending = model_kda.KdaPending(S((1, tp, 3, c), bf), S((1, tp, h, k), f32), S((1, tp, h, k), f32),
                                 S((1, tp, h, k), f32), S((1, tp, h), f32))
  extra = dict(pending=pending, n_prev=S((1,), jnp.int32)) if mode == "folded" else {}
  fn = lambda a, e: kda_chain(*a, lower_bound=-5.0, eps=1e-6, advance=mode == "advance", **e)
  with jax.sharding.use_abstract_mesh(H200):
    text = jax.jit(fn).trace(args, extra).lower(lowering_platforms=("cuda",)).as_text()
  assert text.count("__gpu$xla.gpu.triton") == 1
