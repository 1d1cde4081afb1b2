"""DSpark speculative decoding as fixed-shape device functions: draft block -> verify -> commit -> project context.

Shape legend: B batch, G = gamma (block size = drafted tokens), G+1 verify rows, V vocab, S cache slots,
Ld draft layers, Hk draft kv heads, Dh draft head dim, C prefill chunk. L = committed target length at step entry.

Invariants of `DSparkState` between steps (positions are absolute token indices):
  * the target state holds tokens 0..L-1; `bonus` is token L (verified and emitted, not yet fed);
  * draft context rows 0..L-1 hold K/V of the target features at those positions (ling_jax.dspark.context_kv).
One step (ONE program):
  draft    block [bonus, MASK x (G-1)] at positions L..L+G-1, one parallel draft forward (the lm_head read once for
           all G slots), then the Markov decode left to right: d_{k+1} = pick(base_k + W2 W1[d_k]), d_0 = bonus,
           each slot transformed with the output counts of the chain so far (as its verify row will be; a greedy
           program of neutral requests, adjusts_logits=False, skips the identity transform and the counts);
           then confidence c_k (from h_k and d_{k-1}, all slots at once) and survival s_k = prod_{j<=k} c_j.
  length   static: m = G; confidence: m = #{k : s_k >= threshold} (fixed shapes: G+1 rows are still verified, the
           verdict accepts at most m drafts; the output is the same tokens, only fewer of them per step).
  verify   target over [bonus, d_1..d_G] with the target layers of the context captured; chain verdict (greedy, or
           lossless rejection sampling) limited to m; KDA replay-commit of the n+1 rows (ling_jax.spec).
  project  context K/V of the G+1 verify rows written at rows L..L+G; rows past L+n are the rejected guesses',
           never read (the next block reads rows < L+n+1) and overwritten by the next step.
Every function takes a batch-1 state (one key, scalar sampling fields, histograms [G+1]) or a joined one of
continuous batching (ling_jax.slots: key[B], per-row sampling fields, histograms [B, G+1]); a joined row draws from
its own key exactly as its batch-1 state would, and a batch-1 state runs the batch-1 math unchanged.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from ling_jax.config import ModelConfig
from ling_jax.dspark import DSparkConfig, block_hidden, confidence_logit, context_kv, markov_bias
from ling_jax.model import RuntimeOptions, forward, lm_logits
from ling_jax.sampling import (SamplingParams, TokenHistory, adjust_logits, fold_key, greedy, logprobs, pick,
                               split_key)
from ling_jax.spec import SpecConfig, StepOutput, _row, chunk_rows, count_into, verify_and_commit
from ling_jax.state import DecodeState, init_state


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class DSparkState:
    """Attributes:
    target: DecodeState                 committed positions 0..L-1.
    bonus: int32[B]                     token L (emitted, not yet fed to the target): the next block's anchor.
    ctx_k, ctx_v: dtype[Ld, B, S, Hk, Dh]  draft context K/V by position (valid rows 0..L-1).
    key: PRNG key                       advanced every step; key[B] per row in a joined batch.
    sampling: SamplingParams            scalars, or [B] per row in a joined batch (ling_jax/batching.py).
    history: TokenHistory               prompt tokens and output counts through the bonus (the penalties).
    accept_hist: int32[G+1]             verify steps that accepted n = 0..G drafts (summed over batch); [B, G+1]
                                        per row in a joined batch.
    length_hist: int32[G+1]             verify steps whose proposed length m was 0..G (the confidence schedule);
                                        [B, G+1] per row in a joined batch.
    """

    target: DecodeState
    bonus: jax.Array
    ctx_k: jax.Array
    ctx_v: jax.Array
    key: jax.Array
    sampling: SamplingParams
    history: TokenHistory
    accept_hist: jax.Array
    length_hist: jax.Array

    def replace(self, **kw) -> "DSparkState":
        return dataclasses.replace(self, **kw)


def dspark_init(sampling: SamplingParams, key, cfg: ModelConfig, dcfg: DSparkConfig, *, batch: int, slots: int,
                dtype) -> DSparkState:
    ctx = jnp.zeros((dcfg.num_hidden_layers, batch, slots, dcfg.num_key_value_heads, dcfg.head_dim), dtype)
    hist = jnp.zeros((dcfg.block_size + 1,), jnp.int32)
    return DSparkState(init_state(cfg, batch, slots, dtype), jnp.zeros((batch,), jnp.int32), ctx, ctx, key, sampling,
                       TokenHistory.empty(batch, cfg.vocab_size), hist, hist)


def write_context(ctx, new, start):
    """ctx [Ld, B, S, Hk, Dh] <- new [Ld, B, T, Hk, Dh] at rows start[b]..start[b]+T-1."""
    put = lambda c, n, s: jax.lax.dynamic_update_slice_in_dim(c, n.astype(c.dtype), s, axis=1)
    return jax.vmap(put, in_axes=(1, 1, 0), out_axes=1)(ctx, new, start)


def project_context(dparams, state: DSparkState, feats, start, dcfg: DSparkConfig) -> DSparkState:
    """Context K/V of target features feats [B, T, C] at positions start[b] + t, into the draft cache."""
    T = feats.shape[1]
    k, v = context_kv(dparams, feats, start[:, None] + jnp.arange(T), dcfg)
    return state.replace(ctx_k=write_context(state.ctx_k, k, start), ctx_v=write_context(state.ctx_v, v, start))


def dspark_prefill_chunk(params, dparams, state: DSparkState, tokens, next_token, n_prompt, cfg: ModelConfig,
                         dcfg: DSparkConfig, *, is_greedy: bool, opts: RuntimeOptions = RuntimeOptions()):
    """Target prefill over positions L..L+C-1 with the context layers captured and projected into the draft cache;
    the chunk holding the prompt's last token picks the bonus. next_token is unused (the runner's one prefill
    signature: NEXTN's MTP rows need it). Returns (state, bonus int32[B], its Logprobs)."""
    del next_token
    k_bonus, key = split_key(state.key, 2)
    start = state.target.lengths
    n_valid, live, last, ends = chunk_rows(start, n_prompt, tokens.shape[1])
    out = forward(params, tokens, state.target, cfg, mode="prefill", n_valid=n_valid, opts=opts,
                  capture=dcfg.target_layer_ids)
    history = state.history.add_prompt(tokens, live)
    adjusted = adjust_logits(lm_logits(params, _row(out.hidden, last), opts), state.sampling, history.prompt,
                             history.output)
    bonus, _ = pick(k_bonus, adjusted, state.sampling, is_greedy)
    lp = logprobs(adjusted, bonus, state.sampling, is_greedy)
    bonus = jnp.where(ends, bonus, state.bonus)
    history = history.add_output(bonus[:, None], ends[:, None])
    state = project_context(dparams, state, out.layer_hidden, start, dcfg)  # rows past the prompt: never read
    return state.replace(target=out.state, bonus=bonus, key=key, history=history), bonus, lp


