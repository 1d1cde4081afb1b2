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

from ling_jax.layers.linear import Normed, Projection, linear, norm_projections
from ling_jax.layers.norms import rms_norm
from ling_jax.layers.rope import apply_rope_interleaved, rope_angles
from ling_jax.quant import dense

# q_a_layernorm / kv_a_layernorm: HF's BailingMoeV3RMSNorm(dim) keeps its default eps 1e-6 there, whatever
# config.rms_norm_eps says (the other norms of the model take rms_norm_eps).
LATENT_NORM_EPS = 1e-6


def _kv_b(p, cfg, dtype):
    """kv_b_proj [H*(P+Vh), Lr] -> [H, P + Vh, Lr]: W_uk | W_uv per head (fp8 weights dequantised to dtype)."""
    H, P, Vh = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
    return dense(p["kv_b_proj"], dtype).reshape(H, P + Vh, -1)


def _split_kv_b(p, cfg, dtype):
    """kv_b_proj [H*(P+Vh), Lr] -> W_uk [H, P, Lr], W_uv [H, Vh, Lr] (fp8 weights dequantised to dtype)."""
    w = _kv_b(p, cfg, dtype)
    return w[:, : cfg.qk_nope_head_dim], w[:, cfg.qk_nope_head_dim :]


def mla_projections(p, x, cfg, kernels=None, fp8_activations: bool = False):
    """x [B, T, D] (the normed input, or a layers.linear.Normed) -> (q [B, T, H*(P+R)] (q_a [B, T, Lq] with a
    q LoRA), c = kv_a_proj(x) [B, T, Lr + R], gate = sigmoid(g_proj x) [B, T, H] f32): the projections of the
    block's input, one fused norm + projection kernel where `kernels` takes it."""
    q_w = p["q_proj"] if cfg.q_lora_rank is None else p["q_a_proj"]
    projs = (Projection(q_w), Projection(p["kv_a_proj_with_mqa"]), Projection(p["g_proj"], "sigmoid"))
    return norm_projections(x, projs, kernels, fp8_activations=fp8_activations)


def mla_query_heads(p, q, cfg, kernels=None, fp8_activations: bool = False):
    """q [B, T, H*(P+R)] (or q_a [B, T, Lq]: then q = q_b_proj(RMSNorm(q_a))) -> the heads [B, T, H, P + R]
    (q_nope | q_pe, q_pe before its rotation)."""
    B, T, _ = q.shape
    if cfg.q_lora_rank is not None:
        q_a = Normed(q, p["q_a_layernorm"], LATENT_NORM_EPS)
        (q,) = norm_projections(q_a, (Projection(p["q_b_proj"]),), kernels, fp8_activations=fp8_activations)
    return q.reshape(B, T, cfg.num_attention_heads, cfg.qk_head_dim)


def rotate_queries(q_pe, positions, cfg):
    """q_pe [B, T, H, R] -> q_rope rotated at positions [B, T]."""
    cos, sin = rope_angles(positions, cfg.qk_rope_head_dim, cfg.rope_theta)  # [B, T, R/2]
    return apply_rope_interleaved(q_pe, cos[:, :, None], sin[:, :, None])


def mla_cache_rows(p, c, positions, cfg):
    """c = kv_a_proj(x) [B, T, Lr + R] -> cache rows [B, T, Lr + R]: normalised latent and rotated shared rope
    key."""
    latent = rms_norm(c[..., : cfg.kv_lora_rank], p["kv_a_layernorm"], LATENT_NORM_EPS)
    cos, sin = rope_angles(positions, cfg.qk_rope_head_dim, cfg.rope_theta)
    k_rope = apply_rope_interleaved(c[..., cfg.kv_lora_rank :], cos, sin)
    return jnp.concatenate([latent, k_rope], axis=-1)


