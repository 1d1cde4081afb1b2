"""Train a DSpark draft against a frozen target, online: the target's features are computed in the same program.

    python -m ling_jax.train.dspark --target models/ling-demo --data .data/stdlib --steps 3000 --time-budget 300 \
        --batch 16 --seq 512 --anchors 32 --block-size 16 --out models/ling-demo-dspark

--target: a checkpoint dir (config.json + safetensors, e.g. ling_jax.train's --export; its tokenizer is not read:
the corpus is already token ids). --data: a dir with tokens-{train,heldout}.npy or .npy.xz (uint16 token ids of
the target's tokenizer, as `python -m ling_jax.train.corpus --tokenizer TARGET [--compress]` writes them).

Shape legend: B windows, T positions, N anchors per window, G block size, V vocab, C context features.

Self-distillation (--distill-seqs N): before training, the frozen target greedily continues N random train-split
prompts of --distill-prompt tokens to --seq tokens (greedy_continuations: a prefill, then a lax.scan of decode
steps on the decode state; ONE compiled program of --distill-batch rows or fewer runs every chunk of these and of
the held-out prompts; kept in memory, not on disk), and
--distill-fraction of every batch's windows are rows of that pool. A greedy DSpark step accepts exactly the
target's greedy tokens, so this is the text whose features, Markov inputs and labels inference sees (the demo
target's greedy output repeats itself, which corpus windows never teach the draft to copy).

Anchors (--anchor-window N): the training anchors of every window lie in [P, P + N), P = --distill-prompt: the first
N generated positions of a pool text, where bench.eval_accept verifies (its 200 new tokens after a 64-token
prompt: --distill-prompt 64 --anchor-window 200, --seq >= 64 + 200 + block; a shorter --seq also makes the pool
and each step cheaper). 0 (default): anywhere in [0, T - G), i.e. mostly deep in the target's greedy loops.

Held-out metrics (final, in metrics.json): heldout_* on corpus windows and heldout_greedy_* on the target's greedy
continuation of their first P tokens (random anchors anywhere, as in training by default); heldout_eval_* with the
eval's anchors (ling_jax.train.dspark_eval): bench.eval_accept's own held-out prompts (--eval-prompts 16 of P
tokens), the teacher-forced accept at every anchor of the first --eval-new-tokens (200) generated positions
(heldout_eval_greedy_accept) and along the verify steps a real greedy step takes there (heldout_eval_walk_accept:
the real step's accept equals the teacher-forced one at the same anchors, so this predicts eval_accept's static
mean accept length up to the bf16/fp32 greedy text).

Per step (one jitted program, the draft's params only are differentiated):
    target:  forward(prefill) over the windows with target_layer_ids captured -> features [B, T, C], logits z [B, T, V]
             (stop_gradient; nothing is cached on disk)
    blocks:  N distinct anchors a per window, uniform in [0, T-1-G] or the --anchor-window; block [x_a, MASK...]
             at positions a..a+G-1 reads the context rows t < a (ling_jax.dspark.block_hidden, the inference
             function); slot k predicts x_{a+k+1} with logits lm_head(h_k) + W2 W1[x_{a+k}] (teacher-forced
             Markov input), q_k = softmax
    loss (DeepSpec's config, position weights w_k = exp(-k / --decay-gamma (4)), normalised over the slots):
        0.1 CE(q_k, x_{a+k+1}) + 0.9 L1 = sum_v |q_k - p_k|   (p_k = softmax z_{a+k}, the target's row)
        + kl_weight KL(p_k || q_k)   (off by default; the CLI's --ce/--l1/--kl-weight set the three)
        + BCE(c_k, alpha_k), alpha_k = 1 - TV(q_k, p_k) = sum_v min(q_k, p_k)  (stop_gradient target: the
          probability that a sampled slot k is accepted)
        + acceptance-aware: accept_weight * (1 - E / G), E = sum_k prod_{j<=k} alpha_j, the expected accepted
          drafts of a block (DeepSpec's tau - 1), differentiated through alpha.
AdamW (fp32 masters, warmup then cosine to 10 % over the steps the budget allows), bf16 compute. Outputs in --out:
config.json, model.safetensors (bf16, HF names), metrics.json.

Run control (ling_jax.train.run_control): --time-budget S is the whole run after start-up. The greedy, training and
evaluation programs are compiled first (timed, printed), then the greedy texts are generated, and the training
steps are planned from the time left minus a reserve for the final evaluation (one eval call timed) and the save;
the plan is re-checked every 50 steps. SIGINT / SIGTERM stop at the next step boundary and still evaluate (a
second signal skips that) and save; metrics.json then says "interrupted": true, with the steps done.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ling_jax import dspark
from ling_jax.config import ModelConfig, load_config
from ling_jax.model import forward, lm_logits
from ling_jax.state import init_state
from ling_jax.train.data import fixed_windows, prompt_windows, random_windows, to_device
from ling_jax.train.dspark_eval import eval_anchor_metrics, window_accepts
from ling_jax.train.run_control import Deadline, GracefulStop, steps_in_budget
from ling_jax.train.step import training_options
from ling_jax.train.trainer import lr_at

MIN_LR_FRAC = 0.1  # the cosine ends at 10 % of --lr

SAVE_RESERVE_S = 3.0  # seconds kept for writing the draft dir (about 10 MB of bf16 and two JSON files)


@dataclass(frozen=True)
class DSparkTrainConfig:
    batch: int = 16
    seq: int = 512
    anchors: int = 32
    ce_weight: float = 0.1
    l1_weight: float = 0.9
    kl_weight: float = 0.0
    confidence_weight: float = 1.0
    accept_weight: float = 0.5
    decay_gamma: float = 4.0
    distill_fraction: float = 0.0
    anchor_start: int = 0
    anchor_window: int = 0
    compute_dtype: str = "bfloat16"

    def __post_init__(self):
        if self.batch < 1 or self.seq < 2 or self.anchors < 1:
            raise ValueError(f"batch={self.batch}, seq={self.seq}, anchors={self.anchors}: need >= 1, >= 2, >= 1")
        if not 0.0 <= self.distill_fraction <= 1.0:
            raise ValueError(f"distill_fraction={self.distill_fraction} must be in [0, 1]")
        if self.anchor_start < 0 or self.anchor_window < 0 or 0 < self.anchor_window < self.anchors:
            raise ValueError(f"anchor window [{self.anchor_start}, +{self.anchor_window}) must be >= 0 and hold at "
                             f"least anchors={self.anchors} positions (0: anchors anywhere)")
        if self.decay_gamma <= 0:
            raise ValueError(f"decay_gamma={self.decay_gamma} must be > 0")
        if min(self.ce_weight, self.l1_weight, self.kl_weight, self.confidence_weight, self.accept_weight) < 0:
            raise ValueError(f"loss weights ce={self.ce_weight} l1={self.l1_weight} kl={self.kl_weight} "
                             f"confidence={self.confidence_weight} accept={self.accept_weight} must be >= 0")

    @property
    def pool_rows(self) -> int:
        """Windows of each batch drawn from the self-distillation pool (the rest from the corpus)."""
        return int(round(self.distill_fraction * self.batch))

    def anchor_range(self, T: int, G: int) -> tuple[int, int]:
        """[lo, hi): the training anchors of a window of T tokens, block G. anchor_window 0: anywhere in
        [0, T-G) (every slot's label x_{a+G} inside the window); else [anchor_start, anchor_start + window), the
        first `window` generated positions of a pool text whose prompt is anchor_start tokens (the eval's anchors:
        bench.eval_accept verifies the first --new-tokens after a --prompt-len prompt)."""
        if not self.anchor_window:
            return 0, T - G
        lo, hi = self.anchor_start, self.anchor_start + self.anchor_window
        if hi > T - G:
            raise ValueError(f"anchor window [{lo}, {hi}) with block {G} needs --seq >= {hi + G}, got {T}")
        return lo, hi


def target_features(params, tokens, cfg: ModelConfig, dcfg: dspark.DSparkConfig):
    """Frozen target over tokens int32[B, T] from a fresh state: (features [B, T, C], logits f32[B, T, V])."""
    B, T = tokens.shape
    out = forward(params, tokens, init_state(cfg, B, T, params["embed"].dtype), cfg, mode="prefill",
                  opts=training_options(), capture=dcfg.target_layer_ids)
    return jax.lax.stop_gradient(out.layer_hidden), jax.lax.stop_gradient(lm_logits(params, out.hidden))


def greedy_continuations(params, prompts, n_new: int, cfg: ModelConfig):
    """The target's plain greedy continuation: prompts int32[B, P] -> int32[B, P + n_new] (prompt, then n_new
    argmax tokens, EOS ignored). This is the text a greedy DSpark step verifies: features, Markov inputs and labels
    of the accepted prefix are exactly these tokens (self-distillation data)."""
    B, P = prompts.shape
    opts = training_options()
    out = forward(params, prompts, init_state(cfg, B, P + n_new, params["embed"].dtype), cfg, mode="prefill",
                  opts=opts)
    first = jnp.argmax(lm_logits(params, out.hidden[:, -1]), axis=-1).astype(jnp.int32)

    def next_token(carry, _):
        state, tok = carry
        o = forward(params, tok[:, None], state, cfg, mode="decode", opts=opts)
        return (o.state, jnp.argmax(lm_logits(params, o.hidden[:, 0]), axis=-1).astype(jnp.int32)), tok

    (_, last), toks = jax.lax.scan(next_token, (out.state, first), None, length=n_new - 1)
    return jnp.concatenate([prompts, toks.T, last[:, None]], axis=1)


def sample_anchors(key, B: int, T: int, N: int, G: int, lo: int = 0, hi: int | None = None):
    """N distinct sorted anchors per row, uniform in [lo, hi) (default [0, T-G): every slot's label x_{a+G} is
    inside the window; hi <= T - G)."""
    hi = T - G if hi is None else hi
    if not 0 <= lo < hi <= T - G:
        raise ValueError(f"anchors in [{lo}, {hi}) of seq {T} with block {G}: need 0 <= lo < hi <= {T - G}")
    n_cand = hi - lo
    if n_cand < N:
        raise ValueError(f"seq {T} leaves {n_cand} anchor positions for block {G}, fewer than anchors={N}")
    order = jnp.argsort(jax.random.uniform(key, (B, n_cand)), axis=1)[:, :N]
    return (lo + jnp.sort(order, axis=1)).astype(jnp.int32)


def train_anchors(key, tc: DSparkTrainConfig, B: int, T: int, G: int):
    """The training step's anchors int32[B, tc.anchors], uniform over tc.anchor_range(T, G) in every window."""
    lo, hi = tc.anchor_range(T, G)
    return sample_anchors(key, B, T, tc.anchors, G, lo, hi)


