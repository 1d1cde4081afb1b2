"""Plain (non-speculative) decoding: prefill, then one target token per step.

Same carry discipline as the speculative relay: `bonus` is the last emitted token, not yet fed to the target.
Shape legend: B batch, P prompt bucket, V vocab.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from ling_jax.config import ModelConfig
from ling_jax.model import RuntimeOptions, commit, forward, lm_logits
from ling_jax.sampling import SamplingParams, greedy, probs, sample
from ling_jax.spec import StepOutput, _row
from ling_jax.state import DecodeState, init_state


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class PlainState:
    """Attributes:
    target: DecodeState   committed positions 0..L-1.
    bonus: int32[B]       token L: emitted, fed by the next step.
    key: PRNG key
    sampling: SamplingParams
    """

    target: DecodeState
    bonus: jax.Array
    key: jax.Array
    sampling: SamplingParams

    def replace(self, **kw) -> "PlainState":
        return dataclasses.replace(self, **kw)


def _pick(logits, sp, key, is_greedy):
    return greedy(logits) if is_greedy else sample(key, probs(logits, sp))


def plain_prefill(params, tokens, n_valid, cfg: ModelConfig, *, max_len: int, is_greedy: bool,
                  sampling: SamplingParams, key, dtype, opts: RuntimeOptions = RuntimeOptions()):
    """Target prefill over tokens[:, :n_valid]; the first token comes from row n_valid-1. Returns (state, token)."""
    B = tokens.shape[0]
    k_first, key = jax.random.split(key)
    out = forward(params, tokens, init_state(cfg, B, max_len, dtype), cfg, mode="prefill", n_valid=n_valid, opts=opts)
    first = _pick(lm_logits(params, _row(out.hidden, n_valid - 1), opts), sampling, k_first, is_greedy)
    return PlainState(out.state, first, key, sampling), first


def plain_step(params, state: PlainState, cfg: ModelConfig, *, is_greedy: bool, opts=RuntimeOptions()):
    """Feed the bonus, emit the next token. Returns (state, StepOutput with one token per row)."""
    k_tok, key = jax.random.split(state.key)
    B = state.bonus.shape[0]
    one = jnp.ones((B,), jnp.int32)
    if opts.numerics.target_rows is None:
        out = forward(params, state.bonus[:, None], state.target, cfg, mode="decode", opts=opts)
        target = out.state
    else:  # row-invariant: the verify shape, one row committed (see Numerics.target_rows)
        rows = jnp.repeat(state.bonus[:, None], opts.numerics.target_rows, axis=1)
        out = forward(params, rows, state.target, cfg, mode="verify", n_valid=one, opts=opts)
        target = commit(out.state, out.pending, one, opts)
    tok = _pick(lm_logits(params, out.hidden[:, 0], opts), state.sampling, k_tok, is_greedy)
    return state.replace(target=target, bonus=tok, key=key), StepOutput(tok[:, None], one)
