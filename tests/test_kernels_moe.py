"""MoE kernel (Pallas Triton, interpret mode on CPU) vs the model's moe_experts (ling_jax.layers.moe, through
tests/kernel_oracles.py); the model's experts and router vs float64 numpy loops.

Shapes are small real shapes: D = 256, I = 64..128, E = 4..64, A = 8, T in {1, 3, 5, 6, 17}.
Tolerance ||out - ref|| / ||ref||: fp32 1e-5, bf16 operands 1e-2.
Paths: the default config (v1: unfused down + XLA combine, XLA align), the combine fused into
the down kernel (`fuse_combine`; `combine_split`, `prefetch`), the one-launch Pallas align
(`device_align`).
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import moe as moe_mod
from pallas_kernels.moe import MoeConfig, moe
from tests.kernel_oracles import moe as moe_model
from tests.kernel_oracles import route as route_model

A = 8
CFG = MoeConfig(block_i=32, block_k=128, block_d=128, block_kd=64, interpret=True)


def rel_err(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def make(seed, t, d, e, i, dtype, ids_mode="random", shared=True):
  k = jax.random.split(jax.random.key(seed), 9)
  x = jax.random.normal(k[0], (t, d), jnp.float32).astype(dtype)
  if ids_mode == "random":        # distinct experts per token, duplicates across tokens
    ids = jnp.argsort(jax.random.uniform(k[1], (t, e)), axis=1)[:, :A]
  elif ids_mode == "same":         # every token on the same 8 experts (segments longer than M)
    ids = jnp.tile(jax.random.permutation(k[1], e)[:A], (t, 1))
  elif ids_mode == "one":          # every pair on one expert: one segment of P rows
    ids = jnp.full((t, A), e // 2)
  else:                            # "dup": repeats inside a token too
    ids = jax.random.randint(k[1], (t, A), 0, e)
  w = jax.random.uniform(k[2], (t, A), jnp.float32, 0.1, 1.0)
  nrm = lambda kk, s, sc: (jax.random.normal(kk, s, jnp.float32) * sc).astype(dtype)
  wg, wu = nrm(k[3], (e, i, d), d ** -0.5), nrm(k[4], (e, i, d), d ** -0.5)
  wd = nrm(k[5], (e, d, i), i ** -0.5)
  sh = (nrm(k[6], (i, d), d ** -0.5), nrm(k[7], (i, d), d ** -0.5), nrm(k[8], (d, i), i ** -0.5)
        ) if shared else None
  return x, ids.astype(jnp.int32), w, wg, wu, wd, sh


CASES = [  # (t, e, i, dtype, ids_mode, shared, limit, tol)
    (1, 16, 64, jnp.float32, "random", False, 0.0, 1e-5),
    (3, 16, 64, jnp.float32, "random", True, 0.3, 1e-5),
    (6, 64, 128, jnp.bfloat16, "random", True, 0.3, 1e-2),
    (17, 32, 64, jnp.bfloat16, "same", True, 0.3, 1e-2),
]


@pytest.mark.parametrize("t,e,i,dtype,ids_mode,shared,limit,tol", CASES)
def test_moe_kernel_matches_model(t, e, i, dtype, ids_mode, shared, limit, tol):
  x, ids, w, wg, wu, wd, sh = make(t * 7 + e, t, 256, e, i, dtype, ids_mode, shared)
  kw = dict(limit=limit, shared=sh, shared_limit=limit)
  out = moe(x, ids, w, wg, wu, wd, config=CFG, **kw)
  ref = moe_model(x, ids, w, wg, wu, wd, **kw)
  assert out.shape == x.shape and out.dtype == x.dtype
  assert np.all(np.isfinite(np.asarray(out, np.float32)))
  assert rel_err(out, ref) <= tol
  if limit > 0:   # the clamps bite at this limit: turning them off changes the result
    unclamped = moe_model(x, ids, w, wg, wu, wd, shared=sh)
    assert rel_err(unclamped, ref) > 10 * tol


def test_model_experts_match_dense_loop():
  """The model's experts against a per-token, per-expert numpy loop (float64); the routed clamp as SGLang deploys it:
  min(silu(g), L) * clip(u, -L, L)."""
  x, ids, w, wg, wu, wd, sh = make(5, 3, 256, 16, 64, jnp.float32)
  L = 0.3
  xs, ws = np.asarray(x, np.float64), [np.asarray(a, np.float64) for a in (wg, wu, wd)]
  silu = lambda z: z / (1 + np.exp(-z))
  out = np.zeros_like(xs)
  for t in range(3):
    for a in range(A):
      e = int(ids[t, a])
      g, u = ws[0][e] @ xs[t], ws[1][e] @ xs[t]
      out[t] += float(w[t, a]) * (ws[2][e] @ (np.minimum(silu(g), L) * np.clip(u, -L, L)))  # limit after SiLU
    sg, su, sd = (np.asarray(s, np.float64) for s in sh)
    out[t] += sd @ (np.minimum(silu(sg @ xs[t]), L) * np.clip(su @ xs[t], -L, L))
  ref = moe_model(x, ids, w, wg, wu, wd, limit=L, shared=sh, shared_limit=L)
  assert rel_err(ref, out) <= 1e-5


def test_model_route_matches_numpy():
  t, d, e, g, kg, k = 5, 64, 64, 8, 4, 8
  ks = jax.random.split(jax.random.key(3), 3)
  x = jax.random.normal(ks[0], (t, d), jnp.bfloat16)
  gate = (jax.random.normal(ks[1], (e, d), jnp.float32) * 0.2).astype(jnp.bfloat16)
  bias = jax.random.normal(ks[2], (e,), jnp.float32) * 0.1
  ids, w = route_model(x, gate, bias, n_group=g, topk_group=kg, top_k=k,
                           routed_scaling_factor=2.5)
  s = 1 / (1 + np.exp(-(np.asarray(x, np.float64) @ np.asarray(gate, np.float64).T)))
  sb = s + np.asarray(bias, np.float64)
  for r in range(t):
    gs = np.sort(sb[r].reshape(g, -1), axis=1)[:, -2:].sum(1)
    kept = np.argsort(-gs)[:kg]
    masked = np.full(e, -np.inf)
    for gi in kept:
      masked[gi * (e // g):(gi + 1) * (e // g)] = sb[r, gi * (e // g):(gi + 1) * (e // g)]
    want = np.argsort(-masked)[:k]
    assert set(np.asarray(ids[r]).tolist()) == set(want.tolist())
    ww = s[r, np.asarray(ids[r])]
    np.testing.assert_allclose(np.asarray(w[r]), ww / ww.sum() * 2.5, rtol=1e-5)


def test_kernel_calls_choice_and_shared_width_fallback():
  """The one kernel-choosing object routes CPU to the jnp model; and where the shared expert's width is not the
  routed width I (the kernels take it only as segments of width I: one, or n chunks of a width n x I), KernelCalls.moe
  by default (moe_shared_segments off) runs the routed experts in the kernel and the shared expert through the
  model's shared_expert, summed in fp32 as the model sums them (the kernels themselves reject a width that is no
  multiple of I)."""
  from ling_jax.kernel_calls import kernel_calls
  assert kernel_calls("auto") is None and kernel_calls("reference") is None   # CPU: the model's jnp
  calls = kernel_calls("interpret")
  assert calls.interpret and not kernel_calls("pallas").interpret
  x, ids, w, wg, wu, wd, _ = make(9, 3, 256, 16, 64, jnp.float32, shared=False)
  *_, sh = make(10, 3, 256, 16, 128, jnp.float32)                             # Is = 128 != I = 64
  kw = dict(limit=0.3, shared=sh, shared_limit=0.4)
  *_, sh96 = make(10, 3, 256, 16, 96, jnp.float32)                           # Is = 96: no multiple of I
  with pytest.raises(ValueError, match="multiple of I"):
    moe(x, ids, w, wg, wu, wd, config=CFG, **{**kw, "shared": sh96})
  out = calls.moe(x, ids, w, wg, wu, wd, **kw)
  assert out.dtype == jnp.float32 and rel_err(out, moe_model(x, ids, w, wg, wu, wd, **kw)) <= 1e-5
  assert rel_err(out, moe_model(x, ids, w, wg, wu, wd, limit=0.3)) > 1e-2      # the shared expert is in


# ----------------------------------------------------------------------------- align, paths


FUSED = dataclasses.replace(CFG, fuse_combine=True)
ALIGN = dataclasses.replace(FUSED, device_align=True)
V1 = dataclasses.replace(CFG, fuse_combine=False, device_align=True)
SPLIT3 = dataclasses.replace(ALIGN, combine_split=3)       # expert ranges [0,1), [1,2), [2,4)
PREFETCH = dataclasses.replace(ALIGN, prefetch=True)


@pytest.mark.parametrize("t,e,ids_mode,has_shared", [(6, 64, "random", False),
                                                     (5, 4, "dup", True)])
def test_align_kernel_matches_xla(t, e, ids_mode, has_shared):
  """The one-launch Pallas align gives exactly XLA's (order, seg, w_sorted), through the
  `_segments` wrapper and with the shared expert's rows and slot appended."""
  _, ids, w, *_ = make(t + e, t, 8, e, 8, jnp.float32, ids_mode, shared=False)
  want = [np.asarray(a) for a in moe_mod._segments_xla(ids, w)]
  p = t * A
  if not has_shared:
    got = moe_mod._segments(ids, w, use_pallas=True, interpret=True)
    for a, b in zip(got, want):
      np.testing.assert_array_equal(np.asarray(a), b)
    return
  order, seg, tok, w_rows = moe_mod._align(ids, w, has_shared=True, interpret=True)
  np.testing.assert_array_equal(order, want[0])
  np.testing.assert_array_equal(seg[:, :p], want[1])
  np.testing.assert_array_equal(seg[:, p], [p, t, 0])
  np.testing.assert_array_equal(tok, np.concatenate([want[0] // A, np.arange(t)]))
  np.testing.assert_array_equal(w_rows, np.concatenate([want[2], np.ones(t)]))


PATH_CASES = [  # (config, t, e, i, dtype, ids_mode, shared, limit, tol)
    (PREFETCH, 17, 32, 64, jnp.bfloat16, "same", True, 0.3, 1e-2),
    (SPLIT3, 5, 4, 64, jnp.float32, "dup", True, 0.3, 1e-5),
    (V1, 3, 16, 64, jnp.float32, "one", False, 0.0, 1e-5),
]


@pytest.mark.parametrize("cfg,t,e,i,dtype,ids_mode,shared,limit,tol", PATH_CASES)
def test_moe_paths_match_model(cfg, t, e, i, dtype, ids_mode, shared, limit, tol):
  x, ids, w, wg, wu, wd, sh = make(t * 5 + e, t, 256, e, i, dtype, ids_mode, shared)
  kw = dict(limit=limit, shared=sh, shared_limit=limit)
  out = moe(x, ids, w, wg, wu, wd, config=cfg, **kw)
  assert out.shape == x.shape and out.dtype == x.dtype
  assert rel_err(out, moe_model(x, ids, w, wg, wu, wd, **kw)) <= tol


def test_fused_combine_batch_invariant():
  """fp32 interpret: each token's output is bitwise the same alone (T=1) as in a batch of 6
  (fused combine, XLA align)."""
  x, ids, w, wg, wu, wd, sh = make(11, 6, 256, 16, 64, jnp.float32, "random", True)
  kw = dict(limit=0.3, shared=sh, shared_limit=0.3, config=FUSED)
  batch = np.asarray(moe(x, ids, w, wg, wu, wd, **kw))
  assert rel_err(batch, moe_model(x, ids, w, wg, wu, wd, limit=0.3, shared=sh, shared_limit=0.3)) <= 1e-5
  for t in range(6):
    alone = np.asarray(moe(x[t:t + 1], ids[t:t + 1], w[t:t + 1], wg, wu, wd, **kw))
    np.testing.assert_array_equal(alone[0], batch[t])


# ----------------------------------------------------------------------------- CUDA lowering

_S = jax.ShapeDtypeStruct


def _lower_moe_cuda(t, cfg):
  from jax.sharding import AbstractDevice, AbstractMesh
  h200 = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(
      device_kind="NVIDIA H200", num_cores=132, platform="cuda"))
  d, e, i, bf = 2560, 512, 768, jnp.bfloat16
  args = (_S((t, d), bf), _S((t, A), jnp.int32), _S((t, A), jnp.float32), _S((e, i, d), bf),
          _S((e, i, d), bf), _S((e, d, i), bf), _S((i, d), bf), _S((i, d), bf), _S((d, i), bf))
  f = lambda *a: moe(*a[:6], limit=4.0, shared=a[6:], shared_limit=5.0, config=cfg)
  with jax.sharding.use_abstract_mesh(h200):
    return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("t", [1, 17])
def test_moe_paths_lower_for_cuda(t):
  """Full Ling-3.0-flash shapes. Pallas align + fused combine: the whole MoE is 3 kernels
  (align, up, down+combine) and nothing else but reshapes; XLA align: 2 Triton kernels."""
  text = _lower_moe_cuda(t, MoeConfig(device_align=True, fuse_combine=True))
  assert text.count("__gpu$xla.gpu.triton") == 3
  for op in ("stablehlo.sort", "stablehlo.gather", "stablehlo.scatter", "stablehlo.reduce",
             "stablehlo.concatenate"):
    assert op not in text, op
  assert _lower_moe_cuda(t, MoeConfig()).count("__gpu$xla.gpu.triton") == 2
  assert _lower_moe_cuda(t, MoeConfig(fuse_combine=True)).count("__gpu$xla.gpu.triton") == 2
  for cfg in (MoeConfig(device_align=True, fuse_combine=True, combine_split=4),
              MoeConfig(device_align=True, fuse_combine=True, prefetch=True, block_kd=256)):
    assert _lower_moe_cuda(t, cfg).count("__gpu$xla.gpu.triton") == 3
