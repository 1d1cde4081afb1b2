"""KDA verify/commit kernels (Pallas Triton, interpret mode on CPU) vs the MODEL's jnp (ling_jax/layers/kda.py:
kda_inputs + kda_recurrent, kda_replay + slide_window; through tests/kernel_oracles.py), and the model vs a float64
numpy loop written from the math (ling_jax/layers/kda.py docstring). The kernels read the model's layouts in place
(the fused projection [B, T, 5, C], the whole conv weight, the stacked states at a layer): checks outputs, the rows
each verify writes into the stack (and leaves the other layers' alone), AND the committed states and conv windows
of every layer for several n_accept, for both algorithms (chunked UT form and the default serial v2), in fp32 and
bf16 (the kernels round where the model does: conv output, l2-normed q and k); CUDA lowering of non-default
configs."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kda_verify import KdaConfig, KdaRows, kda_commit, kda_verify
from tests import kernel_oracles as model

W = 4


def rel_err(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def make(seed, b, t, h, dk, dtype, n_layers=2):
  """(proj [B, T, 5, C] (q, k, v, f, and an out-gate stream the kernels must not read), b_raw, A_log, dt_bias,
  conv_w [3, C, 1, W], conv_state [L, B, W-1, 3, C], rec_state [L, B, H, Dk, Dk])."""
  hd = h * dk
  ks = iter(jax.random.split(jax.random.key(seed), 16))
  n = lambda s, sc=1.0, dt=dtype: (jax.random.normal(next(ks), s, jnp.float32) * sc).astype(dt)
  return (n((b, t, 5, hd)), n((b, t, h)), n((h,), 0.5, jnp.float32), n((hd,), 0.5, jnp.float32),
          n((3, hd, 1, W), 0.5), n((n_layers, b, W - 1, 3, hd)), n((n_layers, b, h, dk, dk), 0.3, jnp.float32))


def numpy_kda(args, layer, lower_bound=-5.0):
  """float64 loop over layer `layer`: returns o [B,T,H,Dv] and the per-position states [T+1, B, H, Dk, Dv]."""
  proj, br, alog, dtb, w, cs, s0 = (np.asarray(a, np.float64) for a in args)
  cs, s0 = cs[layer], s0[layer]
  b, t, _, hd = proj.shape
  h = br.shape[-1]
  dk = hd // h
  silu = lambda z: z / (1 + np.exp(-z))
  sig = lambda z: 1 / (1 + np.exp(-z))
  def conv(x, st, w):
    xc = np.concatenate([st, x], axis=1)
    return silu(sum(w[:, 0, j] * xc[:, j:j + t] for j in range(W)))
  qc, kc, vc = (conv(proj[:, :, s], cs[:, :, s], w[s]).reshape(b, t, h, dk) for s in range(3))
  l2 = lambda x: x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)
  qc, kc = l2(qc) * dk ** -0.5, l2(kc)
  g = lower_bound * sig(np.exp(alog)[:, None] * (proj[:, :, 3].reshape(b, t, h, dk) + dtb.reshape(h, dk)))
  beta = sig(br)
  states, o = [s0.copy()], np.zeros((b, t, h, dk))
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


def verify_layers(verify, args):
  """Every layer's verify in order, the rows stacked in place -> ([o per layer], rows)."""
  rows, outs = None, []
  for layer in range(args[-1].shape[0]):
    o, rows = verify(*args, jnp.int32(layer), rows)
    outs.append(o)
  return outs, rows


def test_model_matches_numpy_loop():
  args = make(0, 2, 5, 2, 16, jnp.float32, n_layers=1)
  o, rows = model.kda_verify(*args, 0)
  o_np, states = numpy_kda(args, 0)
  assert rel_err(o, o_np) <= 1e-5
  for n in ([0, 5], [3, 1]):
    s, _ = model.kda_commit(args[-1], args[-2], rows, jnp.array(n, jnp.int32))
    want = np.stack([states[n[bi]][bi] for bi in range(2)])
    assert rel_err(s[0], want) <= 1e-5