def block_logits(dp, params, tokens, anchors, cfg: ModelConfig, dcfg: dspark.DSparkConfig):
    """The draft's teacher-forced block logits: tokens int32[B, T], anchors int32[B, N] (a + G <= T) ->
    (logits f32[B, N, G, V], h [B, N, G, D], prev int32[B, N, G] = x_{a+k} (the Markov inputs), target logits
    f32[B, N, G, V] of rows a+k). The same functions as the DSpark step (ling_jax.dspark_step.draft_block):
    context rows t < a from the target's captured layers, block [x_a, MASK...] at positions a..a+G-1."""
    B, T = tokens.shape
    G = dcfg.block_size
    feats, z = target_features(params, tokens, cfg, dcfg)
    ctx_k, ctx_v = dspark.context_kv(dp, feats, jnp.broadcast_to(jnp.arange(T), (B, T)), dcfg)
    idx = anchors[..., None] + jnp.arange(G)  # [B, N, G]: slot k sits at a+k
    take = jax.vmap(lambda row, i: row[i])  # per window gather
    prev = take(tokens, idx)  # x_{a+k}: the anchor, then the teacher-forced Markov inputs
    block = jnp.where(jnp.arange(G) == 0, prev, dcfg.mask_token_id)
    h = dspark.block_hidden(dp, params["embed"], block, anchors, ctx_k, ctx_v, dcfg)  # [B, N, G, D]
    logits = lm_logits(params, h) + dspark.markov_bias(dp, prev)  # [B, N, G, V] f32
    return logits, h, prev, take(z, idx)


