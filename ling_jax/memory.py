"""How long a context fits: device memory left after the weights, over the bytes each cache slot costs.

Per device (TP shards the heads; the latent caches are replicated, see compile.sharding.STATE_AXES):
    fixed    = weights / tp (block-fp8 weights: 1 B + their scales) + KDA recurrent states (Lk x H x K x V x 4 B) / tp + a reserve
    per slot = latent cache rows: (Lm + MTP) x F x itemsize
             + prefill workspace of one MLA layer over a chunk of C positions, per slot:
               scores and probabilities, 2 x (H / tp) x C x 4 B, and the expanded keys and values,
               (H / tp) x (P + Vh) x itemsize (the plain attention path expands every slot)
    context  = max_position_embeddings if that fits, else (fraction x device bytes - fixed) / per slot rounded
               down to whole chunks.
It is an estimate (XLA may keep more temporaries alive): `fraction` leaves room for them, as SGLang's
--mem-fraction-static does.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

from ling_jax import quant
from ling_jax.config import ModelConfig
from ling_jax.weights import abstract_params

RESERVE_BYTES = 1 << 30  # activations of a step, logits, compiled programs


def device_memory_bytes(device=None) -> int:
    """What one device can hold: its allocator limit on GPU; on CPU, the host's available memory."""
    device = device or jax.devices()[0]
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def bytes_per_slot(cfg: ModelConfig, dtype, chunk: int, tp: int = 1, nextn: bool = True) -> int:
    item = jnp.dtype(dtype).itemsize
    caches = (len(cfg.mla_layers) + (len(cfg.mtp_layers) if nextn else 0)) * cfg.mla_cache_dim * item
    heads = -(-cfg.num_attention_heads // tp)
    prefill = heads * (2 * chunk * 4 + (cfg.qk_nope_head_dim + cfg.v_head_dim) * item)
    return caches + prefill


def weight_bytes(cfg: ModelConfig, dtype, quantization: str | None = None) -> dict[str, int]:
    """Bytes of all weights by storage: "fp8" (block-fp8 w8), "fp8 scales" (their f32 scales), the model dtype's
    name (embedding, lm_head, norms, router, ... and every weight when unquantised), "float32" (A_log, dt_bias,
    expert_bias)."""
    out: dict[str, int] = {}
    for leaf in jax.tree.leaves(abstract_params(cfg, dtype, quantization=quantization),
                                is_leaf=lambda x: isinstance(x, quant.Fp8Weight)):
        if isinstance(leaf, quant.Fp8Weight):
            parts = (("fp8", leaf.w8), ("fp8 scales", leaf.scale_inv))
        else:
            parts = ((jnp.dtype(leaf.dtype).name, leaf),)
        for kind, x in parts:
            out[kind] = out.get(kind, 0) + quant.nbytes(x)
    return out


def kda_state_bytes(cfg: ModelConfig) -> int:
    """The KDA recurrent states of one sequence: Lk x H x K x V float32."""
    return len(cfg.kda_layers) * cfg.num_attention_heads * cfg.head_dim**2 * 4


def fixed_bytes(cfg: ModelConfig, dtype, tp: int = 1, quantization: str | None = None) -> int:
    weights = sum(weight_bytes(cfg, dtype, quantization).values())
    return (weights + kda_state_bytes(cfg)) // tp + RESERVE_BYTES


def default_context_length(cfg: ModelConfig, dtype, chunk: int, *, device_bytes: int, tp: int = 1,
                           nextn: bool = True, fraction: float = 0.85, quantization: str | None = None) -> int:
    """The longest context (cache slots, whole chunks) that fits, at most max_position_embeddings."""
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    free = int(fraction * device_bytes) - fixed_bytes(cfg, dtype, tp, quantization)
    slots = free // bytes_per_slot(cfg, dtype, chunk, tp, nextn)
    if slots >= cfg.max_position_embeddings:
        return cfg.max_position_embeddings
    if slots < chunk:
        raise ValueError(f"{cfg.name} leaves room for {max(slots, 0)} context slots on a device of "
                         f"{device_bytes / 2**30:.1f} GiB (tp {tp}); fewer than one prefill chunk ({chunk}): "
                         f"give --context-length or a smaller --chunked-prefill-size")
    return slots // chunk * chunk
