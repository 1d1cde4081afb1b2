"""Dense SwiGLU MLP, the noaux_tc router and the routed + shared expert MoE (pure jnp).

Shape legend: T tokens (batch folded in), D hidden, E experts, A = top-k activated per token, I expert width,
G groups.

    s = sigmoid(x W_gate^T)  (fp32)        sb = s + expert_bias   (bias only selects)
    keep the topk_group groups with the largest sum of their top-2 sb; ids = top-A of sb inside them
    w = s[ids] / (sum s[ids] + 1e-20) * routed_scaling_factor     (the sum: left to right, topk_weight_sum)
    y = sum_a w_a Expert_{ids_a}(x) + Shared(x)
Clamp (limit L > 0, routed and shared experts alike): h = min(silu(gate), L) * clip(up, -L, L), the limit AFTER
the SiLU, as SGLang deploys Ling-3.0 (`_swiglu_silu_clamp_mul`). The limits are per layer (config.json
expert_swiglu_limit_list / share_expert_swiglu_limit_list); HF's remote code ignores them (= apply_swiglu_clamps
false), but the model was trained with them: on by default.
(swiglu itself lives in layers/linear.py with the other projection epilogues.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ling_jax import quant
from ling_jax.layers.linear import Normed, Projection, linear, norm_projections, swiglu
from ling_jax.layers.norms import add_rms_norm
from ling_jax.quant import dense, take


def dense_mlp(p, x, limit: float = 0.0, *, kernels=None, residual=None, fp8_activations: bool = False):
    """down(act(gate(x)) * up(x)) in the weight dtype; p = {gate_proj [F, D], up_proj [F, D], down_proj [D, F]}
    (fp8 weights dequantised to x.dtype). x: the normed input, or a layers.linear.Normed (then gate|up is one
    fused norm + SwiGLU kernel where `kernels` takes it); residual: returns residual + the MLP (see linear).
    fp8_activations: an fp8 weight's input (x, h) quantised first (quant.gemm_input)."""
    (h,) = norm_projections(x, (Projection((p["gate_proj"], p["up_proj"]), "swiglu", limit),), kernels,
                            fp8_activations=fp8_activations)
    return linear(h, p["down_proj"], kernels, residual, fp8_activations=fp8_activations)


def router_logits(x, gate_w, *, fp32_weight: bool):
    """x [T, D] @ gate_w [E, D]^T with fp32 accumulation. bf16 x bf16 products are exact in fp32, so casting
    the weight to fp32 (the HF reference) and bf16 with fp32 accumulation agree up to summation order."""
    if fp32_weight:
        return jnp.einsum("td,ed->te", x.astype(jnp.float32), gate_w.astype(jnp.float32))
    return jnp.einsum("td,ed->te", x, gate_w, preferred_element_type=jnp.float32)


