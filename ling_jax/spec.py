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
Sampling: every token choice (seed, drafts, verify rows) goes through the request's transform (penalties, logit
bias, temperature, top-k/p, min-p: ling_jax/sampling.py), each row with the output counts of the tokens before it,
so draft and target are transformed alike and the verdict is lossless for the transformed target.
Which tokens need logits is static: a greedy step whose requests do not adjust their logits (adjusts_logits=False:
neutral penalties, no logit bias, so adjust_logits is the identity and the token is argmax of the logits themselves)
needs none for its drafts and extend, nor for its verify rows without logprobs; there, with the fused head
(KernelCalls.lm_head_argmax, `argmax_only`), each of those heads is ONE kernel of final norm + lm_head + argmax
(model.lm_argmax). Every other program (sampled, penalties or bias possible, logprobs) computes the logits as before.
Prefill runs in chunks of C positions (spec_prefill_chunk), one program for every prompt length.
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
from ling_jax.draft_vocab import draft_argmax, draft_logits
from ling_jax.layers.linear import Normed
from ling_jax.model import RuntimeOptions, commit, forward, head_fused, lm_argmax, lm_logits
from ling_jax.nextn import mtp_forward
from ling_jax.sampling import (Logprobs, SamplingParams, TokenHistory, adjust_logits, chain_counts, fold_key, greedy,
                               greedy_rows, greedy_verdict, logprobs, pick, probs, sampled_verdict, split_key)
from ling_jax.state import DecodeState, init_state


ALGORITHMS = ("NEXTN", "DSPARK", "NONE")
DSPARK_VERIFY_MODES = ("static", "confidence")


@dataclass(frozen=True)
class SpecConfig:
    """SGLang's speculative flags. Chains (topk 1) of NEXTN, or DSpark blocks (ling_jax.dspark_step).

    DSPARK: num_steps = gamma = the draft's block_size (from its config.json, not a flag); draft_model_path is the
    draft dir; dspark_verify "static" verifies the whole block (SGLang's deployed config), "confidence" proposes
    only the prefix whose survival product prod_j c_j stays >= confidence_threshold (same shapes; output unchanged).
    """

    algorithm: str = "NEXTN"
    num_steps: int = 3
    eagle_topk: int = 1
    num_draft_tokens: int | None = None
    draft_model_path: str | None = None
    dspark_verify: str = "static"
    confidence_threshold: float = 0.5

    def __post_init__(self):
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"--speculative-algorithm {self.algorithm!r}: supported are {', '.join(ALGORITHMS)}")
        if self.algorithm == "NONE":
            return
        top = 16 if self.is_dspark else 8
        if not 1 <= self.num_steps <= top:
            what = "the DSpark block_size" if self.is_dspark else "--speculative-num-steps"
            raise ValueError(f"{what} must be in 1..{top}, got {self.num_steps}")
        if self.eagle_topk != 1:
            raise ValueError(f"--speculative-eagle-topk {self.eagle_topk}: only chain drafting (topk 1) is supported")
        if self.num_draft_tokens is not None and self.num_draft_tokens != self.num_steps + 1:
            raise ValueError(f"--speculative-num-draft-tokens must be num_steps + 1 = {self.num_steps + 1} for a "
                             f"chain, got {self.num_draft_tokens}")
        if self.is_dspark:
            if self.dspark_verify not in DSPARK_VERIFY_MODES:
                raise ValueError(f"DSpark verify mode {self.dspark_verify!r} not in {DSPARK_VERIFY_MODES}")
            if not 0.0 < self.confidence_threshold < 1.0:
                raise ValueError(f"DSpark confidence threshold must be in (0, 1), got {self.confidence_threshold}")
        elif self.draft_model_path is not None:
            raise ValueError("--speculative-draft-model-path is for DSPARK (NEXTN's head is in the target checkpoint)")

    @property
    def enabled(self) -> bool:
        return self.algorithm != "NONE"

    @property
    def is_nextn(self) -> bool:
        return self.algorithm == "NEXTN"

    @property
    def is_dspark(self) -> bool:
        return self.algorithm == "DSPARK"

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
    seed_q: f32[B, V] | None       distribution d1 was drawn from (sampled mode only; a greedy program carries it
                                   through untouched when the state has one: a slot of a mixed batch).
    key: PRNG key                  advanced every step (sampled mode draws from it); key[B] per row in a joined batch.
    sampling: SamplingParams       scalars, or [B] per row in a joined batch (ling_jax/batching.py).
    accept_hist: int32[K+1]        how many verify steps accepted n = 0..K drafts (summed over batch); [B, K+1]
                                   per row in a joined batch.
    history: TokenHistory          prompt tokens and output counts through the bonus (the penalties).
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
    history: TokenHistory

    def replace(self, **kw) -> "SpecState":
        return dataclasses.replace(self, **kw)


