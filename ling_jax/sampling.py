"""Token choice: SGLang's sampling transforms, greedy / sampled picks, logprobs, and the lossless chain verdicts.

Shape legend: B batch, V vocab, K drafted tokens (= speculative steps), N = MAX_TOP_LOGPROBS.
Everything is fixed-shape device arithmetic; counts are device integers (n_accept = cumprod(match).sum()).

One row's distribution, in SGLang's order (`SamplingBatchInfo.apply_logits_bias`, then the sampler):
    l  = logits                                                     (target or draft head, f32)
    l  = l / r  where l > 0,  l * r  elsewhere,  for tokens seen in the prompt or the output   (repetition)
    l -= f * count_out(x) + a * [count_out(x) > 0]                  (frequency f, presence a: output only)
    l += bias                                                        (logit_bias, dense over V)
    greedy (T = 0): argmax l
    sampled: p = softmax(l / T), then keep the sorted prefix with rank < top_k, mass before < top_p and
             p >= min_p * max p (the top token always stays), renormalise, draw.
Per-row batches (continuous batching, ling_jax/batching.py): SamplingParams fields may be [B] (logit_bias [B, V])
and the key one key per row (key[B]); each row then draws from its own key exactly as a batch-1 state with that key
would, and rows with temperature 0 take the argmax inside the sampled program (a mixed batch runs that program).
With scalar fields and one key (batch-1 programs) every function below is the batch-1 math unchanged.
Speculation applies the SAME transform to the draft and to every verify row, each row with the counts of the
tokens it would follow (the chain drafted so far), so the verdict stays lossless for the transformed target.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

MAX_TOP_LOGPROBS = 20  # top logprobs computed every step (OpenAI's limit for chat top_logprobs)


@dataclass(frozen=True)
class SamplingOptions:
    """One request's sampling fields as the APIs give them (host values, validated here).

    top_k: -1 or 0 keep every token. logit_bias: ((token id, bias), ...), summed per id.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self):
        checks = [
            (self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k == -1 or self.top_k >= 0, f"top_k must be -1 (all), 0 (all) or >= 1, got {self.top_k}"),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}"),
            (0 < self.repetition_penalty <= 2, f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}"),
            (-2 <= self.presence_penalty <= 2, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (-2 <= self.frequency_penalty <= 2, f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ValueError(msg)
        for tok, bias in self.logit_bias:
            if not (isinstance(tok, int) and tok >= 0 and math.isfinite(bias)):
                raise ValueError(f"logit_bias entries must be (token id >= 0, finite bias), got ({tok}, {bias})")

    def kwargs(self) -> dict:
        """The fields by name (Generator.stream's sampling keyword arguments)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @property
    def is_greedy(self) -> bool:
        """Temperature 0 selects the greedy program (a static flag of the step, compiled once)."""
        return self.temperature == 0.0

    @property
    def adjusts_logits(self) -> bool:
        """Whether adjust_logits may change this request's logits (a penalty or a logit bias is set). False: it is
        the identity, so a greedy token is argmax of the logits themselves and the step may be one whose static
        adjusts_logits is False (the fused lm_head + argmax, ling_jax/spec.py: argmax_only)."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or bool(self.logit_bias))

    def device(self, vocab_size: int) -> "SamplingParams":
        bias = np.zeros((vocab_size,), np.float32)
        for tok, b in self.logit_bias:
            if tok >= vocab_size:
                raise ValueError(f"logit_bias token id {tok} is outside the vocabulary [0, {vocab_size})")
            bias[tok] += b
        top_k = vocab_size if self.top_k <= 0 else min(self.top_k, vocab_size)
        f32 = jnp.float32
        return SamplingParams(f32(self.temperature), f32(self.top_p), jnp.int32(top_k), f32(self.min_p),
                              f32(self.repetition_penalty), f32(self.presence_penalty), f32(self.frequency_penalty),
                              jnp.asarray(bias))


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling knobs on device (data, not static arguments: changing them does not recompile).

    temperature, top_p, min_p, repetition_penalty, presence_penalty, frequency_penalty: f32[]
    top_k: int32[]        (V keeps every token)
    logit_bias: f32[V]    (dense; 0 = no bias)
    """

    temperature: jax.Array
    top_p: jax.Array
    top_k: jax.Array
    min_p: jax.Array
    repetition_penalty: jax.Array
    presence_penalty: jax.Array
    frequency_penalty: jax.Array
    logit_bias: jax.Array

    @property
    def per_row(self) -> bool:
        """Fields are [B] (one request per row) rather than scalars shared by the batch."""
        return self.temperature.ndim == 1

    def rows(self, ndim: int) -> "SamplingParams":
        """Per-row fields reshaped to broadcast against an array [B, ..., V] of `ndim` dims; scalars as they are."""
        if not self.per_row:
            return self
        col = lambda x: x.reshape(x.shape[:1] + (1,) * (ndim - 1))
        bias = self.logit_bias
        return SamplingParams(*(col(getattr(self, f.name)) for f in dataclasses.fields(self)[:-1]),
                              bias.reshape(bias.shape[:1] + (1,) * (ndim - 2) + bias.shape[-1:]))

    @staticmethod
    def shapes(vocab_size: int) -> "SamplingParams":
        """ShapeDtypeStructs (for tracing without values)."""
        f, S = jax.ShapeDtypeStruct((), jnp.float32), jax.ShapeDtypeStruct
        return SamplingParams(f, f, S((), jnp.int32), f, f, f, f, S((vocab_size,), jnp.float32))


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class TokenHistory:
    """What the penalties read, updated on device from committed tokens.

    prompt: bool[B, V]    token occurs in the prompt (repetition penalty)
    output: int32[B, V]   occurrences in the emitted output so far (all three penalties)
    """

    prompt: jax.Array
    output: jax.Array

    @staticmethod
    def empty(batch: int, vocab_size: int) -> "TokenHistory":
        return TokenHistory(jnp.zeros((batch, vocab_size), bool), jnp.zeros((batch, vocab_size), jnp.int32))

    @staticmethod
    def shapes(batch: int, vocab_size: int) -> "TokenHistory":
        S = jax.ShapeDtypeStruct
        return TokenHistory(S((batch, vocab_size), jnp.bool_), S((batch, vocab_size), jnp.int32))

    def add_prompt(self, tokens, live) -> "TokenHistory":
        """tokens int32[B, T], live bool[B, T]: mark the live ones as prompt tokens."""
        V = self.prompt.shape[-1]
        rows = jnp.arange(tokens.shape[0])[:, None]
        return TokenHistory(self.prompt.at[rows, jnp.where(live, tokens, V)].set(True, mode="drop"), self.output)

    def add_output(self, tokens, live) -> "TokenHistory":
        """tokens int32[B, T], live bool[B, T]: count the live ones as emitted."""
        rows = jnp.arange(tokens.shape[0])[:, None]
        return TokenHistory(self.prompt, self.output.at[rows, tokens].add(live.astype(jnp.int32)))


def chain_counts(output, drafts):
    """Output counts seen by verify rows 0..K: row j follows the bonus (already counted) and d_1..d_j.
    output int32[B, V], drafts int32[B, K] -> int32[B, K+1, V]."""
    onehot = jax.nn.one_hot(drafts, output.shape[-1], dtype=jnp.int32)  # [B, K, V]
    before = jnp.concatenate([jnp.zeros_like(onehot[:, :1]), jnp.cumsum(onehot, axis=1)], axis=1)
    return output[:, None] + before


def adjust_logits(logits, sp: SamplingParams, prompt, output):
    """Penalties and logit bias (SGLang's order). logits f32[..., V]; prompt bool / output int32 broadcastable to
    it. With the neutral values (r = 1, f = a = 0, bias 0) every logit comes back bit-for-bit unchanged."""
    logits = logits.astype(jnp.float32)
    sp = sp.rows(logits.ndim)
    r = sp.repetition_penalty
    seen = prompt | (output > 0)
    logits = jnp.where(seen, jnp.where(logits > 0, logits / r, logits * r), logits)
    logits = logits - sp.frequency_penalty * output - sp.presence_penalty * (output > 0)
    return logits + sp.logit_bias


def greedy(logits):
    """[..., V] -> int32[...]: argmax (first index on ties)."""
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)


def probs(logits, sp: SamplingParams):
    """The distribution actually sampled from: softmax(logits / T), restricted to the kept sorted prefix (top_k,
    top_p, min_p; ties at the boundary stay) and renormalised. [..., V] f32 -> [..., V] f32. The top token always
    stays, so a top_p that underflowed to 0 in float32 is greedy rather than an empty (NaN) distribution."""
    sp = sp.rows(logits.ndim)
    p = jax.nn.softmax(logits.astype(jnp.float32) / jnp.maximum(sp.temperature, 1e-6), axis=-1)
    sorted_p = jnp.sort(p, axis=-1)[..., ::-1]
    rank = jnp.arange(p.shape[-1])
    before = jnp.cumsum(sorted_p, axis=-1) - sorted_p  # mass strictly above each sorted entry
    keep = (rank < sp.top_k) & ((before < sp.top_p) | (sp.top_p >= 1.0)) & (sorted_p >= sp.min_p * sorted_p[..., :1])
    keep = keep | (rank == 0)  # a prefix of the sorted order (each condition is monotone in the rank)
    threshold = jnp.min(jnp.where(keep, sorted_p, jnp.inf), axis=-1, keepdims=True)  # smallest kept probability
    p = jnp.where(p >= threshold, p, 0.0)
    return p / jnp.sum(p, axis=-1, keepdims=True)


def split_key(key, n: int):
    """n keys from one key, or from per-row keys [B] (row b's keys are split(key[b], n)): a tuple of n."""
    if key.ndim == 0:
        return tuple(jax.random.split(key, n))
    keys = jax.vmap(lambda k: jax.random.split(k, n))(key)  # [B, n]
    return tuple(keys[:, i] for i in range(n))


def fold_key(key, data: int):
    """fold_in for one key or per-row keys [B]."""
    return jax.random.fold_in(key, data) if key.ndim == 0 else jax.vmap(jax.random.fold_in, (0, None))(key, data)


def _per_row_draw(draw, key, *args):
    """draw(key, *args) with one key, or row b drawn with key[b] from args[..][b] (per-row keys [B])."""
    return draw(key, *args) if key.ndim == 0 else jax.vmap(draw)(key, *args)


def sample(key, p):
    """Draw from p [B, ..., V] -> int32[B, ...] (per-row keys: each row from its own key)."""
    return _per_row_draw(lambda k, x: jax.random.categorical(k, jnp.log(x), axis=-1), key, p).astype(jnp.int32)


def greedy_rows(sp: SamplingParams, ndim: int):
    """bool broadcastable to [B, ...] of `ndim` dims: the rows of a mixed batch that decode greedily (temperature
    0); None when the fields are shared (a batch-1 program is greedy or sampled as a whole)."""
    return (sp.rows(ndim + 1).temperature == 0)[..., 0] if sp.per_row else None


def pick(key, adjusted, sp: SamplingParams, is_greedy: bool):
    """Choose from adjusted logits [..., V]. Returns (token int32[...], the distribution drawn from | None)."""
    if is_greedy:
        return greedy(adjusted), None
    p = probs(adjusted, sp)
    tok = sample(key, p)
    g = greedy_rows(sp, tok.ndim)
    return (tok if g is None else jnp.where(g, greedy(adjusted), tok)), p


class Logprobs(NamedTuple):
    """chosen: f32[...] the emitted token's logprob; top_ids: int32[..., N]; top: f32[..., N] (descending; N =
    min(MAX_TOP_LOGPROBS, V))."""

    chosen: jax.Array
    top_ids: jax.Array
    top: jax.Array


def logprobs(adjusted, tokens, sp: SamplingParams, is_greedy: bool) -> Logprobs:
    """Logprobs as SGLang's sampler returns them: log_softmax(adjusted / T) (T = 1 when greedy), i.e. after the
    penalties, the logit bias and the temperature, before the top_k / top_p / min_p truncation (so no -inf).
    Always the TARGET's distribution: under speculation these are the verify rows' logits, never the draft's.
    adjusted f32[..., V], tokens int32[...] -> Logprobs."""
    if is_greedy:
        scaled = adjusted
    else:
        t = sp.rows(adjusted.ndim).temperature
        scaled = adjusted / (jnp.where(t == 0, 1.0, jnp.maximum(t, 1e-6)) if sp.per_row else jnp.maximum(t, 1e-6))
    logp = jax.nn.log_softmax(scaled, axis=-1)
    chosen = jnp.take_along_axis(logp, tokens[..., None], axis=-1)[..., 0]
    top, top_ids = jax.lax.top_k(logp, min(MAX_TOP_LOGPROBS, logp.shape[-1]))
    return Logprobs(chosen, top_ids.astype(jnp.int32), top)


def greedy_verdict(drafts, target_tokens, limit=None):
    """drafts int32[B, K] (d_1..d_K); target_tokens int32[B, K+1] = argmax at verify rows 0..K.

    d_j is accepted while d_j == target_tokens[j-1] for every earlier j too, and j <= limit[b] (int32[B] or None:
    only the first `limit` drafts are proposed; DSpark's confidence schedule):
        n_accept = sum_j prod_{i<=j} [d_i == t_{i-1}] [i <= limit]           (0..K)
    The committed new tokens are d_1..d_n then the bonus t_n: exactly target_tokens[:, :n+1].
    Returns (n_accept int32[B], bonus int32[B]).
    """
    match = (drafts == target_tokens[:, :-1]) & _proposed(drafts, limit)
    n = jnp.sum(jnp.cumprod(match.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)
    bonus = jnp.take_along_axis(target_tokens, n[:, None], axis=1)[:, 0]
    return n, bonus


def _proposed(drafts, limit):
    """bool[B, K]: draft j (1-based j = index + 1) is proposed, j <= limit[b] (all when limit is None)."""
    if limit is None:
        return jnp.ones(drafts.shape, bool)
    return jnp.arange(drafts.shape[1])[None, :] < limit[:, None]


def sampled_verdict(key, drafts, q, p, limit=None):
    """Lossless speculative sampling for a chain (Leviathan et al. / Chen et al.).

    drafts int32[B, K]; q f32[B, K, V]: the draft distribution each d_j was drawn from;
    p f32[B, K+1, V]: target distributions at verify rows 0..K (row j-1 scores d_j).
    Accept d_j with probability min(1, p_{j-1}(d_j) / q_j(d_j)) while all earlier were accepted; at the first
    rejection j draw the bonus from norm(max(0, p_{j-1} - q_j)); if all K pass, draw it from p_K.
    limit int32[B] | None: only d_1..d_limit are proposed; when all of them pass the bonus is drawn from p_limit
    (no draft was sampled there, so nothing is subtracted): the chain simply ends early, still lossless.
    Returns (n_accept int32[B], bonus int32[B]); committed tokens are d_1..d_n then the bonus.
    """
    B, K = drafts.shape
    k_acc, k_bonus = split_key(key, 2)
    p_d = jnp.take_along_axis(p[:, :K], drafts[..., None], axis=2)[..., 0]  # [B, K]
    q_d = jnp.take_along_axis(q, drafts[..., None], axis=2)[..., 0]
    u = jax.random.uniform(k_acc, (B, K)) if key.ndim == 0 else jax.vmap(lambda k: jax.random.uniform(k, (K,)))(k_acc)
    accept = (u * q_d < p_d) & _proposed(drafts, limit)  # u < p/q without dividing by q
    n = jnp.sum(jnp.cumprod(accept.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)
    q_pad = jnp.concatenate([q, jnp.zeros_like(q[:, :1])], axis=1)  # no draft to subtract after K
    row = lambda a: jnp.take_along_axis(a, n[:, None, None], axis=1)[:, 0]  # [B, V] at row n
    q_n = row(q_pad) if limit is None else jnp.where((n < limit)[:, None], row(q_pad), 0.0)
    residual = jnp.maximum(row(p) - q_n, 0.0)
    mass = jnp.sum(residual, axis=-1, keepdims=True)
    # If p == q exactly the residual is empty; any draw is then correct, fall back to p itself.
    residual = jnp.where(mass > 0, residual / jnp.where(mass > 0, mass, 1.0), row(p))
    return n, sample(k_bonus, residual)