def losses(dp, params, tokens, anchors, cfg: ModelConfig, dcfg: dspark.DSparkConfig, tc: DSparkTrainConfig):
    """tokens int32[B, T], anchors int32[B, N] (a + G < T) -> (loss, metrics dict of f32 scalars / [G] vectors;
    accept_by_anchor int32[B, N]: each block's teacher-forced greedy accept length, 1 + the leading slots whose
    argmax is the target's)."""
    dt = jnp.dtype(tc.compute_dtype)
    dp = jax.tree.map(lambda a: a.astype(dt), dp)
    G = dcfg.block_size
    logits, h, prev, z = block_logits(dp, params, tokens, anchors, cfg, dcfg)
    labels = jax.vmap(lambda row, i: row[i])(tokens, anchors[..., None] + jnp.arange(G) + 1)
    log_q = jax.nn.log_softmax(logits, axis=-1)
    log_p = jax.nn.log_softmax(z, axis=-1)  # the target's row a+k predicts x_{a+k+1}
    p = jnp.exp(log_p)
    q = jnp.exp(log_q)
    w = jnp.exp(-jnp.arange(G) / tc.decay_gamma)
    wmean = lambda x: jnp.mean(jnp.sum(x * w, axis=-1) / jnp.sum(w))  # position-weighted mean over [B, N, G]
    ce = -jnp.take_along_axis(log_q, labels[..., None], axis=-1)[..., 0]
    l1 = jnp.sum(jnp.abs(q - p), axis=-1)
    alpha = jnp.clip(1.0 - 0.5 * l1, 0.0, 1.0)  # = sum_v min(q, p)
    expected = jnp.sum(jnp.cumprod(alpha, axis=-1), axis=-1)  # E[accepted drafts] of each block
    kl = jnp.sum(p * (log_p - log_q), axis=-1)  # KL(p || q): dense gradients towards the target's whole row
    loss = (tc.ce_weight * wmean(ce) + tc.l1_weight * wmean(l1) + tc.kl_weight * wmean(kl)
            + tc.accept_weight * (1.0 - jnp.mean(expected) / G))
    m = {"ce": wmean(ce), "l1": wmean(l1), "kl": wmean(kl), "expected_accept": 1.0 + jnp.mean(expected)}
    if "confidence_head" in dp:
        c_logit = dspark.confidence_logit(dp, h, prev)
        bce = optax.sigmoid_binary_cross_entropy(c_logit, jax.lax.stop_gradient(alpha))
        loss = loss + tc.confidence_weight * wmean(bce)
        m["confidence_bce"] = wmean(bce)
        m["confidence_abs_error"] = jnp.mean(jnp.abs(jax.nn.sigmoid(c_logit) - alpha))
    match = (jnp.argmax(logits, -1) == jnp.argmax(p, -1)).astype(jnp.float32)
    accept = 1 + jnp.sum(jnp.cumprod(match, axis=-1), axis=-1).astype(jnp.int32)  # [B, N]
    m["greedy_accept"] = jnp.mean(accept.astype(jnp.float32))  # teacher-forced estimate
    m["accept_by_anchor"] = accept
    m["top1_by_slot"] = jnp.mean(match, axis=(0, 1))
    m["loss"] = loss
    return loss, m


