"""The projections of a layer pass, as the model writes them, with a fused kernel where one takes the call.

Shape legend: B batch, T positions, D (or K) the projection's input width, N_s output rows of projection s
(a weight may carry several output axes, e.g. KDA's [5, C, D]: its output is [B, T, 5, C]).

    h = RMSNorm(x)                          (a `Normed`: not computed yet, so a kernel can fold the norm in)
    y_s = epilogue_s(h @ W_s^T)             "linear": the einsum's output (activation dtype)
                                            "sigmoid": sigmoid(f32(h @ W^T))           (KDA beta, MLA gate)
                                            "swiglu": swiglu(h @ G^T, h @ U^T, limit)  (dense MLP)
    out = residual + o @ W^T                (output projections: the projection rounded first, then the add)

Every projection that reads the same normed input is one `norm_projections` call: with a KernelCalls that takes
it (ling_jax/kernel_calls.py: `norm_linear`, the Mosaic GPU kernel of pallas_kernels/fused_linear.py, or of
fused_linear_fp8.py for quant.Fp8Weight weights) that is ONE kernel (the norm in its prologue, each weight read once,
the epilogue in registers); otherwise (kernels None, fp32, shapes past the kernel's limits) the jnp below, which is
the kernel's reference (fp8 weights: dequantised to the activation dtype first, quant.dense).
fp8_activations (model.Numerics.fp8_activations == "dynamic"): an fp8 weight's input h goes through
quant.gemm_input (per token and 128-column e4m3 and back) before its einsum, and the kernels take their e4m3 form;
bf16 weights' inputs are never quantised (a call mixing both: each projection reads its own form of h).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from ling_jax.layers.norms import rms_norm
from ling_jax.quant import Fp8Weight, dense, gemm_input

KINDS = ("linear", "sigmoid", "swiglu")


class Normed(NamedTuple):
    """RMSNorm(x) with `weight`, not yet computed. x [..., D] (or a tuple of inputs, each normed with its own
    weight and concatenated on the last axis: the MTP's [enorm(e) | hnorm(h)])."""

    x: jax.Array | tuple
    weight: jax.Array | tuple
    eps: float

    @property
    def parts(self) -> tuple:
        """((x_i, weight_i), ...) of the inputs."""
        if isinstance(self.x, tuple):
            return tuple(zip(self.x, self.weight))
        return ((self.x, self.weight),)

    def value(self) -> jax.Array:
        normed = [rms_norm(x, w, self.eps) for x, w in self.parts]
        return normed[0] if len(normed) == 1 else jnp.concatenate(normed, axis=-1)

    @property
    def shape(self) -> tuple:
        return self.parts[0][0].shape[:-1] + (sum(x.shape[-1] for x, _ in self.parts),)

    @property
    def dtype(self):
        return jnp.result_type(*(a for part in self.parts for a in part))  # rms_norm's: weight * normed


class Projection(NamedTuple):
    """One projection of a normed input: weight [*N, D] (or the (gate [F, D], up [F, D]) pair of "swiglu"), either
    a dense array or a quant.Fp8Weight; kind in KINDS; limit the swiglu clamp (0 = off)."""

    weight: object
    kind: str = "linear"
    limit: float = 0.0


def _einsum(h, w):
    """h [..., D] @ w [N, D]^T -> [..., N] (or w [S, C, D] -> [..., S, C]) in h's dtype (fp8 weights dequantised)."""
    w = dense(w, h.dtype)
    return jnp.einsum("...d,scd->...sc" if w.ndim == 3 else "...d,nd->...n", h, w)


def _rounded(a, dtype):
    """Round an fp32 intermediate to the activation dtype, as the reference computes it (no-op in fp32)."""
    return a.astype(dtype).astype(jnp.float32)


def swiglu(gate, up, limit: float):
    """gate, up in the activation dtype -> h = min(silu(gate), L) * clip(up, -L, L) in that dtype (no clamp when
    limit <= 0). silu(gate) is rounded to the activation dtype first, as the reference's act_fn output is."""
    dt = gate.dtype
    act, up = _rounded(jax.nn.silu(gate.astype(jnp.float32)), dt), up.astype(jnp.float32)
    if limit > 0:
        act, up = jnp.minimum(act, limit), jnp.clip(up, -limit, limit)
    return (act * up).astype(dt)


def project(h, proj: Projection):
    """The jnp form of one projection of the normed h [..., D] (the fused kernel's reference)."""
    if proj.kind not in KINDS:
        raise ValueError(f"projection kind={proj.kind!r} not in {KINDS}")
    if proj.kind == "swiglu":
        gate, up = proj.weight
        return swiglu(_einsum(h, gate), _einsum(h, up), proj.limit)
    y = _einsum(h, proj.weight)
    return jax.nn.sigmoid(y.astype(jnp.float32)) if proj.kind == "sigmoid" else y


def first_weight(proj: Projection):
    """The projection's weight (a swiglu pair's gate: gate and up are quantised alike)."""
    return proj.weight[0] if proj.kind == "swiglu" else proj.weight


def norm_projections(h, projections: tuple, kernels=None, *, fp8_activations: bool = False) -> tuple:
    """(epilogue_s(h @ W_s^T) for each projection). h: a Normed (the norm may be folded into the kernel) or an
    array that is already the normed input. kernels: a KernelCalls (or None for the jnp path). fp8_activations:
    fp8 weights read h quantised (quant.gemm_input; computed once for all of them)."""
    if kernels is not None and isinstance(h, Normed):
        fused = kernels.norm_linear(h, projections, fp8_activations=fp8_activations)
        if fused is not None:
            return fused
    hv = h.value() if isinstance(h, Normed) else h
    fp8 = [isinstance(first_weight(p), Fp8Weight) for p in projections]
    hq = gemm_input(hv, first_weight(projections[fp8.index(True)]), fp8_activations) if any(fp8) else hv
    return tuple(project(hq if f else hv, p) for f, p in zip(fp8, projections))


def linear(o, w, kernels=None, residual=None, *, fp8_activations: bool = False):
    """o [..., K] @ w [N, K]^T in o's dtype, plus `residual` [..., N] when given (the stream the block adds its
    output to: the projection is rounded first, then added, as `x + layer(x)` computes it). With kernels, the
    residual add rides in the projection's epilogue (one kernel) where the kernel takes the call.
    fp8_activations: an fp8 w reads o quantised (quant.gemm_input)."""
    if kernels is not None and residual is not None:
        fused = kernels.linear_residual(o, w, residual, fp8_activations=fp8_activations)
        if fused is not None:
            return fused
    y = jnp.einsum("...k,nk->...n", gemm_input(o, w, fp8_activations), dense(w, o.dtype))
    return y if residual is None else residual + y
