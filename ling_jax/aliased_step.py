"""A step program whose every output aliases a donated input, so XLA records its CUDA graph once.

On the GPU XLA runs the whole step as one command buffer (a CUDA graph), and re-records it (every kernel node's
arguments, `command_buffer::update`) whenever a buffer it uses has moved since the last call
(xla/backends/gpu/runtime/command_buffer_thunk.cc). A step `(params, state) -> (state, out)` on donated state
keeps the state's buffers in place, but `out` (the emitted tokens, the accept count) is a fresh allocation every
call, so EVERY call re-records the graph. Measured on the H200 with the demo model (bench/dispatch_probe.py, XLA's
VLOG counting the updates; bench/results/dispatch-probe-*-h200-2026-12-02*.json): the plain jitted step re-records
on 150 of 150 calls, 87-180 us each for the plain step and 340-470 us for the NEXTN 5 step; this form re-records
on none. A device allocation between two steps (a copy of the outputs in device memory) can also move the step's
temporary buffer, and then the whole graph is re-recorded (65 of 150 calls at 640-1600 us each, measured), so the
copy the host reads goes to pinned host memory.

So the step runs as two programs:

    advance(params, state, box) -> (state', out')   state and box donated: out' is written into the box's buffers
    emit(out') -> a copy of out' in pinned host memory   a few bytes; what the host holds and reads one step late

The box is the previous call's out' (its buffers are reused in place; the first box is zeros, placed like the
outputs). `emit`'s copy is what makes the host's late read safe: the box itself is donated to the next call.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp


class AliasedStep:
    """callable (params, state) -> (state, out), as `jax.jit(step, donate_argnums=(1,))` is, with every output of
    the big program aliased to a donated input (see the module docstring).

    step: the un-jitted step function (params, state) -> (state, out).
    out_shardings: tree of the step's `out` (abstract) -> their shardings (None: the inputs' one device, committed
      where they are); a sharded caller passes its output sharding rule, so the box aliases the outputs and the
      second call matches the first one's signature."""

    def __init__(self, step: Callable, out_shardings: Callable | None = None):
        self._step = step
        self._out_shardings = out_shardings
        self.advance = jax.jit(lambda params, state, box: _into_box(step(params, state), box), donate_argnums=(1, 2))
        self.emit = None  # built with the first box, which knows where the outputs live
        self._box = None

    def first_box(self, params, state):
        """Zeros shaped and placed like the step's `out`, made on the device (no step runs, no host transfer: the
        runner dispatches under jax.transfer_guard("disallow"))."""
        out = jax.eval_shape(self._step, params, state)[1]
        if self._out_shardings is not None:
            shardings = self._out_shardings(out)
        else:  # jit's outputs are committed to the inputs' device when any input is (else the call with the
            # previous outputs as its box would not match the first call's signature and compile again)
            committed = [a for a in jax.tree.leaves((params, state)) if getattr(a, "committed", False)]
            shardings = committed[0].sharding if committed else None
        zeros = lambda: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), out)
        if self.emit is None:
            self.emit = jax.jit(lambda o: jax.tree.map(jnp.copy, o), out_shardings=_in_host_memory(shardings, out))
        return jax.jit(zeros, out_shardings=shardings)()

    def __call__(self, params, state):
        box = self._box if self._box is not None else self.first_box(params, state)
        state, out = self.advance(params, state, box)
        self._box = out  # donated to the next call: its buffers are this call's outputs, reused in place
        return state, self.emit(out)

    def compile(self, params, state):
        """Compile the advance program ahead of time on these arguments (`state` may be abstract: shapes and
        shardings); later calls run that executable. Returns it (its memory_analysis, as_text)."""
        self.advance = self.lower(params, state).compile()
        return self.advance

    def lower(self, params, state):
        """The advance program lowered on these arguments (what runs on the device, e.g. to inspect its HLO)."""
        return self.advance.lower(params, state, self.first_box(params, state))

    def lower_abstract(self, params, state):
        """The advance program lowered on abstract arguments (ShapeDtypeStructs with shardings), its box abstract
        too: nothing runs on any device, so this lowers for a compile-only device (deviceless compilation, e.g.
        bench/census_offline.py). Needs the out_shardings rule (the box's placement)."""
        if self._out_shardings is None:
            raise ValueError("lower_abstract needs out_shardings: an abstract box has no device to follow")
        out = jax.eval_shape(self._step, params, state)[1]
        box = jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), out,
                           self._out_shardings(out))
        return self.advance.lower(params, state, box)


def _in_host_memory(shardings, out):
    """Where `emit` writes its copies: pinned host memory of the outputs' devices (the copy IS the device-to-host
    transfer the host reads one step late, and it allocates nothing on the device between two steps: a device
    allocation there can move the step's temporary buffer, and a moved buffer re-records the whole graph,
    ~800 us on the H200). Device memory where the device has no pinned host memory."""
    if shardings is None:
        shardings = jax.tree.map(lambda a: jax.sharding.SingleDeviceSharding(jax.devices()[0]), out)
    one = jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
    kinds = {m.kind for m in next(iter(one[0].device_set)).addressable_memories()} if one else set()
    if "pinned_host" not in kinds:
        return shardings
    return jax.tree.map(lambda sh: sh.with_memory_kind("pinned_host"), shardings,
                        is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))


def _into_box(result, box):
    """(state, out) with out written over the box: the box becomes an input the program uses (jit drops unused
    arguments, and a dropped argument aliases nothing), and XLA folds the whole-array update into out itself."""
    state, out = result
    return state, write_into(box, out)


def write_into(box, value):
    """`value` (a tree) written over `box` (a tree of the same structure, shapes and dtypes), leaf by leaf, as whole-
    array updates: inside a program with the box donated, each output then aliases its box leaf (the box is used,
    so jit keeps it as an argument) and XLA writes the value straight into the box's buffer (no copy, the box's
    contents never read)."""
    into = lambda b, o: jax.lax.dynamic_update_slice(b.reshape(-1, *b.shape[b.ndim:]) if b.ndim == 0 else b,
                                                     o.reshape(1) if o.ndim == 0 else o,
                                                     (0,) * max(o.ndim, 1)).reshape(o.shape)
    return jax.tree.map(into, box, value)
