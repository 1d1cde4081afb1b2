"""NEXTN speculative decoding as fixed-shape device functions: draft -> verify -> commit -> extend.

Shape legend: B batch, K = steps (drafted tokens), K+1 verify rows (draft_tokens), V vocab, D hidden,
S cache slots. L = committed target length at step entry.

Invariants of `SpecState` between steps (positions are absolute token indices):
  * the target state holds tokens 0..L-1; `bonus` is token L (verified and emitted, not yet fed);
  * MTP cache rows 0..L-1 are valid (row t = MTP(tok_{t+1}, h_t)); `seed` = d1, the draft for token L+1,
    read from MTP row L-1, whose hidden output is `draft_hidden`.
One step:
  draft   d1 = seed; d_{i+1} = MTP(d_i, h'_{i}) for i = 1..K-1           (K-1 MTP forwards, rows L..L+K-2)
  verify  target over [bonus, d1..dK] at positions L..L+K (KDA state untouched; MLA rows written)
  verdict n = accepted drafts (chain); new bonus t_n; emitted tokens d1..dn, t_n
  commit  KDA replay of the n+1 committed rows from the pre-verify state, conv windows, lengths L+n+1
  extend  MTP rows L..L+K over (committed tokens shifted by one, target hidden); seed <- row L+n
KDA stage-then-commit choice (bytes per step at Ling-3.0-flash size, |S| = 35 x 32 x 128 x 128 x 4 B = 73.4 MB):
  * staging every verify row's state: write (K+1) x |S| in verify + copy |S| at commit = 8 x 73.4 MB at K=5;
  * replay (this module): verify reads |S|; commit reads |S| and writes |S|: 3 x 73.4 MB = 220 MB, plus the
    per-row k, v, g, beta (K+1 rows x 35 layers x 32 x (3 x 128 + 1) x 4 B = 10 MB).
  Replay moves the fewest bytes; its recompute is 128x128 rank-1 updates, negligible next to the bytes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp

from ling_jax.config import ModelConfig
from ling_jax.model import RuntimeOptions, commit, forward, lm_logits
from ling_jax.nextn import mtp_forward
from ling_jax.sampling import SamplingParams, greedy, greedy_verdict, probs, sample, sampled_verdict
from ling_jax.state import DecodeState, init_state


@dataclass(frozen=True)
class SpecConfig:
    """SGLang's speculative flags. Only chains (topk 1) of NEXTN are supported, as in the seed."""

    algorithm: str = "NEXTN"
    num_steps: int = 3
    eagle_topk: int = 1
    num_draft_tokens: int | None = None

    def __post_init__(self):
        if self.algorithm not in ("NEXTN", "NONE"):
            raise ValueError(f"--speculative-algorithm {self.algorithm!r}: supported are NEXTN and NONE")
        if self.algorithm == "NONE":
            return
        if not 1 <= self.num_steps <= 8:
            raise ValueError(f"--speculative-num-steps must be in 1..8, got {self.num_steps}")
        if self.eagle_topk != 1:
            raise ValueError(f"--speculative-eagle-topk {self.eagle_topk}: only chain drafting (topk 1) is supported")
        if self.num_draft_tokens is not None and self.num_draft_tokens != self.num_steps + 1:
            raise ValueError(f"--speculative-num-draft-tokens must be num_steps + 1 = {self.num_steps + 1} for a "
                             f"chain, got {self.num_draft_tokens}")

    @property
    def enabled(self) -> bool:
        return self.algorithm == "NEXTN"

    @property
    def draft_tokens(self) -> int:
        return self.num_steps + 1 if self.enabled else 1


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SpecState:
    """Attributes:
    target: DecodeState            committed positions 0..L-1.
    bonus: int32[B]                token L (emitted, not yet fed to the target).
    draft_cache: dtype[B, S, F]    MTP latent cache (valid rows 0..L-1).
    seed: int32[B]                 d1, the draft for token L+1.
    draft_hidden: dtype[B, D]      MTP hidden output at row L-1 (chained into the next draft row).
    seed_q: f32[B, V] | None       distribution d1 was drawn from (sampled mode only).
    key: PRNG key                  advanced every step (sampled mode draws from it).
    sampling: SamplingParams
    accept_hist: int32[K+1]        how many verify steps accepted n = 0..K drafts (summed over batch).
    """

    target: DecodeState
    bonus: jax.Array
    draft_cache: jax.Array
    seed: jax.Array
    draft_hidden: jax.Array
    seed_q: jax.Array | None
    key: jax.Array
    sampling: SamplingParams
    accept_hist: jax.Array

    def replace(self, **kw) -> "SpecState":
        return dataclasses.replace(self, **kw)


