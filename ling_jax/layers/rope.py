"""Interleaved rotary embedding: pairs (2i, 2i+1) rotate by pos * theta^(-2i / rot_dim).

Ling-3.0 applies RoPE only to MLA's 64 rope dims (partial_rotary_factor 0.5 of head_dim 128). HF stores the
rotated pairs de-interleaved; any fixed permutation shared by q and k leaves q.k unchanged, so we keep pairs
in place.
"""

import jax
import jax.numpy as jnp


def rope_angles(positions: jax.Array, rot_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """positions [...] int -> (cos, sin) [..., rot_dim/2] in fp32."""
    inv_freq = theta ** (-jnp.arange(0, rot_dim, 2, dtype=jnp.float32) / rot_dim)  # [rot/2]
    ang = positions.astype(jnp.float32)[..., None] * inv_freq
    return jnp.cos(ang), jnp.sin(ang)


def apply_rope_interleaved(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [..., rot_dim] with cos/sin broadcastable to [..., rot_dim/2]; computed in fp32, returned in x.dtype."""
    xf = x.astype(jnp.float32)
    x_even, x_odd = xf[..., 0::2], xf[..., 1::2]
    out_even = x_even * cos - x_odd * sin
    out_odd = x_even * sin + x_odd * cos
    return jnp.stack([out_even, out_odd], axis=-1).reshape(x.shape).astype(x.dtype)


def apply_rope_half(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half RoPE (HF Llama/Qwen3 layout: dim i pairs with i + rot_dim/2), as the DSpark draft's checkpoints
    store q/k: x [..., rot_dim], cos/sin broadcastable to [..., rot_dim/2]; fp32 inside, returned in x.dtype."""
    xf = x.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)
