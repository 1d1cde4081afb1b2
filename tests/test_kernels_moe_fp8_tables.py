"""pallas_kernels/moe_fp8_tables.py (the Triton interpreter on CPU) against the XLA path it replaces,
moe_mosaic_fp8.align (moe_mosaic._align + moe_mosaic_fp8.scale_tables + the pad of x): all five outputs bitwise.

Shapes: small (D = 256, I = 128, E = 16, A = 8: one up / two down scale blocks) and Ling-3.0-flash's (D = 2560,
I = 768, E = 512, A = 8: nI = 6, nD = 20) at T = 1, 6, 17, 32, with and without the shared expert; the MoE configs
KernelCalls runs (moe_fp8_split_k 6, moe_fp8_n_tokens 16 -> 32), the kernel's defaults (split_k 3, 64 columns) and
a split with KPS = 3 down steps per slot (not a power of 2); the launch's own tiles at their defaults and tiny (many
programs, every mask at a tile edge). The routing: each token's A experts distinct (a top-k's), drawn from a pool
of about 1.5 A experts, so tokens share experts (the dedupe), with and without expert 0 (the expert _align gives
the empty slots: their tables gather it, their wc rows stay zero). Then the whole fp8 MoE through KernelCalls with
moe_fp8_tables on and off (its w8a8 form, the one the Mosaic interpreter runs): the same output bit for bit; the
CUDA lowering (Triton IR, one launch, only free reshapes around it) and XLA's deviceless H200 compile (skipped
without the CUDA plugin, scripts/setup_census.sh): the MoE call's launches with and without the kernel.
"""
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ling_jax import quant
from ling_jax.kernel_calls import KernelCalls
from pallas_kernels import moe_fp8_tables as MT
from pallas_kernels.moe_mosaic import MosaicMoeConfig
from pallas_kernels.moe_mosaic_fp8 import Aligned, align, moe_fp8
from tests.cuda_lowering import S, compile_only_h200, lower_cuda

BF, F8, F32 = jnp.bfloat16, jnp.float8_e4m3fn, jnp.float32
A = 8
SMALL = dict(d=256, i=128, e=16)
LING = dict(d=2560, i=768, e=512)   # ../shared/LING3_MODEL.md: hidden 2560, moe_intermediate 768, 512 experts, top-8


def n_tokens(t):
  return 16 if t <= 16 else 32      # KernelCalls' moe_fp8_n_tokens 16 -> 32


def configs(dims, t):
  """(name, MosaicMoeConfig) the MoE runs at these dims: KernelCalls' fp8 default, the kernel's own tiles, and a
  down split with KPS = 3 (Ling: 768 / (2 x 128)); small dims: KPS = 2 and 1."""
  if dims is LING:
    gate = S((LING["e"], LING["i"], LING["d"]), F8)
    return [("kernel_calls", KernelCalls()._fp8_moe_config(t, gate)),
            ("defaults", MosaicMoeConfig()),
            ("kps3", MosaicMoeConfig(n_tokens=n_tokens(t), split_k=2, block_k=64))]
  return [("ks1", MosaicMoeConfig(block_i=128, block_kd=64, split_k=1, n_tokens=n_tokens(t))),
          ("ks2", MosaicMoeConfig(block_i=128, block_kd=64, split_k=2, block_k=64, n_tokens=n_tokens(t)))]