def make_optimizer(weight_decay: float, clip: float):
    """clip -> Adam moments (b2 0.95) -> decoupled weight decay on matrices: AdamW without its learning rate. The
    rate is applied by train_step (a traced argument, trainer.lr_at from the host: warmup then cosine to 10 %
    over the steps the run will actually take), so a --time-budget run decays to the end of ITS steps; a
    schedule built into the optimizer over --steps (100000 in the device commands) barely decayed at all."""
    decay = lambda params: jax.tree.map(lambda a: a.ndim >= 2, params)
    return optax.chain(optax.clip_by_global_norm(clip), optax.scale_by_adam(0.9, 0.95),
                       optax.add_decayed_weights(weight_decay, decay))


def distill_prompts(ids: np.ndarray, n: int, prompt_len: int, seq: int, seed: int) -> np.ndarray:
    """n prompts int32[n, prompt_len] of the train split at random offsets (their greedy continuations to seq
    tokens are the self-distillation pool; kept in memory, never on disk)."""
    if n < 1:
        raise ValueError(f"--distill-seqs {n} must be >= 1 (0 turns self-distillation off)")
    if not 1 <= prompt_len < seq:
        raise ValueError(f"--distill-prompt {prompt_len} must be in [1, --seq {seq})")
    starts = np.random.default_rng(seed).integers(0, len(ids) - prompt_len, n)
    return np.stack([ids[s : s + prompt_len] for s in starts]).astype(np.int32)


