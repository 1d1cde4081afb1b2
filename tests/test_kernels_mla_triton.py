"""pallas_kernels/mla_triton.py (Pallas Triton interpreter on CPU) against the model's own absorbed MLA attention.

Oracles: ling_jax.layers.mla.attend_absorbed (kernels=None: q_lat = q_nope W_uk, the jnp context over every slot
with its mask and softmax, then W_uv) for the attention output, and ling_jax.layers.mla.absorbed_context for the
ctx-only form; the rope queries the oracle gets are the model's rotate_queries of the same unrotated heads the
kernel rotates itself. fp32 (inputs and weights fp32: <= 1e-5) and bf16 (the model in bf16: <= 1e-2).
Shapes: the v2 demo's MLA (models/ling-demo: H = 5, Lr = 128, R = 32, P = Vh = 64) and an odd set (H = 3, Lr = 96,
R = 24, P = 40, Vh = 48: every tile masked); S = 200 slots (not a multiple of the block), tiles BS = 16, splits of
2 blocks (32 slots, NS = 7) so that live lengths 1, 9, 40, 117, 200 end inside a block, inside a split and at the
cache's end; T = 1, 6 and 17 (M = T H = 5, 30, 85 query rows: 1, 2 and 6 row tiles of BM = 16).
Then batch invariance (bitwise in the interpreter), and the CUDA lowering at the demo's and Ling-3.0-flash's MLA
shapes: Triton IR (no plugin needed), and XLA's deviceless GPU compile (the CUDA PJRT plugin of
bench/census_offline.py; skipped without it) of exactly 2 launches.
"""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ling_jax.config import get_preset
from ling_jax.kernel_calls import KernelCalls
from ling_jax.layers.mla import _kv_b, absorbed_context, attend_absorbed, gated_heads, rotate_queries
from pallas_kernels.mla_triton import MlaTritonConfig, mla_triton
from tests.conftest import rel_err
from tests.cuda_lowering import compile_only_h200

BF, F32 = jnp.bfloat16, jnp.float32
DEMO = get_preset("ling-demo-v2")  # the shipped models/ling-demo (v2)
ODD = DEMO.replace(num_attention_heads=3, head_dim=48, kv_lora_rank=96, qk_rope_head_dim=24, qk_nope_head_dim=40,
                   v_head_dim=48)  # rope 24 = head_dim 48 x partial_rotary_factor 0.5
FLASH = get_preset("ling3-flash")
S = 200
KCFG = MlaTritonConfig(block_s=16, split_blocks=2, interpret=True)
TOL = {jnp.dtype(F32): 1e-5, jnp.dtype(BF): 1e-2}
LIVES = (1, 9, 40, 117, 200)  # inside block 0; inside a block of split 1; mid split 3; the whole (partial-block) S


def make(cfg, b, t, lives, dtype, seed=0):
  """(params {kv_b_proj}, unrotated heads [B, T, H, P + R], cache [B, S, Lr + R], positions [B, T]): batch row i's
  T rows end at lives[i] - 1 (the cache already holds them). Peaked queries (scale 2), as trained heads."""
  H, P, R, Lr, Vh = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank,
                     cfg.v_head_dim)
  k = jax.random.split(jax.random.key(seed), 3)
  heads = (2.0 * jax.random.normal(k[0], (b, t, H, P + R), F32)).astype(dtype)
  cache = jax.random.normal(k[1], (b, S, Lr + R), F32).astype(dtype)
  kv_b = (jax.random.normal(k[2], (H * (P + Vh), Lr), F32) * Lr ** -0.5).astype(dtype)
  positions = jnp.asarray([[live - t + j for j in range(t)] for live in lives], jnp.int32)
  return {"kv_b_proj": kv_b}, heads, cache, positions


