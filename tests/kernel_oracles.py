"""The kernels' references: the MODEL's own jnp functions (ling_jax/layers/*), called with the kernels' argument
layouts. Layout only here (stack, reshape, name the config fields); every piece of math and every rounding point
is the model's, written once in ling_jax. Used by the kernel tests and by the benches (their XLA baselines).

Kernel layouts (pallas_kernels): router x [T, D], gate_w [E, D], expert_bias [E]; MoE x [T, D], ids / weights
[T, A], experts [E, I, D] / [E, D, I], shared (gate [Is, D], up [Is, D], down [D, Is]); KDA verify/commit the
model's own (proj [B, T, S, C], conv_w [3, C, 1, W], the stacked conv_state [L, B, W-1, 3, C] and rec_state
[L, B, H, K, V] f32 read at a layer); KDA decode the raw streams q/k/v/f [B, T, C], b_raw [B, T, H], conv weights
3 x [C, 1, W], conv_state [B, W-1, 3C] (q | k | v channels), rec_state [B, H, K, V] f32.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ling_jax.config import ModelConfig
from ling_jax.layers import kda as model_kda
from ling_jax.layers import moe as model_moe
from pallas_kernels.kda_verify import KdaRows


@functools.partial(jax.jit, static_argnames=("n_group", "topk_group", "top_k", "routed_scaling_factor",
                                             "norm_topk_prob"))
def route(x, gate_w, expert_bias, *, n_group, topk_group, top_k, routed_scaling_factor, norm_topk_prob=True):
  """pallas_kernels.router.route's contract through the model's router_logits (bf16 weight, fp32 accumulation:
  the kernel's path in moe_layer) and route -> (ids [T, A] int32, weights [T, A] f32)."""
  cfg = ModelConfig(num_experts=gate_w.shape[0], num_experts_per_tok=top_k, n_group=n_group, topk_group=topk_group,
                    routed_scaling_factor=routed_scaling_factor, norm_topk_prob=norm_topk_prob)
  return model_moe.route(model_moe.router_logits(x, gate_w, fp32_weight=False), expert_bias, cfg)


@functools.partial(jax.jit, static_argnames=("limit", "shared_limit", "fp8_activations"))
def moe(x, topk_ids, topk_weights, w_gate, w_up, w_down, *, limit=0.0, shared=None, shared_limit=0.0,
        fp8_activations=False):
  """The MoE kernels' contract (-> [T, D] in x.dtype) through the model's moe_experts, rounded once as
  moe_layer rounds it (fp8_activations: its w8a8 form, the fp8 kernel's fp8_activations reference)."""
  y = model_moe.moe_experts(x, topk_ids, topk_weights, w_gate, w_up, w_down, limit=limit, shared=shared,
                            shared_limit=shared_limit, fp8_activations=fp8_activations)
  return y.astype(x.dtype)


def _model_layout(q_raw, k_raw, v_raw, f_raw, A_log, dt_bias, q_conv_w, k_conv_w, v_conv_w, conv_state):
  """The kernel's KDA operands in the model's layout: (proj [B, T, 4, C], params, conv_window [B, W-1, 3, C])."""
  bsz, wm1 = conv_state.shape[:2]
  proj = jnp.stack([q_raw, k_raw, v_raw, f_raw], axis=2)
  p = dict(conv_w=jnp.stack([q_conv_w, k_conv_w, v_conv_w]), A_log=A_log, dt_bias=dt_bias)
  return proj, p, conv_state.reshape(bsz, wm1, 3, -1)


@functools.partial(jax.jit, static_argnames=("lower_bound", "eps"))
def kda_verify(proj, b_raw, A_log, dt_bias, conv_w, conv_state, rec_state, layer, rows=None, *, lower_bound=-5.0,
               o_norm=None, eps=1e-6):
  """pallas_kernels.kda_verify.kda_verify's contract through the model's kda_inputs + kda_recurrent (its verify
  path) -> (o [B, T, H, V] rounded to the activation dtype (the projection's) as kda_output_gate does first, KdaRows
  with layer `layer` set; rows None: the other layers zero); with o_norm, o through the model's kda_output_gate
  (out gate: stream 4 of proj) -> [B, T, H*V]."""
  p = dict(conv_w=conv_w, A_log=A_log, dt_bias=dt_bias)
  q, k, v, g, beta = model_kda.kda_inputs(proj, b_raw, p, conv_state[layer], lower_bound, proj.dtype)
  o, _ = model_kda.kda_recurrent(q, k, v, g, beta, rec_state[layer])
  mine = KdaRows(proj[:, :, :3], k, v, g, beta)
  if rows is None:
    rows = jax.tree.map(lambda a: jnp.zeros((rec_state.shape[0],) + a.shape, a.dtype), mine)
  rows = jax.tree.map(lambda stack, a: stack.at[layer].set(a), KdaRows(*rows), mine)
  if o_norm is not None:
    return model_kda.kda_output_gate(dict(o_norm=o_norm), o, proj[:, :, 4], eps, proj.dtype), rows
  return o.astype(proj.dtype), rows


@jax.jit
def kda_commit(rec_state, conv_state, rows, n_accept):
  """pallas_kernels.kda_verify.kda_commit's contract through the model's kda_replay and slide_window, layer by
  layer -> (rec_state, conv_state)."""
  def layer(state, window, r):
    return model_kda.kda_replay(state, r.k, r.v, r.g, r.beta, n_accept), \
        model_kda.slide_window(window, r.qkv_raw, n_accept).astype(window.dtype)
  return jax.vmap(layer)(rec_state, conv_state, KdaRows(*rows))


@functools.partial(jax.jit, static_argnames=("lower_bound",))
def kda_decode(q_raw, k_raw, v_raw, f_raw, b_raw, A_log, dt_bias, q_conv_w, k_conv_w, v_conv_w, conv_state,
               rec_state, *, lower_bound=-5.0):
  """pallas_kernels.kda_decode.kda_decode's contract (T = 1) through the model's decode path (kda_inputs,
  kda_recurrent, slide_window) -> (o [B, 1, H, V] f32, rec_state, conv_state [B, W-1, 3C])."""
  proj, p, window = _model_layout(q_raw, k_raw, v_raw, f_raw, A_log, dt_bias, q_conv_w, k_conv_w, v_conv_w,
                                  conv_state)
  q, k, v, g, beta = model_kda.kda_inputs(proj, b_raw, p, window, lower_bound, q_raw.dtype)
  o, state = model_kda.kda_recurrent(q, k, v, g, beta, rec_state)
  ones = jnp.ones((q_raw.shape[0],), jnp.int32)
  new_window = model_kda.slide_window(window, proj[:, :, :3], ones)
  return o, state, new_window.reshape(conv_state.shape)
