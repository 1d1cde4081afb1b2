"""Token choice: greedy, temperature / top-p sampling, and the lossless chain verdicts of speculative decoding.

Shape legend: B batch, V vocab, K drafted tokens (= speculative steps).
Everything is fixed-shape device arithmetic; counts are device integers (n_accept = cumprod(match).sum()).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling knobs as device scalars (changing them does not recompile).

    temperature: f32[]  (0 selects greedy; the greedy/sampled choice itself is a static flag of the step)
    top_p: f32[]        (1 keeps the whole distribution)
    """

    temperature: jax.Array
    top_p: jax.Array

    @staticmethod
    def make(temperature: float = 0.0, top_p: float = 1.0) -> "SamplingParams":
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        return SamplingParams(jnp.float32(temperature), jnp.float32(top_p))


def greedy(logits):
    """[..., V] -> int32[...]: argmax (first index on ties)."""
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)


def probs(logits, sp: SamplingParams):
    """The distribution actually sampled from: softmax(logits / T), restricted to the top-p nucleus and
    renormalised. [..., V] f32 -> [..., V] f32. Target and draft both use it, so the verdict stays lossless."""
    p = jax.nn.softmax(logits.astype(jnp.float32) / jnp.maximum(sp.temperature, 1e-6), axis=-1)
    sorted_p = jnp.sort(p, axis=-1)[..., ::-1]
    before = jnp.cumsum(sorted_p, axis=-1) - sorted_p  # mass strictly above each sorted entry
    kept = jnp.where(before < sp.top_p, sorted_p, jnp.inf)
    threshold = jnp.min(kept, axis=-1, keepdims=True)  # smallest probability still inside the nucleus
    p = jnp.where(p >= threshold, p, 0.0)
    return p / jnp.sum(p, axis=-1, keepdims=True)


def sample(key, p):
    """Draw from p [..., V] -> int32[...]."""
    return jax.random.categorical(key, jnp.log(p), axis=-1).astype(jnp.int32)


def greedy_verdict(drafts, target_tokens):
    """drafts int32[B, K] (d_1..d_K); target_tokens int32[B, K+1] = argmax at verify rows 0..K.

    d_j is accepted while d_j == target_tokens[j-1] for every earlier j too:
        n_accept = sum_j prod_{i<=j} [d_i == t_{i-1}]           (0..K)
    The committed new tokens are d_1..d_n then the bonus t_n: exactly target_tokens[:, :n+1].
    Returns (n_accept int32[B], bonus int32[B]).
    """
    match = (drafts == target_tokens[:, :-1]).astype(jnp.int32)
    n = jnp.sum(jnp.cumprod(match, axis=1), axis=1).astype(jnp.int32)
    bonus = jnp.take_along_axis(target_tokens, n[:, None], axis=1)[:, 0]
    return n, bonus


def sampled_verdict(key, drafts, q, p):
    """Lossless speculative sampling for a chain (Leviathan et al. / Chen et al.).

    drafts int32[B, K]; q f32[B, K, V]: the draft distribution each d_j was drawn from;
    p f32[B, K+1, V]: target distributions at verify rows 0..K (row j-1 scores d_j).
    Accept d_j with probability min(1, p_{j-1}(d_j) / q_j(d_j)) while all earlier were accepted; at the first
    rejection j draw the bonus from norm(max(0, p_{j-1} - q_j)); if all K pass, draw it from p_K.
    Returns (n_accept int32[B], bonus int32[B]); committed tokens are d_1..d_n then the bonus.
    """
    B, K = drafts.shape
    k_acc, k_bonus = jax.random.split(key)
    p_d = jnp.take_along_axis(p[:, :K], drafts[..., None], axis=2)[..., 0]  # [B, K]
    q_d = jnp.take_along_axis(q, drafts[..., None], axis=2)[..., 0]
    u = jax.random.uniform(k_acc, (B, K))
    accept = (u * q_d < p_d).astype(jnp.int32)  # u < p/q without dividing by q
    n = jnp.sum(jnp.cumprod(accept, axis=1), axis=1).astype(jnp.int32)
    q_pad = jnp.concatenate([q, jnp.zeros_like(q[:, :1])], axis=1)  # no draft to subtract after K
    row = lambda a: jnp.take_along_axis(a, n[:, None, None], axis=1)[:, 0]  # [B, V] at row n
    residual = jnp.maximum(row(p) - row(q_pad), 0.0)
    mass = jnp.sum(residual, axis=-1, keepdims=True)
    # If p == q exactly the residual is empty; any draw is then correct, fall back to p itself.
    residual = jnp.where(mass > 0, residual / jnp.where(mass > 0, mass, 1.0), row(p))
    return n, sample(k_bonus, residual)