def draft_block(params, dparams, state: DSparkState, dcfg: DSparkConfig, *, is_greedy: bool, opts=RuntimeOptions(),
                adjusts_logits: bool = True):
    """One parallel draft forward, then the Markov decode left to right. Returns (drafts int32[B, G],
    q f32[B, G, V] | None (the distributions drawn from), confidence f32[B, G]).
    adjusts_logits=False (static: every request of the program has neutral penalties and no logit bias) with
    is_greedy: adjust_logits is the identity and nothing reads the chain's output counts, so each slot is only
    argmax(base_k + W2 W1[d_k]) (two launches at batch 1: the gather + matvec, the add + argmax), the same drafts.
    The confidence c_k reads only h_k and prev = d_{k-1}, all known after the chain: one pass over the G slots.
    Named scopes (the kernel census groups the step's launches by them, bench/hlo_census.py): draft_forward,
    markov_slot_NN, confidence."""
    B, G = state.bonus.shape[0], dcfg.block_size
    with jax.named_scope("draft_forward"):
        tokens = jnp.concatenate([state.bonus[:, None], jnp.full((B, G - 1), dcfg.mask_token_id, jnp.int32)], axis=1)
        h = block_hidden(dparams, params["embed"], tokens[:, None], state.target.lengths[:, None], state.ctx_k,
                         state.ctx_v, dcfg)[:, 0]  # [B, G, D]
        base = lm_logits(params, h, opts)  # [B, G, V]: the target's lm_head, read once for the block
    neutral = is_greedy and not adjusts_logits
    keys = None if is_greedy else split_key(fold_key(state.key, 1), G)
    prev, history = state.bonus, state.history
    drafts, qs = [], []
    for k in range(G):  # slot k predicts the token after prev = d_k (d_0 = the bonus)
        with jax.named_scope(f"markov_slot_{k:02d}"):
            logits = base[:, k] + markov_bias(dparams, prev)
            if neutral:
                tok, q = greedy(logits), None
            else:
                adjusted = adjust_logits(logits, state.sampling, history.prompt, history.output)
                tok, q = pick(None if keys is None else keys[k], adjusted, state.sampling, is_greedy)
                history = history.add_output(tok[:, None], jnp.ones((B, 1), bool))
        drafts.append(tok)
        qs.append(q)
        prev = tok
    drafts = jnp.stack(drafts, axis=1)
    with jax.named_scope("confidence"):
        if "confidence_head" in dparams:  # slot k's prev: the bonus, then d_1..d_{G-1}
            prevs = jnp.concatenate([state.bonus[:, None], drafts[:, :-1]], axis=1)
            conf = jax.nn.sigmoid(confidence_logit(dparams, h, prevs))
        else:
            conf = jnp.ones((B, G), jnp.float32)
    return drafts, None if is_greedy else jnp.stack(qs, axis=1), conf