class StepOutput(NamedTuple):
    tokens: jax.Array  # int32[B, K+1]: emitted tokens are tokens[b, :n_emit[b]]
    n_emit: jax.Array  # int32[B] = accepted drafts + 1
    logprobs: Logprobs | None  # of tokens[b, j] under the target's (transformed) distribution at its verify row
    # (None from a step compiled without logprobs: with_logprobs=False)


def _row(a, idx):
    """a [B, T, ...], idx int32[B] -> a[b, idx[b]]."""
    return jnp.take_along_axis(a, idx.reshape((-1, 1) + (1,) * (a.ndim - 2)), axis=1)[:, 0]


def argmax_only(opts: RuntimeOptions, *, is_greedy: bool, adjusts_logits: bool, with_logprobs: bool = False) -> bool:
    """Whether a head's token is argmax of the logits themselves and nothing else reads them (static): a greedy
    program whose requests leave their logits as they are (adjusts_logits False), no logprobs asked of this head,
    and the fused lm_head + argmax on (model.head_fused). Then the head runs model.lm_argmax and, where that takes
    the call, no logits are made; where it does not, the logits path below (the same token: adjust_logits is the
    identity on neutral fields)."""
    return is_greedy and not adjusts_logits and not with_logprobs and head_fused(opts)


def _choose(params, hidden, history: TokenHistory, sp: SamplingParams, key, is_greedy: bool, opts,
            argmax: bool = False):
    """A draft token from the MTP head's hidden state [B, D] (or its Normed: the final layernorm not yet computed)
    under the request's transform: (token, q | None, the normed hidden [B, D]). The draft's logits cover the
    draft vocabulary (ling_jax.draft_vocab; the full one unless params carry one). argmax (static, argmax_only):
    the fused head where it takes the call, no logits."""
    if argmax and isinstance(hidden, Normed):
        got = draft_argmax(params, hidden, opts)
        if got is not None:
            return got[0], None, got[1]
    hidden = hidden.value() if isinstance(hidden, Normed) else hidden
    adjusted = adjust_logits(draft_logits(params, hidden, opts), sp, history.prompt, history.output)
    return (*pick(key, adjusted, sp, is_greedy), hidden)


# ---- chunked prefill --------------------------------------------------------------------------------------


def chunk_rows(start, n_prompt, C: int):
    """Where a prefill chunk at positions start..start+C-1 meets a prompt of n_prompt tokens (int32[B] each).
    Returns (n_valid int32[B], live bool[B, C], last int32[B] = the chunk row of the chunk's last prompt token,
    ends bool[B] = the prompt's last token is in this chunk)."""
    n_valid = jnp.clip(n_prompt - start, 0, C).astype(jnp.int32)
    live = jnp.arange(C)[None, :] < n_valid[:, None]
    ends = (n_valid > 0) & (n_prompt <= start + C)
    return n_valid, live, jnp.maximum(n_valid - 1, 0), ends


def spec_init(sampling: SamplingParams, key, cfg: ModelConfig, *, batch: int, slots: int, steps: int,
              is_greedy: bool, dtype) -> SpecState:
    """The empty state a prefill starts from (slots = cache rows, a multiple of the prefill chunk)."""
    tok = jnp.zeros((batch,), jnp.int32)
    return SpecState(target=init_state(cfg, batch, slots, dtype), bonus=tok,
                     draft_cache=jnp.zeros((batch, slots, cfg.mla_cache_dim), dtype), seed=tok,
                     draft_hidden=jnp.zeros((batch, cfg.hidden_size), dtype),
                     seed_q=None if is_greedy else jnp.zeros((batch, cfg.vocab_size), jnp.float32), key=key,
                     sampling=sampling, accept_hist=jnp.zeros((steps + 1,), jnp.int32),
                     history=TokenHistory.empty(batch, cfg.vocab_size))


