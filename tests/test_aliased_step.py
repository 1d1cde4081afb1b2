"""ling_jax.aliased_step: every output of the step program aliases a donated input (so XLA's CUDA graph of the
step is not re-recorded each call), the outputs the host holds stay valid after later calls, and the values
equal the plain jitted step's."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ling_jax.aliased_step import AliasedStep
from ling_jax.runner import count_compiles


def toy_step(params, state):
    """state = (x [4, 8] f32, t int32[1]) -> ((x', t + 1), out = (token int32[1, 3], n int32[1]))."""
    x, t = state
    x = jnp.tanh(x @ params + t.astype(jnp.float32))
    token = jnp.argsort(x[0])[:3].astype(jnp.int32)[None]
    return (x, t + 1), (token, t * 2)


def fresh_state():
    return (jnp.asarray(np.random.default_rng(0).normal(size=(4, 8)), jnp.float32), jnp.zeros((1,), jnp.int32))


def aliased_outputs(lowered) -> int:
    return len(re.findall(r"tf\.aliasing_output = \d+", lowered.as_text()))


def test_every_output_aliases_a_donated_input():
    params = jnp.eye(8, dtype=jnp.float32) * 0.5
    step = AliasedStep(toy_step)
    n_out = len(jax.tree.leaves(jax.eval_shape(toy_step, params, fresh_state())))
    assert aliased_outputs(step.lower(params, fresh_state())) == n_out == 4
    # the plain donated jit aliases only the state's two leaves: its two outputs are fresh buffers every call
    plain = jax.jit(toy_step, donate_argnums=(1,))
    assert aliased_outputs(plain.lower(params, fresh_state())) == 2


@pytest.mark.parametrize("committed", [False, True])
def test_values_equal_the_jitted_step_and_held_outputs_survive(committed):
    params = jnp.eye(8, dtype=jnp.float32) * 0.5
    if committed:  # the runner's case: weights placed on the device, so every output is committed too
        params = jax.device_put(params, jax.devices()[0])
    place = (lambda t: jax.device_put(t, jax.devices()[0])) if committed else (lambda t: t)
    ref = jax.jit(toy_step)
    step = AliasedStep(toy_step)
    s_ref, s = fresh_state(), place(fresh_state())  # a state as prefill leaves it (committed with the weights)
    held, want = [], []
    for i in range(5):
        s_ref, o_ref = ref(params, s_ref)
        with count_compiles() as names, jax.transfer_guard("disallow"):  # as the runner dispatches
            s, o = step(params, s)
        # calls 2..: the box (the previous call's outputs) is placed as the first call's zeros were: no recompile
        assert i == 0 or names == [], (i, names)
        held.append(o)
        want.append(jax.device_get(o_ref))
    for o, w in zip(held, want):  # every call's copy is intact although its buffers were reused since
        for a, b in zip(jax.device_get(o), w):
            np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(jax.device_get(s[0]), jax.device_get(s_ref[0]))


def test_compile_ahead_of_time_on_abstract_state():
    params = jnp.eye(8, dtype=jnp.float32) * 0.5
    step = AliasedStep(toy_step)
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), fresh_state())
    compiled = step.compile(params, abstract)
    assert "aliasing" in compiled.as_text() or "alias" in compiled.as_text()
    s, o = step(params, fresh_state())
    s, o2 = step(params, s)
    np.testing.assert_array_equal(jax.device_get(o2[1]), [2])
