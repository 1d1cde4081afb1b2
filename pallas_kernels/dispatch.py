"""Pick the Pallas kernel on GPU and the jnp reference elsewhere.

Every function takes `backend`: Backend.PALLAS, Backend.REFERENCE or Backend.AUTO (the default
comes from LING_JAX_KERNELS=pallas|reference|auto, read at call time; unset means auto).
AUTO means Pallas when the default JAX backend is a GPU, else the reference.
"""
from __future__ import annotations

import enum
import os

import jax

import jax.numpy as jnp

from pallas_kernels import kda_decode as _kdd
from pallas_kernels import kda_prefill as _kdp
from pallas_kernels import kda_verify as _kda
from pallas_kernels import moe as _moe
from pallas_kernels import moe_mosaic as _moe_mgpu
from pallas_kernels import router as _router

MOE_IMPLS = ("auto", "mosaic", "triton")


class Backend(enum.Enum):
  AUTO = "auto"
  PALLAS = "pallas"
  REFERENCE = "reference"


def resolve(backend: Backend | str | None = None) -> Backend:
  """The concrete backend (PALLAS or REFERENCE) for this call."""
  if backend is None:
    backend = os.environ.get("LING_JAX_KERNELS", "auto")
  backend = Backend(backend.value if isinstance(backend, Backend) else backend.lower())
  if backend is Backend.AUTO:
    return Backend.PALLAS if jax.default_backend() == "gpu" else Backend.REFERENCE
  return backend


def moe_impl(x, w_gate, impl: str | None = None) -> str:
  """Which Pallas MoE serves this call: "mosaic" (Hopper TMA + wgmma; bf16/f16, T <= 64, tiles dividing the
  dims) or "triton". impl (or LING_JAX_MOE_IMPL) "auto" takes Mosaic whenever it applies."""
  impl = (impl or os.environ.get("LING_JAX_MOE_IMPL", "auto")).lower()
  if impl not in MOE_IMPLS:
    raise ValueError(f"MoE impl {impl!r} not in {MOE_IMPLS}")
  if impl != "auto":
    return impl
  _, i, d = w_gate.shape
  try:
    _moe_mgpu.MosaicMoeConfig().check(x.shape[0], d, i)
  except ValueError:
    return "triton"
  return "mosaic" if x.dtype in (jnp.bfloat16, jnp.float16) else "triton"


def moe(x, topk_ids, topk_weights, w_gate, w_up, w_down, *, limit=0.0, shared=None,
        shared_limit=0.0, config=None, backend=None, impl=None):
  """See pallas_kernels.moe.moe_reference for shapes and math. config: a MoeConfig (Triton) or a
  MosaicMoeConfig (Mosaic GPU); it also picks the implementation when given."""
  if resolve(backend) is Backend.REFERENCE:
    fn = _moe.moe_reference
  elif isinstance(config, _moe_mgpu.MosaicMoeConfig):
    fn = _moe_mgpu.moe
  elif isinstance(config, _moe.MoeConfig):
    fn = _moe.moe
  else:
    fn = _moe_mgpu.moe if moe_impl(x, w_gate, impl) == "mosaic" else _moe.moe
  return fn(x, topk_ids, topk_weights, w_gate, w_up, w_down, limit=limit, shared=shared,
            shared_limit=shared_limit, config=config)


def route(x, gate_w, expert_bias, *, n_group, topk_group, top_k, routed_scaling_factor,
          norm_topk_prob=True, config=None, backend=None):
  """See pallas_kernels.router.route_reference. Pallas: the two-kernel Triton router (H200, same run:
  12.3 us vs XLA's 21.7 us at T=1, bench/results/kernels-h200-2026-11-30-run4.json)."""
  fn = _router.route if resolve(backend) is Backend.PALLAS else _router.route_reference
  kw = dict(config=config) if fn is _router.route else {}
  return fn(x, gate_w, expert_bias, n_group=n_group, topk_group=topk_group, top_k=top_k,
            routed_scaling_factor=routed_scaling_factor, norm_topk_prob=norm_topk_prob, **kw)


def kda_verify(q_raw, k_raw, v_raw, f_raw, b_raw, A_log, dt_bias, q_conv_w, k_conv_w, v_conv_w,
               conv_state, rec_state, *, lower_bound=-5.0, config=None, backend=None):
  """See pallas_kernels.kda_verify.kda_verify_reference."""
  pallas = resolve(backend) is Backend.PALLAS
  fn = _kda.kda_verify if pallas else _kda.kda_verify_reference
  return fn(q_raw, k_raw, v_raw, f_raw, b_raw, A_log, dt_bias, q_conv_w, k_conv_w, v_conv_w,
            conv_state, rec_state, lower_bound=lower_bound, config=config)


def kda_commit(rec_state, commit_inputs, n_accept, *, config=None, backend=None):
  """See pallas_kernels.kda_verify.kda_commit_reference."""
  fn = _kda.kda_commit if resolve(backend) is Backend.PALLAS else _kda.kda_commit_reference
  return fn(rec_state, commit_inputs, n_accept, config=config)


def kda_decode(q_raw, k_raw, v_raw, f_raw, b_raw, A_log, dt_bias, q_conv_w, k_conv_w, v_conv_w,
               conv_state, rec_state, *, lower_bound=-5.0, config=None, backend=None):
  """One token (T = 1), state updated in place. See pallas_kernels.kda_decode.kda_decode_reference."""
  fn = _kdd.kda_decode if resolve(backend) is Backend.PALLAS else _kdd.kda_decode_reference
  return fn(q_raw, k_raw, v_raw, f_raw, b_raw, A_log, dt_bias, q_conv_w, k_conv_w, v_conv_w,
            conv_state, rec_state, lower_bound=lower_bound, config=config)


def kda_prefill(q, k, v, g, beta, initial_state=None, *, config=None, backend=None):
  """Chunked KDA over a prompt. See pallas_kernels.kda_prefill.kda_prefill_reference."""
  fn = _kdp.kda_prefill if resolve(backend) is Backend.PALLAS else _kdp.kda_prefill_reference
  return fn(q, k, v, g, beta, initial_state, config=config)


conv_window_commit = _kda.conv_window_commit