def q_lat_of(cfg, p, heads):
  """q_lat = q_nope W_uk [B, T, H, Lr] in the heads' dtype as the GPU's gemm forms it (f32 sums, rounded once)."""
  P = cfg.qk_nope_head_dim
  w_uk = _kv_b(p, cfg, F32)[:, :P]
  return jnp.einsum("bthp,hpl->bthl", heads[..., :P].astype(F32), w_uk).astype(heads.dtype)


def _model(cfg, p, heads, cache, positions, form):
  P = cfg.qk_nope_head_dim
  q_rope = rotate_queries(heads[..., P:], positions, cfg)
  if form == "ctx":
    return absorbed_context(q_lat_of(cfg, p, heads), q_rope, cache, positions, cfg)
  return attend_absorbed(p, heads[..., :P], q_rope, cache, positions, cfg)


def model_out(cfg, p, heads, cache, positions, form="heads"):
  """The model's attention output [B, T, H, Vh] f32 (attend_absorbed, no kernels; form "ctx": absorbed_context's
  [B, T, H, Lr] in the cache dtype). In bf16, one row at a time: B = T = 1 calls on the same cache (row t sees
  slots <= positions[:, t] either way) because XLA's CPU dot of bf16 operands to a bf16 result sums in bf16 once
  it has more than one row: attend_absorbed's q_lat einsum is then ~1% off the fp32 product at T >= 2 (0.17%, its
  rounding, at T = 1); the GPU's sums are f32 at every T."""
  if heads.dtype == F32:
    return _model(cfg, p, heads, cache, positions, form)
  b, t = positions.shape
  rows = [[_model(cfg, p, heads[i:i + 1, j:j + 1], cache[i:i + 1], positions[i:i + 1, j:j + 1], form)
           for j in range(t)] for i in range(b)]
  return jnp.concatenate([jnp.concatenate(r, axis=1) for r in rows], axis=0)


def model_f32(cfg, p, heads, cache, positions, form="heads"):
  """The model in fp32 on the same (bf16) values: what bf16 rounding is measured against."""
  up = lambda a: a.astype(F32)
  return _model(cfg, {"kv_b_proj": up(p["kv_b_proj"])}, up(heads), up(cache), positions, form)


def check(cfg, got, p, heads, cache, positions, form="heads"):
  """fp32: <= 1e-5 of the model. bf16: <= 1e-2 of the model in bf16, and within 5e-3 of the model in fp32 on the
  same values (the kernel's roundings are the model's or finer: it is no further from exact than the bf16 model)."""
  want = model_out(cfg, p, heads, cache, positions, form)
  assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, got.dtype, want.shape, want.dtype)
  err = rel_err(got, want)
  assert err <= TOL[heads.dtype], err
  if heads.dtype != F32:
    exact = model_f32(cfg, p, heads, cache, positions, form)
    assert rel_err(got, exact) <= min(5e-3, rel_err(want, exact) + 1e-3), (rel_err(got, exact), rel_err(want, exact))


def kernel_out(cfg, p, heads, cache, positions, form="heads", config=KCFG, layer=None):
  """The kernel's attention output: form "heads" (the unrotated heads in, q_nope W_uk and the rope rotation in the
  attend prologue: the demo's KernelCalls path), "q_lat" (the model's q_lat and rotated q_rope in: Ling's), or
  "ctx" (the context [B, T, H, Lr] only, no kv_b)."""
  P, Vh, scale = cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.qk_head_dim ** -0.5
  kv_b = _kv_b(p, cfg, heads.dtype)
  if form == "heads":
    return jax.block_until_ready(mla_triton(heads, heads, cache, positions, kv_b, scale=scale, v_head_dim=Vh,
                                            absorb_q=True, rope_theta=cfg.rope_theta, rope_offset=P,
                                            config=config, layer=layer))
  q_lat = q_lat_of(cfg, p, heads)
  q_rope = rotate_queries(heads[..., P:], positions, cfg)
  return jax.block_until_ready(mla_triton(q_lat, q_rope, cache, positions, None if form == "ctx" else kv_b,
                                          scale=scale, v_head_dim=None if form == "ctx" else Vh, config=config,
                                          layer=layer))