def verify_length(conf, spec: SpecConfig):
    """int32[B]: drafts proposed for verification. static: all G; confidence: the prefix whose survival
    s_k = prod_{j<=k} c_j stays >= the threshold (s is non-increasing, so it is a count)."""
    G = conf.shape[1]
    if spec.dspark_verify == "static":
        return jnp.full(conf.shape[:1], G, jnp.int32)
    survival = jnp.cumprod(conf, axis=1)
    return jnp.sum(survival >= spec.confidence_threshold, axis=1).astype(jnp.int32)


def dspark_step_with_drafts(params, dparams, state: DSparkState, drafts, q, limit, cfg: ModelConfig,
                            dcfg: DSparkConfig, *, is_greedy: bool, opts=RuntimeOptions(), with_logprobs: bool = True,
                            adjusts_logits: bool = True):
    """verify -> verdict -> commit -> project for given drafts and proposed lengths limit int32[B] (tests inject
    drafts here). adjusts_logits=False (static, ling_jax.spec.argmax_only): the verify rows' tokens may come from
    the fused lm_head + argmax. Returns (state, StepOutput)."""
    v = verify_and_commit(params, state, drafts, q, cfg, is_greedy=is_greedy, opts=opts,
                          capture=dcfg.target_layer_ids, limit=limit, with_logprobs=with_logprobs,
                          adjusts_logits=adjusts_logits)
    with jax.named_scope("project_context"):
        state = project_context(dparams, state, v.layer_hidden, state.target.lengths, dcfg)
    with jax.named_scope("accept_histograms"):
        state = state.replace(target=v.target, bonus=v.bonus, key=fold_key(state.key, 4), history=v.history,
                              accept_hist=count_into(state.accept_hist, v.n),
                              length_hist=count_into(state.length_hist, limit))
    return state, StepOutput(v.committed, v.n + 1, v.logprobs)


def dspark_step(params, dparams, state: DSparkState, cfg: ModelConfig, dcfg: DSparkConfig, spec: SpecConfig, *,
                is_greedy: bool, opts=RuntimeOptions(), with_logprobs: bool = True, adjusts_logits: bool = True):
    """One DSpark step: draft the block -> choose the verify length -> verify -> commit -> project context.
    with_logprobs=False: StepOutput.logprobs is None (no log-softmax and top-k over the G+1 verify rows).
    adjusts_logits=False (static: the program serves only requests with neutral penalties and no logit bias,
    sampling.SamplingOptions.adjusts_logits): a greedy step's Markov decode is argmax only (draft_block), and its
    verify rows may take the fused lm_head + argmax (dspark_step_with_drafts)."""
    drafts, q, conf = draft_block(params, dparams, state, dcfg, is_greedy=is_greedy, opts=opts,
                                  adjusts_logits=adjusts_logits)
    with jax.named_scope("verify_length"):
        limit = verify_length(conf, spec)
    return dspark_step_with_drafts(params, dparams, state, drafts, q, limit, cfg, dcfg, is_greedy=is_greedy,
                                   opts=opts, with_logprobs=with_logprobs, adjusts_logits=adjusts_logits)