class StepOutput(NamedTuple):
    tokens: jax.Array  # int32[B, K+1]: emitted tokens are tokens[b, :n_emit[b]]
    n_emit: jax.Array  # int32[B] = accepted drafts + 1


def _choose(logits, sp: SamplingParams, key, is_greedy: bool):
    """Pick a token per row; sampled mode also returns the distribution it drew from."""
    if is_greedy:
        return greedy(logits), None
    p = probs(logits, sp)
    return sample(key, p), p


def _row(a, idx):
    """a [B, T, ...], idx int32[B] -> a[b, idx[b]]."""
    return jnp.take_along_axis(a, idx.reshape((-1, 1) + (1,) * (a.ndim - 2)), axis=1)[:, 0]


# ---- prefill ----------------------------------------------------------------------------------------------


def spec_prefill(params, tokens, n_valid, cfg: ModelConfig, *, max_len: int, steps: int, is_greedy: bool,
                 sampling: SamplingParams, key, dtype, opts: RuntimeOptions = RuntimeOptions()):
    """Prefill the target over tokens[:, :n_valid] (padded to a bucket), then the MTP over the prompt shifted
    left by one (the bonus closes it) with the target's hidden states. Returns (SpecState, bonus)."""
    B, P = tokens.shape
    k_bonus, k_seed, key = jax.random.split(key, 3)
    out = forward(params, tokens, init_state(cfg, B, max_len, dtype), cfg, mode="prefill", n_valid=n_valid, opts=opts)
    last = n_valid - 1
    bonus, _ = _choose(lm_logits(params, _row(out.hidden, last), opts), sampling, k_bonus, is_greedy)
    # MTP row t pairs tok_{t+1} with h_t: the prompt shifted left, the bonus at row n-1.
    shifted = jnp.concatenate([tokens[:, 1:], tokens[:, :1]], axis=1)
    shifted = jnp.where(jnp.arange(P)[None, :] == last[:, None], bonus[:, None], shifted)
    draft_cache = jnp.zeros((B, max_len, cfg.mla_cache_dim), dtype)
    h_mtp, draft_cache = mtp_forward(params, shifted, out.hidden, draft_cache, jnp.zeros((B,), jnp.int32), cfg,
                                     absorbed=False, opts=opts)
    h_last = _row(h_mtp, last)
    seed, seed_q = _choose(lm_logits(params, h_last, opts), sampling, k_seed, is_greedy)
    state = SpecState(target=out.state, bonus=bonus, draft_cache=draft_cache, seed=seed, draft_hidden=h_last,
                      seed_q=seed_q, key=key, sampling=sampling, accept_hist=jnp.zeros((steps + 1,), jnp.int32))
    return state, bonus


# ---- the step, in parts -----------------------------------------------------------------------------------


def draft(params, state: SpecState, cfg: ModelConfig, *, steps: int, is_greedy: bool, opts=RuntimeOptions()):
    """d1 = seed, then steps-1 chained MTP forwards. Returns (drafts int32[B, K], q f32[B, K, V] | None, cache)."""
    L = state.target.lengths
    tok, h, cache = state.seed, state.draft_hidden, state.draft_cache
    drafts, qs = [tok], [state.seed_q]
    keys = jax.random.split(jax.random.fold_in(state.key, 1), max(steps - 1, 1))
    for i in range(steps - 1):
        h_out, cache = mtp_forward(params, tok[:, None], h[:, None], cache, L + i, cfg, absorbed=True, opts=opts)
        h = h_out[:, 0]
        tok, q = _choose(lm_logits(params, h, opts), state.sampling, keys[i], is_greedy)
        drafts.append(tok)
        qs.append(q)
    q = None if is_greedy else jnp.stack(qs, axis=1)
    return jnp.stack(drafts, axis=1), q, cache


ROW_BUCKET = 8  # deterministic inference pads every target pass to a multiple of this many rows