def program_rows(n: int, batch: int) -> int:
    """Rows of the one greedy program for n prompts and at most `batch` rows a program: the fewest programs,
    rows spread evenly over them (4128 prompts at 512 -> 9 programs of 459 rows, not 8 full + 1 of 32)."""
    if batch < 1 or n < 1:
        raise ValueError(f"--distill-batch {batch} and the prompts ({n}) must be >= 1")
    return -(-n // -(-n // batch))


def greedy_program(params, rows: int, prompt_len: int, seq: int, cfg: ModelConfig):
    """greedy_continuations lowered for int32[rows, prompt_len] -> int32[rows, seq]: prefill of the prompts, then
    a lax.scan of decode steps on the model's decode state. Compiled once, it runs every chunk."""
    shape = jax.ShapeDtypeStruct((rows, prompt_len), jnp.int32)
    return jax.jit(lambda p, t: greedy_continuations(p, t, seq - prompt_len, cfg)).lower(params, shape)


def continue_prompts(gen, params, prompts: np.ndarray, rows: int) -> np.ndarray:
    """prompts [n, P] -> int32[n, seq] through `gen` (greedy_program(.., rows, P, ..) compiled), `rows` at a time;
    the last chunk is padded with repeats of its first row (its outputs are dropped)."""
    prompts = np.asarray(prompts, np.int32)
    out = []
    for i in range(0, len(prompts), rows):
        chunk = prompts[i : i + rows]
        pad = rows - len(chunk)
        got = np.asarray(gen(params, jnp.asarray(np.concatenate([chunk, np.repeat(chunk[:1], pad, 0)]))))
        out.append(got[: len(chunk)])
    return np.concatenate(out)


def train_step(dp, opt_state, params, tokens_all, pool, key, lr, cfg, dcfg, tc, tx):
    """pool int32[P, seq] | None: tc.pool_rows windows of the batch are rows of it (self-distillation text);
    lr f32[]: this step's learning rate."""
    k_win, k_anchor, k_pool = jax.random.split(key, 3)
    n_pool = tc.pool_rows if pool is not None else 0
    windows = random_windows(tokens_all, k_win, tc.batch - n_pool, tc.seq - 1)  # [B - n_pool, seq]
    if n_pool:
        picked = pool[jax.random.randint(k_pool, (n_pool,), 0, pool.shape[0])]
        windows = jnp.concatenate([picked, windows], axis=0)
    anchors = train_anchors(k_anchor, tc, windows.shape[0], windows.shape[1], dcfg.block_size)
    (_, m), grads = jax.value_and_grad(losses, has_aux=True)(dp, params, windows, anchors, cfg, dcfg, tc)
    del m["accept_by_anchor"]  # per block: the logged rows keep the means
    updates, opt_state = tx.update(grads, opt_state, dp)
    m["grad_norm"] = optax.tree.norm(grads)
    m["lr"] = lr
    return optax.apply_updates(dp, jax.tree.map(lambda u: -lr * u, updates)), opt_state, m


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="models/ling-demo", help="the target checkpoint dir (frozen)")
    p.add_argument("--data", default=".data/stdlib",
                   help="dir with tokens-{train,heldout}.npy or .npy.xz (ling_jax.train.corpus)")
    p.add_argument("--out", required=True, help="the draft dir written (config.json, model.safetensors, metrics.json)")
    p.add_argument("--init", default=None, help="start from this draft dir instead of random weights")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--time-budget", type=float, default=None,
                   help="seconds of the whole run after start-up (compiles, greedy texts, training, final eval, save); "
                        "caps --steps")
    p.add_argument("--compile-threads", type=int, default=1,
                   help="compile the greedy, training and eval programs concurrently in this many threads")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--anchors", type=int, default=32)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--layers", type=int, default=2, help="draft decoder layers")
    p.add_argument("--context-layers", type=int, default=5, help="target layers feeding the context (evenly spaced)")
    p.add_argument("--target-layers", default=None,
                   help="comma-separated target layer ids feeding the context (overrides --context-layers), e.g. "
                        "1,3,5,7 to include the last layer")
    p.add_argument("--markov-rank", type=int, default=256)
    p.add_argument("--kv-heads", type=int, default=None,
                   help="draft kv heads (default: the largest divisor of the target's heads that is <= 2)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--accept-weight", type=float, default=0.5)
    p.add_argument("--ce-weight", type=float, default=0.1, help="CE against the text's next token")
    p.add_argument("--l1-weight", type=float, default=0.9, help="L1 = 2 TV(q, p) to the target's distribution")
    p.add_argument("--kl-weight", type=float, default=0.0, help="KL(p || q) to the target's distribution")
    p.add_argument("--distill-seqs", type=int, default=0,
                   help="self-distillation: this many windows of the target's own greedy continuation of train-split "
                        "prompts, generated before training (the text a greedy DSpark step verifies)")
    p.add_argument("--distill-prompt", type=int, default=64, help="corpus tokens before each greedy continuation")
    p.add_argument("--distill-batch", type=int, default=256, help="windows generated per program")
    p.add_argument("--distill-fraction", type=float, default=0.5, help="share of each batch from the pool")
    p.add_argument("--anchor-window", type=int, default=0,
                   help="N > 0: training anchors uniform in [--distill-prompt, --distill-prompt + N) of every window, "
                        "i.e. the first N generated positions of a pool text, where bench.eval_accept verifies "
                        "(--prompt-len 64 --new-tokens 200: --distill-prompt 64 --anchor-window 200; needs --seq >= "
                        "prompt + N + block, e.g. 280); 0: anywhere in [0, seq - block) (the old default)")
    p.add_argument("--decay-gamma", type=float, default=4.0,
                   help="slot k's loss weight exp(-k / gamma) (DFlash: 7 for block 16, 4 for block 8)")
    p.add_argument("--compute-dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--eval-windows", type=int, default=32,
                   help="held-out windows of the heldout_* (corpus) and heldout_greedy_* metrics (random anchors)")
    p.add_argument("--eval-prompts", type=int, default=16,
                   help="the heldout_eval_* metrics: the teacher-forced accept at every anchor of the first "
                        "--eval-new-tokens generated positions after bench.eval_accept's held-out prompts (this many, "
                        "of --distill-prompt tokens, the same selection; 16 x 64 = that bench's defaults), and the "
                        "accept of the verify steps a real greedy step takes there (walk_accept); 0: off")
    p.add_argument("--eval-new-tokens", type=int, default=200, help="generated positions of the heldout_eval_* metrics")
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    return p


def draft_config(a, cfg: ModelConfig) -> dspark.DSparkConfig:
    if a.init:
        if a.target_layers:
            raise ValueError(f"--target-layers {a.target_layers} with --init {a.init}: the draft's fc reads the "
                             f"layers of its config.json")
        return dspark.load_config(a.init)
    H = cfg.num_attention_heads
    kv_heads = a.kv_heads or max(d for d in (1, 2) if H % d == 0)  # the target's heads: 4 in ling-demo, 5 in v2
    return dspark.DSparkConfig(
        hidden_size=cfg.hidden_size, num_hidden_layers=a.layers, num_attention_heads=H,
        num_key_value_heads=kv_heads, head_dim=cfg.hidden_size // cfg.num_attention_heads,
        intermediate_size=cfg.intermediate_size, rms_norm_eps=cfg.rms_norm_eps, rope_theta=1e6,
        vocab_size=cfg.vocab_size, block_size=a.block_size,
        target_layer_ids=(tuple(int(i) for i in a.target_layers.split(",")) if a.target_layers
                          else dspark.evenly_spaced_layers(cfg.num_hidden_layers, a.context_layers)),
        num_target_layers=cfg.num_hidden_layers, mask_token_id=cfg.pad_token_id, markov_rank=a.markov_rank)


