"""How the layers call the Pallas kernels: one object, so a compiler can wrap every call (e.g. in shard_map).

The layers never import a kernel directly; they call `opts.kernel_calls().moe(...)` etc. `KernelCalls` runs the
kernel on the arrays it is given (one device, or whatever the caller's jit partitions). The compiler
(compile/sharding.py, `ShardedKernelCalls`) subclasses it to run the same per-device calls under
`jax.shard_map` with the specs of its sharding rules, since a Pallas custom call cannot be auto-partitioned.

Shapes (per call, the layers' view; a subclass sees its per-device slices inside shard_map):
  moe:        x [T, D], ids [T, A] int32, weights [T, A] f32, w_gate/w_up [E, I, D], w_down [E, D, I],
              shared = (gate [Is, D], up [Is, D], down [D, Is])           -> [T, D] f32
              (any weight may be a quant.Fp8Weight: w8 of that shape + its 128-block scales)
  kda_verify: q/k/v/f raw [B, T, C], b_raw [B, T, H], A_log [H], dt_bias [C], conv weights 3 x [C, 1, W],
              conv_window [B, W-1, 3, C], rec_state [B, H, K, V] f32       -> (o [B, T, H, V] f32, KdaCommitInputs)
  kda_commit: rec_state [B, H, K, V], KdaCommitInputs, n_accept [B]        -> rec_state
  kda_decode: kda_verify's arguments with T = 1                           -> (o, rec_state, conv_window)
  route:      x [T, D], gate_w [E, D], expert_bias [E], the model config    -> (ids [T, A] int32, weights [T, A] f32),
              or None when the Pallas router does not fit the dims (the caller routes in jnp)
  kda_prefill: q, k [B, T, H, K] (q scaled), v [B, T, H, V], g [B, T, H, K], beta [B, T, H], state
              [B, H, K, V]                                                -> (o [B, T, H, V] f32, state)
"""

from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp

from ling_jax.quant import Fp8Weight, dense