def deterministic_rows(draft_tokens: int) -> int:
    """Numerics.target_rows for deterministic inference: one bucket of ROW_BUCKET rows covers plain decoding
    and NEXTN up to 7 steps, so all of them give the same greedy tokens (steps=8 needs 16 rows: it still agrees with
    itself, not with plain decoding's 8)."""
    return -(-max(draft_tokens, 1) // ROW_BUCKET) * ROW_BUCKET


def verify_and_commit(params, state: SpecState, drafts, q, cfg: ModelConfig, *, is_greedy: bool,
                      opts=RuntimeOptions()):
    """Target over [bonus, d1..dK]; chain verdict; commit n+1 rows. Returns (target state, n, new bonus,
    committed tokens int32[B, K+1] (row j = token at L+j+1 for j <= n), target hidden [B, K+1, D])."""
    K = drafts.shape[1]
    rows = jnp.concatenate([state.bonus[:, None], drafts], axis=1)
    live = None
    if opts.numerics.target_rows is not None:  # row-invariant: pad to the fixed row count (Numerics.target_rows)
        if opts.numerics.target_rows < K + 1:
            raise ValueError(f"target_rows={opts.numerics.target_rows} < {K + 1} verify rows (steps={K})")
        rows = jnp.pad(rows, ((0, 0), (0, opts.numerics.target_rows - K - 1)), mode="edge")
        live = jnp.full((rows.shape[0],), K + 1, jnp.int32)
    out = forward(params, rows, state.target, cfg, mode="verify", n_valid=live, opts=opts)
    hidden = out.hidden[:, : K + 1]
    logits = lm_logits(params, hidden, opts)  # [B, K+1, V]
    if is_greedy:
        n, bonus = greedy_verdict(drafts, greedy(logits))
    else:
        n, bonus = sampled_verdict(jax.random.fold_in(state.key, 2), drafts, q, probs(logits, state.sampling))
    target = commit(out.state, out.pending, n + 1, opts)
    j = jnp.arange(K + 1)[None, :]
    committed = jnp.where(j < n[:, None], jnp.pad(drafts, ((0, 0), (0, 1))), bonus[:, None])
    return target, n, bonus, committed, hidden


def extend(params, state: SpecState, cache, committed, target_hidden, n, cfg: ModelConfig, *, is_greedy: bool,
           opts=RuntimeOptions()):
    """MTP rows L..L+K over (committed tokens, target hidden); the next seed comes from row L+n.
    Rows past L+n hold rejected guesses and are overwritten by the next draft. Returns (seed, seed_q, h, cache)."""
    L = state.target.lengths
    h_mtp, cache = mtp_forward(params, committed, target_hidden, cache, L, cfg, absorbed=True, opts=opts)
    h = _row(h_mtp, n)
    seed, seed_q = _choose(lm_logits(params, h, opts), state.sampling, jax.random.fold_in(state.key, 3), is_greedy)
    return seed, seed_q, h, cache


def spec_step_with_drafts(params, state: SpecState, drafts, q, cache, cfg: ModelConfig, *, is_greedy: bool,
                          opts=RuntimeOptions()):
    """verify -> commit -> extend for given drafts (the step's second half; tests inject drafts here)."""
    target, n, bonus, committed, hidden = verify_and_commit(params, state, drafts, q, cfg, is_greedy=is_greedy,
                                                            opts=opts)
    seed, seed_q, h, cache = extend(params, state, cache, committed, hidden, n, cfg, is_greedy=is_greedy, opts=opts)
    K = drafts.shape[1]
    hist = state.accept_hist + jnp.zeros((K + 1,), jnp.int32).at[n].add(1)
    new = state.replace(target=target, bonus=bonus, draft_cache=cache, seed=seed, draft_hidden=h, seed_q=seed_q,
                        key=jax.random.fold_in(state.key, 4), accept_hist=hist)
    return new, StepOutput(committed, n + 1)


def spec_step(params, state: SpecState, cfg: ModelConfig, *, steps: int, is_greedy: bool, opts=RuntimeOptions()):
    """One NEXTN step: draft -> verify -> commit -> extend. Returns (state, StepOutput)."""
    drafts, q, cache = draft(params, state, cfg, steps=steps, is_greedy=is_greedy, opts=opts)
    return spec_step_with_drafts(params, state, drafts, q, cache, cfg, is_greedy=is_greedy, opts=opts)
