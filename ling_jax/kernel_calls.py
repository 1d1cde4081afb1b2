"""How the layers call the Pallas kernels: one object, so a compiler can wrap every call (e.g. in shard_map).

The layers never import a kernel directly; they call `opts.kernel_calls().moe(...)` etc. `KernelCalls` runs the
kernel on the arrays it is given (one device, or whatever the caller's jit partitions). The compiler
(compile/sharding.py, `ShardedKernelCalls`) subclasses it to run the same per-device calls under
`jax.shard_map` with the specs of its sharding rules, since a Pallas custom call cannot be auto-partitioned.

Shapes (per call, the layers' view; a subclass sees its per-device slices inside shard_map):
  moe:        x [T, D], ids [T, A] int32, weights [T, A] f32, w_gate/w_up [E, I, D], w_down [E, D, I],
              shared = (gate [Is, D], up [Is, D], down [D, Is])           -> [T, D] f32
  kda_verify: q/k/v/f raw [B, T, C], b_raw [B, T, H], A_log [H], dt_bias [C], conv weights 3 x [C, 1, W],
              conv_window [B, W-1, 3, C], rec_state [B, H, K, V] f32       -> (o [B, T, H, V] f32, KdaCommitInputs)
  kda_commit: rec_state [B, H, K, V], KdaCommitInputs, n_accept [B]        -> rec_state
"""

from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp


@dataclass(frozen=True)
class KernelCalls:
    """Direct kernel calls. interpret: run the kernels in the Pallas interpreter with tiles that fit any small
    test shape (CPU tests of the wiring)."""

    interpret: bool = False

    # Tiles are picked from the shapes the kernel actually sees (a subclass's per-device slice).
    def _moe_config(self, d: int, i: int):
        if not self.interpret:
            return None
        from pallas_kernels.moe import MoeConfig

        return MoeConfig(block_i=min(32, i), block_k=min(256, d), block_d=min(64, d), block_kd=min(256, i),
                         interpret=True)

    def _kda_config(self):
        if not self.interpret:
            return None
        from pallas_kernels.kda_verify import KdaConfig

        return KdaConfig(block_v=16, interpret=True)

    def moe(self, x, ids, weights, w_gate, w_up, w_down, *, limit: float, shared, shared_limit: float):
        from pallas_kernels.dispatch import Backend, moe

        _, i, d = w_gate.shape
        out = moe(x, ids, weights, w_gate, w_up, w_down, limit=limit, shared=shared, shared_limit=shared_limit,
                  config=self._moe_config(d, i), backend=Backend.PALLAS)
        return out.astype(jnp.float32)

    def kda_verify(self, q_raw, k_raw, v_raw, f_raw, b_raw, A_log, dt_bias, q_conv_w, k_conv_w, v_conv_w,
                   conv_window, rec_state, *, lower_bound: float):
        from pallas_kernels.dispatch import Backend, kda_verify

        B, Wm1 = conv_window.shape[:2]
        return kda_verify(q_raw, k_raw, v_raw, f_raw, b_raw, A_log, dt_bias, q_conv_w, k_conv_w, v_conv_w,
                          conv_window.reshape(B, Wm1, -1), rec_state, lower_bound=lower_bound,
                          config=self._kda_config(), backend=Backend.PALLAS)

    def kda_commit(self, rec_state, inputs, n_accept):
        from pallas_kernels.dispatch import Backend, kda_commit

        return kda_commit(rec_state, inputs, n_accept, config=self._kda_config(), backend=Backend.PALLAS)
