"""Kimi Delta Attention (KDA) with Ling-3.0's lower-bound gate, in pure jnp.

Shape legend: B batch, T positions, H heads, K = key head dim, V = value head dim, C = H*K channels of one
stream, W = short-conv kernel width, N chunks, L chunk length. The q, k, v conv streams sit on their own axis
([.., 3, C]) so that sharding C by heads keeps every stream's heads together.

Per head, with fp32 state S [K, V] (Ling-3.0 KDA with the lower-bound gate; oracle fla-core naive_recurrent_kda):
    S_t = (I - b_t k_t k_t^T) Diag(exp g_t) S_{t-1} + b_t k_t v_t^T        o_t = S_t^T (q_t / sqrt(K))

Three forms of the same recurrence:
  * `kda_recurrent`: lax.scan over T (decode, verify, commit replay, exact reference),
  * `kda_chunked`: the chunked (UT) form for prefill and training, exact pairwise decays, differentiable,
  * positions with g = 0 and b = 0 leave S unchanged: that is how padding and "commit only the accepted
    prefix" are expressed with fixed shapes.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from ling_jax.layers.linear import Projection, linear, norm_projections
from ling_jax.layers.norms import l2_normalize


class KdaPending(NamedTuple):
    """What a later commit needs from a verify pass (per layer; stacked over layers by the model).

    qkv_raw: [B, T, 3, C] the conv inputs (to slide the conv window by the accepted count)
    k: [B, T, H, K] normalised keys (f32); v: [B, T, H, V] (f32); g: [B, T, H, K] log decays (f32);
    beta: [B, T, H] (f32). Replaying the accepted prefix from the pre-verify state moves 2 x |S| bytes.
    """

    qkv_raw: jax.Array
    k: jax.Array
    v: jax.Array
    g: jax.Array
    beta: jax.Array


# ---- short convolution --------------------------------------------------------------------------------------


def short_conv(x: jax.Array, w: jax.Array, window: jax.Array) -> jax.Array:
    """Depthwise causal conv + SiLU. x [B, T, *ch], w [*ch, W], window [B, W-1, *ch] (previous inputs)."""
    W = w.shape[-1]
    T = x.shape[1]
    xcat = jnp.concatenate([window.astype(x.dtype), x], axis=1).astype(jnp.float32)  # [B, T+W-1, *ch]
    wf = w.astype(jnp.float32)
    y = sum(xcat[:, j : j + T] * wf[..., j] for j in range(W))  # y_t = sum_j w_j x_{t-W+1+j}
    return jax.nn.silu(y).astype(x.dtype)


def slide_window(window: jax.Array, x: jax.Array, n_valid: jax.Array) -> jax.Array:
    """The last W-1 inputs after consuming x[:, :n_valid]: window [B, W-1, *ch], x [B, T, *ch], n_valid [B]."""
    Wm1 = window.shape[1]
    xcat = jnp.concatenate([window.astype(x.dtype), x], axis=1)  # [B, T+W-1, C]
    take = lambda row, n: lax.dynamic_slice_in_dim(row, n, Wm1, axis=0)
    return jax.vmap(take)(xcat, n_valid.astype(jnp.int32))


# ---- gate -----------------------------------------------------------------------------------------------------


def kda_gate(f: jax.Array, A_log: jax.Array, dt_bias: jax.Array, lower_bound: float) -> jax.Array:
    """g = lower_bound * sigmoid(exp(A_log[h]) * (f + dt_bias[h, :])) in fp32; f [..., H, K] -> g in (lb, 0)."""
    H, K = f.shape[-2:]
    a = jnp.exp(A_log.astype(jnp.float32)).reshape(H, 1)
    return lower_bound * jax.nn.sigmoid(a * (f.astype(jnp.float32) + dt_bias.astype(jnp.float32).reshape(H, K)))


# ---- recurrent form --------------------------------------------------------------------------------------------


def kda_recurrent(q, k, v, g, beta, state):
    """q, k [B, T, H, K] (q already scaled), v [B, T, H, V], g [B, T, H, K], beta [B, T, H], state [B, H, K, V].

    Returns o [B, T, H, V] f32 and the final state. All math in fp32.
    """
    f32 = lambda a: jnp.moveaxis(a.astype(jnp.float32), 1, 0)  # time-major for scan

    def step(S, xs):
        q_t, k_t, v_t, g_t, b_t = xs  # [B, H, K] ... [B, H]
        S = jnp.exp(g_t)[..., None] * S  # decay the key rows
        pred = jnp.einsum("bhkv,bhk->bhv", S, k_t)  # S^T k
        S = S + jnp.einsum("bhk,bhv->bhkv", b_t[..., None] * k_t, v_t - pred)
        o_t = jnp.einsum("bhkv,bhk->bhv", S, q_t)
        return S, o_t

    S, o = lax.scan(step, state.astype(jnp.float32), (f32(q), f32(k), f32(v), f32(g), f32(beta)))
    return jnp.moveaxis(o, 0, 1), S


# ---- chunked form ----------------------------------------------------------------------------------------------


def _chunk_step(S0, xs):
    """One chunk, batched over [B, H]. S0 [B, H, K, V]; q, k [B, H, L, K]; v [B, H, L, V]; g [B, H, L, K]; b [B, H, L].

    With G = cumsum(g) inside the chunk and pseudo-values u_s = b_s (v_s - S_{s-}^T k_s):
        (I + A) U = b * (V - (k e^G) S0),      A[s, r] = b_s sum_c k_s k_r e^(G_s - G_r)  (r < s)
        o_t = (q_t e^G_t) S0 + sum_{s <= t} (sum_c q_t k_s e^(G_t - G_s)) u_s
        S_L = e^(G_L) * S0 + sum_s (k_s e^(G_L - G_s)) u_s^T
    Decay ratios are formed as e^(G_t - G_s) with t >= s only, so nothing overflows.
    """
    q, k, v, g, b = xs
    L = q.shape[-2]
    G = jnp.cumsum(g, axis=-2)  # [B, H, L, K]
    diff = G[..., :, None, :] - G[..., None, :, :]  # [B, H, L(t), L(s), K] = G_t - G_s
    idx = jnp.arange(L)
    incl = (idx[:, None] >= idx[None, :])[..., None]
    decay = jnp.exp(jnp.where(incl, diff, -jnp.inf))  # e^(G_t - G_s) for s <= t, else 0
    kk = jnp.einsum("bhtc,bhsc,bhtsc->bhts", k, k, decay)
    A = b[..., :, None] * jnp.where(idx[:, None] > idx[None, :], kk, 0.0)  # strictly lower
    rhs = b[..., None] * (v - jnp.einsum("bhtk,bhkv->bhtv", k * jnp.exp(G), S0))
    eye = jnp.eye(L, dtype=A.dtype)
    U = jax.scipy.linalg.solve_triangular(eye + A, rhs, lower=True, unit_diagonal=True)
    qk = jnp.einsum("bhtc,bhsc,bhtsc->bhts", q, k, decay)
    o = jnp.einsum("bhtk,bhkv->bhtv", q * jnp.exp(G), S0) + jnp.einsum("bhts,bhsv->bhtv", qk, U)
    G_last = G[..., -1:, :]  # [B, H, 1, K]
    S = jnp.exp(G_last)[..., 0, :, None] * S0 + jnp.einsum("bhsk,bhsv->bhkv", k * jnp.exp(G_last - G), U)
    return S, o


def kda_chunked(q, k, v, g, beta, state, chunk: int = 64):
    """Same contract as `kda_recurrent`; T is padded with no-op positions (g = 0, b = 0) to a chunk multiple."""
    B, T, H, K = q.shape
    Vd = v.shape[-1]
    L = min(chunk, T)
    N = -(-T // L)
    pad = N * L - T

    def prep(a):  # [B, T, H, ...] -> [N, B, H, L, ...] f32
        a = a.astype(jnp.float32)
        a = jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))
        a = a.reshape((B, N, L) + a.shape[2:])
        return jnp.moveaxis(jnp.moveaxis(a, 1, 0), 2, 3)  # [N, B, L, H, ...] -> [N, B, H, L, ...]

    S, o = lax.scan(_chunk_step, state.astype(jnp.float32), (prep(q), prep(k), prep(v), prep(g), prep(beta)))
    o = jnp.moveaxis(o, 0, 1)  # [B, N, H, L, V]
    o = jnp.moveaxis(o, 2, 3).reshape(B, N * L, H, Vd)[:, :T]
    return o, S


# ---- the layer ---------------------------------------------------------------------------------------------------


def kda_projections(p, x, kernels=None, fp8_activations: bool = False):
    """x [B, T, D] (the normed input, or a layers.linear.Normed) -> (proj [B, T, 5, C]: the q, k, v, f, g streams;
    b_raw [B, T, H]): the layer's input projections, one fused norm + projection kernel where `kernels` takes it."""
    return norm_projections(x, (Projection(p["w_qkvfg"]), Projection(p["b_proj"])), kernels,
                            fp8_activations=fp8_activations)