def write_cache(cache, rows, start, layer: int | None = None):
    """cache [B, S, F] (or the stacked [L, B, S, F] with `layer`), rows [B, T, F], start [B] -> cache with rows
    at slots start[b] .. start[b]+T-1 (of layer `layer`). Writing into the stack in place avoids copying the
    layer's cache out of it and back."""
    if layer is None:
        put = lambda c, r, s: lax.dynamic_update_slice_in_dim(c, r.astype(c.dtype), s, axis=0)
        return jax.vmap(put)(cache, rows, start.astype(jnp.int32))
    put = lambda c, r, s: lax.dynamic_update_slice(c, r[None].astype(c.dtype), (layer, s, 0))  # c [L, S, F]
    return jax.vmap(put, in_axes=(1, 0, 0), out_axes=1)(cache, rows, start.astype(jnp.int32))


def _causal_mask(positions, S):
    """Slot j is visible to a query at absolute position p iff j <= p. positions [B, T] -> [B, 1, T, S]."""
    return (jnp.arange(S)[None, None, :] <= positions[:, :, None])[:, None]


def attend_plain(p, q_nope, q_rope, cache, positions, cfg):
    """Prefill path: expand keys/values of every slot. Returns [B, T, H, Vh] f32."""
    w_uk, w_uv = _split_kv_b(p, cfg, cache.dtype)
    latent, k_rope = cache[..., : cfg.kv_lora_rank], cache[..., cfg.kv_lora_rank :]
    k_nope = jnp.einsum("bsl,hpl->bshp", latent, w_uk)
    v = jnp.einsum("bsl,hvl->bshv", latent, w_uv)
    scores = jnp.einsum("bthp,bshp->bhts", q_nope, k_nope, preferred_element_type=jnp.float32)
    scores += jnp.einsum("bthr,bsr->bhts", q_rope, k_rope, preferred_element_type=jnp.float32)
    scores = scores.astype(v.dtype).astype(jnp.float32)  # eager attention rounds q.k to the activation dtype
    probs = _softmax(scores * cfg.qk_head_dim**-0.5, _causal_mask(positions, cache.shape[1]))
    o = jnp.einsum("bhts,bshv->bthv", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return o.astype(v.dtype).astype(jnp.float32)


def absorbed_context(q_lat, q_rope, cache, positions, cfg):
    """The attention-weighted latent: q_lat [B, T, H, Lr] (q_nope W_uk), q_rope [B, T, H, R], cache [B, S, Lr+R]
    -> ctx [B, T, H, Lr] in the cache dtype (before W_uv). The reference of pallas_kernels/mla_attention.py."""
    # One dot over the whole 576-wide row ([q_lat | q_rope] . [latent | k_rope] = q_lat.latent + q_rope.k_rope),
    # and the context over whole rows with its rope columns dropped after: slicing the cache into its latent and
    # rope parts first would copy the whole allocated cache (two XLA slice kernels per call).
    q_row = jnp.concatenate([q_lat.astype(cache.dtype), q_rope.astype(cache.dtype)], axis=-1)  # [B, T, H, Lr+R]
    scores = jnp.einsum("bthf,bsf->bhts", q_row, cache, preferred_element_type=jnp.float32)
    probs = _softmax(scores * cfg.qk_head_dim**-0.5, _causal_mask(positions, cache.shape[1]))
    return jnp.einsum("bhts,bsf->bthf", probs.astype(cache.dtype), cache)[..., : cfg.kv_lora_rank]


def gated_heads(o, gate, dtype):
    """The attention's heads o [B, T, H, Vh] f32 times the block's head gate [B, T, H] f32 (sigmoid(g_proj x)),
    rounded to dtype: the dense projection's input (before its [B, T, H Vh] reshape)."""
    return (o * gate[..., None]).astype(dtype)


def attend_absorbed(p, q_nope, q_rope, cache, positions, cfg, *, kernels=None, layer: int | None = None,
                    q_heads=None, gate=None, out_dtype=None):
    """Decode/verify path: attention over latent rows with W_uk, W_uv absorbed. Returns [B, T, H, Vh] f32, or with
    the head gate [B, T, H] gated_heads(o, gate, out_dtype) (the Triton kernel applies it in its combine).
    cache: [B, S, F], or the stacked [L, B, S, F] read at `layer`. kernels: a KernelCalls whose MLA kernels read
    the live prefix only: mla_attention (context and W_uv in the kernel, given the whole [H, P + Vh, Lr] weight:
    a slice of it would be an XLA copy), else mla_context (the context), else (None, or shapes neither takes)
    the jnp context over every slot. q_heads: the unrotated heads [B, T, H, P + R] (mla_query_heads), from which
    mla_attention may rotate the rope queries and absorb q_nope @ W_uk in its prologue (then q_rope, q_lat and
    their slices are unused and XLA drops the kernels that made them)."""
    kv_b = _kv_b(p, cfg, q_nope.dtype)
    w_uk, w_uv = kv_b[:, : cfg.qk_nope_head_dim], kv_b[:, cfg.qk_nope_head_dim :]
    q_lat = jnp.einsum("bthp,hpl->bthl", q_nope, w_uk)  # query in latent space
    ctx = None
    if kernels is not None:
        o = kernels.mla_attention(q_lat, q_rope, cache, positions, kv_b, v_head_dim=cfg.v_head_dim,
                                  scale=cfg.qk_head_dim**-0.5, layer=layer, q_heads=q_heads, rope_theta=cfg.rope_theta,
                                  gate=gate, out_dtype=out_dtype)
        if o is not None:
            return o
        ctx = kernels.mla_context(q_lat, q_rope, cache, positions, scale=cfg.qk_head_dim**-0.5, layer=layer)
    if ctx is None:
        ctx = absorbed_context(q_lat, q_rope, cache if layer is None else cache[layer], positions, cfg)
    o = jnp.einsum("bthl,hvl->bthv", ctx, w_uv, preferred_element_type=jnp.float32)
    return o if gate is None else gated_heads(o, gate, out_dtype)


def _softmax(scores, mask):
    scores = jnp.where(mask, scores, -jnp.inf)
    return jax.nn.softmax(scores, axis=-1)


def mla_layer(p, x, cache, lengths, cfg, *, absorbed: bool, layer: int | None = None, kernels=None,
              residual=None, fp8_activations: bool = False):
    """One gated-MLA block. x [B, T, D] the normed input (or a layers.linear.Normed) at positions lengths[b] + t;
    cache [B, S, Lr + R], or the model's stacked [L, B, S, Lr + R] of which this block owns layer `layer` (read
    and written in place). Without `residual` the block's output; with it, residual + that output (the add
    rides in the output projection's kernel).

    The new rows are written first so each query sees itself; rows past the committed length (a rejected
    verify position) are overwritten by later steps and never read before that.
    fp8_activations: fp8 projections read their inputs quantised (Numerics.fp8_activations); kv_b_proj is read
    weight-only in both attention forms (absorbed decode has no [token, Lr] input of it to quantise; see Numerics).
    Returns (out [B, T, D], cache) with the cache in the layout it came in.
    """
    B, T, _ = x.shape
    positions = lengths[:, None].astype(jnp.int32) + jnp.arange(T, dtype=jnp.int32)[None, :]
    q, c, gate = mla_projections(p, x, cfg, kernels, fp8_activations)
    q = mla_query_heads(p, q, cfg, kernels, fp8_activations)
    q_nope, q_rope = q[..., : cfg.qk_nope_head_dim], rotate_queries(q[..., cfg.qk_nope_head_dim :], positions, cfg)
    cache = write_cache(cache, mla_cache_rows(p, c, positions, cfg), lengths, layer)
    if absorbed:
        o = attend_absorbed(p, q_nope, q_rope, cache, positions, cfg, kernels=kernels, layer=layer, q_heads=q,
                            gate=gate, out_dtype=x.dtype)
    else:
        o = gated_heads(attend_plain(p, q_nope, q_rope, cache if layer is None else cache[layer], positions, cfg),
                        gate, x.dtype)
    o = o.reshape(B, T, -1)
    return linear(o, p["dense"], kernels, residual, fp8_activations=fp8_activations), cache