def spec_prefill_chunk(params, state: SpecState, tokens, next_token, n_prompt, cfg: ModelConfig, *,
                       is_greedy: bool, opts: RuntimeOptions = RuntimeOptions()):
    """Target prefill over positions L..L+C-1 (tokens int32[B, C]; next_token int32[B] = the prompt token after
    the chunk; n_prompt int32[B]), then the MTP over the same rows with the target's hidden states. The chunk that
    holds the prompt's last token picks the bonus there and closes the MTP rows with it.
    Returns (state, bonus int32[B], the bonus's Logprobs)."""
    B, C = tokens.shape
    start, sp = state.target.lengths, state.sampling
    k_bonus, k_seed, key = split_key(state.key, 3)
    n_valid, live, last, ends = chunk_rows(start, n_prompt, C)
    out = forward(params, tokens, state.target, cfg, mode="prefill", n_valid=n_valid, opts=opts)
    history = state.history.add_prompt(tokens, live)
    adjusted = adjust_logits(lm_logits(params, _row(out.hidden, last), opts), sp, history.prompt, history.output)
    bonus, _ = pick(k_bonus, adjusted, sp, is_greedy)
    lp = logprobs(adjusted, bonus, sp, is_greedy)
    bonus = jnp.where(ends, bonus, state.bonus)
    history = history.add_output(bonus[:, None], ends[:, None])
    # MTP row t pairs tok_{t+1} with h_t: the chunk shifted left by one, the next token after it, and the bonus
    # at the prompt's last row.
    shifted = jnp.concatenate([tokens[:, 1:], next_token[:, None]], axis=1)
    shifted = jnp.where((jnp.arange(C)[None, :] == last[:, None]) & ends[:, None], bonus[:, None], shifted)
    h_mtp, draft_cache = mtp_forward(params, shifted, out.hidden, state.draft_cache, start, cfg, absorbed=False,
                                     opts=opts)
    h_last = _row(h_mtp, last)
    seed, seed_q, _ = _choose(params, h_last, history, sp, k_seed, is_greedy, opts)
    keep = lambda new, old: jnp.where(ends.reshape((-1,) + (1,) * (new.ndim - 1)), new, old)
    state = state.replace(target=out.state, bonus=bonus, draft_cache=draft_cache, seed=keep(seed, state.seed),
                          draft_hidden=keep(h_last, state.draft_hidden), key=key, history=history,
                          seed_q=state.seed_q if is_greedy else keep(seed_q, state.seed_q))
    return state, bonus, lp


# ---- the step, in parts -----------------------------------------------------------------------------------


def draft(params, state: SpecState, cfg: ModelConfig, *, steps: int, is_greedy: bool, opts=RuntimeOptions(),
          adjusts_logits: bool = True):
    """d1 = seed, then steps-1 chained MTP forwards; draft i+1 is transformed with the output counts of the chain
    so far (d_1..d_i after the bonus), as its verify row will be. Returns (drafts int32[B, K], q f32[B, K, V] |
    None, cache). adjusts_logits=False (static: no request of the program adjusts its logits): with the fused
    head each draft is one lm_head + argmax kernel (argmax_only), whose normed row is the next row's hidden."""
    argmax = argmax_only(opts, is_greedy=is_greedy, adjusts_logits=adjusts_logits)
    L = state.target.lengths
    tok, h, cache = state.seed, state.draft_hidden, state.draft_cache
    history = state.history
    drafts, qs = [tok], [state.seed_q]
    keys = split_key(fold_key(state.key, 1), max(steps - 1, 1))
    for i in range(steps - 1):
        history = history.add_output(tok[:, None], jnp.ones_like(tok[:, None], bool))
        h_out, cache = mtp_forward(params, tok[:, None], h[:, None], cache, L + i, cfg, absorbed=True, opts=opts,
                                   lazy_norm=argmax)
        h = h_out._replace(x=h_out.x[:, 0]) if isinstance(h_out, Normed) else h_out[:, 0]
        tok, q, h = _choose(params, h, history, state.sampling, keys[i], is_greedy, opts, argmax)
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


class Verified(NamedTuple):
    target: DecodeState  # committed through the bonus's predecessor: lengths L+n+1
    n: jax.Array  # int32[B] accepted drafts
    bonus: jax.Array  # int32[B] the new bonus t_n
    committed: jax.Array  # int32[B, K+1]: row j = token at L+j+1 for j <= n
    hidden: jax.Array  # [B, K+1, D] target hidden states of the verify rows
    logprobs: Logprobs | None  # of committed[b, j] at verify row j (None: not asked for)
    history: TokenHistory  # output counts through the new bonus
    layer_hidden: jax.Array | None = None  # [B, K+1, C] the captured target layers' outputs (DSpark's context)