def routing(key, t, e, with_zero):
  """ids [T, A] int32 (each row distinct, rows sharing experts from a pool of ~1.5 A), weights [T, A] f32."""
  k1, k2, k3 = jax.random.split(key, 3)
  pool = jax.random.permutation(k1, e)[:A + A // 2]
  if with_zero:
    pool = pool.at[0].set(0) if not bool(jnp.any(pool == 0)) else pool
  else:
    pool = jnp.where(pool == 0, jax.random.permutation(k1, e)[A + A // 2], pool)
  pick = jnp.argsort(jax.random.uniform(k2, (t, pool.shape[0])), axis=1)[:, :A]
  return pool[pick].astype(jnp.int32), jax.random.uniform(k3, (t, A), F32, 0.05, 1.0)


def scales(key, d, i, e, shared):
  """Distinct random scale values everywhere, so a scale read from the wrong expert, block or step shows."""
  ni, nd = -(-i // 128), -(-d // 128)
  k = jax.random.split(key, 6)
  u = lambda kk, s: jax.random.uniform(kk, s, F32, 1e-3, 1.0)
  routed = (u(k[0], (e, ni, nd)), u(k[1], (e, ni, nd)), u(k[2], (e, nd, ni)))
  return routed, ((u(k[3], (ni, nd)) + 2, u(k[4], (ni, nd)) + 2, u(k[5], (nd, ni)) + 2) if shared else None)


def _interp(cfg):
  """The config for the interpreters (interpret=True; the tables do not depend on where the Mosaic kernels
  keep their converted tiles, so KernelCalls' register operand becomes the SMEM one the interpreter takes)."""
  return dataclasses.replace(cfg, interpret=True, fp8_operand="smem")


def assert_bitwise(got: Aligned, want: Aligned):
  for name, g, w in zip(Aligned._fields, got, want):
    assert g.shape == w.shape and g.dtype == w.dtype, (name, g.shape, g.dtype, w.shape, w.dtype)
    np.testing.assert_array_equal(np.asarray(g).view(np.uint8), np.asarray(w).view(np.uint8), err_msg=name)


def check(x, ids, w, routed, shared_s, cfg, i, tiles=None):
  got = MT.align_tables(x, ids, w, *routed, shared_s, cfg=cfg, i=i, tiles=tiles)
  want = jax.jit(align, static_argnames=("cfg", "i"))(x, ids, w, *routed, shared_s, cfg=cfg, i=i)
  assert_bitwise(got, want)
  return got


@pytest.mark.parametrize("t", [1, 6, 17, 32])
@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("dims", [SMALL, LING], ids=["small", "ling"])
def test_align_tables_equals_xla_align(dims, shared, t):
  d, i, e = dims["d"], dims["i"], dims["e"]
  key = jax.random.key(100 * t + shared + (7 if dims is LING else 0))
  ids, w = routing(key, t, e, with_zero=(t % 2 == 1))
  routed, shared_s = scales(jax.random.fold_in(key, 1), d, i, e, shared)
  x = jax.random.normal(jax.random.fold_in(key, 2), (t, d), F32).astype(BF)
  assert len(np.unique(np.asarray(ids))) < ids.size or t == 1       # tokens share experts
  for name, cfg in configs(dims, t):
    cfg = _interp(cfg)
    got = check(x, ids, w, routed, shared_s, cfg, i)
    n_active = len(np.unique(np.asarray(ids)))
    assert int(got.meta[0]) == n_active, name
    if t == 6 and dims is SMALL:  # tiny tiles: many programs, every slot / position / column tile edge masked
      check(x, ids, w, routed, shared_s, cfg, i, tiles=MT.TablesConfig(block_s=4, block_q=8, block_x=64))


def test_e4m3_x_and_repeated_expert_of_one_token():
  """w8a8's e4m3 x8 is padded bit for bit; a token that repeats an expert (no top-k does): its two weights add
  exactly as XLA's sum adds them (two terms: any order), into one slot."""
  d, i, e, t = SMALL["d"], SMALL["i"], SMALL["e"], 6
  key = jax.random.key(5)
  ids, w = routing(key, t, e, with_zero=True)
  ids = ids.at[2, 3].set(ids[2, 0])
  routed, shared_s = scales(jax.random.fold_in(key, 1), d, i, e, True)
  x8 = quant.quantize_activations(jax.random.normal(jax.random.fold_in(key, 2), (t, d), F32).astype(BF)).x8
  cfg = _interp(MosaicMoeConfig(block_i=128, block_kd=64, split_k=2, n_tokens=16))
  got = check(x8, ids, w, routed, shared_s, cfg, i)
  slot = int(np.searchsorted(np.unique(np.asarray(ids)), int(ids[2, 0])))
  assert float(got.wc[slot, 2]) == float(np.float32(w[2, 0]) + np.float32(w[2, 3]))


def test_errors():
  cfg = _interp(MosaicMoeConfig(block_i=128, block_kd=64, split_k=2, n_tokens=64))
  routed, shared_s = scales(jax.random.key(0), 256, 128, 16, True)
  ids, w = routing(jax.random.key(1), 33, 16, with_zero=True)
  x = jnp.zeros((33, 256), BF)
  with pytest.raises(ValueError, match="T=33 tokens > 32"):
    MT.align_tables(x, ids, w, *routed, shared_s, cfg=cfg, i=128)
  with pytest.raises(ValueError, match=r"shared_s .*expected \[nI, nD\]"):
    MT.align_tables(x[:4], ids[:4], w[:4], *routed, (shared_s[2], shared_s[0], shared_s[1]), cfg=cfg, i=128)
  with pytest.raises(ValueError, match="split_k x block_kd=128"):
    MT.align_tables(x[:4], ids[:4], w[:4], *routed, shared_s, cfg=cfg, i=192)
  with pytest.raises(ValueError, match="must be a power of 2"):
    MT.TablesConfig(block_s=12)
  # moe_fp8 checks the Aligned it is handed against align's shapes
  wq = lambda s: quant.quantize(jnp.ones(s, BF))
  ws = (wq((16, 128, 256)), wq((16, 128, 256)), wq((16, 256, 128)))
  good = MT.align_tables(x[:4], ids[:4], w[:4], *(q.scale_inv for q in ws), None, cfg=cfg, i=128)
  with pytest.raises(ValueError, match="aligned .*expected align's"):
    moe_fp8(x[:4], ids[:4], w[:4], *ws, config=cfg, aligned=good._replace(wc=good.wc[:, :16]))


def test_kernel_calls_moe_fp8_tables_on_equals_off():
  """The whole fp8 MoE through KernelCalls (the Mosaic interpreter runs its w8a8 form), the operands from the
  Triton launch or from XLA: the same output bit for bit; the program holds the launch only when the field is
  on."""
  d, i, e, t = SMALL["d"], SMALL["i"], SMALL["e"], 6
  key = jax.random.key(3)
  ids, w = routing(key, t, e, with_zero=True)
  ids, w = ids[:, :2], w[:, :2]       # fewer slots for the interpreter, tokens still sharing experts
  k = jax.random.split(jax.random.fold_in(key, 1), 7)
  q = lambda kk, s: quant.quantize((jax.random.normal(kk, s, F32) * s[-1] ** -0.5).astype(BF))
  experts = (q(k[0], (e, i, d)), q(k[1], (e, i, d)), q(k[2], (e, d, i)))
  shared = (q(k[3], (i, d)), q(k[4], (i, d)), q(k[5], (d, i)))
  x = jax.random.normal(k[6], (t, d), F32).astype(BF)
  outs = {}
  for on in (False, True):
    calls = KernelCalls(interpret=True, moe_fp8_tables=on)
    f = lambda x, ids, w: calls.moe(x, ids, w, *experts, limit=0.3, shared=shared, shared_limit=0.5,
                                    fp8_activations=True)
    assert ("moe_fp8_tables" in str(jax.make_jaxpr(f)(x, ids, w))) == on
    outs[on] = np.asarray(jax.jit(f)(x, ids, w))
  assert np.isfinite(outs[False]).all() and np.abs(outs[False]).max() > 0
  np.testing.assert_array_equal(outs[True], outs[False])


@pytest.mark.parametrize("t", [1, 6, 17, 32])
def test_lowers_for_cuda_to_one_launch(t):
  """Ling's dims, bf16 and e4m3 x: one Triton launch and only free reshapes around it; KernelCalls' MoE call with
  the field on lowers to it and the two Mosaic kernels."""
  d, e, i = LING["d"], LING["e"], LING["i"]
  cfg = KernelCalls()._fp8_moe_config(t, S((e, i, d), F8))
  sc = (S((e, 6, 20), F32), S((e, 6, 20), F32), S((e, 20, 6), F32))
  sh = (S((6, 20), F32), S((6, 20), F32), S((20, 6), F32))
  for x_dtype in (BF, F8):
    text = lower_cuda(lambda *a: MT.align_tables(*a, cfg=cfg, i=i), S((t, d), x_dtype), S((t, A), jnp.int32),
                      S((t, A), F32), *sc, sh)
    assert text.count("__gpu$xla.gpu.triton") == 1 and 'name = "moe_fp8_tables"' in text
    assert set(re.findall(r"= (stablehlo\.\w+)", text)) <= {"stablehlo.custom_call", "stablehlo.reshape"}
  pair = lambda shape: quant.Fp8Weight(S(shape, F8), S(quant.scale_shape(shape), F32))
  calls = KernelCalls(moe_fp8_tables=True)
  text = lower_cuda(lambda x, ids, w, *ws: calls.moe(x, ids, w, *ws[:3], limit=4.0, shared=ws[3:], shared_limit=5.0),
                    S((t, d), BF), S((t, A), jnp.int32), S((t, A), F32), pair((e, i, d)), pair((e, i, d)),
                    pair((e, d, i)), pair((i, d)), pair((i, d)), pair((d, i)))
  assert text.count("custom_call @mosaic_gpu") == 2 and text.count("__gpu$xla.gpu.triton") == 1


@pytest.mark.parametrize("t", [1, 6, 32])
def test_compiled_moe_call_launches(t):
  """XLA's GPU compiler (deviceless, H200) on KernelCalls' fp8 MoE call at Ling's dims: with the field on, the
  tables launch, the two Mosaic kernels and the split-K sum (4 launches); off, XLA's alignment chain instead
  (10-12 launches: its reduce, concatenate and pad fusions)."""
  from jax.sharding import SingleDeviceSharding

  from bench.hlo_census import count_launches

  device = compile_only_h200()
  d, e, i = LING["d"], LING["e"], LING["i"]
  SD = lambda s, dt: jax.ShapeDtypeStruct(s, dt, sharding=SingleDeviceSharding(device))
  pair = lambda shape: quant.Fp8Weight(SD(shape, F8), SD(quant.scale_shape(shape), F32))
  args = (SD((t, d), BF), SD((t, A), jnp.int32), SD((t, A), F32), pair((e, i, d)), pair((e, i, d)),
          pair((e, d, i)), pair((i, d)), pair((i, d)), pair((d, i)))
  launches = {}
  for on in (False, True):
    calls = KernelCalls(moe_fp8_tables=on)
    f = lambda x, ids, w, *ws: calls.moe(x, ids, w, *ws[:3], limit=4.0, shared=ws[3:], shared_limit=5.0)
    with jax.default_device(device):
      launches[on] = count_launches(jax.jit(f).trace(*args).lower().compile().as_text())
  on = sorted(k for k, n in launches[True].by_kind.items() for _ in range(n))
  assert launches[True].total == 4, on
  assert on.count("custom:mosaic_gpu_v2:") == 2 and "custom:__gpu$xla.gpu.triton:moe_fp8_tables" in on
  assert launches[False].total >= 10, launches[False].by_kind


def test_bench_step_flag():
  """bench_step's (and so census_offline's) --moe-fp8-tables reaches the KernelCalls; --baseline-set takes it."""
  from bench import bench_step
  from compile.sharding import TP, ShardingRules
  from ling_jax.config import get_preset

  ap = bench_step.build_parser()
  a = ap.parse_args(["--preset", "test-tiny", "--moe-fp8-tables", "--skip-plain", "--steps", "1"])
  assert a.moe_fp8_tables and not ap.parse_args(["--preset", "test-tiny"]).moe_fp8_tables
  assert bench_step.parse_baseline_set(ap, a, "moe_fp8_tables=0") == {"moe_fp8_tables": False}
  mesh = jax.make_mesh((1,), (TP,), devices=jax.devices()[:1])
  ((_, _, prog, _),) = bench_step.programs(a, get_preset("test-tiny"), mesh, ShardingRules.tensor_parallel(), "pallas")
  assert prog.opts.kernels.moe_fp8_tables