def kda_project(p, x, conv_window, cfg, kernels=None, fp8_activations: bool = False):
    """Projections + short conv + normalisations shared by every mode.

    x [B, T, D] (or a Normed) -> (q [B,T,H,K] scaled f32, k [B,T,H,K] f32, v [B,T,H,V] f32, g, beta,
    qkv_raw [B,T,3,C], out_gate [B,T,C]).
    """
    proj, b_raw = kda_projections(p, x, kernels, fp8_activations)  # [B, T, 5, C], [B, T, H]
    q, k, v, g, beta = kda_inputs(proj, b_raw, p, conv_window, cfg.kda_lower_bound, x.dtype)
    return q, k, v, g, beta, proj[:, :, :3], proj[:, :, 4]


def kda_inputs(proj, b_raw, p, conv_window, lower_bound: float, dtype):
    """The recurrence's inputs from the raw streams (the fused KDA kernels' reference: they take the same streams).

    proj [B, T, >=4, C] (the q, k, v, f streams; a 5th, the out gate, is not read), b_raw [B, T, H], p: conv_w
    [3, C, 1, W], A_log [H], dt_bias [C]; conv_window [B, W-1, 3, C]; dtype the activation dtype
    -> (q [B,T,H,K] scaled, k [B,T,H,K], v [B,T,H,V], g [B,T,H,K], beta [B,T,H]), all f32.
    Rounding points (bf16 activations): the conv + SiLU output, and q, k after the l2norm (before q's scale).
    """
    B, T, H = b_raw.shape
    Kd = proj.shape[-1] // H
    qkv = short_conv(proj[:, :, :3], p["conv_w"][:, :, 0, :], conv_window)  # conv_w [3, C, 1, W]
    # l2norm in fp32, rounded to the activation dtype before the fp32 recurrence (as fla does).
    to_act = lambda a: a.astype(dtype).astype(jnp.float32)
    q = to_act(l2_normalize(qkv[:, :, 0].reshape(B, T, H, Kd))) * (Kd**-0.5)
    k = to_act(l2_normalize(qkv[:, :, 1].reshape(B, T, H, Kd)))
    v = qkv[:, :, 2].reshape(B, T, H, Kd).astype(jnp.float32)
    g = kda_gate(proj[:, :, 3].reshape(B, T, H, Kd), p["A_log"], p["dt_bias"], lower_bound)
    beta = jax.nn.sigmoid(b_raw.astype(jnp.float32))
    return q, k, v, g, beta