CASES = [(t, live) for t in (1, 6, 17) for live in LIVES if live >= t]


@pytest.mark.parametrize("dtype", [F32, BF], ids=["f32", "bf16"])
@pytest.mark.parametrize("t,live", CASES)
def test_matches_attend_absorbed(t, live, dtype):
  p, heads, cache, positions = make(DEMO, 1, t, [live], dtype, seed=t * 1000 + live)
  got = kernel_out(DEMO, p, heads, cache, positions)
  assert got.shape == (1, t, 5, 64) and got.dtype == F32
  check(DEMO, got, p, heads, cache, positions)


@pytest.mark.parametrize("dtype", [F32, BF], ids=["f32", "bf16"])
@pytest.mark.parametrize("form", ["heads", "q_lat", "ctx"])
@pytest.mark.parametrize("t", [1, 6, 17])
def test_odd_widths_and_every_form(t, form, dtype):
  """H = 3, Lr = 96, R = 24, P = 40, Vh = 48 (masked columns in every tile), two batch rows of different live
  lengths (one mid block, one at the cache's end); the three operand forms."""
  p, heads, cache, positions = make(ODD, 2, t, [45, 200], dtype, seed=7 * t)
  got = kernel_out(ODD, p, heads, cache, positions, form)
  assert got.dtype == (dtype if form == "ctx" else F32)
  check(ODD, got, p, heads, cache, positions, "ctx" if form == "ctx" else "heads")


@pytest.mark.parametrize("cfg", [DEMO, ODD], ids=["demo", "odd"])
@pytest.mark.parametrize("t", [1, 6])
def test_head_gate_in_the_combine(t, cfg):
  """The block's head gate applied in the combine (gate [B, T, H] f32, out_dtype bf16): bitwise
  layers.mla.gated_heads of the ungated kernel output (the same f32 multiply and one rounding), two batch rows, and
  so within the bf16 model's error of the model's gated heads."""
  p, heads, cache, positions = make(cfg, 2, t, [45, 200], BF, seed=19 + t)
  gate = jax.nn.sigmoid(jax.random.normal(jax.random.key(23), positions.shape + (cfg.num_attention_heads,), F32))
  P, Vh, scale = cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.qk_head_dim ** -0.5
  kv_b = _kv_b(p, cfg, BF)
  got = jax.block_until_ready(mla_triton(heads, heads, cache, positions, kv_b, gate, scale=scale, v_head_dim=Vh,
                                         absorb_q=True, rope_theta=cfg.rope_theta, rope_offset=P, config=KCFG,
                                         out_dtype=BF))
  ungated = kernel_out(cfg, p, heads, cache, positions)
  assert got.dtype == BF and got.shape == ungated.shape
  np.testing.assert_array_equal(np.asarray(got, F32), np.asarray(gated_heads(ungated, gate, BF), F32))
  want = gated_heads(model_out(cfg, p, heads, cache, positions), gate, BF)
  assert rel_err(got, want) <= 1e-2
  with pytest.raises(ValueError, match="gate"):
    mla_triton(heads, heads, cache, positions, kv_b, gate[:, :, :1], scale=scale, v_head_dim=Vh, absorb_q=True,
               rope_theta=cfg.rope_theta, rope_offset=P, config=KCFG)


def test_causal_inside_the_verify_rows():
  """The T = 6 rows see different prefixes: row 0 with row 5's visibility gives another answer, so the mask is
  what the match above tests (the kernel's row 0 is the model's row 0, not the wide one)."""
  p, heads, cache, positions = make(DEMO, 1, 6, [117], BF, seed=5)
  P = DEMO.qk_nope_head_dim
  cache = cache.at[0, 112:117, :DEMO.kv_lora_rank].set(  # the later rows align with row 0's head-0 query
      0.5 * jnp.einsum("p,pl->l", heads[0, 0, 0, :P], _kv_b(p, DEMO, BF)[0, :P]).astype(BF))
  got = kernel_out(DEMO, p, heads, cache, positions)
  check(DEMO, got, p, heads, cache, positions)
  wide = model_out(DEMO, p, heads, cache, jnp.full_like(positions, 116))
  assert rel_err(wide[:, 0], got[:, 0]) > 0.3