def verify_and_commit(params, state: SpecState, drafts, q, cfg: ModelConfig, *, is_greedy: bool,
                      opts=RuntimeOptions(), capture: tuple[int, ...] = (), limit=None,
                      with_logprobs: bool = True, adjusts_logits: bool = True) -> Verified:
    """Target over [bonus, d1..dK]; each row j transformed with the counts of bonus, d_1..d_j; chain verdict
    (per row in a mixed batch: greedy rows take the greedy verdict); commit n+1 rows. `state` is any relay state
    with target, bonus, sampling, history and key (SpecState or dspark_step.DSparkState). capture: target layers
    returned in layer_hidden; limit int32[B] | None: only d_1..d_limit are proposed (the verdicts' limit).
    adjusts_logits=False (static) without logprobs: with the fused head the verify rows' tokens come from one
    lm_head + argmax kernel (argmax_only), which also norms the rows the extend reads; no logits."""
    K = drafts.shape[1]
    rows = jnp.concatenate([state.bonus[:, None], drafts], axis=1)
    live = None
    if opts.numerics.target_rows is not None:  # row-invariant: pad to the fixed row count (Numerics.target_rows)
        if opts.numerics.target_rows < K + 1:
            raise ValueError(f"target_rows={opts.numerics.target_rows} < {K + 1} verify rows (steps={K})")
        rows = jnp.pad(rows, ((0, 0), (0, opts.numerics.target_rows - K - 1)), mode="edge")
        live = jnp.full((rows.shape[0],), K + 1, jnp.int32)
    with jax.named_scope("verify_forward"):
        out = forward(params, rows, state.target, cfg, mode="verify", n_valid=live, opts=opts, capture=capture)
    with jax.named_scope("verdict_commit"):  # (the kernel census groups launches by these scopes)
        hidden = out.hidden[:, : K + 1]
        sp = state.sampling
        got = None
        if out.final is not None and argmax_only(opts, is_greedy=is_greedy, adjusts_logits=adjusts_logits,
                                                 with_logprobs=with_logprobs):
            got = lm_argmax(params, out.final._replace(x=out.final.x[:, : K + 1]), opts)
        if got is not None:  # argmax of the logits themselves (adjust_logits is the identity here), none written
            target_tokens, hidden = got
            n, bonus = greedy_verdict(drafts, target_tokens, limit)
        else:
            counts = chain_counts(state.history.output, drafts)  # [B, K+1, V]
            adjusted = adjust_logits(lm_logits(params, hidden, opts), sp, state.history.prompt[:, None], counts)
            if is_greedy:
                n, bonus = greedy_verdict(drafts, greedy(adjusted), limit)
            else:
                n, bonus = sampled_verdict(fold_key(state.key, 2), drafts, q, probs(adjusted, sp), limit)
                g = greedy_rows(sp, 1)
                if g is not None:  # a mixed batch: its temperature-0 rows decide as the greedy program does
                    n_g, bonus_g = greedy_verdict(drafts, greedy(adjusted), limit)
                    n, bonus = jnp.where(g, n_g, n), jnp.where(g, bonus_g, bonus)
        target = commit(out.state, out.pending, n + 1, opts)
        j = jnp.arange(K + 1)[None, :]
        committed = jnp.where(j < n[:, None], jnp.pad(drafts, ((0, 0), (0, 1))), bonus[:, None])
        lp = logprobs(adjusted, committed, sp, is_greedy) if with_logprobs else None
        history = state.history.add_output(committed, j <= n[:, None])
        layer_hidden = None if out.layer_hidden is None else out.layer_hidden[:, : K + 1]
        return Verified(target, n, bonus, committed, hidden, lp, history, layer_hidden)


def extend(params, state: SpecState, cache, committed, target_hidden, n, history: TokenHistory, cfg: ModelConfig,
           *, is_greedy: bool, opts=RuntimeOptions(), adjusts_logits: bool = True):
    """MTP rows L..L+K over (committed tokens, target hidden); the next seed comes from row L+n, transformed with
    `history` (the counts through the new bonus). Rows past L+n hold rejected guesses and are overwritten by the
    next draft. Returns (seed, seed_q, h, cache). adjusts_logits=False (static): with the fused head the seed is
    one lm_head + argmax kernel over row L+n (argmax_only), which also norms that row (h)."""
    L = state.target.lengths
    argmax = argmax_only(opts, is_greedy=is_greedy, adjusts_logits=adjusts_logits)
    h_mtp, cache = mtp_forward(params, committed, target_hidden, cache, L, cfg, absorbed=True, opts=opts,
                               lazy_norm=argmax)
    h = h_mtp._replace(x=_row(h_mtp.x, n)) if isinstance(h_mtp, Normed) else _row(h_mtp, n)  # (a norm per row)
    seed, seed_q, h = _choose(params, h, history, state.sampling, fold_key(state.key, 3), is_greedy, opts, argmax)
    return seed, seed_q, h, cache