def kda_output_gate(p, o, out_gate, eps: float, dtype):
    """o [B, T, H, V] (f32, or already in `dtype`) -> RMSNorm_V(o) * o_norm * sigmoid(out_gate) -> [B, T, H*V] in
    `dtype`: the output epilogue of every KDA path, and the reference of kda_verify's folded epilogue
    (KernelCalls.kda_verify_epilogue). out_gate [B, T, H*V] the fifth stream of the fused projection.
    Rounding points: o in `dtype` first (the recurrence hands its output over in the activation dtype), then the
    norm, o_norm and gate in f32, rounded to `dtype` once at the end."""
    B, T, H, Vd = o.shape
    o = o.astype(dtype).astype(jnp.float32)
    o = o * jax.lax.rsqrt(jnp.mean(o * o, axis=-1, keepdims=True) + eps)
    o = o * p["o_norm"].astype(jnp.float32) * jax.nn.sigmoid(out_gate.astype(jnp.float32)).reshape(B, T, H, Vd)
    return o.reshape(B, T, H * Vd).astype(dtype)


def kda_output(p, o, out_gate, cfg, dtype, kernels=None, residual=None, fp8_activations: bool = False):
    """o [B, T, H, V] f32 -> kda_output_gate (RMSNorm_V(o) * o_norm * sigmoid(g_proj x)) -> o_proj -> [B, T, D]
    (+ residual, in the projection's kernel where `kernels` takes it: see layers.linear.linear)."""
    return linear(kda_output_gate(p, o, out_gate, cfg.rms_norm_eps, dtype), p["o_proj"], kernels, residual,
                  fp8_activations=fp8_activations)


