"""KDA verify/commit kernels (Pallas Triton, interpret mode on CPU) vs the MODEL's jnp (ling_jax/layers/kda.py:
kda_inputs + kda_recurrent, kda_replay; through tests/kernel_oracles.py), and the model vs a float64 numpy loop
written from the math (ling_jax/layers/kda.py docstring). Checks outputs, the commit inputs AND the committed
state for several n_accept, for both algorithms (chunked UT form and the default serial v2), in fp32 and bf16 (the
kernels round where the model does: conv output, l2-normed q and k); CUDA lowering of non-default configs."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kda_verify import KdaCommitInputs, KdaConfig, kda_commit, kda_verify
from tests import kernel_oracles as model

W = 4


def rel_err(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def make(seed, b, t, h, dk, dtype):
  hd = h * dk
  ks = iter(jax.random.split(jax.random.key(seed), 16))
  n = lambda s, sc=1.0, dt=dtype: (jax.random.normal(next(ks), s, jnp.float32) * sc).astype(dt)
  return (n((b, t, hd)), n((b, t, hd)), n((b, t, hd)), n((b, t, hd)), n((b, t, h)),
          n((h,), 0.5, jnp.float32), n((hd,), 0.5, jnp.float32), n((hd, 1, W), 0.5),
          n((hd, 1, W), 0.5), n((hd, 1, W), 0.5), n((b, W - 1, 3 * hd)),
          n((b, h, dk, dk), 0.3, jnp.float32))


def numpy_kda(args, lower_bound=-5.0):
  """float64 loop: returns o [B,T,H,Dv] and the per-position states [T+1, B, H, Dk, Dv]."""
  q, k, v, f, br, alog, dtb, qw, kw, vw, cs, s0 = (np.asarray(a, np.float64) for a in args)
  b, t, hd = q.shape
  h = br.shape[-1]
  dk = hd // h
  silu = lambda z: z / (1 + np.exp(-z))
  sig = lambda z: 1 / (1 + np.exp(-z))
  def conv(x, st, w):
    xc = np.concatenate([st, x], axis=1)
    return silu(sum(w[:, 0, j] * xc[:, j:j + t] for j in range(W)))
  qc, kc, vc = (conv(x, st, w).reshape(b, t, h, dk) for x, st, w in
                zip((q, k, v), np.split(cs, 3, axis=-1), (qw, kw, vw)))
  l2 = lambda x: x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)
  qc, kc = l2(qc) * dk ** -0.5, l2(kc)
  g = lower_bound * sig(np.exp(alog)[:, None] * (f.reshape(b, t, h, dk) + dtb.reshape(h, dk)))
  beta = sig(br)
  s = s0.copy()
  states, o = [s.copy()], np.zeros((b, t, h, dk))
  for bi in range(b):
    for hi in range(h):
      sh = s0[bi, hi].copy()
      for ti in range(t):
        kk = kc[bi, ti, hi]
        # S_t = (I - beta k k^T) Diag(e^g) S_{t-1} + beta k v^T
        dec = np.exp(g[bi, ti, hi])[:, None] * sh
        sh = dec - beta[bi, ti, hi] * np.outer(kk, kk @ dec) + beta[bi, ti, hi] * np.outer(kk, vc[bi, ti, hi])
        o[bi, ti, hi] = sh.T @ qc[bi, ti, hi]
        if len(states) <= ti + 1:
          states.append(np.zeros_like(s0))
        states[ti + 1][bi, hi] = sh
  return o, np.stack(states)


def test_model_matches_numpy_loop():
  args = make(0, 2, 5, 2, 16, jnp.float32)
  o, ci = model.kda_verify(*args)
  o_np, states = numpy_kda(args)
  assert rel_err(o, o_np) <= 1e-5
  for n in ([0, 5], [3, 1]):
    s = model.kda_commit(args[-1], ci, jnp.array(n, jnp.int32))
    want = np.stack([states[n[bi]][bi] for bi in range(2)])
    assert rel_err(s, want) <= 1e-5


CASES = [  # (b, t, h, dk, dtype, block_v, n_accepts, algorithm)
    (1, 1, 2, 32, jnp.float32, 16, ([0], [1]), "chunk"),
    (2, 6, 2, 32, jnp.float32, 16, ([0, 6], [3, 1]), "chunk"),
    (1, 17, 2, 32, jnp.bfloat16, 32, ([17], [9]), "chunk"),
    (1, 9, 1, 32, jnp.bfloat16, 16, ([9], [5]), "serial"),
]


@pytest.mark.parametrize("b,t,h,dk,dtype,block_v,n_accepts,algorithm", CASES)
def test_kda_kernels_match_model(b, t, h, dk, dtype, block_v, n_accepts, algorithm):
  args = make(t * 11 + b, b, t, h, dk, dtype)
  cfg = KdaConfig(block_v=block_v, interpret=True, algorithm=algorithm)
  s_before = np.asarray(args[-1]).copy()
  o, ci = kda_verify(*args, config=cfg)
  o_ref, ci_ref = model.kda_verify(*args)
  np.testing.assert_array_equal(np.asarray(args[-1]), s_before)     # verify leaves state alone
  assert rel_err(o, o_ref) <= 1e-5
  if dtype == jnp.bfloat16:   # the kernel rounds where the model does: far closer to it than to unrounded math
    assert rel_err(o, numpy_kda(args)[0]) > 10 * max(rel_err(o, o_ref), 1e-7)
  for got, want in zip(ci, ci_ref):
    assert got.shape == want.shape and rel_err(got, want) <= 1e-5
  for n in n_accepts:
    n = jnp.array(n, jnp.int32)
    s = kda_commit(args[-1], ci, n, config=cfg)
    s_ref = model.kda_commit(args[-1], ci_ref, n)
    assert rel_err(s, s_ref) <= 1e-5
    for bi in range(b):
      if int(n[bi]) == 0:
        np.testing.assert_array_equal(np.asarray(s[bi]), s_before[bi])


def test_model_commit_against_numpy_loop():
  """The model (verify, then commit 2 of 3 positions) against the float64 numpy loop."""
  args = make(4, 1, 3, 2, 16, jnp.float32)
  o, ci = model.kda_verify(*args)
  o_np, states = numpy_kda(args)
  assert rel_err(o, o_np) <= 1e-5
  s = model.kda_commit(args[-1], ci, jnp.array([2], jnp.int32))
  assert rel_err(s, states[2]) <= 1e-5 and rel_err(states[2], states[3]) > 1e-3  # 2 steps, not 3


def test_kda_chunk_stable_on_repeated_keys():
  """Worst case for the chunk form's triangular inverse: identical keys, beta ~ 1, and either no
  decay (the inverse's Neumann terms grow like binomials) or the strongest decay (e^(-5 T))."""
  for f_val in (-30.0, 30.0):
    args = list(make(3, 1, 17, 1, 32, jnp.float32))
    args[1] = jnp.broadcast_to(args[1][:, :1], args[1].shape) * 3
    args[3] = jnp.full_like(args[3], f_val)
    args[4] = jnp.full_like(args[4], 4.0)
    chunk = KdaConfig(block_v=32, interpret=True, algorithm="chunk")
    o, ci = kda_verify(*args, config=chunk)
    o_np, states = numpy_kda(args)
    assert rel_err(o, o_np) <= 1e-5
    if f_val < 0:
      s = kda_commit(args[-1], ci, jnp.array([11], jnp.int32), config=chunk)
      assert rel_err(s, states[11]) <= 1e-5


def test_kda_configs_lower_for_cuda():
  """Non-default configs (8 warps, chunk with ieee dots, wide V tiles) lower at full shapes to Triton calls with
  the outputs' shapes and dtypes, and each config gives its own kernels (the config reaches the lowering)."""
  from tests.cuda_lowering import H200, S, lower_cuda
  h, dk, t = 32, 128, 6
  hd = h * dk
  args = ((S((1, t, hd), jnp.bfloat16),) * 4 + (S((1, t, h), jnp.bfloat16), S((h,), jnp.float32),
          S((hd,), jnp.float32)) + (S((hd, 1, W), jnp.bfloat16),) * 3
          + (S((1, W - 1, 3 * hd), jnp.bfloat16), S((1, h, dk, dk), jnp.float32)))
  ci = tuple(S((1, t, h, dk), jnp.float32) for _ in range(3)) + (S((1, t, h), jnp.float32),)
  texts = []
  for cfg in (KdaConfig(block_v=16, num_warps=8), KdaConfig(algorithm="chunk", block_v=64,
              precision="ieee"), KdaConfig(algorithm="chunk", block_v=128, num_warps=8)):
    verify = lambda *a, cfg=cfg: kda_verify(*a, config=cfg)
    commit = lambda s, c, n, cfg=cfg: kda_commit(s, c, n, config=cfg)
    with jax.sharding.use_abstract_mesh(H200):
      o, out_ci = jax.eval_shape(verify, *args)
      new_state = jax.eval_shape(commit, args[-1], KdaCommitInputs(*ci), S((1,), jnp.int32))
    assert (o.shape, o.dtype) == ((1, t, h, dk), jnp.float32)
    assert [(a.shape, a.dtype) for a in out_ci] == [(c.shape, c.dtype) for c in ci]
    assert (new_state.shape, new_state.dtype) == ((1, h, dk, dk), jnp.float32)
    texts.append(lower_cuda(verify, *args))
    lower_cuda(commit, args[-1], KdaCommitInputs(*ci), S((1,), jnp.int32))
  assert len(set(texts)) == len(texts)
