"""Token windows for training and evaluation.

The whole tokenized split lives on the device (3.3M uint16 tokens of the stdlib corpus = 6.6 MB); each training
step draws B random window starts from its own key (fold_in(seed key, step)), so the data order is a pure
function of (seed, step) and costs no host transfer. Evaluation uses fixed, non-overlapping windows.
Shape legend: N corpus tokens, B windows, T + 1 tokens per window (T inputs and the T shifted labels).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


def to_device(tokens: np.ndarray) -> jax.Array:
    return jnp.asarray(np.asarray(tokens, np.int32))


def random_windows(tokens: jax.Array, key, batch: int, seq: int) -> jax.Array:
    """tokens int32[N] -> int32[B, T+1] windows at uniform random starts in [0, N - T - 1]."""
    starts = jax.random.randint(key, (batch,), 0, tokens.shape[0] - seq - 1)
    return jax.vmap(lambda s: lax.dynamic_slice_in_dim(tokens, s, seq + 1))(starts)


def fixed_windows(tokens: np.ndarray, seq: int, max_windows: int | None = None) -> np.ndarray:
    """Non-overlapping windows int32[W, T+1] (consecutive windows share one boundary token), from the start."""
    n = (len(tokens) - 1) // seq
    if max_windows is not None:
        n = min(n, max_windows)
    idx = np.arange(n)[:, None] * seq + np.arange(seq + 1)[None, :]
    return np.asarray(tokens, np.int32)[idx]


def prompt_windows(tokens: np.ndarray, n: int, length: int, eos: int) -> list[list[int]]:
    """Up to n prompts of `length` tokens: the first n of 4 n evenly spaced windows of the stream that hold no EOS
    (each inside one file). bench.eval_accept's held-out prompts, and the DSpark trainer's eval-anchor metric."""
    out, starts = [], np.linspace(0, len(tokens) - length - 1, 4 * n).astype(int)
    for s in starts:
        w = tokens[s : s + length]
        if eos not in w:
            out.append([int(t) for t in w])
        if len(out) == n:
            break
    return out
