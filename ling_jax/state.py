"""The target model's decode state: one pytree, fixed shapes, donated every step.

Shape legend: Lk KDA layers, Lm MLA layers, B batch, H heads, K = V = head dim, C = H*K, W conv width,
S cache slots (max context), F = kv_lora_rank + qk_rope_head_dim (576 at full size).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from ling_jax.config import ModelConfig


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class DecodeState:
    """Attributes:
    kda_recurrent: f32[Lk, B, H, K, V]  delta-rule state per KDA layer (73.4 MB per sequence at full size).
    kda_conv: dtype[Lk, B, W-1, 3, C]  the last W-1 raw q, k, v inputs of each KDA layer's short conv.
    mla_cache: dtype[Lm, B, S, F]       per MLA layer: normalised latent | rotated rope key, by position.
    lengths: int32[B]                   committed tokens per sequence (= next position to write).
    """

    kda_recurrent: jax.Array
    kda_conv: jax.Array
    mla_cache: jax.Array
    lengths: jax.Array

    @property
    def max_len(self) -> int:
        return self.mla_cache.shape[2]

    def replace(self, **kw) -> "DecodeState":
        return dataclasses.replace(self, **kw)


def state_shapes(cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.bfloat16) -> DecodeState:
    """ShapeDtypeStructs of an empty state (for tracing, sharding and memory reports)."""
    H, K = cfg.num_attention_heads, cfg.head_dim
    Lk, Lm = len(cfg.kda_layers), len(cfg.mla_layers)
    S = jax.ShapeDtypeStruct
    return DecodeState(
        kda_recurrent=S((Lk, batch, H, K, K), jnp.float32),
        kda_conv=S((Lk, batch, cfg.short_conv_kernel_size - 1, 3, H * K), jnp.dtype(dtype)),
        mla_cache=S((Lm, batch, max_len, cfg.mla_cache_dim), jnp.dtype(dtype)),
        lengths=S((batch,), jnp.int32),
    )


def init_state(cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.bfloat16) -> DecodeState:
    """Zero state: empty caches, zero recurrent state (the reference's initial state), length 0."""
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), state_shapes(cfg, batch, max_len, dtype))


def state_bytes(state) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
