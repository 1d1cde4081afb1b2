"""Live-prefix MLA attention (pallas_kernels/mla_attention.py): the Mosaic GPU interpreter on CPU vs the
model's own `ling_jax.layers.mla.attend_absorbed`, and the CUDA lowering at full Ling-3.0-flash shapes.

attend_absorbed returns W_uv(ctx) from q_nope; the kernel returns ctx from q_lat = q_nope W_uk. The oracle
is attend_absorbed itself, unmodified, with kv_b_proj = [I; I] per head (qk_nope_head_dim = v_head_dim =
kv_lora_rank): then q_lat = q_nope and the output is ctx exactly, with the model's own scores, mask,
softmax and bf16 rounding points. Two oracles: the model in bf16 (<= 1e-2) and the model in fp32 (inputs
upcast; the kernel must be at least as close to it as the bf16 model is, and <= 5e-3).
Shapes: ling-demo v2's H = 5, Lr = 128, R = 32; S = 256; tiles BS = 32 (one case 64), splits of 2 blocks
(NS = 4), ctx columns in 2 chunks of 64. Lengths: inside one block, at a block (and split) boundary,
mid-cache with T = 6 causal verify rows, T = 17 (two row tiles), B = 2 with different lengths.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ling_jax.config import get_preset
from ling_jax.layers.mla import attend_absorbed
from pallas_kernels.mla_attention import MlaAttentionConfig, mla_attention
from tests.cuda_lowering import H200

BF, F32 = jnp.bfloat16, jnp.float32
DEMO = get_preset("ling-demo-v2")  # the shipped models/ling-demo (v2): H = 5
LR, R, H, S = DEMO.kv_lora_rank, DEMO.qk_rope_head_dim, DEMO.num_attention_heads, 256
CFG_ID = dataclasses.replace(DEMO, qk_nope_head_dim=LR, v_head_dim=LR)      # W_uk = W_uv = I
SCALE = CFG_ID.qk_head_dim ** -0.5
KCFG = MlaAttentionConfig(block_s=32, split_blocks=2, block_l=64, combine_block_l=64, interpret=True)


def interpreted(*args, **kw):
  """The kernel in the Mosaic GPU interpreter, finished before the caller goes on: the interpreter runs its
  barriers and SMEM as host callbacks, and an eager jnp op dispatched while they still run can deadlock with them
  on CPU (seen in the full suite: the reference's einsum and a callback's _deallocate_barrier both waiting)."""
  return jax.block_until_ready(mla_attention(*args, **kw))


def identity_params(dtype):
  eye = jnp.eye(LR, dtype=dtype)
  return {"kv_b_proj": jnp.tile(jnp.concatenate([eye, eye])[None], (H, 1, 1)).reshape(H * 2 * LR, LR)}


def model_ctx(q_lat, q_rope, cache, positions, dtype=BF):
  cast = lambda a: a.astype(dtype)
  return attend_absorbed(identity_params(dtype), cast(q_lat), cast(q_rope), cast(cache), positions, CFG_ID)


def make(seed, b, t, q_scale=2.0):
  k = jax.random.split(jax.random.key(seed), 3)
  q_lat = (jax.random.normal(k[0], (b, t, H, LR), F32) * q_scale).astype(BF)   # peaked, as trained heads
  q_rope = (jax.random.normal(k[1], (b, t, H, R), F32) * q_scale).astype(BF)
  cache = jax.random.normal(k[2], (b, S, LR + R), F32).astype(BF)
  return q_lat, q_rope, cache


def rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


CASES = {  # name: (batch, query positions [B, T])
    "len<block": (1, [[19]]),
    "len=block=split": (1, [[63]]),
    "mid T=6 causal": (1, [list(range(150, 156))]),
    "T=17 two row tiles": (1, [list(range(90, 107))]),
    "B=2 lengths differ": (2, [[10, 11, 12], [200, 201, 202]]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_matches_attend_absorbed(name):
  b, pos = CASES[name]
  positions = jnp.array(pos, jnp.int32)
  q_lat, q_rope, cache = make(len(name), b, positions.shape[1])
  if name == "mid T=6 causal":   # slots 151..155 align with row 0's head-0 query: it would attend them
    cache = cache.at[0, 151:156, :LR].set(q_lat[0, 0, 0] * 0.5)
  ctx = interpreted(q_lat, q_rope, cache, positions, scale=SCALE, config=KCFG)
  assert ctx.shape == q_lat.shape and ctx.dtype == BF
  ref16, ref32 = model_ctx(q_lat, q_rope, cache, positions), model_ctx(q_lat, q_rope, cache, positions, F32)
  err16, err32 = rel(ctx, ref16), rel(ctx, ref32)
  assert err16 <= 1e-2, err16
  assert err32 <= min(5e-3, rel(ref16, ref32)), (err32, rel(ref16, ref32))
  if name == "mid T=6 causal":   # causality bites: row 0 with row 5's visibility differs
    wide = model_ctx(q_lat, q_rope, cache, jnp.full_like(positions, 155))
    assert rel(wide[:, 0], ref16[:, 0]) > 0.3


def test_block_of_64_slots():
  """The default block size (P tile [64, 64], 128 B swizzle), one block per split: NS = 4, live 156."""
  cfg = dataclasses.replace(KCFG, block_s=64, split_blocks=1)
  positions = jnp.array([list(range(150, 156))], jnp.int32)
  q_lat, q_rope, cache = make(17, 1, 6)
  ctx = interpreted(q_lat, q_rope, cache, positions, scale=SCALE, config=cfg)
  assert rel(ctx, model_ctx(q_lat, q_rope, cache, positions)) <= 1e-2


def test_reads_only_the_live_blocks():
  """NaN in every block past the live prefix changes nothing: those blocks are never loaded."""
  positions = jnp.array([[40, 41]], jnp.int32)                   # live 42: blocks 0, 1 (slots 0..63)
  q_lat, q_rope, cache = make(11, 1, 2)
  clean = interpreted(q_lat, q_rope, cache, positions, scale=SCALE, config=KCFG)
  poisoned = cache.at[:, 64:].set(jnp.nan)
  ctx = interpreted(q_lat, q_rope, poisoned, positions, scale=SCALE, config=KCFG)
  np.testing.assert_array_equal(np.asarray(ctx, F32), np.asarray(clean, F32))
  assert rel(clean, model_ctx(q_lat, q_rope, cache, positions)) <= 1e-2


def test_batch_invariant():
  """A row's ctx is bit-identical whatever T (verify rows vs one decode row) and whatever the other batch
  rows are (their lengths change the live blocks)."""
  positions = jnp.array([list(range(100, 106)), list(range(30, 36))], jnp.int32)
  q_lat, q_rope, cache = make(13, 2, 6)
  ctx = interpreted(q_lat, q_rope, cache, positions, scale=SCALE, config=KCFG)
  alone = interpreted(q_lat[1:, 2:3], q_rope[1:, 2:3], cache[1:], positions[1:, 2:3], scale=SCALE,
                        config=KCFG)
  np.testing.assert_array_equal(np.asarray(alone[0, 0], F32), np.asarray(ctx[1, 2], F32))


def test_errors():
  q_lat, q_rope, cache = make(0, 1, 1)
  pos = jnp.array([[3]], jnp.int32)
  with pytest.raises(ValueError, match="block_s=48"):
    MlaAttentionConfig(block_s=48)
  with pytest.raises(ValueError, match="block_l=96"):
    MlaAttentionConfig(block_l=96)
  with pytest.raises(ValueError, match="S=250"):
    mla_attention(q_lat, q_rope, cache[:, :250], pos, scale=SCALE, config=KCFG)
  with pytest.raises(ValueError, match="one 16-bit dtype"):
    mla_attention(q_lat.astype(F32), q_rope, cache, pos, scale=SCALE, config=KCFG)
  with pytest.raises(ValueError, match="shapes"):
    mla_attention(q_lat, q_rope, cache[..., :LR], pos, scale=SCALE, config=KCFG)


SD = jax.ShapeDtypeStruct


@pytest.mark.parametrize("t", [1, 6, 17])
def test_lowers_for_cuda_at_ling_shapes(t):
  """H = 32, Lr = 512, R = 64, S = 8192 + 64: Pallas -> Mosaic GPU -> NVVM (SMEM budget, wgmma shapes)."""
  args = (SD((1, t, 32, 512), BF), SD((1, t, 32, 64), BF), SD((1, 8256, 576), BF), SD((1, t), jnp.int32))
  f = lambda *a: mla_attention(*a, scale=192 ** -0.5)
  with jax.sharding.use_abstract_mesh(H200):
    text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @mosaic_gpu") == 2 and "wgmma" in text     # attend + combine
    if t == 6:   # 4 stages x 64 x 576 x 2 B + the 72 KB query tile: over the SMEM budget
      big = lambda *a: mla_attention(*a, scale=192 ** -0.5, config=MlaAttentionConfig(stages=4, block_s=64))
      with pytest.raises(ValueError, match="shared memory"):
        jax.jit(big).trace(*args).lower(lowering_platforms=("cuda",))