def evaluate(ev, dp, params, held: np.ndarray, batch: int, n_anchors: int, G: int, prefix: str = "heldout_",
             stop=None) -> dict:
    """Mean metrics over the batches of held, n_anchors random anchors anywhere in each window (batch i's from
    key(i)); stop (a GracefulStop): a second signal ends it between batches (the metrics are then over the
    batches done)."""
    sums, n = {}, 0
    for i in range(0, len(held) - batch + 1, batch):
        if stop is not None and stop.urgent:
            break
        anchors = sample_anchors(jax.random.key(i), batch, held.shape[1], n_anchors, G)
        m = jax.device_get(ev(dp, params, jnp.asarray(held[i : i + batch]), anchors))
        del m["accept_by_anchor"]
        for k, v in m.items():
            sums[k] = sums.get(k, 0.0) + np.asarray(v, np.float64)
        n += 1
    return {f"{prefix}{k}": (v / max(n, 1)).tolist() for k, v in sums.items()}


def check_tokens(ids: np.ndarray, split: str, a, cfg: ModelConfig) -> np.ndarray:
    """The corpus must be ids of the target's vocabulary and hold at least one window."""
    if ids.ndim != 1 or ids.size < a.seq + 1:
        raise ValueError(f"{a.data}: tokens-{split} has shape {ids.shape}; need a 1-D stream of > --seq {a.seq} ids")
    if int(ids.max()) >= cfg.vocab_size:
        raise ValueError(f"{a.data}: tokens-{split} holds id {int(ids.max())} >= the target's vocab_size "
                         f"{cfg.vocab_size} (tokenized with another tokenizer?)")
    return ids


def compile_programs(lowered: dict, threads: int) -> tuple[dict, dict]:
    """{name: jax Lowered} -> ({name: compiled}, {name: seconds}); threads > 1 compiles them concurrently (XLA
    compiles outside the GIL; the seconds then overlap)."""
    def one(item):
        t = time.perf_counter()
        return item[0], item[1].compile(), time.perf_counter() - t

    if threads > 1:
        with ThreadPoolExecutor(threads) as ex:
            done = list(ex.map(one, lowered.items()))
    else:
        done = [one(item) for item in lowered.items()]
    return {n: c for n, c, _ in done}, {n: s for n, _, s in done}


def train_loop(step, dp, opt_state, params, tokens, pool, a, clock: Deadline, reserve_s: float, stop: GracefulStop):
    """Steps until --steps, the budget (steps_in_budget: re-planned after step 11 and every 50 steps, from the
    mean step time since step 1) or a signal. Returns (dp, opt_state, logged rows, steps done, first step s,
    mean step s)."""
    key = jax.random.key(a.seed + 1)
    rows, total, i = [], a.steps, 0
    t0 = time.perf_counter()
    t_first = t_timed = None
    step_s = math.nan
    while i < total and not stop.requested:
        lr = lr_at(i, total, a.lr, a.warmup, MIN_LR_FRAC)
        dp, opt_state, m = step(dp, opt_state, params, tokens, pool, jax.random.fold_in(key, i), jnp.float32(lr))
        i += 1
        if i == 1:
            jax.block_until_ready(m)
            t_timed = time.perf_counter()
            t_first = t_timed - t0
        elif a.time_budget and (i == 11 or i % 50 == 0):
            jax.block_until_ready(m)
            step_s = (time.perf_counter() - t_timed) / (i - 1)
            total = steps_in_budget(i, step_s, clock.left(), reserve_s, a.steps)
        if i % a.log_every == 0 or i == total or stop.requested:
            r = {"step": i, **{k: np.asarray(v).tolist() for k, v in jax.device_get(m).items()}}
            rows.append(r)
            print(f"step {i}/{total}: loss {r['loss']:.4f} ce {r['ce']:.3f} l1 {r['l1']:.3f} "
                  f"E[accept] {r['expected_accept']:.2f} greedy {r['greedy_accept']:.2f}", flush=True)
    jax.block_until_ready(dp)
    if i > 1:
        step_s = (time.perf_counter() - t_timed) / (i - 1)
    return dp, opt_state, rows, i, t_first, step_s