CASES = [  # (b, t, h, dk, dtype, block_v, n_accepts, algorithm, stacked layers)
    (1, 1, 2, 32, jnp.float32, 16, ([0], [1]), "chunk", 1),
    (2, 6, 2, 32, jnp.float32, 16, ([0, 6], [3, 1]), "chunk", 2),
    (1, 17, 2, 32, jnp.bfloat16, 32, ([17], [9]), "chunk", 1),
    (1, 9, 1, 32, jnp.bfloat16, 16, ([9], [5]), "serial", 1),
    (2, 1, 2, 32, jnp.bfloat16, 16, ([1, 1], [0, 1]), "serial", 1),   # plain decode, a padded row (n = 0)
    (1, 6, 2, 32, jnp.float32, 16, ([6], [2]), "serial", 2),           # NEXTN5's verify, two layers stacked
]


@pytest.mark.parametrize("b,t,h,dk,dtype,block_v,n_accepts,algorithm,n_layers", CASES)
def test_kda_kernels_match_model(b, t, h, dk, dtype, block_v, n_accepts, algorithm, n_layers):
  args = make(t * 11 + b, b, t, h, dk, dtype, n_layers)
  cfg = KdaConfig(block_v=block_v, interpret=True, algorithm=algorithm)
  s_before, cs_before = np.asarray(args[-1]).copy(), np.asarray(args[-2]).copy()
  outs, rows = verify_layers(lambda *a: kda_verify(*a, config=cfg), args)
  outs_ref, rows_ref = verify_layers(model.kda_verify, args)
  np.testing.assert_array_equal(np.asarray(args[-1]), s_before)     # verify leaves the states alone
  for o, o_ref in zip(outs, outs_ref):
    assert rel_err(o, o_ref) <= 1e-5
  if dtype == jnp.bfloat16:   # the kernel rounds where the model does: far closer to it than to unrounded math
    assert rel_err(outs[0], numpy_kda(args, 0)[0]) > 10 * max(rel_err(outs[0], outs_ref[0]), 1e-7)
  np.testing.assert_array_equal(np.asarray(rows.qkv_raw), np.asarray(rows_ref.qkv_raw))  # copied rows: exact
  for got, want in zip(rows[1:], rows_ref[1:]):
    assert got.shape == want.shape and rel_err(got, want) <= 1e-5
  for n in n_accepts:
    n = jnp.array(n, jnp.int32)
    s, cs = kda_commit(args[-1], args[-2], rows, n, config=cfg)
    s_ref, cs_ref = model.kda_commit(args[-1], args[-2], rows_ref, n)
    assert rel_err(s, s_ref) <= 1e-5
    np.testing.assert_array_equal(np.asarray(cs), np.asarray(cs_ref))  # the window slide moves data only
    for bi in range(b):
      if int(n[bi]) == 0:
        np.testing.assert_array_equal(np.asarray(s[:, bi]), s_before[:, bi])
        np.testing.assert_array_equal(np.asarray(cs[:, bi]), cs_before[:, bi])


def test_verify_writes_only_its_layer_rows():
  """A verify at layer 1 writes layer 1's rows and leaves layers 0 and 2 of the rows it is given as they were."""
  args = make(5, 1, 3, 2, 16, jnp.float32, n_layers=3)
  cfg = KdaConfig(block_v=16, interpret=True)
  given = jax.tree.map(lambda a: jnp.full(a.shape, 7, a.dtype), model.kda_verify(*args, 0)[1])
  _, rows = kda_verify(*args, jnp.int32(1), given, config=cfg)
  _, want = model.kda_verify(*args, 1, given)
  for got, w in zip(rows, want):
    np.testing.assert_array_equal(np.asarray(got)[[0, 2]], np.asarray(w)[[0, 2]])
    assert rel_err(np.asarray(got)[1], np.asarray(w)[1]) <= 1e-5


