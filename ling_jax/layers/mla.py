"""Gated multi-head latent attention (MLA) over a latent cache.

Shape legend: B batch, T new positions, S cache slots, H heads, P = qk_nope dim, R = rope dim,
Vh = v head dim, Lr = kv_lora_rank. Cache row = [latent (Lr) | rotated k_rope (R)] = 576 values at full size.

    q = q_proj(x) -> [T, H, P | R]             c = kv_a_proj(x) -> [Lr | R]; latent = RMSNorm(c[:Lr]) (eps 1e-6)
    k_h = [W_uk,h latent | rope(k_rope)]        v_h = W_uv,h latent        (kv_b_proj = [W_uk | W_uv] per head)
    out = dense(concat_h softmax(q_h.k_h / sqrt(P + R)) v_h * sigmoid(g_proj x)_h)

Two equal ways to evaluate attention:
  * plain (prefill): expand k_nope and v for every cached slot with kv_b_proj, then attend;
  * absorbed (decode/verify): fold W_uk into the query and W_uv into the output, so attention runs directly
    over the 576-wide latent rows and the cache is read once.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from ling_jax.layers.norms import rms_norm
from ling_jax.layers.rope import apply_rope_interleaved, rope_angles

# q_a_layernorm / kv_a_layernorm: HF's BailingMoeV3RMSNorm(dim) keeps its default eps 1e-6 there, whatever
# config.rms_norm_eps says (the other norms of the model take rms_norm_eps).
LATENT_NORM_EPS = 1e-6


def _split_kv_b(p, cfg):
    """kv_b_proj [H*(P+Vh), Lr] -> W_uk [H, P, Lr], W_uv [H, Vh, Lr]."""
    H, P, Vh = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
    w = p["kv_b_proj"].reshape(H, P + Vh, -1)
    return w[:, :P], w[:, P:]


def mla_queries(p, x, positions, cfg):
    """x [B, T, D] -> (q_nope [B, T, H, P], q_rope rotated [B, T, H, R])."""
    B, T, _ = x.shape
    H = cfg.num_attention_heads
    if cfg.q_lora_rank is None:
        q = jnp.einsum("btd,fd->btf", x, p["q_proj"])
    else:
        q_a = rms_norm(jnp.einsum("btd,fd->btf", x, p["q_a_proj"]), p["q_a_layernorm"], LATENT_NORM_EPS)
        q = jnp.einsum("btr,fr->btf", q_a, p["q_b_proj"])
    q = q.reshape(B, T, H, cfg.qk_head_dim)
    cos, sin = rope_angles(positions, cfg.qk_rope_head_dim, cfg.rope_theta)  # [B, T, R/2]
    q_rope = apply_rope_interleaved(q[..., cfg.qk_nope_head_dim :], cos[:, :, None], sin[:, :, None])
    return q[..., : cfg.qk_nope_head_dim], q_rope


def mla_cache_rows(p, x, positions, cfg):
    """x [B, T, D] -> cache rows [B, T, Lr + R]: normalised latent and rotated shared rope key."""
    c = jnp.einsum("btd,fd->btf", x, p["kv_a_proj_with_mqa"])
    latent = rms_norm(c[..., : cfg.kv_lora_rank], p["kv_a_layernorm"], LATENT_NORM_EPS)
    cos, sin = rope_angles(positions, cfg.qk_rope_head_dim, cfg.rope_theta)
    k_rope = apply_rope_interleaved(c[..., cfg.kv_lora_rank :], cos, sin)
    return jnp.concatenate([latent, k_rope], axis=-1)


def write_cache(cache, rows, start):
    """cache [B, S, F], rows [B, T, F], start [B] -> cache with rows at slots start[b] .. start[b]+T-1."""
    put = lambda c, r, s: lax.dynamic_update_slice_in_dim(c, r.astype(c.dtype), s, axis=0)
    return jax.vmap(put)(cache, rows, start.astype(jnp.int32))


def _causal_mask(positions, S):
    """Slot j is visible to a query at absolute position p iff j <= p. positions [B, T] -> [B, 1, T, S]."""
    return (jnp.arange(S)[None, None, :] <= positions[:, :, None])[:, None]


def attend_plain(p, q_nope, q_rope, cache, positions, cfg):
    """Prefill path: expand keys/values of every slot. Returns [B, T, H, Vh] f32."""
    w_uk, w_uv = _split_kv_b(p, cfg)
    latent, k_rope = cache[..., : cfg.kv_lora_rank], cache[..., cfg.kv_lora_rank :]
    k_nope = jnp.einsum("bsl,hpl->bshp", latent, w_uk)
    v = jnp.einsum("bsl,hvl->bshv", latent, w_uv)
    scores = jnp.einsum("bthp,bshp->bhts", q_nope, k_nope, preferred_element_type=jnp.float32)
    scores += jnp.einsum("bthr,bsr->bhts", q_rope, k_rope, preferred_element_type=jnp.float32)
    scores = scores.astype(v.dtype).astype(jnp.float32)  # eager attention rounds q.k to the activation dtype
    probs = _softmax(scores * cfg.qk_head_dim**-0.5, _causal_mask(positions, cache.shape[1]))
    o = jnp.einsum("bhts,bshv->bthv", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return o.astype(v.dtype).astype(jnp.float32)


def attend_absorbed(p, q_nope, q_rope, cache, positions, cfg):
    """Decode/verify path: attention over latent rows with W_uk, W_uv absorbed. Returns [B, T, H, Vh] f32."""
    w_uk, w_uv = _split_kv_b(p, cfg)
    latent, k_rope = cache[..., : cfg.kv_lora_rank], cache[..., cfg.kv_lora_rank :]
    q_lat = jnp.einsum("bthp,hpl->bthl", q_nope, w_uk)  # query in latent space
    scores = jnp.einsum("bthl,bsl->bhts", q_lat, latent, preferred_element_type=jnp.float32)
    scores += jnp.einsum("bthr,bsr->bhts", q_rope, k_rope, preferred_element_type=jnp.float32)
    probs = _softmax(scores * cfg.qk_head_dim**-0.5, _causal_mask(positions, cache.shape[1]))
    ctx = jnp.einsum("bhts,bsl->bthl", probs.astype(latent.dtype), latent)
    return jnp.einsum("bthl,hvl->bthv", ctx, w_uv, preferred_element_type=jnp.float32)


def _softmax(scores, mask):
    scores = jnp.where(mask, scores, -jnp.inf)
    return jax.nn.softmax(scores, axis=-1)


def mla_layer(p, x, cache, lengths, cfg, *, absorbed: bool):
    """One gated-MLA block (no residual). x [B, T, D] at positions lengths[b] + t; cache [B, S, Lr + R].

    The new rows are written first so each query sees itself; rows past the committed length (a rejected
    verify position) are overwritten by later steps and never read before that.
    Returns (out [B, T, D], cache).
    """
    B, T, _ = x.shape
    positions = lengths[:, None].astype(jnp.int32) + jnp.arange(T, dtype=jnp.int32)[None, :]
    q_nope, q_rope = mla_queries(p, x, positions, cfg)
    cache = write_cache(cache, mla_cache_rows(p, x, positions, cfg), lengths)
    attend = attend_absorbed if absorbed else attend_plain
    o = attend(p, q_nope, q_rope, cache, positions, cfg)  # [B, T, H, Vh] f32
    gate = jax.nn.sigmoid(jnp.einsum("btd,hd->bth", x, p["g_proj"]).astype(jnp.float32))
    o = (o * gate[..., None]).reshape(B, T, -1).astype(x.dtype)
    return jnp.einsum("btc,dc->btd", o, p["dense"]), cache