def lower_programs(params, dp, opt_state, tokens, held: np.ndarray, gen_rows: int, prompt: int, a, cfg, dcfg, tc,
                   tx) -> dict:
    """The run's three programs, lowered: the greedy texts, the training step and the evaluation."""
    pool = jax.ShapeDtypeStruct((a.distill_seqs, a.seq), jnp.int32) if a.distill_seqs else None
    step = jax.jit(functools.partial(train_step, cfg=cfg, dcfg=dcfg, tc=tc, tx=tx), donate_argnums=(0, 1))
    ev = jax.jit(lambda dp, params, w, anchors: losses(dp, params, w, anchors, cfg, dcfg, tc)[1])
    eval_batch = min(a.batch, len(held))
    return {"greedy": greedy_program(params, gen_rows, prompt, a.seq, cfg),
            "train_step": step.lower(dp, opt_state, params, tokens, pool, jax.random.key(0), jnp.float32(0)),
            "eval": ev.lower(dp, params, jnp.asarray(held[:eval_batch]),
                             jax.ShapeDtypeStruct((eval_batch, tc.anchors), jnp.int32))}


def eval_calls(n_held: int, n_eval_texts: int, window: int, batch: int, n_anchors: int) -> int:
    """Eval program calls of the final evaluation: the held-out corpus and greedy windows (a batch each), and
    window_accepts over the eval-anchor texts."""
    return 2 * (n_held // batch) + (-(-n_eval_texts // batch) * -(-window // n_anchors) if n_eval_texts else 0)


def eval_reserve(ev, dp, params, held: np.ndarray, batch: int, n_anchors: int, G: int, calls: int) -> float:
    """Seconds kept for the final evaluation (`calls` eval calls; one timed, x 1.5) and the save."""
    anchors = sample_anchors(jax.random.key(0), batch, held.shape[1], n_anchors, G)
    t0 = time.perf_counter()
    jax.block_until_ready(ev(dp, params, jnp.asarray(held[:batch]), anchors))
    return 1.5 * calls * (time.perf_counter() - t0) + SAVE_RESERVE_S


def main(argv=None) -> dict:
    """--time-budget S: the whole run after start-up (the target and the corpus loaded): compiles, the greedy
    texts, training, the final evaluation and the save. SIGINT / SIGTERM: see ling_jax.train.run_control."""
    from ling_jax.train import corpus
    from ling_jax.weights import load_params

    a = build_parser().parse_args(argv)
    cfg = load_config(a.target)
    dcfg = draft_config(a, cfg)
    dcfg.check_target(cfg)
    prompt = min(a.distill_prompt, a.seq - 1)
    tc = DSparkTrainConfig(batch=a.batch, seq=a.seq, anchors=a.anchors, ce_weight=a.ce_weight, l1_weight=a.l1_weight,
                           kl_weight=a.kl_weight, accept_weight=a.accept_weight, decay_gamma=a.decay_gamma,
                           distill_fraction=a.distill_fraction if a.distill_seqs else 0.0, anchor_start=prompt,
                           anchor_window=a.anchor_window, compute_dtype=a.compute_dtype)
    G = dcfg.block_size
    tc.anchor_range(a.seq, G)  # a window that does not fit --seq fails here, before anything is loaded
    if a.eval_prompts < 0 or a.eval_new_tokens < 1:
        raise ValueError(f"--eval-prompts {a.eval_prompts} must be >= 0, --eval-new-tokens {a.eval_new_tokens} >= 1")
    if a.compile_threads < 1:
        raise ValueError(f"--compile-threads {a.compile_threads} must be >= 1")
    params = load_params(cfg, a.target, dtype=jnp.dtype(a.compute_dtype))
    train_ids, held_ids = (check_tokens(corpus.load_tokens(a.data, s), s, a, cfg) for s in ("train", "heldout"))
    tokens = to_device(train_ids)
    held = fixed_windows(held_ids, a.seq - 1, a.eval_windows)
    clock = Deadline(a.time_budget)
    # one greedy program for the held-out prompts (the target's own text after each held-out window's first
    # distill_prompt tokens: what inference verifies), bench.eval_accept's held-out prompts (the eval-anchor
    # metric) and the pool's prompts
    eval_window = min(a.eval_new_tokens, a.seq - G - prompt)
    eval_prompts = (np.asarray(prompt_windows(held_ids, a.eval_prompts, prompt, cfg.eos_token_id), np.int32)
                    .reshape(-1, prompt) if a.eval_prompts else np.zeros((0, prompt), np.int32))
    if a.eval_prompts and (len(eval_prompts) == 0 or eval_window < 1):
        raise ValueError(f"--eval-prompts {a.eval_prompts}: {len(eval_prompts)} held-out prompts of {prompt} tokens "
                         f"without EOS, a window of {eval_window} anchors in --seq {a.seq} (block {G})")
    if a.eval_prompts and eval_window < a.eval_new_tokens:
        print(f"warning: the eval-anchor metric covers the first {eval_window} of --eval-new-tokens "
              f"{a.eval_new_tokens} generated positions (--seq {a.seq} >= {prompt + a.eval_new_tokens + G} covers all)",
              flush=True)
    prompts = np.concatenate([held[:, :prompt], eval_prompts])
    if a.distill_seqs:
        prompts = np.concatenate([prompts, distill_prompts(train_ids, a.distill_seqs, prompt, a.seq, a.seed)])
    gen_rows = program_rows(len(prompts), a.distill_batch)
    dp = dspark.load_params(dcfg, a.init, jnp.float32) if a.init else dspark.init_params(dcfg, a.seed)
    tx = make_optimizer(a.weight_decay, 1.0)
    opt_state = tx.init(dp)
    lowered = lower_programs(params, dp, opt_state, tokens, held, gen_rows, prompt, a, cfg, dcfg, tc, tx)
    programs, compile_s = compile_programs(lowered, a.compile_threads)
    print("compiled in " + ", ".join(f"{k} {v:.1f} s" for k, v in compile_s.items()) +
          f" ({a.compile_threads} thread(s); {clock.elapsed():.1f} s since start-up)", flush=True)
    t0 = time.perf_counter()
    texts = continue_prompts(programs["greedy"], params, prompts, gen_rows)
    greedy_s = time.perf_counter() - t0
    n_held, n_eval = len(held), len(eval_prompts)
    held_greedy, eval_texts = texts[:n_held], texts[n_held : n_held + n_eval]
    pool = jnp.asarray(texts[n_held + n_eval :]) if a.distill_seqs else None
    n_programs = -(-len(prompts) // gen_rows)
    print(f"greedy texts: {len(held)} + {n_eval} held-out" +
          (f" + self-distillation pool {a.distill_seqs}" if a.distill_seqs else "") +
          f" x {a.seq} tokens ({prompt} corpus + greedy) in {greedy_s:.1f} s ({n_programs} programs of {gen_rows} "
          f"rows, {1e3 * greedy_s / (n_programs * (a.seq - prompt)):.1f} ms per decode step; compile "
          f"{compile_s['greedy']:.1f} s)", flush=True)
    eval_batch = min(a.batch, len(held))
    calls = eval_calls(n_held, n_eval, eval_window, eval_batch, tc.anchors)
    reserve_s = eval_reserve(programs["eval"], dp, params, held, eval_batch, tc.anchors, G, calls)
    if clock.left() < reserve_s:
        print(f"warning: {clock.elapsed():.0f} s of the {a.time_budget:g} s budget spent before training", flush=True)
    with GracefulStop() as stop:
        t0 = time.perf_counter()
        dp, opt_state, rows, steps, first_s, step_s = train_loop(programs["train_step"], dp, opt_state, params,
                                                                 tokens, pool, a, clock, reserve_s, stop)
        train_s, t0 = time.perf_counter() - t0, time.perf_counter()
        final = {}
        if not stop.urgent:
            final = evaluate(programs["eval"], dp, params, held, eval_batch, tc.anchors, G, stop=stop)
            final |= evaluate(programs["eval"], dp, params, held_greedy, eval_batch, tc.anchors, G,
                              "heldout_greedy_", stop)
            accept = (window_accepts(programs["eval"], dp, params, eval_texts, prompt, eval_window, eval_batch,
                                     tc.anchors, stop) if n_eval else None)
            if accept is not None:
                final |= eval_anchor_metrics(accept, a.eval_new_tokens, G)
            print(json.dumps({k: v for k, v in final.items() if "top1_by_slot" not in k and "by_prompt" not in k
                              and "per_position" not in k}), flush=True)
        eval_s, t0 = time.perf_counter() - t0, time.perf_counter()
        dspark.save(dcfg, dp, a.out)
        report = {"command": "python -m ling_jax.train.dspark " + " ".join(argv if argv is not None else sys.argv[1:]),
                  "device": jax.devices()[0].device_kind, "jax_version": jax.__version__,
                  "date": time.strftime("%Y-%m-%d"), "target": a.target, "draft_params": dspark.param_count(dcfg),
                  "steps": steps, "interrupted": stop.requested, "final_eval_skipped": stop.urgent,
                  "time_budget": a.time_budget, "anchor_range": list(tc.anchor_range(a.seq, G)),
                  "pool_epochs": steps * tc.pool_rows / a.distill_seqs if a.distill_seqs else None,
                  "compile_s": compile_s, "greedy_s": greedy_s,
                  "reserve_s": reserve_s, "first_step_s": first_s, "train_s": train_s, "step_ms": 1e3 * step_s,
                  "eval_s": eval_s, "save_s": time.perf_counter() - t0, "run_s": clock.elapsed(), "final": final,
                  "rows": rows}
        with open(os.path.join(a.out, "metrics.json"), "w") as f:
            json.dump(report, f, indent=1)
    print(f"wrote {a.out} ({dspark.param_count(dcfg) / 1e6:.2f}M params, {steps} steps"
          f"{', interrupted' if stop.requested else ''}; train {train_s:.0f} s, whole run {report['run_s']:.0f} s"
          + (f" of {a.time_budget:g}" if a.time_budget else "") + ")", flush=True)
    return report


if __name__ == "__main__":
    main()