def test_model_commit_against_numpy_loop():
  """The model (verify, then commit 2 of 3 positions) against the float64 numpy loop."""
  args = make(4, 1, 3, 2, 16, jnp.float32, n_layers=1)
  o, rows = model.kda_verify(*args, 0)
  o_np, states = numpy_kda(args, 0)
  assert rel_err(o, o_np) <= 1e-5
  s, _ = model.kda_commit(args[-1], args[-2], rows, jnp.array([2], jnp.int32))
  assert rel_err(s[0], states[2]) <= 1e-5 and rel_err(states[2], states[3]) > 1e-3  # 2 steps, not 3


def test_kda_chunk_stable_on_repeated_keys():
  """Worst case for the chunk form's triangular inverse: identical keys, beta ~ 1, and either no
  decay (the inverse's Neumann terms grow like binomials) or the strongest decay (e^(-5 T))."""
  for f_val in (-30.0, 30.0):
    args = list(make(3, 1, 17, 1, 32, jnp.float32, n_layers=1))
    proj = args[0]
    proj = proj.at[:, :, 1].set(jnp.broadcast_to(proj[:, :1, 1], proj[:, :, 1].shape) * 3)
    args[0] = proj.at[:, :, 3].set(f_val)
    args[1] = jnp.full_like(args[1], 4.0)
    chunk = KdaConfig(block_v=32, interpret=True, algorithm="chunk")
    o, rows = kda_verify(*args, jnp.int32(0), config=chunk)
    o_np, states = numpy_kda(args, 0)
    assert rel_err(o, o_np) <= 1e-5
    if f_val < 0:
      s, _ = kda_commit(args[-1], args[-2], rows, jnp.array([11], jnp.int32), config=chunk)
      assert rel_err(s[0], states[11]) <= 1e-5


def test_kda_configs_lower_for_cuda():
  """Non-default configs (8 warps, chunk with ieee dots, wide V tiles) lower at full shapes (35 stacked layers)
  to Triton calls with the outputs' shapes and dtypes, and each config gives its own kernels (the config reaches
  the lowering)."""
  from tests.cuda_lowering import H200, S, lower_cuda
  h, dk, t, n_layers = 32, 128, 6, 35
  hd = h * dk
  args = (S((1, t, 5, hd), jnp.bfloat16), S((1, t, h), jnp.bfloat16), S((h,), jnp.float32), S((hd,), jnp.float32),
          S((3, hd, 1, W), jnp.bfloat16), S((n_layers, 1, W - 1, 3, hd), jnp.bfloat16),
          S((n_layers, 1, h, dk, dk), jnp.float32), S((), jnp.int32))
  rows = KdaRows(S((n_layers, 1, t, 3, hd), jnp.bfloat16), *(S((n_layers, 1, t, h, dk), jnp.float32),) * 3,
                 S((n_layers, 1, t, h), jnp.float32))
  texts = []
  for cfg in (KdaConfig(block_v=16, num_warps=8), KdaConfig(algorithm="chunk", block_v=64,
              precision="ieee"), KdaConfig(algorithm="chunk", block_v=128, num_warps=8)):
    verify = lambda *a, cfg=cfg: kda_verify(*a, config=cfg)
    commit = lambda s, c, r, n, cfg=cfg: kda_commit(s, c, r, n, config=cfg)
    with jax.sharding.use_abstract_mesh(H200):
      o, out_rows = jax.eval_shape(verify, *args, rows)
      new_state, new_window = jax.eval_shape(commit, args[6], args[5], rows, S((1,), jnp.int32))
    assert (o.shape, o.dtype) == ((1, t, h, dk), jnp.bfloat16)               # R(o), the model's first rounding
    assert [(a.shape, a.dtype) for a in out_rows] == [(r.shape, r.dtype) for r in rows]
    assert (new_state.shape, new_window.shape) == (args[6].shape, args[5].shape)
    texts.append(lower_cuda(verify, *args, rows))
    lower_cuda(verify, *args)                                          # the first layer's: rows allocated
    lower_cuda(commit, args[6], args[5], rows, S((1,), jnp.int32))
  assert len(set(texts)) == len(texts)
