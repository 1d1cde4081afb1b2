"""How long a context fits: device memory left after the weights, over the bytes each cache slot costs.

Per device (TP shards the heads; the latent caches are replicated, see compile.sharding.STATE_AXES), for R
request rows (R = serve.launch_server.request_rows with continuous batching, ling_jax/batching.py; 1 without):
    fixed    = weights / tp (block-fp8 weights: 1 B + their scales; DSPARK: + the draft's own weights, which
               share the target's embedding and lm_head) + R x per-request state (KDA recurrent
               Lk x H x K x V x 4 B and conv windows, / tp; sampling state: prompt / output counts, draft
               distribution, logit bias, 13 B x V) + a reserve
    per slot = R x latent cache rows: (Lm + MTP with NEXTN) x F x itemsize
               (DSPARK: + the draft context K/V, 2 x Ld x Hk x Dh x itemsize; no MTP cache)
             + prefill workspace of one MLA layer over a chunk of C positions (one prefill at a time):
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
from ling_jax.dspark import DSparkConfig, param_count
from ling_jax.weights import abstract_params

RESERVE_BYTES = 1 << 30  # activations of a step, logits, compiled programs


def device_memory_bytes(device=None) -> int:
    """What one device can hold: its allocator limit on GPU; on CPU, the host's available memory."""
    device = device or jax.local_devices()[0]  # this process's: another host's devices report nothing here
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def draft_context_bytes_per_position(draft: DSparkConfig, dtype) -> int:
    """A DSpark request's draft context K and V per position (DSparkState.ctx_k / ctx_v [Ld, B, S, Hk, Dh])."""
    return 2 * draft.num_hidden_layers * draft.num_key_value_heads * draft.head_dim * jnp.dtype(dtype).itemsize


def cache_bytes_per_position(cfg: ModelConfig, dtype, nextn: bool = True, draft: DSparkConfig | None = None) -> int:
    """One request's cache bytes per context position: the target MLA layers' latents, the MTP layer's (nextn)
    and a DSpark draft's context K/V (draft: its config)."""
    layers = len(cfg.mla_layers) + (len(cfg.mtp_layers) if nextn else 0)
    latent = layers * cfg.mla_cache_dim * jnp.dtype(dtype).itemsize
    return latent + (draft_context_bytes_per_position(draft, dtype) if draft is not None else 0)


def bytes_per_slot(cfg: ModelConfig, dtype, chunk: int, tp: int = 1, nextn: bool = True, rows: int = 1,
                   draft: DSparkConfig | None = None) -> int:
    item = jnp.dtype(dtype).itemsize
    heads = -(-cfg.num_attention_heads // tp)
    prefill = heads * (2 * chunk * 4 + (cfg.qk_nope_head_dim + cfg.v_head_dim) * item)
    return rows * cache_bytes_per_position(cfg, dtype, nextn, draft) + prefill


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


def request_state_bytes(cfg: ModelConfig, dtype, tp: int = 1) -> int:
    """One request row's state apart from its caches: KDA recurrent states and conv windows (sharded by heads),
    sampling state (prompt bool, output counts int32, draft distribution f32, logit bias f32: 13 B per token)."""
    C = cfg.num_attention_heads * cfg.head_dim
    conv = len(cfg.kda_layers) * (cfg.short_conv_kernel_size - 1) * 3 * C * jnp.dtype(dtype).itemsize
    return (kda_state_bytes(cfg) + conv) // tp + 13 * cfg.vocab_size


def device_weight_bytes(cfg: ModelConfig, dtype, tp: int = 1, quantization: str | None = None) -> int:
    return sum(weight_bytes(cfg, dtype, quantization).values()) // tp


def draft_weight_bytes(draft: DSparkConfig | None, dtype) -> int:
    """A DSpark draft's own weights in the serving dtype (ling_jax.generate.load_draft; the embedding and lm_head
    are the target's); 0 without one."""
    return 0 if draft is None else param_count(draft) * jnp.dtype(dtype).itemsize


def fixed_bytes(cfg: ModelConfig, dtype, tp: int = 1, quantization: str | None = None, rows: int = 1,
                draft: DSparkConfig | None = None) -> int:
    return (device_weight_bytes(cfg, dtype, tp, quantization) + draft_weight_bytes(draft, dtype)
            + rows * request_state_bytes(cfg, dtype, tp) + RESERVE_BYTES)


def serving_budget(cfg: ModelConfig, dtype, chunk: int, context: int, *, rows: int, device_bytes: int, tp: int = 1,
                   nextn: bool = True, fraction: float = 0.85, quantization: str | None = None,
                   draft: DSparkConfig | None = None) -> dict:
    """What `rows` request rows of `context` positions take on one device, or a ValueError naming the numbers
    when that exceeds fraction x device bytes. Returns the budget in bytes (the server reports it). draft: a DSpark
    draft's config (its weights and every row's draft context K/V are counted)."""
    per_request = request_state_bytes(cfg, dtype, tp) + context * cache_bytes_per_position(cfg, dtype, nextn, draft)
    total = (fixed_bytes(cfg, dtype, tp, quantization, rows, draft)
             + context * bytes_per_slot(cfg, dtype, chunk, tp, nextn, rows, draft))
    weights = device_weight_bytes(cfg, dtype, tp, quantization) + draft_weight_bytes(draft, dtype)
    budget = dict(rows=rows, context_length=context, weights_bytes=weights,
                  per_request_bytes=per_request, total_bytes=total, limit_bytes=int(fraction * device_bytes))
    if total > budget["limit_bytes"]:
        gib = lambda b: f"{b / 2**30:.2f} GiB"
        raise ValueError(f"{rows} request state rows x --context-length {context} do not fit: {gib(total)} (weights "
                         f"{gib(weights)}, {gib(per_request)} per row, prefill workspace, "
                         f"reserve) > {fraction:g} x {gib(device_bytes)} of device memory; lower "
                         f"--max-running-requests or --context-length")
    return budget


def default_context_length(cfg: ModelConfig, dtype, chunk: int, *, device_bytes: int, tp: int = 1,
                           nextn: bool = True, fraction: float = 0.85, quantization: str | None = None,
                           rows: int = 1, draft: DSparkConfig | None = None) -> int:
    """The longest context (cache slots, whole chunks) that fits `rows` requests, at most max_position_embeddings."""
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    free = int(fraction * device_bytes) - fixed_bytes(cfg, dtype, tp, quantization, rows, draft)
    slots = free // bytes_per_slot(cfg, dtype, chunk, tp, nextn, rows, draft)
    if slots >= cfg.max_position_embeddings:
        return cfg.max_position_embeddings
    if slots < chunk:
        raise ValueError(f"{cfg.name} leaves room for {max(slots, 0)} context slots x {rows} request rows on a device "
                         f"of {device_bytes / 2**30:.1f} GiB (tp {tp}); fewer than one prefill chunk ({chunk}): "
                         f"give --context-length, a smaller --chunked-prefill-size or --max-running-requests")
    return slots // chunk * chunk