def no_op_mask(g, beta, n_valid):
    """Turn positions t >= n_valid[b] into no-ops of the recurrence (g = 0, beta = 0)."""
    T = beta.shape[1]
    live = jnp.arange(T)[None, :] < n_valid[:, None]  # [B, T]
    return jnp.where(live[..., None, None], g, 0.0), jnp.where(live[..., None], beta, 0.0)


def _kernel_inputs(p, x, conv_window, rec_state, kernels=None, fp8_activations: bool = False):
    """The fused decode kernel's arguments (raw q/k/v/f streams, b, gates, conv weights, states) and the out-gate
    stream, from one projection of x."""
    proj, b_raw = kda_projections(p, x, kernels, fp8_activations)  # [B, T, 5, C], [B, T, H]
    conv_w = p["conv_w"]  # [3, C, 1, W]
    args = (proj[:, :, 0], proj[:, :, 1], proj[:, :, 2], proj[:, :, 3], b_raw, p["A_log"], p["dt_bias"],
            conv_w[0], conv_w[1], conv_w[2], conv_window, rec_state)
    return args, proj


def kda_in_place(kernels, mode: str) -> bool:
    """Whether the KDA blocks of a decode / verify pass run the verify kernel on the model's stacked states in
    place (kernels, decode not fused): each block reads its layer of the stacks where they lie and writes its rows
    into one stacked KdaPending, and one commit call then advances every layer (`kda_commit_layers`): no XLA
    slice, scatter or copy of a state around the kernels."""
    return (kernels is not None and mode in ("decode", "verify")
            and not (mode == "decode" and kernels.kda_fused_decode))


def kda_verify_block(p, x, conv, rec, cfg, *, layer: int, pending, kernels, residual=None,
                     fp8_activations: bool = False):
    """One KDA block's verify on the model's stacked states, in place (see `kda_in_place`).

    x [B, T, D] the normed input (or a layers.linear.Normed); conv [Lk, B, W-1, 3, C] and rec [Lk, B, H, K, V]
    read at `layer` by the kernel, never written; pending: the stacked KdaPending [Lk, ...] the blocks before wrote
    (None for the first). The kernel takes the fused projection [B, T, 5, C] and conv_w [3, C, 1, W] whole; where
    kernels.kda_epilogue_in_verify(V) it also runs kda_output_gate (the norm + gate epilogue, its o_norm and the
    out-gate stream of proj) and hands o_proj its [B, T, H*V] input, else the epilogue runs here in XLA.
    Returns (out [B, T, D] (+ residual, as kda_layer), pending with this layer's rows written in place)."""
    proj, b_raw = kda_projections(p, x, kernels, fp8_activations)  # [B, T, 5, C], [B, T, H]
    args = (proj, b_raw, p["A_log"], p["dt_bias"], p["conv_w"], conv, rec, layer, pending)
    if kernels.kda_epilogue_in_verify(rec.shape[-1]):
        o, rows = kernels.kda_verify(*args, lower_bound=cfg.kda_lower_bound, o_norm=p["o_norm"],
                                     eps=cfg.rms_norm_eps)  # [B, T, H*V] in x's dtype: o_proj's input
        out = linear(o, p["o_proj"], kernels, residual, fp8_activations=fp8_activations)
        return out, KdaPending(*rows)
    o, rows = kernels.kda_verify(*args, lower_bound=cfg.kda_lower_bound)
    return kda_output(p, o, proj[:, :, 4], cfg, x.dtype, kernels, residual, fp8_activations), KdaPending(*rows)


def _pallas_decode(p, x, conv_window, rec_state, cfg, kernels, fp8_activations: bool = False):
    """One fused kernel for T = 1: conv + gates + beta + l2norm + delta rule + in-place state update. Every sequence
    must be live (n_valid = 1: plain_step's decode), since the kernel always advances the state."""
    args, proj = _kernel_inputs(p, x, conv_window, rec_state, kernels, fp8_activations)
    o, new_rec, new_conv = kernels.kda_decode(*args, lower_bound=cfg.kda_lower_bound)
    return o, new_rec, new_conv, proj[:, :, 4]


