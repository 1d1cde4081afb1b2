"""MoE router (DeepSeek-V3 noaux_tc, sigmoid scores, grouped top-k).

Shape legend: T tokens, D hidden, E experts, G groups (n_group), A experts per token (top_k).

  logits = x @ gate_w.T                      (fp32 accumulation)
  s  = sigmoid(logits);  sb = s + expert_bias          # the bias only selects
  group score = sum of the top-2 sb in each of G groups; keep the top topk_group groups
  ids = top_k(sb masked to -inf outside kept groups);  w = s[ids]
  w = w / (sum w + 1e-20) * routed_scaling_factor      (if norm_topk_prob)

Only the XLA version exists: the router is a [T, D] x [D, E] product (2.6 MB of weight at
full size) plus top-k on [T, 512]; a fused Pallas version is only worth keeping if it beats
XLA in the same bench run (bench/KERNEL_NOTES.md), so `route` is the reference.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


@functools.partial(jax.jit, static_argnames=("n_group", "topk_group", "top_k",
                                             "routed_scaling_factor", "norm_topk_prob"))
def route_reference(x, gate_w, expert_bias, *, n_group, topk_group, top_k,
                    routed_scaling_factor, norm_topk_prob=True):
  """x [T, D], gate_w [E, D], expert_bias [E] f32 -> (ids [T, A] int32, weights [T, A] f32)."""
  t = x.shape[0]
  e = gate_w.shape[0]
  logits = jnp.einsum("td,ed->te", x, gate_w, preferred_element_type=jnp.float32)  # [T, E]
  s = jax.nn.sigmoid(logits)
  sb = s + expert_bias.astype(jnp.float32)[None, :]
  grouped = sb.reshape(t, n_group, e // n_group)                      # [T, G, E/G]
  group_score = jax.lax.top_k(grouped, 2)[0].sum(-1)                  # [T, G]
  _, keep = jax.lax.top_k(group_score, topk_group)                    # [T, topk_group]
  group_mask = jnp.zeros((t, n_group), bool).at[jnp.arange(t)[:, None], keep].set(True)
  masked = jnp.where(jnp.repeat(group_mask, e // n_group, axis=1), sb, -jnp.inf)
  _, ids = jax.lax.top_k(masked, top_k)                               # [T, A]
  w = jnp.take_along_axis(s, ids, axis=1)
  if norm_topk_prob:
    w = w / (w.sum(-1, keepdims=True) + 1e-20)
  return ids.astype(jnp.int32), w * routed_scaling_factor


route = route_reference
