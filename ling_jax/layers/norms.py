"""RMSNorm as BailingMoeV3 computes it: statistics in fp32, weight applied as is (not 1 + w)."""

import jax
import jax.numpy as jnp


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """w * (x_f32 * rsqrt(mean(x^2) + eps)).to(x.dtype) over the last axis."""
    xf = x.astype(jnp.float32)
    normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * normed.astype(x.dtype)


def add_rms_norm(residual: jax.Array, y: jax.Array, weight: jax.Array, eps: float):
    """A layer boundary: x = residual + y rounded to the stream's dtype (the model's `x + layer(x)`), and the next
    block's rms_norm(x) -> (x, normed)."""
    x = residual + y.astype(residual.dtype)
    return x, rms_norm(x, weight, eps)


def l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """x / sqrt(sum x^2 + eps) over the last axis, in fp32 (KDA's q and k)."""
    xf = x.astype(jnp.float32)
    return xf * jax.lax.rsqrt(jnp.sum(xf * xf, axis=-1, keepdims=True) + eps)