def kda_layer(p, x, conv_window, rec_state, cfg, *, mode: str, n_valid, chunked: bool, kernels=None,
              residual=None, fp8_activations: bool = False):
    """One KDA attention block: x [B, T, D] the normed input (or a layers.linear.Normed, whose norm the input
    projection kernel may fold in). Without `residual` the block's output; with it, residual + that output (the
    add rides in the output projection's kernel).

    mode "prefill"/"decode": consume x[:, :n_valid] and return the new (conv_window, rec_state).
    mode "verify": leave both states untouched and return a KdaPending for `kda_commit`.
    kernels: a ling_jax.kernel_calls.KernelCalls, or None for the jnp path. Its kda_fused_decode runs decode in
    one kernel (B = 1 decode always has n_valid = 1); with kda_in_place, decode / verify run kda_verify_block
    (+ kda_commit_layers) on this layer's states as stacks of one (the model calls kda_verify_block on its own
    stacks instead: no copy of a state around the kernel).
    fp8_activations: fp8 projections read their inputs quantised (layers.linear; Numerics.fp8_activations).
    Returns (out [B, T, D], conv_window, rec_state, pending or None).
    """
    fa = fp8_activations
    if kernels is not None and mode == "decode" and kernels.kda_fused_decode:
        o, rec_state, conv_window, out_gate = _pallas_decode(p, x, conv_window, rec_state, cfg, kernels, fa)
        return kda_output(p, o, out_gate, cfg, x.dtype, kernels, residual, fa), conv_window, rec_state, None
    if kda_in_place(kernels, mode):  # this layer's states as stacks of one (the model passes its stacks)
        out, pending = kda_verify_block(p, x, conv_window[None], rec_state[None], cfg, layer=0, pending=None,
                                        kernels=kernels, residual=residual, fp8_activations=fa)
        if mode == "verify":
            return out, conv_window, rec_state, jax.tree.map(lambda a: a[0], pending)
        conv, rec = kda_commit_layers(conv_window[None], rec_state[None], pending, n_valid, kernels)
        return out, conv[0], rec[0], None
    q, k, v, g, beta, qkv_raw, out_gate = kda_project(p, x, conv_window, cfg, kernels, fa)
    if mode == "verify":
        o, _ = kda_recurrent(q, k, v, g, beta, rec_state)
        out = kda_output(p, o, out_gate, cfg, x.dtype, kernels, residual, fa)
        return out, conv_window, rec_state, KdaPending(qkv_raw, k, v, g, beta)
    g, beta = no_op_mask(g, beta, n_valid)
    core = kda_chunked if chunked else kda_recurrent
    o, new_state = core(q, k, v, g, beta, rec_state)
    out = kda_output(p, o, out_gate, cfg, x.dtype, kernels, residual, fa)
    return out, slide_window(conv_window, qkv_raw, n_valid), new_state, None


def kda_commit(conv_window, rec_state, pending: KdaPending, n_accept):
    """Apply the first n_accept[b] verified positions to the committed state (replay from the pre-verify S)."""
    new_state = kda_replay(rec_state, pending.k, pending.v, pending.g, pending.beta, n_accept)
    return slide_window(conv_window, pending.qkv_raw, n_accept), new_state


def kda_commit_layers(conv, rec, pending: KdaPending, n_accept, kernels=None):
    """Commit every KDA layer: conv [Lk, B, W-1, 3, C], rec [Lk, B, H, K, V], pending stacked [Lk, ...] ->
    (conv, rec). kernels: ONE kernel call for all layers, both states updated in place; None: kda_commit per
    layer (its reference)."""
    if kernels is not None:
        rec, conv = kernels.kda_commit(rec, conv, pending, n_accept)
        return conv, rec
    return jax.vmap(kda_commit, in_axes=(0, 0, 0, None))(conv, rec, pending, n_accept)


def kda_replay(rec_state, k, v, g, beta, n_accept):
    """The state after the first n_accept[b] positions of (k, v, g, beta) (as KdaPending holds them) from
    rec_state [B, H, K, V]: the commit kernel's reference."""
    g, beta = no_op_mask(g, beta, n_accept)
    _, new_state = kda_recurrent(jnp.zeros_like(k), k, v, g, beta, rec_state)
    return new_state
