"""The NEXTN / MTP draft head (checkpoint layer `num_hidden_layers`).

Row t pairs the token at t+1 with the target's final-norm hidden state at t and predicts the token at t+2:
    x = eh_proj(concat[enorm(Embed(tok_{t+1})), hnorm(h_t)])        (2D -> D, no bias)
    x = MLA+MoE decoder block (own latent cache, indexed by the same positions as the target's)
    h'_t = final_layernorm(x);  logits = lm_head(h'_t)               (embedding and lm_head are the target's)
Chained drafting feeds h'_t back as the next row's hidden state.
Shape legend: B batch, T rows, D hidden, S cache slots, F latent row width.
"""

from __future__ import annotations

import jax.numpy as jnp

from ling_jax.config import ModelConfig
from ling_jax.layers.linear import Normed, Projection, norm_projections
from ling_jax.layers.norms import rms_norm
from ling_jax.model import RuntimeOptions, embed, mla_block


def mtp_forward(params, tokens, hidden, cache, start, cfg: ModelConfig, *, absorbed: bool,
                opts: RuntimeOptions = RuntimeOptions(), expert_load: bool = False, lazy_norm: bool = False):
    """tokens int32[B, T] (tok_{t+1}), hidden [B, T, D] (h_t), cache [B, S, F], start int32[B] (row of t=0).

    Writes cache rows start..start+T-1. Returns (h' [B, T, D] after final_layernorm, cache), plus the MTP
    layer's expert load int32[E] (or None if dense) when expert_load is set (training's router balancing).
    lazy_norm: h' is a layers.linear.Normed (final_layernorm not yet computed: the fused lm_head + argmax norms
    it, model.lm_argmax) where no fused layer boundary computed it.
    """
    if not cfg.mtp_layers:
        raise ValueError(f"{cfg.name} has no MTP layer (num_nextn_predict_layers=0): NEXTN needs one")
    p = params["mtp"][0]
    x = None
    if opts.calls is not None:  # the gather, both norms and eh_proj in one kernel, where one takes the call
        x = opts.calls.mtp_input(tokens, params["embed"], hidden.astype(params["embed"].dtype), p["enorm"],
                                 p["hnorm"], p["eh_proj"], eps=cfg.rms_norm_eps)
    if x is None:
        e = embed(params, tokens)
        eh = Normed((e, hidden.astype(e.dtype)), (p["enorm"], p["hnorm"]), cfg.rms_norm_eps)  # [enorm(e) | hnorm(h)]
        (x,) = norm_projections(eh, (Projection(p["eh_proj"]),), opts.calls,
                                fp8_activations=opts.numerics.quantises_activations)  # (eh_proj: bf16 by fp8_policy)
    i = cfg.mtp_layers[0]
    # where the kernel calls fuse a MoE layer's boundary (TP + p2p_allreduce), the final norm rides in it
    fused = opts.calls is not None and opts.calls.fuses_layer_boundary and cfg.is_moe(i)
    x, cache, *load = mla_block(p, x, cache, start, cfg, i, absorbed=absorbed, opts=opts, return_load=expert_load,
                                next_norm=p["final_norm"] if fused else None)
    if fused:
        x, h = x
    else:
        h = Normed(x, p["final_norm"], cfg.rms_norm_eps)
        h = h if lazy_norm else h.value()  # (Normed.value is rms_norm)
    return (h, cache, load[0]) if expert_load else (h, cache)
