"""A Generator whose programs keep every state in the sharding of compile.sharding (params arrive sharded).

The model code stays sharding-free: the step and prefill programs are the Generator's own, wrapped in one more
jit whose outputs are pinned with `with_sharding_constraint` to `state_shardings`, so the donated state comes
back in the layout it went in (XLA aliases it) and the parameters' shardings drive the rest. The Pallas kernel
calls (which XLA cannot partition) go through `ShardedKernelCalls`, i.e. run per device under shard_map.
"""

from __future__ import annotations

import functools

import jax
from jax.sharding import Mesh

from compile.sharding import ShardingRules, kernel_calls_for, shardings_for, state_shardings
from ling_jax.aliased_step import AliasedStep
from ling_jax.config import ModelConfig
from ling_jax.runner import Generator
from ling_jax.weights import init_params


def constrain(tree, mesh: Mesh, rules: ShardingRules):
    """Pin every leaf of a state / output pytree to its rule sharding (works on tracers)."""
    return jax.lax.with_sharding_constraint(tree, state_shardings(tree, mesh, rules))


class ShardedGenerator(Generator):
    """Generator over a mesh. `params` must be sharded with `shardings_for(cfg, mesh, rules)` (see
    `sharded_params`)."""

    def __init__(self, cfg: ModelConfig, params, mesh: Mesh, rules: ShardingRules = ShardingRules(), **kw):
        super().__init__(cfg, params, **kw)
        self.mesh, self.rules = mesh, rules
        self.opts = kernel_calls_for(self.opts, mesh, rules)  # Pallas calls under shard_map

    @functools.lru_cache(maxsize=None)
    def init_fn(self, is_greedy: bool):
        inner = super().init_fn(is_greedy)
        return jax.jit(lambda *a: constrain(inner(*a), self.mesh, self.rules))

    @functools.lru_cache(maxsize=None)
    def prefill_fn(self, is_greedy: bool):
        inner = super().prefill_fn(is_greedy)
        return jax.jit(lambda *a: constrain(inner(*a), self.mesh, self.rules), donate_argnums=(1,))

    @functools.lru_cache(maxsize=None)
    def step_program(self, is_greedy: bool, with_logprobs: bool, adjusts_logits: bool):
        inner = self.dispatch_step(is_greedy, with_logprobs, adjusts_logits)
        return AliasedStep(lambda p, s: constrain(inner(p, s), self.mesh, self.rules),
                           out_shardings=lambda out: state_shardings(out, self.mesh, self.rules))


def sharded_params(cfg: ModelConfig, mesh: Mesh, rules: ShardingRules = ShardingRules(), *, seed: int = 0,
                   dtype=jax.numpy.bfloat16):
    """Random parameters born sharded on the mesh (same values as the unsharded init of the same seed)."""
    return init_params(cfg, seed, dtype, shardings_for(cfg, mesh, rules))
