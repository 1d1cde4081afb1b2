"""The DSpark trainer's held-out metric with bench.eval_accept's anchors.

The real greedy DSpark step's accept length equals the trainer's teacher-forced block at the same anchors
(bench/dspark_teacher_forced.py: every verify step of 3 prompts), so what separates the trainer's figure from the
eval's is WHERE the anchors are. bench.eval_accept verifies the first --new-tokens (200) generated positions after
--prompt-len (64) held-out tokens; the trainer's heldout_greedy_* anchors lie anywhere in 448 greedy tokens, deep in
the target's greedy loops, where copying is easy (6.22 there vs 2.6 on the eval). Here: the teacher-forced accept at
EVERY anchor of that window of the eval's own prompts' greedy texts (window_accepts), and the verify steps a real
step would take through them (verify_walk: the eval's mean accept length, computed without running the step).

Shape legend: n texts, T positions, W window anchors, A anchors per eval call.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def window_accepts(ev, dp, params, texts: np.ndarray, start: int, window: int, batch: int, n_anchors: int,
                   stop=None) -> np.ndarray | None:
    """int32[n, window]: the teacher-forced greedy accept length at EVERY anchor start .. start+window-1 of each
    text. ev: the eval program, compiled for [batch, T] texts and [batch, n_anchors] anchors (the last batch of
    texts and chunk of anchors are padded with repeats; their outputs are dropped). None if stop.urgent."""
    n = len(texts)
    rows = np.concatenate([texts, np.repeat(texts[:1], -n % batch, 0)])
    pos = np.arange(start, start + window)
    pos = np.concatenate([pos, np.full(-window % n_anchors, start)])
    out = np.zeros((len(rows), len(pos)), np.int32)
    for i in range(0, len(rows), batch):
        for j in range(0, len(pos), n_anchors):
            if stop is not None and stop.urgent:
                return None
            anchors = jnp.asarray(np.broadcast_to(pos[j : j + n_anchors], (batch, n_anchors)), jnp.int32)
            m = ev(dp, params, jnp.asarray(rows[i : i + batch]), anchors)
            out[i : i + batch, j : j + n_anchors] = np.asarray(jax.device_get(m["accept_by_anchor"]))
    return out[:n, :window]


def verify_walk(accept: np.ndarray, new_tokens: int) -> list[list[int]]:
    """The verify steps of a greedy DSpark step generating new_tokens after each prompt, from the accept length
    at every anchor (accept int[n, W], column j = the anchor j positions after the prompt): the prefill emits the
    first token (the first anchor, j = 0); a step at anchor j emits accept[j] tokens and the next anchor is
    j + accept[j]; steps go on while fewer than new_tokens are emitted (ling_jax.runner.Generator's loop), or
    until the walk leaves the window. Each text's list of step accept lengths: with the greedy text and the
    teacher-forced block equal to the real step's (tests/test_dspark_parity.py), this IS the real step's."""
    walks = []
    for row in np.asarray(accept):
        steps, emitted = [], 1
        while emitted < new_tokens and emitted - 1 < len(row):
            steps.append(int(row[emitted - 1]))
            emitted += steps[-1]
        walks.append(steps)
    return walks


def eval_anchor_metrics(accept: np.ndarray, new_tokens: int, G: int, prefix: str = "heldout_eval_") -> dict:
    """The held-out metrics with bench.eval_accept's anchors (accept int[n, W]: window_accepts over the first W
    generated positions of n held-out prompts' greedy texts): greedy_accept, the mean over every anchor of the
    window; walk_accept, the mean accept length of the verify steps a real greedy step would take (verify_walk,
    pooled over the prompts as eval_accept's mean_accept_length), with its per-position acceptance and per-prompt
    means."""
    walks = verify_walk(accept, new_tokens)
    flat = np.concatenate([np.asarray(w, np.int64) for w in walks])
    return {f"{prefix}greedy_accept": float(np.mean(accept)), f"{prefix}walk_accept": float(np.mean(flat)),
            f"{prefix}walk_acceptance_rate_per_position": [float(np.mean(flat - 1 >= j)) for j in range(1, G + 1)],
            f"{prefix}walk_accept_by_prompt": [float(np.mean(w)) for w in walks],
            f"{prefix}walk_steps": int(flat.size), f"{prefix}prompts": int(accept.shape[0]),
            f"{prefix}window": int(accept.shape[1]), f"{prefix}new_tokens": new_tokens}