def route(logits, expert_bias, cfg):
    """logits [T, E] f32 -> (ids [T, A] int32, weights [T, A] f32)."""
    T, E = logits.shape
    G = cfg.n_group
    s = jax.nn.sigmoid(logits)
    sb = s + expert_bias.astype(jnp.float32)
    group_top2 = jax.lax.top_k(sb.reshape(T, G, E // G), 2)[0].sum(-1)  # [T, G]
    _, keep = jax.lax.top_k(group_top2, cfg.topk_group)  # [T, topk_group]
    group_mask = jnp.zeros((T, G), bool).at[jnp.arange(T)[:, None], keep].set(True)
    masked = jnp.where(jnp.repeat(group_mask, E // G, axis=1), sb, -jnp.inf)
    _, ids = jax.lax.top_k(masked, cfg.num_experts_per_tok)
    w = jnp.take_along_axis(s, ids, axis=1)
    if cfg.norm_topk_prob:
        den = topk_weight_sum(w) + 1e-20  # [T, 1]
        # one IEEE quotient per weight, column by column: XLA rewrites w / broadcast(den) as w * broadcast(1 / den)
        # (two roundings; on CPU a quarter of Ling's weights land an ulp off the quotient)
        w = jnp.concatenate([w[:, a:a + 1] / den for a in range(w.shape[1])], axis=1)
    return ids.astype(jnp.int32), w * cfg.routed_scaling_factor


def topk_weight_sum(w):
    """w [T, A] -> [T, 1] f32: ((w_0 + w_1) + w_2) + ... + w_{A-1}, left to right in pick order. Written as a chain
    of elementwise adds, not a reduce: a reduce's association is the backend's choice (XLA CPU's vectorised tree,
    a Triton program's lane layout, which follows T and the program's tile shapes), so a token's weights could
    change with the batch it is in; this order is fixed by construction, the same for every T and every program
    (the Pallas routers add the picks' columns in this order: pallas_kernels.router.normalised_weights)."""
    total = w[:, :1]
    for a in range(1, w.shape[1]):
        total = total + w[:, a:a + 1]
    return total


def routed_experts(x, ids, weights, w_gate, w_up, w_down, limit: float, *, fp8_activations: bool = False):
    """sum_a weights[t, a] * Expert_{ids[t, a]}(x_t), fp32 combine. x [T, D]; w_gate/w_up [E, I, D]; w_down [E, D, I].

    Few tokens: gather the A chosen experts per token. Many tokens: every expert over every token, weighted
    by a dense [T, E] combine matrix (no gather of T*A expert copies). fp8 experts: gathered, then dequantised.
    fp8_activations: each fp8 expert GEMM's input (x, and h before the down projection) goes through the dynamic
    per-token block fp8 of quant.fake_quantize_activations first (quant.gemm_input; w8a8: the MoE kernel's
    fp8_activations form). Per token and group, so quantising before the gather equals quantising each copy.
    """
    T = x.shape[0]
    E = w_gate.shape[0]
    act = lambda a, w: quant.gemm_input(a, w, fp8_activations)
    xg, xu = act(x, w_gate), act(x, w_up)
    if T * ids.shape[1] <= E:
        pick = lambda w: dense(take(w, ids), x.dtype)  # [T, A, ., .]
        g = jnp.einsum("td,tafd->taf", xg, pick(w_gate))
        u = jnp.einsum("td,tafd->taf", xu, pick(w_up))
        h = act(swiglu(g, u, limit), w_down)
        y = jnp.einsum("taf,tadf->tad", h, pick(w_down))  # each expert's output in the activation dtype
        return jnp.einsum("tad,ta->td", y.astype(jnp.float32), weights)
    combine = jnp.zeros((T, E), jnp.float32).at[jnp.arange(T)[:, None], ids].add(weights)
    g = jnp.einsum("td,efd->tef", xg, dense(w_gate, x.dtype))
    u = jnp.einsum("td,efd->tef", xu, dense(w_up, x.dtype))
    h = act(swiglu(g, u, limit), w_down)
    y = jnp.einsum("tef,edf->ted", h, dense(w_down, x.dtype))
    return jnp.einsum("ted,te->td", y.astype(jnp.float32), combine)


def moe_experts(x, ids, weights, w_gate, w_up, w_down, *, limit: float, shared=None, shared_limit: float = 0.0,
                fp8_activations: bool = False):
    """The routed experts plus the shared expert, as one fp32 sum (rounded once, by the caller): x [T, D], ids and
    weights [T, A], the experts as in `routed_experts`, shared = (gate [Is, D], up [Is, D], down [D, Is]) or None
    -> [T, D] f32. The MoE kernels' reference (KernelCalls.moe takes the same arguments); fp8_activations: the
    w8a8 form (see routed_experts), the fp8_activations kernel's reference."""
    y = routed_experts(x, ids, weights, w_gate, w_up, w_down, limit, fp8_activations=fp8_activations)
    if shared is None:
        return y
    return y + shared_expert(x, shared, shared_limit, fp8_activations=fp8_activations)


def shared_expert(x, shared, limit: float, *, fp8_activations: bool = False):
    """The shared expert (a dense SwiGLU MLP) of x [T, D]: shared = (gate [Is, D], up [Is, D], down [D, Is])
    -> [T, D] f32 (its output in the activation dtype, widened for the fp32 sum with the routed experts).
    fp8_activations: fp8 weights read x and h quantised (dense_mlp's, the routed experts' w8a8 form)."""
    gate, up, down = shared
    return dense_mlp({"gate_proj": gate, "up_proj": up, "down_proj": down}, x, limit,
                     fp8_activations=fp8_activations).astype(jnp.float32)


def borrow_routing(ids, w, live_rows, bt):
    """ids, w [B*T, A]; rows t >= live_rows[b] take row live_rows[b]-1's (ids, w)."""
    B, T = bt
    ids, w = ids.reshape(B, T, -1), w.reshape(B, T, -1)
    t = jnp.arange(T)[None, :]
    src = jnp.minimum(t, jnp.maximum(live_rows[:, None], 1) - 1)  # [B, T]
    take = lambda a: jnp.take_along_axis(a, src[..., None], axis=1).reshape(B * T, -1)
    return take(ids), take(w)


def expert_load(ids, num_experts: int):
    """ids [T, A] -> int32[E]: how many (token, slot) pairs each expert received (for noaux_tc bias updates)."""
    return jnp.zeros((num_experts,), jnp.int32).at[ids.reshape(-1)].add(1)


def moe_layer(p, x, cfg, *, routed_limit: float, shared_limit: float, router_fp32: bool, return_load: bool = False,
              kernels=None, live_rows=None, boundary=None, residual=None, fp8_activations: bool = False):
    """x [..., D] -> [..., D]. p: gate_w [E, D], expert_bias [E], w_gate, w_up, w_down, shared {gate,up,down}_proj.
    x: the normed input, or a layers.linear.Normed of the residual stream (one input; not computed yet): the
    router's kernel computes that norm where `kernels.routed_moe` takes it, every other path x.value().
    return_load: also return the expert load int32[E] of this call (training's router balancing).
    kernels: a ling_jax.kernel_calls.KernelCalls to run the router and experts through, or None for the jnp path.
    live_rows: int32[B] or None (x is [B, T, D]): rows t >= live_rows[b] are padding and borrow row
    live_rows[b]-1's experts and weights, so they add no expert reads (their outputs are discarded).
    boundary: (residual [..., D], norm weight [D], eps) or None: return the layer boundary (residual + y, its
    RMSNorm with that weight) in place of y, computed with the MoE in one `kernels.moe_residual_norm` call (under
    TP: the all-reduce of the partial sums fused with the add and the norm). Needs kernels.
    residual: [..., D] or None: return residual + y (y rounded to the activation dtype first: the model's
    `x + moe(x)`), the add in the MoE's down kernel where `kernels.routed_moe` folds it (moe_residual_epilogue).
    Not with boundary (which adds the residual itself).
    fp8_activations: fp8 experts' GEMM inputs quantised (moe_experts; the kernels' w8a8 form). The router's input
    is not (the gate is bf16 in the format)."""
    if boundary is not None and residual is not None:
        raise ValueError("moe_layer: boundary carries its residual; pass boundary or residual, not both")
    if boundary is not None and kernels is None:
        raise ValueError("moe_layer(boundary=...) needs kernels (KernelCalls.moe_residual_norm); the jnp model adds "
                         "and norms in the caller")
    shape, dtype = x.shape, x.dtype  # (a Normed's: those of the normed rows)
    normed = x if isinstance(x, Normed) else None
    flat = lambda a: a.reshape(-1, shape[-1])
    gate_w = dense(p["gate_w"], dtype)
    sh = p["shared"]
    shared = (sh["gate_proj"], sh["up_proj"], sh["down_proj"])
    with_load = lambda out, ids: (out, expert_load(ids, cfg.num_experts)) if return_load else out
    if kernels is not None and not router_fp32:  # router -> up -> down, the expert alignment inside the router
        rows = x if normed is not None and len(normed.parts) == 1 else flat(x if normed is None else x.value())
        fused = kernels.routed_moe(rows, gate_w, p["expert_bias"], cfg, (p["w_gate"], p["w_up"], p["w_down"]),
                                   shared, limit=routed_limit, shared_limit=shared_limit, live_rows=live_rows,
                                   rows_per_seq=shape[-2], fp8_activations=fp8_activations, residual=residual)
        if fused is not None:
            if residual is not None:  # routed_moe returned residual + y (the add in its kernel, or the model's)
                return with_load(fused[0], fused[1])
            y = fused[0].astype(dtype).reshape(shape)
            return with_load(y if boundary is None else add_rms_norm(boundary[0], y, *boundary[1:]), fused[1])
    xt = flat(x if normed is None else normed.value())  # every other path: the model's norm in XLA
    routed = None
    if kernels is not None and not router_fp32:  # one fused Pallas router (matvec + sigmoid + grouped top-k)
        routed = kernels.route(xt, gate_w, p["expert_bias"], cfg)
    if routed is None:
        routed = route(router_logits(xt, gate_w, fp32_weight=router_fp32), p["expert_bias"], cfg)
    ids, w = routed
    if live_rows is not None:
        ids, w = borrow_routing(ids, w, live_rows, shape[:-1])
    experts = (xt, ids, w, p["w_gate"], p["w_up"], p["w_down"])
    if boundary is not None:
        residual, norm_weight, eps = boundary
        out = kernels.moe_residual_norm(*experts, limit=routed_limit, shared=shared, shared_limit=shared_limit,
                                        residual=residual.reshape(xt.shape), norm_weight=norm_weight, eps=eps,
                                        fp8_activations=fp8_activations)
        return with_load(tuple(o.reshape(shape) for o in out), ids)
    if kernels is not None:  # reads only the activated experts, each once; the shared expert rides along
        y = kernels.moe(*experts, limit=routed_limit, shared=shared, shared_limit=shared_limit,
                        fp8_activations=fp8_activations)
    else:
        y = moe_experts(*experts, limit=routed_limit, shared=shared, shared_limit=shared_limit,
                        fp8_activations=fp8_activations)
    y = y.astype(dtype).reshape(shape)
    return with_load(y if residual is None else residual + y, ids)
