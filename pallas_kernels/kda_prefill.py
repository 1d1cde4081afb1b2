"""KDA (Kimi Delta Attention) prefill: the chunked UT form, chunk 64, as one Pallas (Triton) kernel.

Shape legend: B batch, T positions, H heads, Dk key dim, Dv value dim, L chunk (64), M sub-chunk (16),
BV value columns of one program.

Inputs are the per-position tensors after conv, norms and gates (the contract of ling_jax's
`kda_recurrent` / `kda_chunked`, this kernel's reference): q [B,T,H,Dk] (l2-normed AND scaled by Dk^-0.5), k [B,T,H,Dk]
(l2-normed), v [B,T,H,Dv], g [B,T,H,Dk] log-decays in (lower_bound, 0) fp32, beta [B,T,H] fp32,
initial state [B,H,Dk,Dv] fp32 (or None = zeros). Per head (all fp32):
    S_t = (I - b_t k_t k_t^T) Diag(e^g_t) S_{t-1} + b_t k_t v_t^T          o_t = S_t^T q_t

Chunk form (G = cumsum(g) from the chunk start, S0 the state entering the chunk):
    A[t,s]  = b_t sum_c k_t k_s e^(G_t - G_s)   (s < t)      (I + A) U = b (V - (k e^G) S0)
    Aqk[t,s] = sum_c q_t k_s e^(G_t - G_s)        (s <= t)
    o = (q e^G) S0 + Aqk U                       S_L = e^(G_L) S0 + (k e^(G_L - G))^T U

Overflow-safe pairwise decays (the model forms e^(G_t - G_s) per pair, [L, L, Dk]; a kernel wants
matmuls): split the chunk into four sub-chunks of M = 16 rows. For row block i let n_i be the
cumulative log-decay just before its first row. Then
    e^(G_t - G_s) = e^(G_t - n_i) * e^(n_i - G_s),     t in block i, s in block j <= i,
and both factors are bounded: e^(G_t - n_i) in (e^-80, 1] (at most 16 steps of g > -5), and
e^(n_i - G_s) <= 1 for j < i, < e^80 for j = i (finite in fp32; pairs s > t are masked after the dot,
their magnitude stays < 128 e^75). So each [M, M] block of A and Aqk is one tensor-core dot
    (k_i e^(G_i - n_i)) (k_j e^(n_i - G_j))^T.
Every exponent is formed from sums of g over sub-chunks (never the difference of two long cumulative
sums where avoidable), so its rounding error scales with the exponent itself.

Triangular solve, block forward substitution over the 4 row blocks:
    U_i = (I + A_ii)^-1 (R_i - sum_{j<i} A_ij U_j)
with the four 16x16 unit-lower inverses formed first (independent of S0, interleaved for ILP) by
row-wise forward substitution. (The finite Neumann product (I - N)(I + N^2)(I + N^4)(I + N^8) is
exact in algebra but lost 3e-4 on nearly parallel keys with b ~ 1, where N^k entries ~ C(15, k).)

Kernel (Triton): grid (B, H, Dv/BV); each program keeps its [Dk, BV] state tile in registers and
walks the chunks in order (lax.fori_loop). The A blocks depend only on (q, k, g, beta), so the Dv/BV
programs of a head recompute them (no inter-program traffic). T need not be a multiple of 64: the
last chunk's missing rows load as zeros (g = 0, beta = 0: no-ops) and are not stored.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

CHUNK, SUB = 64, 16
_PRECISIONS = {"ieee": lax.Precision.HIGHEST, "tf32": lax.Precision.DEFAULT,
               "tf32x3": lax.DotAlgorithmPreset.TF32_TF32_F32_X3}


@dataclasses.dataclass(frozen=True)
class KdaPrefillConfig:
  """Tiling for the Triton KDA prefill kernel.

  Attributes:
    block_v: value columns per program (power of 2, >= 16, dividing Dv).
    num_warps: Triton warps per program (8: ~19k fp32 values stay live per program at BV=32).
    precision: dot inputs on the GPU. "tf32x3" (default): tensor cores, 3 tf32 passes, ~fp32
      accuracy. "tf32": one pass, ~1e-3 relative. "ieee": fp32 FMA dots -- Triton gives each
      thread whole K-rows of the operands; offline (Triton 3.8 + ptxas 13, sm_90a) it spilled
      ~25 KB/thread, vs 1-5 KB for tf32 / tf32x3 at 255 registers. The interpreter always
      computes in fp32.
    interpret: run in the Pallas interpreter (CPU tests).
  """
  block_v: int = 32
  num_warps: int = 8
  precision: str = "tf32x3"
  interpret: bool = False

  def __post_init__(self):
    if self.block_v < 16 or self.block_v & (self.block_v - 1):
      raise ValueError(f"block_v={self.block_v} must be a power of 2 >= 16 (tl.dot minimum)")
    if self.precision not in _PRECISIONS:
      raise ValueError(f"precision={self.precision!r} must be one of {sorted(_PRECISIONS)}")


# ----------------------------------------------------------------------------- kernel


def _unit_lower_inverses(mats):
  """(I + N)^-1 for strictly lower N [M,M], several at once (independent chains, for ILP).

  Row-wise forward substitution, stable where the Neumann series is not (nearly parallel keys with
  b ~ 1 give N^k entries ~ C(15, k)):  X_t = e_t - sum_{s<t} N[t,s] X_s.
  """
  m = mats[0].shape[0]
  row = lax.broadcasted_iota(jnp.int32, (m, m), 0)
  eye = jnp.where(row == lax.broadcasted_iota(jnp.int32, (m, m), 1), 1.0, 0.0)

  def step(t, xs):
    out = []
    for nmat, x in zip(mats, xs):
      n_t = jnp.sum(jnp.where(row == t, nmat, 0.0), axis=0)             # N[t, s] over s  [M]
      upd = jnp.sum(n_t[:, None] * x, axis=0)                          # sum_s N[t,s] X_s  [M]
      out.append(x - jnp.where(row == t, upd[None, :], 0.0))
    return tuple(out)

  return lax.fori_loop(1, m, step, tuple(eye for _ in mats))


def _prefill_kernel(q_ref, k_ref, v_ref, g_ref, b_ref, s0_ref, o_ref, s_ref, *, t_len, dk, bv,
                    precision, interpret=False):
  b, h, vb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  cols = pl.ds(vb * bv, bv)
  f32 = jnp.float32
  prec = _PRECISIONS["ieee" if interpret else precision]              # the CPU interpreter: fp32
  dot = lambda x, y: jnp.dot(x, y, precision=prec, preferred_element_type=f32)
  dot_nt = lambda x, y: lax.dot_general(x, y, (((1,), (1,)), ((), ())), precision=prec,
                                        preferred_element_type=f32)      # x @ y^T
  dot_tn = lambda x, y: lax.dot_general(x, y, (((0,), (0,)), ((), ())), precision=prec,
                                        preferred_element_type=f32)      # x^T @ y
  row = lax.broadcasted_iota(jnp.int32, (SUB, SUB), 0)
  col = lax.broadcasted_iota(jnp.int32, (SUB, SUB), 1)
  incl, strict, eye = row >= col, row > col, row == col
  upper = jnp.where(col > row, 1.0, 0.0)                               # [M, M] strictly upper ones
  dot_hi = lambda x, y: jnp.dot(x, y, precision=lax.Precision.HIGHEST, preferred_element_type=f32)
  rows = lax.broadcasted_iota(jnp.int32, (SUB,), 0)
  nsub = CHUNK // SUB

  def load(ref, t0, width=None, cs=slice(None)):                      # [M, width] rows t0.., 0 past T
    live = rows + t0 < t_len
    if width is None:
      return plt.load(ref.at[b, pl.ds(t0, SUB), h], mask=live, other=0.0).astype(f32)
    return plt.load(ref.at[b, pl.ds(t0, SUB), h, cs], other=0.0,
                    mask=jnp.broadcast_to(live[:, None], (SUB, width))).astype(f32)

  def chunk(c, s0):                                                    # s0 [Dk, BV]
    t0s = [c * CHUNK + i * SUB for i in range(nsub)]
    # Phase 1 (no S0): per sub-chunk the gate sums, the diagonal blocks and their inverses, and
    # kn_j = k_s e^(n_{j+1} - G_s) (<= 1), from which every later column factor is built.
    tots, kns, diag = [], [], []
    for i in range(nsub):
      ki, gi, bi = load(k_ref, t0s[i], dk), load(g_ref, t0s[i], dk), load(b_ref, t0s[i])
      gl = jnp.cumsum(gi, axis=0)                                      # G_t - n_i  [M, Dk]
      tots.append(jnp.sum(gi, axis=0))                                 # n_{i+1} - n_i  [Dk]
      kns.append(ki * jnp.exp(dot_hi(upper, gi)))                      # suffix sums sum_{r>t} g_r
      diag.append(jnp.where(strict, bi[:, None] * dot_nt(ki * jnp.exp(gl), ki * jnp.exp(-gl)),
                            0.0))                                      # b_t k_t k_s e^(G_t - G_s)
    inv = _unit_lower_inverses(tuple(diag))                            # (I + A_ii)^-1

    def span(j, i):                                                    # n_i - n_j = sum tots[j:i]
      acc = jnp.zeros((dk,), f32)
      for m in range(j, i):
        acc = acc + tots[m]
      return acc

    # Phase 2: one row block at a time (its q, v, A row, U_i, o_i), so few tiles stay live.
    s_new = jnp.exp(span(0, nsub))[:, None] * s0                       # e^(G_L) S0
    us = []
    for i in range(nsub):
      qi, ki, gi = load(q_ref, t0s[i], dk), load(k_ref, t0s[i], dk), load(g_ref, t0s[i], dk)
      vi, bi = load(v_ref, t0s[i], bv, cols), load(b_ref, t0s[i])     # [M, BV], [M]
      gl = jnp.cumsum(gi, axis=0)
      e_i = jnp.exp(gl)                                                # e^(G_t - n_i) <= 1
      eg = jnp.exp(span(0, i))[None, :] * e_i                          # e^(G_t), chunk-relative
      r = bi[:, None] * (vi - dot(ki * eg, s0))                        # b (v - (k e^G) S0)
      o = dot(qi * eg, s0)                                             # (q e^G) S0
      qr, kr = qi * e_i, ki * e_i
      # diagonal block: e^(n_i - G_s) < e^80; its diagonal exactly (e^x e^-x carries |x| eps)
      a_qk = jnp.where(incl, dot_nt(qr, ki * jnp.exp(-gl)), 0.0)
      aqk = [jnp.where(eye, jnp.sum(qi * ki, axis=1)[:, None], a_qk)]
      for j in range(i):
        kc = kns[j] * jnp.exp(span(j + 1, i))[None, :]                 # k_s e^(n_i - G_s) <= 1
        aqk.insert(j, dot_nt(qr, kc))
        r = r - dot(bi[:, None] * dot_nt(kr, kc), us[j])               # - A_ij U_j
      us.append(dot(inv[i], r))                                        # U_i  [M, BV]
      for j in range(i + 1):
        o = o + dot(aqk[j], us[j])                                     # + Aqk U
      live = rows + t0s[i] < t_len
      plt.store(o_ref.at[b, pl.ds(t0s[i], SUB), h, cols], o,
                mask=jnp.broadcast_to(live[:, None], (SUB, bv)))
      kd = kns[i] * jnp.exp(span(i + 1, nsub))[None, :]                # k e^(G_L - G_s)
      s_new = s_new + dot_tn(kd, us[i])
    return s_new

  s0 = s0_ref[b, h, :, cols].astype(f32)
  s_ref[b, h, :, cols] = lax.fori_loop(0, pl.cdiv(t_len, CHUNK), chunk, s0)


@functools.partial(jax.jit, static_argnames=("config",))
def kda_prefill(q, k, v, g, beta, initial_state=None, *, config=None):
  """Pallas (Triton) chunked KDA; the reference is the model's ling_jax.layers.kda.kda_chunked (chunk 64).

  q, k [B,T,H,Dk] (q pre-scaled), v [B,T,H,Dv], g [B,T,H,Dk] fp32, beta [B,T,H] fp32 (any float
  dtype is upcast), initial_state [B,H,Dk,Dv] f32 or None (zeros).
  Returns o [B,T,H,Dv] f32 and the final state [B,H,Dk,Dv] f32.
  """
  cfg = config or KdaPrefillConfig()
  bsz, t, h, dk = q.shape
  dv = v.shape[-1]
  assert k.shape == g.shape == q.shape and v.shape == (bsz, t, h, dv), (q.shape, v.shape, g.shape)
  assert beta.shape == (bsz, t, h), beta.shape
  assert dv % cfg.block_v == 0 and dk >= 16 and dk & (dk - 1) == 0, (dk, dv, cfg.block_v)
  f32 = jnp.float32
  s0 = jnp.zeros((bsz, h, dk, dv), f32) if initial_state is None else initial_state.astype(f32)
  assert s0.shape == (bsz, h, dk, dv), s0.shape
  kern = functools.partial(_prefill_kernel, t_len=t, dk=dk, bv=cfg.block_v,
                           precision=cfg.precision, interpret=cfg.interpret)
  return pl.pallas_call(
      kern, grid=(bsz, h, dv // cfg.block_v),
      out_shape=(jax.ShapeDtypeStruct((bsz, t, h, dv), f32),
                 jax.ShapeDtypeStruct((bsz, h, dk, dv), f32)),
      compiler_params=plt.CompilerParams(num_warps=cfg.num_warps, num_stages=1),
      interpret=cfg.interpret, name="kda_prefill",
  )(q, k, v, g, beta, s0)
