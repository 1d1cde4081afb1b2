"""KDA verify/commit kernels (Pallas Triton, interpret mode on CPU) vs the MODEL's jnp (ling_jax/layers/kda.py:
kda_inputs + kda_recurrent, kda_replay + slide_window; through tests/kernel_oracles.py), and the model vs a float64
numpy loop written from the math (ling_jax/layers/kda.py docstring). The kernels read the model's layouts in place
(the fused projection [B, T, 5, C], the whole conv weight, the stacked states at a layer): checks outputs, the rows
each verify writes into the stack (and leaves the other layers' alone), AND the committed states and conv windows
of every layer for several n_accept, in fp32 and bf16 (the kernels round where the model does: conv output,
l2-normed q and k); the folded output epilogue (o_norm given) vs the model's kda_output_gate on its verify output,
at the demo's and Ling's head dims; CUDA lowering of non-default configs and of the epilogue."""
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
  """(proj [B, T, 5, C] (q, k, v, f, and the out-gate stream only the folded epilogue reads), b_raw, A_log, dt_bias,
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


CASES = [  # (b, t, h, dk, dtype, block_v, n_accepts, stacked layers)
    (1, 17, 2, 32, jnp.bfloat16, 32, ([17], [9]), 1),
    (1, 9, 1, 32, jnp.bfloat16, 16, ([9], [5]), 1),
    (2, 1, 2, 32, jnp.bfloat16, 16, ([1, 1], [0, 1]), 1),   # plain decode, a padded row (n = 0)
    (1, 6, 2, 32, jnp.float32, 16, ([6], [2]), 2),           # NEXTN5's verify, two layers stacked
]


@pytest.mark.parametrize("b,t,h,dk,dtype,block_v,n_accepts,n_layers", CASES)
def test_kda_kernels_match_model(b, t, h, dk, dtype, block_v, n_accepts, n_layers):
  args = make(t * 11 + b, b, t, h, dk, dtype, n_layers)
  cfg = KdaConfig(block_v=block_v, interpret=True)
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


EPILOGUE_CASES = [  # (t, h, dk, dtype, tol): the demo's heads (5 x 64) and Ling's head width (128)
    (1, 5, 64, jnp.bfloat16, 4e-3),
    (6, 5, 64, jnp.float32, 1e-5),
    (6, 2, 128, jnp.bfloat16, 4e-3),
    (1, 2, 128, jnp.float32, 1e-5),
]


@pytest.mark.parametrize("t,h,dk,dtype,tol", EPILOGUE_CASES)
def test_verify_epilogue_matches_model_output_gate(t, h, dk, dtype, tol):
  """With o_norm the verify kernel writes the model's kda_output_gate (RMSNorm over V, o_norm, sigmoid of proj's
  stream 4) of its verify output, [B, T, H*V] in the activation dtype, for two stacked layers (the second call
  aliases the first's rows, after the extra o_norm operand); its rows equal the tiled kernel's (no epilogue)
  bitwise; fp32 <= 1e-5, bf16 <= 4e-3 (about one rounding of the output; the interpreter gives 0)."""
  args = make(100 + t + dk, 1, t, h, dk, dtype, n_layers=2)
  o_norm = (1 + 0.3 * jax.random.normal(jax.random.key(dk), (dk,), jnp.float32)).astype(dtype)
  kw = dict(o_norm=o_norm, eps=1e-6)
  outs, rows = verify_layers(lambda *a: kda_verify(*a, config=KdaConfig(block_v=16, interpret=True), **kw), args)
  outs_ref, rows_ref = verify_layers(lambda *a: model.kda_verify(*a, **kw), args)
  _, rows_tiled = verify_layers(lambda *a: kda_verify(*a, config=KdaConfig(block_v=16, interpret=True)), args)
  for o, o_ref in zip(outs, outs_ref):
    assert (o.shape, o.dtype) == ((1, t, h * dk), dtype)
    assert rel_err(o, o_ref) <= tol, rel_err(o, o_ref)
  for got, want, tiled in zip(rows, rows_ref, rows_tiled):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(tiled))
    assert rel_err(got, want) <= 1e-5
  # the gate and o_norm are visible at this tolerance (an epilogue that dropped either would fail above)
  ref = outs_ref[1].astype(jnp.float32)
  for dropped in (ref / jax.nn.sigmoid(args[0][:, :, 4].astype(jnp.float32)),
                  ref / jnp.tile(o_norm.astype(jnp.float32), h)):
    assert rel_err(dropped, ref) > 10 * tol


@pytest.mark.parametrize("epilogue", [False, True])
def test_verify_chunks_do_not_change_the_result(epilogue):
  """KdaConfig.chunk_rows bounds the rows live in registers (DSpark's 17 verify rows as 6 + 6 + 5); the outputs
  and rows are bitwise those of one chunk of all 17 (and of chunks of 4 and 1: chunk edges inside and at the conv
  window), and match the model (the independent check is test_kda_kernels_match_model at T = 17)."""
  args = make(23, 1, 17, 2, 32, jnp.bfloat16, n_layers=2)
  kw = dict(o_norm=jnp.linspace(0.5, 1.5, 32).astype(jnp.bfloat16), eps=1e-6) if epilogue else {}
  run = lambda n: verify_layers(lambda *a: kda_verify(*a, config=KdaConfig(block_v=16, chunk_rows=n,
                                                                           interpret=True), **kw), args)
  want_o, want_rows = run(17)
  for n in (6, 4, 1):
    outs, rows = run(n)
    for got, want in zip(list(outs) + list(rows), list(want_o) + list(want_rows)):
      np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  outs_ref, _ = verify_layers(lambda *a: model.kda_verify(*a, **kw), args)
  assert rel_err(want_o[1], outs_ref[1]) <= (4e-3 if epilogue else 1e-5)


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


def test_kda_configs_lower_for_cuda():
  """Non-default configs (8 warps, wide V tiles) and the folded epilogue (one program per head of 128, the default
  Dv / 32 = 4 warps and 8) lower at full shapes (35 stacked layers) to Triton calls with the outputs' shapes and dtypes, and each
  config gives its own kernels (the config reaches the lowering)."""
  from tests.cuda_lowering import H200, S, lower_cuda
  h, dk, t, n_layers = 32, 128, 6, 35
  hd = h * dk
  args = (S((1, t, 5, hd), jnp.bfloat16), S((1, t, h), jnp.bfloat16), S((h,), jnp.float32), S((hd,), jnp.float32),
          S((3, hd, 1, W), jnp.bfloat16), S((n_layers, 1, W - 1, 3, hd), jnp.bfloat16),
          S((n_layers, 1, h, dk, dk), jnp.float32), S((), jnp.int32))
  rows = KdaRows(S((n_layers, 1, t, 3, hd), jnp.bfloat16), *(S((n_layers, 1, t, h, dk), jnp.float32),) * 3,
                 S((n_layers, 1, t, h), jnp.float32))
  texts = []
  o_norm = S((dk,), jnp.bfloat16)
  for cfg, epilogue in ((KdaConfig(block_v=16, num_warps=8), False), (KdaConfig(block_v=64), False),
                        (KdaConfig(), True), (KdaConfig(epilogue_num_warps=8), True)):
    verify = lambda w, *a, cfg=cfg, ep=epilogue: kda_verify(*a, config=cfg, o_norm=w if ep else None)
    commit = lambda s, c, r, n, cfg=cfg: kda_commit(s, c, r, n, config=cfg)
    with jax.sharding.use_abstract_mesh(H200):
      o, out_rows = jax.eval_shape(verify, o_norm, *args, rows)
      new_state, new_window = jax.eval_shape(commit, args[6], args[5], rows, S((1,), jnp.int32))
    want = (1, t, h * dk) if epilogue else (1, t, h, dk)                  # the gated rows, or R(o)
    assert (o.shape, o.dtype) == (want, jnp.bfloat16)
    assert [(a.shape, a.dtype) for a in out_rows] == [(r.shape, r.dtype) for r in rows]
    assert (new_state.shape, new_window.shape) == (args[6].shape, args[5].shape)
    texts.append(lower_cuda(verify, o_norm, *args, rows))
    lower_cuda(verify, o_norm, *args)                                  # the first layer's: rows allocated
    lower_cuda(commit, args[6], args[5], rows, S((1,), jnp.int32))
  assert len(set(texts)) == len(texts)