@pytest.mark.parametrize("form", ["heads", "ctx"])
def test_slots_past_the_live_prefix_are_never_read(form):
  """NaN in every slot past the live length, the rest of the last live block included (slots 117..127 of block
  7) and in the blocks and splits past it: the result is bitwise the clean cache's, and it is the model's."""
  p, heads, cache, positions = make(DEMO, 1, 6, [117], BF, seed=11)
  clean = kernel_out(DEMO, p, heads, cache, positions, form)
  poisoned = kernel_out(DEMO, p, heads, cache.at[:, 117:].set(jnp.nan), positions, form)
  np.testing.assert_array_equal(np.asarray(poisoned, F32), np.asarray(clean, F32))
  garbage = kernel_out(DEMO, p, heads, cache.at[:, 117:].set(1e4), positions, form)  # finite: a stale row
  np.testing.assert_array_equal(np.asarray(garbage, F32), np.asarray(clean, F32))
  check(DEMO, clean, p, heads, cache, positions, form)


def test_stacked_cache_read_in_place_at_its_layer():
  """The model's stacked [L, B, S, F] cache read at `layer`: bitwise the unstacked call, the other layer's NaN
  rows untouched."""
  p, heads, cache, positions = make(DEMO, 2, 6, [40, 117], BF, seed=13)
  stacked = jnp.stack([jnp.full_like(cache, jnp.nan), cache, jnp.full_like(cache, jnp.nan)])
  got = kernel_out(DEMO, p, heads, stacked, positions, layer=1)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(kernel_out(DEMO, p, heads, cache, positions)))


@pytest.mark.parametrize("form", ["heads", "q_lat"])
def test_row_zero_is_batch_invariant(form):
  """Batch row 0, verify row 0 (live 117 at T = 6, so position 111): bitwise the same whether it is computed alone
  (T = 1 at position 111: live 112, a different set of live blocks and splits), among 6 verify rows, or beside a
  second batch row of another length (B = 2)."""
  p, heads, cache, positions = make(DEMO, 2, 6, [117, 200], BF, seed=17)
  b2 = kernel_out(DEMO, p, heads, cache, positions, form)
  b1 = kernel_out(DEMO, p, heads[:1], cache[:1], positions[:1], form)
  t1 = kernel_out(DEMO, p, heads[:1, :1], cache[:1], positions[:1, :1], form)
  for other in (b1, t1):
    np.testing.assert_array_equal(np.asarray(other[0, 0]), np.asarray(b2[0, 0]))
  np.testing.assert_array_equal(np.asarray(b1[0]), np.asarray(b2[0]))   # all 6 rows: B = 1 vs B = 2
  check(DEMO, b2, p, heads, cache, positions)


