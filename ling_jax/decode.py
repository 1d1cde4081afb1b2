"""Plain (non-speculative) decoding: chunked prefill, then one target token per step.

Same carry discipline as the speculative relay: `bonus` is the last emitted token, not yet fed to the target.
Shape legend: B batch, C prefill chunk, V vocab, S cache slots.

Prefill runs in chunks of a fixed size C: one program serves every prompt length (the host calls it
ceil(P / C) times; positions past the prompt are padding the state ignores). Each chunk also picks a token from
its last prompt row; only the chunk holding the prompt's last token keeps it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from ling_jax.config import ModelConfig
from ling_jax.model import RuntimeOptions, commit, forward, lm_argmax, lm_logits
from ling_jax.sampling import SamplingParams, TokenHistory, adjust_logits, logprobs, pick, split_key
from ling_jax.spec import StepOutput, _row, argmax_only, chunk_rows
from ling_jax.state import DecodeState, init_state


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class PlainState:
    """Attributes:
    target: DecodeState     committed positions 0..L-1.
    bonus: int32[B]         token L: emitted, fed by the next step.
    key: PRNG key           key[B] per row in a joined batch (ling_jax/batching.py).
    sampling: SamplingParams  scalars, or [B] per row in a joined batch.
    history: TokenHistory   prompt tokens and output counts (the penalties).
    """

    target: DecodeState
    bonus: jax.Array
    key: jax.Array
    sampling: SamplingParams
    history: TokenHistory

    def replace(self, **kw) -> "PlainState":
        return dataclasses.replace(self, **kw)


def plain_init(sampling: SamplingParams, key, cfg: ModelConfig, *, batch: int, slots: int, dtype) -> PlainState:
    """The empty state a prefill starts from (slots = cache rows, a multiple of the prefill chunk)."""
    return PlainState(init_state(cfg, batch, slots, dtype), jnp.zeros((batch,), jnp.int32), key, sampling,
                      TokenHistory.empty(batch, cfg.vocab_size))


def plain_prefill_chunk(params, state: PlainState, tokens, n_prompt, cfg: ModelConfig, *, is_greedy: bool,
                        opts: RuntimeOptions = RuntimeOptions()):
    """Consume prompt positions L..L+C-1 (tokens int32[B, C]; n_prompt int32[B] = the whole prompt's length).
    Returns (state, first token int32[B], its Logprobs); both are final once the prompt's last chunk ran."""
    k_first, key = split_key(state.key, 2)
    n_valid, live, last, ends = chunk_rows(state.target.lengths, n_prompt, tokens.shape[1])
    out = forward(params, tokens, state.target, cfg, mode="prefill", n_valid=n_valid, opts=opts)
    history = state.history.add_prompt(tokens, live)
    adjusted = adjust_logits(lm_logits(params, _row(out.hidden, last), opts), state.sampling, history.prompt,
                             history.output)
    first, _ = pick(k_first, adjusted, state.sampling, is_greedy)
    lp = logprobs(adjusted, first, state.sampling, is_greedy)
    first = jnp.where(ends, first, state.bonus)
    history = history.add_output(first[:, None], ends[:, None])
    return state.replace(target=out.state, bonus=first, key=key, history=history), first, lp


def plain_step(params, state: PlainState, cfg: ModelConfig, *, is_greedy: bool, opts=RuntimeOptions(),
               with_logprobs: bool = True, adjusts_logits: bool = True):
    """Feed the bonus, emit the next token. Returns (state, StepOutput with one token per row; logprobs None
    when with_logprobs is False). adjusts_logits=False (static: no request of the program adjusts its logits,
    see spec.spec_step): a greedy step without logprobs may take its token from the fused lm_head + argmax
    (spec.argmax_only), no logits made."""
    k_tok, key = split_key(state.key, 2)
    B = state.bonus.shape[0]
    one = jnp.ones((B,), jnp.int32)
    if opts.numerics.target_rows is None:
        out = forward(params, state.bonus[:, None], state.target, cfg, mode="decode", opts=opts)
        target = out.state
    else:  # row-invariant: the verify shape, one row committed (see Numerics.target_rows)
        rows = jnp.repeat(state.bonus[:, None], opts.numerics.target_rows, axis=1)
        out = forward(params, rows, state.target, cfg, mode="verify", n_valid=one, opts=opts)
        target = commit(out.state, out.pending, one, opts)
    h = state.history
    got = None
    if out.final is not None and argmax_only(opts, is_greedy=is_greedy, adjusts_logits=adjusts_logits,
                                             with_logprobs=with_logprobs):
        got = lm_argmax(params, out.final._replace(x=out.final.x[:, 0]), opts)
    if got is not None:  # argmax of the logits themselves (adjust_logits is the identity here), none written
        tok, lp = got[0], None
    else:
        adjusted = adjust_logits(lm_logits(params, out.hidden[:, 0], opts), state.sampling, h.prompt, h.output)
        tok, _ = pick(k_tok, adjusted, state.sampling, is_greedy)
        lp = jax.tree.map(lambda a: a[:, None], logprobs(adjusted, tok, state.sampling, is_greedy)) \
            if with_logprobs else None
    history = h.add_output(tok[:, None], jnp.ones((B, 1), bool))
    return state.replace(target=target, bonus=tok, key=key, history=history), StepOutput(tok[:, None], one, lp)