def count_into(hist, n):
    """A verify step's histogram update: hist int32[B, K+1] (per row, a joined batch) or [K+1] (batch 1) plus one
    at each row's count n int32[B]. A one-hot sum, not a scatter-add: the same counts, and XLA fuses it into the
    histogram's add (the scatter was a launch of its own)."""
    hot = jax.nn.one_hot(n.reshape(-1), hist.shape[-1], dtype=jnp.int32)
    return hist + (hot if hist.ndim == 2 else jnp.sum(hot, axis=0))


def spec_step_with_drafts(params, state: SpecState, drafts, q, cache, cfg: ModelConfig, *, is_greedy: bool,
                          opts=RuntimeOptions(), with_logprobs: bool = True, adjusts_logits: bool = True):
    """verify -> commit -> extend for given drafts (the step's second half; tests inject drafts here)."""
    v = verify_and_commit(params, state, drafts, q, cfg, is_greedy=is_greedy, opts=opts, with_logprobs=with_logprobs,
                          adjusts_logits=adjusts_logits)
    with jax.named_scope("nextn_extend"):
        seed, seed_q, h, cache = extend(params, state, cache, v.committed, v.hidden, v.n, v.history, cfg,
                                        is_greedy=is_greedy, opts=opts, adjusts_logits=adjusts_logits)
    with jax.named_scope("accept_histograms"):
        hist = count_into(state.accept_hist, v.n)
    new = state.replace(target=v.target, bonus=v.bonus, draft_cache=cache, seed=seed, draft_hidden=h,
                        seed_q=state.seed_q if is_greedy else seed_q, key=fold_key(state.key, 4), accept_hist=hist,
                        history=v.history)
    return new, StepOutput(v.committed, v.n + 1, v.logprobs)


def spec_step(params, state: SpecState, cfg: ModelConfig, *, steps: int, is_greedy: bool, opts=RuntimeOptions(),
              with_logprobs: bool = True, adjusts_logits: bool = True):
    """One NEXTN step: draft -> verify -> commit -> extend. Returns (state, StepOutput). with_logprobs=False (a
    static flag: the program serving requests that asked for none) skips the target rows' log_softmax and top-k.
    adjusts_logits=False (static: the program serves only requests with neutral penalties and no logit bias,
    sampling.SamplingOptions.adjusts_logits): a greedy program may then take its tokens from the fused lm_head +
    argmax (argmax_only) instead of the logits."""
    with jax.named_scope("nextn_draft"):  # (the kernel census groups the step's launches by its named scopes)
        drafts, q, cache = draft(params, state, cfg, steps=steps, is_greedy=is_greedy, opts=opts,
                                 adjusts_logits=adjusts_logits)
    return spec_step_with_drafts(params, state, drafts, q, cache, cfg, is_greedy=is_greedy, opts=opts,
                                 with_logprobs=with_logprobs, adjusts_logits=adjusts_logits)


def spec_from_flags(algorithm: str, num_steps: int | None, eagle_topk: int | None, num_draft_tokens: int | None,
                    draft_model_path: str | None = None, dspark_verify: str = "static",
                    confidence_threshold: float = 0.5):
    """SGLang's --speculative-* flags -> (SpecConfig, DSparkConfig | None). NEXTN defaults: 3 steps, topk 1.
    DSPARK takes gamma from the draft's config.json (block_size), so the step / draft-token / topk flags are refused
    with it, as SGLang's DSpark worker has none."""
    if algorithm != "DSPARK":
        if draft_model_path is not None:
            raise ValueError("--speculative-draft-model-path is only for --speculative-algorithm DSPARK")
        return SpecConfig(algorithm, 3 if num_steps is None else num_steps, 1 if eagle_topk is None else eagle_topk,
                          num_draft_tokens), None
    given = [f for f, v in (("--speculative-num-steps", num_steps), ("--speculative-eagle-topk", eagle_topk),
                            ("--speculative-num-draft-tokens", num_draft_tokens)) if v is not None]
    if given:
        raise ValueError(f"DSPARK takes its block size from the draft's config.json: drop {', '.join(given)}")
    if draft_model_path is None:
        raise ValueError("--speculative-algorithm DSPARK needs --speculative-draft-model-path DIR")
    from ling_jax.dspark import load_config

    dcfg = load_config(draft_model_path)
    if dspark_verify == "confidence" and not dcfg.enable_confidence_head:
        raise ValueError(f"{draft_model_path}: the confidence verify schedule needs a confidence head "
                         f"(enable_confidence_head is false)")
    return SpecConfig("DSPARK", dcfg.block_size, draft_model_path=draft_model_path, dspark_verify=dspark_verify,
                      confidence_threshold=confidence_threshold), dcfg