def test_kernel_calls_route():
  """KernelCalls.mla_attention: off by default (None: the layer goes on to mla_context / jnp); on, the demo's
  W_uk (80 KiB) is absorbed in the kernel from the heads (q_lat unused: NaN here), Ling's 4 MiB is not (q_lat
  read); at its own tiles (BS 64, splits of 4 blocks) with S = 600: 3 splits."""
  p, heads, cache, positions = make(DEMO, 1, 6, [117], BF, seed=19)
  big = jnp.concatenate([cache, jax.random.normal(jax.random.key(1), (1, 400, cache.shape[-1]), BF)], axis=1)
  P = DEMO.qk_nope_head_dim
  kv_b = _kv_b(p, DEMO, BF)
  q_rope = rotate_queries(heads[..., P:], positions, DEMO)
  q_lat = jnp.full(heads.shape[:3] + (DEMO.kv_lora_rank,), jnp.nan, BF)
  kw = dict(v_head_dim=DEMO.v_head_dim, scale=DEMO.qk_head_dim ** -0.5, rope_theta=DEMO.rope_theta)
  assert KernelCalls(interpret=True).mla_attention(q_lat, q_rope, big, positions, kv_b, q_heads=heads, **kw) is None
  calls = KernelCalls(interpret=True, mla_triton=True)
  for live in (117, 589):
    pos = positions + (live - 117)
    got = jax.block_until_ready(calls.mla_attention(q_lat, rotate_queries(heads[..., P:], pos, DEMO), big, pos,
                                                    kv_b, q_heads=heads, **kw))
    check(DEMO, got, p, heads, big, pos)
  assert calls._mla_triton_config(q_lat, q_rope, big, kv_b).split == 256
  # Ling's dims: the layer's q_lat is the kernel's query (NaN there would be NaN out); its tiles BS 64, 4 blocks, 2
  # pipeline stages (the demo's: 3)
  flash_kv_b = jnp.zeros((FLASH.num_attention_heads, FLASH.qk_nope_head_dim + FLASH.v_head_dim,
                          FLASH.kv_lora_rank), BF)
  q_lat_f = jnp.zeros((1, 1, FLASH.num_attention_heads, FLASH.kv_lora_rank), BF)
  cfg_f = calls._mla_triton_config(q_lat_f, q_lat_f, q_lat_f, flash_kv_b)
  assert (cfg_f.block_s, cfg_f.split_blocks, cfg_f.num_stages) == (64, 4, 2)
  assert calls._mla_triton_config(q_lat, q_rope, big, kv_b).num_stages == 3


@pytest.mark.parametrize("tp", [2, 4])
def test_sharded_over_heads_matches_the_model(tp):
  """compile.sharding.ShardedKernelCalls.mla_attention on tp simulated devices: the heads (queries, kv_b_proj,
  output) split over "tp", the stacked cache and positions replicated; each device absorbs and attends its own
  heads (fp32: <= 1e-5 of the model), the W_uk choice the base's on the device's heads; and the q_lat form."""
  from compile.mesh import make_mesh
  from compile.sharding import ShardedKernelCalls

  cfg = DEMO.replace(num_attention_heads=4)
  p, heads, cache, positions = make(cfg, 1, 6, [117], F32, seed=23)
  P = cfg.qk_nope_head_dim
  kv_b = _kv_b(p, cfg, F32)
  q_rope = rotate_queries(heads[..., P:], positions, cfg)
  stacked = jnp.stack([jnp.full_like(cache, jnp.nan), cache])
  calls = ShardedKernelCalls(interpret=True, mesh=make_mesh(tp), mla_triton=True)
  kw = dict(v_head_dim=cfg.v_head_dim, scale=cfg.qk_head_dim ** -0.5, layer=1, rope_theta=cfg.rope_theta)
  from_heads = jax.jit(lambda ql, qr, c, pos, w, h: calls.mla_attention(ql, qr, c, pos, w, q_heads=h, **kw))
  from_q_lat = jax.jit(lambda ql, qr, c, pos, w: calls.mla_attention(ql, qr, c, pos, w, **kw))
  q_lat = q_lat_of(cfg, p, heads)
  for got in (from_heads(jnp.full_like(q_lat, jnp.nan), q_rope, stacked, positions, kv_b, heads),
              from_q_lat(q_lat, q_rope, stacked, positions, kv_b)):
    check(cfg, jax.block_until_ready(got), p, heads, cache, positions)


def test_errors():
  p, heads, cache, positions = make(DEMO, 1, 1, [9], BF)
  kv_b = _kv_b(p, DEMO, BF)
  with pytest.raises(ValueError, match="block_s=48"):
    MlaTritonConfig(block_s=48)
  with pytest.raises(ValueError, match="absorb_q needs kv_b"):
    mla_triton(heads, heads, cache, positions, None, scale=1.0, absorb_q=True, config=KCFG)
  with pytest.raises(ValueError, match="layer=2"):
    mla_triton(heads, heads, cache, positions, kv_b, scale=1.0, v_head_dim=64, absorb_q=True, layer=2,
               config=KCFG)
  with pytest.raises(ValueError, match="kv_b"):
    mla_triton(heads, heads, cache, positions, kv_b[:4], scale=1.0, v_head_dim=64, absorb_q=True, config=KCFG)


