"""Batch-1 decode states joined into one batch and split back (the continuous-batching step's data movement).

A slot holds one request as a batch-1 SpecState / PlainState. Joining concatenates the slots' rows along each
leaf's batch axis (DecodeState leaves are [layers, B, ...]: axis 1; the others [B, ...]: axis 0) and stacks the
leaves a batch-1 state keeps per request without a batch axis (the PRNG key, the SamplingParams scalars and
logit_bias, the accept histogram) into a new leading axis: the joined state carries per-row keys, sampling fields
and histograms, which ling_jax.sampling / spec / decode treat row by row. split_rows(join_rows(s), n) == s.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ling_jax.decode import PlainState
from ling_jax.spec import SpecState
from ling_jax.state import DecodeState

STACKED = -1  # a leaf with no batch axis in a batch-1 state: joined along a new leading axis


def batch_axes(state: SpecState | PlainState):
    """The state's structure with each leaf replaced by the axis its rows lie on (STACKED: per request)."""
    each = lambda tree, axis: jax.tree.map(lambda _: axis, tree)
    common = dict(target=DecodeState(kda_recurrent=1, kda_conv=1, mla_cache=1, lengths=0), bonus=0, key=STACKED,
                  sampling=each(state.sampling, STACKED), history=each(state.history, 0))
    if isinstance(state, SpecState):
        return SpecState(draft_cache=0, seed=0, draft_hidden=0, seed_q=None if state.seed_q is None else 0,
                         accept_hist=STACKED, **common)
    if isinstance(state, PlainState):
        return PlainState(**common)
    raise TypeError(f"join_rows takes SpecState or PlainState slots, got {type(state).__name__}")


def join_rows(states):
    """Batch-1 states (a sequence, all of one structure) -> one state of len(states) rows."""
    return jax.tree.map(lambda axis, *xs: jnp.stack(xs) if axis == STACKED else jnp.concatenate(xs, axis=axis),
                        batch_axes(states[0]), *states)


def split_rows(state, n: int) -> tuple:
    """A joined state of n rows -> n batch-1 states (join_rows' inverse)."""
    axes = batch_axes(state)
    take = lambda i, axis, x: x[i] if axis == STACKED else jax.lax.slice_in_dim(x, i, i + 1, axis=axis)
    return tuple(jax.tree.map(lambda axis, x: take(i, axis, x), axes, state) for i in range(n))
