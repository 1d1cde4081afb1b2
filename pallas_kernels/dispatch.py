"""Pick the Pallas kernel on GPU and the jnp reference elsewhere.

Every function takes `backend`: Backend.PALLAS, Backend.REFERENCE or Backend.AUTO (the default
comes from LING_JAX_KERNELS=pallas|reference|auto, read at call time; unset means auto).
AUTO means Pallas when the default JAX backend is a GPU, else the reference.
"""
from __future__ import annotations

import enum
import os

import jax

from pallas_kernels import kda_verify as _kda
from pallas_kernels import moe as _moe
from pallas_kernels import router as _router


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


def moe(x, topk_ids, topk_weights, w_gate, w_up, w_down, *, limit=0.0, shared=None,
        shared_limit=0.0, config=None, backend=None):
  """See pallas_kernels.moe.moe_reference for shapes and math."""
  fn = _moe.moe if resolve(backend) is Backend.PALLAS else _moe.moe_reference
  return fn(x, topk_ids, topk_weights, w_gate, w_up, w_down, limit=limit, shared=shared,
            shared_limit=shared_limit, config=config)


def route(x, gate_w, expert_bias, *, n_group, topk_group, top_k, routed_scaling_factor,
          norm_topk_prob=True, backend=None):
  """See pallas_kernels.router.route_reference. XLA on every backend (no Pallas router won)."""
  del backend
  return _router.route_reference(x, gate_w, expert_bias, n_group=n_group,
                                 topk_group=topk_group, top_k=top_k,
                                 routed_scaling_factor=routed_scaling_factor,
                                 norm_topk_prob=norm_topk_prob)


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


conv_window_commit = _kda.conv_window_commit
