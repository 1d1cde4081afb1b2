"""Batch-1 decode states joined into one batch and split back (the continuous-batching step's data movement).

A slot holds one request as a batch-1 SpecState / DSparkState / PlainState. Joining concatenates the slots' rows
along each leaf's batch axis (DecodeState leaves are [layers, B, ...] and DSpark's draft context K/V [Ld, B, ...]:
axis 1; the others [B, ...]: axis 0) and stacks the leaves a batch-1 state keeps per request without a batch axis
(the PRNG key, the SamplingParams scalars and logit_bias, the accept histogram and DSpark's verify-length
histogram) into a new leading axis: the joined state carries per-row keys, sampling fields and histograms, which
ling_jax.sampling / spec / dspark_step / decode treat row by row. split_rows(join_rows(s), n) == s.

A joined state is also edited row by row (the continuous-batching group, ling_jax.batching): put_row overwrites
one row with a batch-1 state (every leaf), take_rows gathers rows into a joined state of another size, and
cat_rows appends one joined state's rows to another's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ling_jax.decode import PlainState
from ling_jax.dspark_step import DSparkState
from ling_jax.spec import SpecState
from ling_jax.state import DecodeState

STACKED = -1  # a leaf with no batch axis in a batch-1 state: joined along a new leading axis


def batch_axes(state: SpecState | DSparkState | PlainState):
    """The state's structure with each leaf replaced by the axis its rows lie on (STACKED: per request)."""
    each = lambda tree, axis: jax.tree.map(lambda _: axis, tree)
    common = dict(target=DecodeState(kda_recurrent=1, kda_conv=1, mla_cache=1, lengths=0), bonus=0, key=STACKED,
                  sampling=each(state.sampling, STACKED), history=each(state.history, 0))
    if isinstance(state, SpecState):
        return SpecState(draft_cache=0, seed=0, draft_hidden=0, seed_q=None if state.seed_q is None else 0,
                         accept_hist=STACKED, **common)
    if isinstance(state, DSparkState):
        return DSparkState(ctx_k=1, ctx_v=1, accept_hist=STACKED, length_hist=STACKED, **common)
    if isinstance(state, PlainState):
        return PlainState(**common)
    raise TypeError(f"join_rows takes SpecState, DSparkState or PlainState slots, got {type(state).__name__}")


def join_rows(states):
    """Batch-1 states (a sequence, all of one structure) -> one state of len(states) rows."""
    return jax.tree.map(lambda axis, *xs: jnp.stack(xs) if axis == STACKED else jnp.concatenate(xs, axis=axis),
                        batch_axes(states[0]), *states)


def split_rows(state, n: int) -> tuple:
    """A joined state of n rows -> n batch-1 states (join_rows' inverse)."""
    axes = batch_axes(state)
    take = lambda i, axis, x: x[i] if axis == STACKED else jax.lax.slice_in_dim(x, i, i + 1, axis=axis)
    return tuple(jax.tree.map(lambda axis, x: take(i, axis, x), axes, state) for i in range(n))


def is_joined(state) -> bool:
    """A joined state (per-row keys) rather than a batch-1 state (one scalar key)."""
    return state.key.ndim == 1


def put_row(group, position, state):
    """A joined state, position int32[], a batch-1 state -> the joined state with row `position` replaced by the
    batch-1 state's row, every leaf (dynamic_update_slice along each leaf's batch axis: donate the group and this
    copies one row)."""

    def put(axis, g, x):
        if axis == STACKED:
            x, axis = x[None], 0
        start = [jnp.int32(0)] * g.ndim
        start[axis] = jnp.asarray(position, jnp.int32)
        return jax.lax.dynamic_update_slice(g, x, start)

    return jax.tree.map(put, batch_axes(group), group, state)


def take_rows(group, idx):
    """A joined state, idx int32[m] -> the joined state of its rows idx (m rows, in that order)."""
    take = lambda axis, x: x[idx] if axis in (0, STACKED) else x[:, idx]
    return jax.tree.map(take, batch_axes(group), group)


def cat_rows(a, b):
    """Two joined states -> one holding a's rows then b's."""
    cat = lambda axis, x, y: jnp.concatenate((x, y), axis=0 if axis == STACKED else axis)
    return jax.tree.map(cat, batch_axes(a), a, b)