# -- CUDA lowering (an H200 target, nothing runs) ------------------------------------------------------------------

SD = jax.ShapeDtypeStruct
MAX_LEN = 8192
SHAPES = {  # name: (H, P, R, Lr, Vh, absorb in the kernel): KernelCalls.mla_attention's choice at each
    "demo": (5, 64, 32, 128, 64, True),
    "ling-flash": (32, 128, 64, 512, 128, False),
    "odd": (3, 40, 24, 96, 48, True),  # every tile masked, spans past their dims (traced starts)
}


def _abstract_call(name, t):
  """(f, abstract args) of KernelCalls(mla_triton=True).mla_attention at the shapes: the model's call, with its
  stacked cache [2 MLA layers, B = 1, S = 8192, Lr + R] read at layer 1."""
  H, P, R, Lr, Vh, _ = SHAPES[name]
  calls = KernelCalls(mla_triton=True)

  def f(q_lat, q_rope, cache, positions, kv_b, heads):
    return calls.mla_attention(q_lat, q_rope, cache, positions, kv_b, v_head_dim=Vh, scale=(P + R) ** -0.5,
                               layer=1, q_heads=heads, rope_theta=6e6)

  args = (SD((1, t, H, Lr), BF), SD((1, t, H, R), BF), SD((2, 1, MAX_LEN, Lr + R), BF), SD((1, t), jnp.int32),
          SD((H, P + Vh, Lr), BF), SD((1, t, H, P + R), BF))
  return f, args


@pytest.mark.parametrize("t", [1, 6, 17])
@pytest.mark.parametrize("name", list(SHAPES))
def test_lowers_for_cuda_as_two_triton_calls(name, t):
  """Pallas -> Triton IR for CUDA at the demo's and Ling-3.0-flash's MLA shapes: two Triton custom calls (attend
  + combine) and, around them, only free reshapes (no XLA compute: no slice, concatenate, convert, dot)."""
  from tests.cuda_lowering import lower_cuda

  f, args = _abstract_call(name, t)
  text = lower_cuda(f, *args)
  assert text.count("__gpu$xla.gpu.triton") == 2, text.count("__gpu$xla.gpu.triton")
  assert 'name = "mla_triton_attend"' in text and 'name = "mla_triton_combine"' in text
  ops = set(re.findall(r"= (stablehlo\.\w+|\"stablehlo\.\w+\")", text))
  assert ops <= {"stablehlo.custom_call", "stablehlo.reshape"}, ops


@pytest.mark.parametrize("t", [1, 6, 17])
@pytest.mark.parametrize("name", list(SHAPES))
def test_compiles_for_h200_to_exactly_two_launches(name, t):
  """XLA's GPU compiler (deviceless, H200 target) on the call: the optimized program launches 2 kernels, the two
  Triton programs, nothing else (bench/hlo_census.py counts launches as the offline step census does)."""
  from jax.sharding import SingleDeviceSharding

  from bench.hlo_census import count_launches

  device = compile_only_h200()
  f, args = _abstract_call(name, t)
  sharded = [SD(a.shape, a.dtype, sharding=SingleDeviceSharding(device)) for a in args]
  with jax.default_device(device):
    compiled = jax.jit(f).trace(*sharded).lower().compile()
  census = count_launches(compiled.as_text())
  kinds = sorted(k for k, n in census.by_kind.items() for _ in range(n))
  assert census.total == 2, kinds
  assert kinds == ["custom:__gpu$xla.gpu.triton:mla_triton_attend", "custom:__gpu$xla.gpu.triton:mla_triton_combine"]