@dataclass(frozen=True)
class KernelCalls:
    """Direct kernel calls. interpret: run the kernels in the Pallas interpreter with tiles that fit any small
    test shape (CPU tests of the wiring)."""

    interpret: bool = False
    moe_impl: str | None = None  # "mosaic" | "triton" | None (pallas_kernels.dispatch.moe_impl decides)

    # Tiles are picked from the shapes the kernel actually sees (a subclass's per-device slice): the kernels'
    # defaults where they divide the dims (full-size Ling), else the largest power of two that does (small
    # models, e.g. ling-demo's expert width 96), so any preset runs on the GPU too.
    def _moe_config(self, x, w_gate):
        from pallas_kernels.dispatch import moe_impl
        from pallas_kernels.moe import MoeConfig

        _, i, d = w_gate.shape
        if not self.interpret and moe_impl(x, w_gate, self.moe_impl) == "mosaic":
            return None  # the Mosaic GPU kernel with its default tiles (moe_impl checked they fit)
        base = MoeConfig()
        fit = lambda n, cap: max(b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512) if b <= cap and n % b == 0)
        tiles = dict(block_i=fit(i, base.block_i), block_k=fit(d, base.block_k), block_d=fit(d, base.block_d),
                     block_kd=fit(i, base.block_kd))
        return MoeConfig(**tiles, interpret=self.interpret)

    def _router_config(self, d: int, e: int, cfg):
        """The Pallas router's tiles for these dims, or None where it does not apply (non power-of-2 groups)."""
        from pallas_kernels.router import RouterConfig

        fit = lambda n, cap: max(b for b in (16, 32, 64, 128, 256) if b <= cap and n % b == 0) if n % 16 == 0 else 0
        if not fit(d, 256) or not fit(e, 16):
            return None
        rc = RouterConfig(block_e=fit(e, 16), block_k=fit(d, 256), interpret=self.interpret)
        try:
            rc.check(d, e, cfg.n_group, cfg.topk_group, cfg.num_experts_per_tok)
        except ValueError:
            return None
        return rc

    def route(self, x, gate_w, expert_bias, cfg):
        from pallas_kernels.dispatch import Backend, route

        rc = self._router_config(x.shape[-1], gate_w.shape[0], cfg)
        if rc is None:
            return None
        return route(x, gate_w, expert_bias, n_group=cfg.n_group, topk_group=cfg.topk_group,
                     top_k=cfg.num_experts_per_tok, routed_scaling_factor=cfg.routed_scaling_factor,
                     norm_topk_prob=cfg.norm_topk_prob, config=rc, backend=Backend.PALLAS)

    def _kda_config(self):
        if not self.interpret:
            return None
        from pallas_kernels.kda_verify import KdaConfig

        return KdaConfig(block_v=16, interpret=True)

    def _fp8_mosaic(self, x, experts, shared) -> bool:
        """Whether the fp8-weight Mosaic kernel serves this call: every weight block fp8, the bf16 Mosaic kernel's
        tiles fit (dispatch.moe_impl), and the shared expert rides as slot P (its width equals I)."""
        from pallas_kernels.dispatch import moe_impl

        weights = list(experts) + list(shared or ())
        if self.interpret or not all(isinstance(w, Fp8Weight) for w in weights):
            return False
        if shared is not None and shared[0].shape[0] != experts[0].shape[1]:
            return False
        return moe_impl(x, experts[0], self.moe_impl) == "mosaic"

    def moe(self, x, ids, weights, w_gate, w_up, w_down, *, limit: float, shared, shared_limit: float):
        """fp8 weights (quant.Fp8Weight): the fp8 Mosaic kernel where it applies, else the bf16 kernels on the
        weights dequantised to x.dtype (interpret mode, widths its tiles cannot take)."""
        from pallas_kernels.dispatch import Backend, moe

        if self._fp8_mosaic(x, (w_gate, w_up, w_down), shared):
            from pallas_kernels.moe_mosaic_fp8 import moe_fp8

            out = moe_fp8(x, ids, weights, w_gate, w_up, w_down, limit=limit, shared=shared,
                          shared_limit=shared_limit)
            return out.astype(jnp.float32)
        w_gate, w_up, w_down = (dense(w, x.dtype) for w in (w_gate, w_up, w_down))
        shared = None if shared is None else tuple(dense(w, x.dtype) for w in shared)
        out = moe(x, ids, weights, w_gate, w_up, w_down, limit=limit, shared=shared, shared_limit=shared_limit,
                  config=self._moe_config(x, w_gate), backend=Backend.PALLAS, impl=self.moe_impl)
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

    def kda_decode(self, q_raw, k_raw, v_raw, f_raw, b_raw, A_log, dt_bias, q_conv_w, k_conv_w, v_conv_w,
                   conv_window, rec_state, *, lower_bound: float):
        from pallas_kernels.dispatch import Backend, kda_decode

        B, Wm1 = conv_window.shape[:2]
        o, state, window = kda_decode(q_raw, k_raw, v_raw, f_raw, b_raw, A_log, dt_bias, q_conv_w, k_conv_w,
                                      v_conv_w, conv_window.reshape(B, Wm1, -1), rec_state, lower_bound=lower_bound,
                                      config=self._kda_config(), backend=Backend.PALLAS)
        return o, state, window.reshape(conv_window.shape)

    def kda_prefill(self, q, k, v, g, beta, state):
        from pallas_kernels.dispatch import Backend, kda_prefill

        config = None
        if self.interpret:
            from pallas_kernels.kda_prefill import KdaPrefillConfig

            config = KdaPrefillConfig(block_v=min(32, v.shape[-1]), interpret=True)
        return kda_prefill(q, k, v, g, beta, state, config=config, backend=Backend.PALLAS)
