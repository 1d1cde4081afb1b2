"""KDA (Kimi Delta Attention) verify + commit: fused conv1d + gates + delta rule, state never written by verify.

Shape legend: L KDA layers (the model's stacked states), B batch, T positions (<= ~17), H heads, Dk = Dv head
dims, C = H*Dk channels of one stream, S >= 4 streams of the fused projection (q, k, v, f, out gate), W conv kernel
(4), BV value tile of one program.

Per position t, per head (fp32; R(.) = round to the activation dtype, the raw streams', and back):
  y_t[c] = R(silu(sum_j w[c, 0, j] * xcat_{t+j}[c]))     xcat = concat(conv_state, raw) along time
  q, k   = R(y rsqrt(sum y^2 + 1e-6));  q *= Dk^-0.5
  g      = lower_bound * sigmoid(exp(A_log[h]) * (f_raw + dt_bias))     [Dk]
  beta   = sigmoid(b_raw[h])
  S      = diag(exp(g)) S                                  S [Dk, Dv], decay on the K rows
  S      = S + beta k (v - S^T k)^T
  o_t    = S^T q
Verify returns R(o) (the model's epilogue, kda_output_gate, rounds the recurrence's output to the activation dtype
first: rounded here, no XLA convert between), or with o_norm given the epilogue itself (below), and writes the
per-position rows the commit needs (raw q/k/v, k, v, g, beta: `KdaRows`); commit replays the accepted prefix
t < n_accept[b] from the pre-verify state (reads S once, writes S once) and slides the conv window by n_accept[b].
Reference: the model's own jnp, ling_jax/layers/kda.py (kda_inputs + kda_recurrent for verify, + kda_output_gate
for the folded epilogue, kda_replay and slide_window for commit, with its rounding points R above);
tests/kernel_oracles.py calls it with these layouts.

In place (the model's layouts, no XLA glue around the kernels): verify takes the fused projection output
proj [B, T, S, C] and the whole conv weight [3, C, 1, W] (streams and taps indexed in the kernel), reads the
stacked states [L, ...] at `layer`, and writes its rows into the stacked KdaRows at `layer` (aliased in place;
the first layer's call allocates them). One commit call then advances every layer's state and conv window in
place. Inside the kernels the stream axes are flattened (channel s*C + c of stream s: free reshapes).

Kernels (Triton): verify grid (B, H, Dv/BV), commit grid (L*B, H, Dv/BV). Each verify program loads its head's
q/k conv window (full Dk, recomputed by the Dv/BV programs of a head: only raw rows, tiny) and its [Dk, BV] state
tile; program (., h, vb) owns the channels h*Dk + vb*BV + [0, BV) of each of q, k, v for the raw rows (verify)
and the conv window (commit), so the in-place writes of programs never overlap. The T steps are unrolled on the
register tile, two reductions over Dk each (v2, "serial"; a chunked UT / WY form, every state product a tl.dot
and a [Tp, Tp] triangular inverse, measured 2-3x slower on the H200 (24.5 / 80 vs 7.5 / 39 us at T = 6 / 17,
bench/results/kernels-kda-h200-2026-11-30.json) and was deleted on 2026-12-06).

Folded epilogue (o_norm given; KernelCalls.kda_verify_epilogue): verify writes the model's kda_output_gate,
  out_t = act(R(o_t) rsqrt(mean_V R(o_t)^2 + eps) o_norm sigmoid(gate_t))      gate = stream 4 of proj [Dv]
as [B, T, H*Dv] (o_proj's input: no XLA kernel between verify and o_proj) instead of R(o). The mean over V needs
a head's whole row o_t and Triton programs cannot exchange partial sums (no grid sync), so this variant runs ONE
program per head: grid (B, H, 1), BV = Dv (config.block_v is not used). Each program holds in registers the
[Dk, Dv] f32 state and, for every one of the T positions (all loaded and prepared before the serial steps, as in
the tiled form), qn, kn, g [Dk], v, gate, o [Dv] and beta, plus o_norm [Dv]; the head's q/k conv is done once
instead of by Dv/BV programs. Register pressure (ptxas for sm_90a on the pip Triton's compile of the lowering's
Triton IR, and bench/sass_model's in-order latency model of one warp; bench/sass_kda_verify.py, CPU only; XLA's own
Triton may allocate differently): the state alone is Dk Dv / (32 warps) f32 registers a thread (64 at the demo's
64 x 64 with 2 warps, 128 at Ling's 128 x 128 with 4), and the T rows of [Dk] / [Dv] vectors come on top, partly
replicated across lanes (Triton places them in the state's slice layouts to avoid layout conversions):
    demo 64 x 64            T = 1                     T = 6                      T = 17
    tiled bv32, 4 warps     64 regs, 2.1 us           217 regs, 4.7 us           255 + 824 B spill, 27.6 us
    folded, 2 warps         126 regs, 1.6 us          210 regs, 4.7 us           255 + 368 B spill, 17.7 us
    folded, 4 warps         106 regs, 2.9 us          255 + 136 B spill, 10.0 us 168 + 2.6 KB stack, 57 us
    Ling 128 x 128
    tiled bv32, 4 warps     72 regs, 1.5 us           155 regs, 4.4 us
    folded, 4 warps         217 regs, 1.9 us          255 + 80 B spill, 7.9 us
    folded, 8 / 16 warps    178 regs, 3.1 us (8)      255 + 1.2 KB / 128 + 0.9 KB spill, 34 / 23 us
(modeled us per program; every program of a call runs at once). At the demo's heads the folded program costs
what the tiled one does at T = 1 and 6 and removes the XLA epilogue's 2-3 kernels (~1.1-1.8 us each); at Ling's
it is ~3.5 us slower at T = 6 (the one-program-per-head KDA chain kernel, kda_chain, measured 110.5 us against
26.9 us for verify + the XLA epilogue + commit at T = 6 on the H200, 2026-12-01). So KernelCalls folds the epilogue only where the head
fits (Dv <= 64); bench/kernels_kda.py times the folded form at both head sizes (the data to move that limit).
The fused T = 1 decode (verify + commit + conv window in one kernel) is in kda_decode.py.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

L2_EPS = 1e-6  # ling_jax.layers.norms.l2_normalize's eps (KDA's q and k)
F32 = jnp.float32


class KdaRows(NamedTuple):
  """A verify pass's rows of every KDA layer, stacked (the fields of the model's KdaPending, in its order).

  Attributes:
    qkv_raw: [L, B, T, 3, C] the raw q, k, v conv inputs (activation dtype), to slide the conv windows.
    k: [L, B, T, H, Dk] l2-normalised keys (f32).
    v: [L, B, T, H, Dv] values after conv + silu (f32).
    g: [L, B, T, H, Dk] log-decays (f32).
    beta: [L, B, T, H] write strengths (f32).
  """
  qkv_raw: jax.Array
  k: jax.Array
  v: jax.Array
  g: jax.Array
  beta: jax.Array


@dataclasses.dataclass(frozen=True)
class KdaConfig:
  """Tiling for the Triton KDA kernels.

  Attributes:
    block_v: value columns per program (power of 2 dividing Dv); 32 with 4 warps was the fastest verify on the
      H200 (7.5 / 39 us at T = 6 / 17). The folded epilogue's programs take a whole head (Dv) instead.
    num_warps: Triton warps per program.
    epilogue_num_warps: warps of the folded epilogue's one program per head; None: Dv / 32 (2 at the demo's 64,
      4 at Ling's 128: the fastest of 1-16 warps in bench/sass_kda_verify.py's model at T = 1 and 6, see the
      module docstring).
    chunk_rows: verify positions whose rows (loads, prepared vectors, outputs) are live in registers at once;
      the state carries from chunk to chunk. 6 covers NEXTN's verify (steps 5) in one chunk, as before; DSpark's
      17 rows run as 6 + 6 + 5 (all 17 at once spilled). The results do not depend on it (the same operations
      in the same order, bitwise).
    interpret: run in the Pallas interpreter (CPU tests).
  """
  block_v: int = 32
  num_warps: int = 4
  epilogue_num_warps: int | None = None
  chunk_rows: int = 6
  interpret: bool = False

  def __post_init__(self):
    if self.block_v <= 0 or self.block_v & (self.block_v - 1):
      raise ValueError(f"block_v={self.block_v} must be a positive power of 2")
    if self.chunk_rows < 1:
      raise ValueError(f"chunk_rows={self.chunk_rows} must be >= 1")
    if self.epilogue_num_warps not in (None, 1, 2, 4, 8, 16):
      raise ValueError(f"epilogue_num_warps={self.epilogue_num_warps} must be one of 1, 2, 4, 8, 16 (or None)")


# ----------------------------------------------------------------------------- kernels
#
# Flattened layouts inside the kernels (free reshapes of the model's): proj [B, T, S*C], conv_w [3C, 1, W],
# conv_state [L, B, W-1, 3C], qkv_raw rows [L, B, T, 3C]; stream s's channel c sits at s*C + c.


def _sigmoid(x):
  return 1.0 / (1.0 + jnp.exp(-x))


def _round(x, act):
  """R(x): the model's hand-over in the activation dtype (ling_jax.layers.kda.kda_inputs): round, back to fp32."""
  return x.astype(act).astype(jnp.float32)


def _conv_rows(xcat, taps, act):
  """R(silu(causal conv)) rows: xcat the W-1 conv window rows then the T raw rows (each [n], as stored), taps the
  W weights [n] f32 -> T rows [n] f32, y_t = sum_j w_j xcat_{t+j}."""
  width = len(taps)
  x = [r.astype(jnp.float32) for r in xcat]
  out = []
  for t in range(len(x) - width + 1):
    y = taps[0] * x[t]
    for j in range(1, width):
      y = y + taps[j] * x[t + j]
    out.append(_round(y * _sigmoid(y), act))
  return out


def _taps(w_ref, ch, width):
  return [w_ref[ch, 0, j].astype(jnp.float32) for j in range(width)]


def _slid_window(cs_ref, raw_ref, l, b, n, c, bv, c_all, t_len, width):
  """Layer l's conv window after n accepted positions (the model's slide_window), channels [c, c+BV) of each
  stream: rows n .. n+W-2 of xcat = [window (W-1 rows) | raw (T rows)] -> [(channels, [W-1 rows])]."""
  out = []
  for s in range(3):
    ch = pl.ds(s * c_all + c, bv)
    rows = []
    for i in range(width - 1):
      src = n + i
      old = cs_ref[l, b, jnp.minimum(src, width - 2), ch]
      new = raw_ref[l, b, jnp.clip(src - (width - 1), 0, t_len - 1), ch].astype(cs_ref.dtype)
      rows.append(jnp.where(src < width - 1, old, new))
    out.append((ch, rows))
  return out


def _store_window(cs_ref, l, b, window):
  for ch, rows in window:
    for i, row in enumerate(rows):
      cs_ref[l, b, i, ch] = row


def _verify_kernel(layer_ref, proj_ref, b_ref, alog_ref, dtb_ref, w_ref, cs_ref, s_ref, *refs, t_len, width,
                   h_n, dk, bv, lower_bound, eps, chunk):
  """eps None: o_ref [B, T, H, Dv] gets R(o); eps given (the folded epilogue, BV = Dv): refs[0] is o_norm [Dv]
  and o_ref [B, T, H*Dv] gets the gated, normed rows. The T positions run in chunks of `chunk` rows (see
  KdaConfig.chunk_rows); the state and the conv window's last W-1 raw rows carry from chunk to chunk."""
  o_ref, raw_ref, ko_ref, vo_ref, go_ref, bo_ref = refs[-6:]   # before them: [o_norm], the rows aliased in place
  epilogue = eps is not None                                            # (unread)
  b, h, vb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  l = layer_ref[0]
  c_all = h_n * dk
  c0, v0 = h * dk, h * dk + vb * bv                                    # the head's channels, this program's
  head = pl.ds(c0, dk)
  act = proj_ref.dtype
  chans = (pl.ds(c0, dk), pl.ds(c_all + c0, dk), pl.ds(2 * c_all + v0, bv))   # q, k, v: this program's
  window = [[cs_ref[l, b, i, ch] for i in range(width - 1)] for ch in chans]  # xcat's first W-1 rows
  taps = [_taps(w_ref, ch, width) for ch in chans]
  a = jnp.exp(alog_ref[h].astype(jnp.float32))
  dtb = dtb_ref[head].astype(jnp.float32)
  s = s_ref[l, b, h, :, pl.ds(vb * bv, bv)]                            # [Dk, BV] f32
  w_norm = refs[0][:].astype(jnp.float32) if epilogue else None       # o_norm [Dv]
  scale = dk ** -0.5
  for t0 in range(0, t_len, chunk):
    ts = range(t0, min(t0 + chunk, t_len))
    # Within a chunk every load is issued before the recurrence and every store after it: a load placed after
    # a store may alias it (the compiler cannot tell), which would put one global round trip on each serial
    # step. Between chunks that order is what bounds the registers: the chunk's loads wait for the previous
    # chunk's stores, so only one chunk's rows are live at a time (all 17 rows at once spilled: ~58 us a call
    # on the H100 at the demo's heads, 2026-12-07).
    raws = [[proj_ref[b, t, ch] for t in ts] for ch in chans]
    own = [[proj_ref[b, t, pl.ds(i * c_all + v0, bv)] for t in ts] for i in range(3)]
    fs = [proj_ref[b, t, pl.ds(3 * c_all + c0, dk)].astype(jnp.float32) for t in ts]
    bs = [b_ref[b, t, h].astype(jnp.float32) for t in ts]
    gates = [proj_ref[b, t, pl.ds(4 * c_all + v0, bv)].astype(jnp.float32) for t in ts] if epilogue else None
    qs, ks, vs = (_conv_rows(win + raw, tp, act) for win, raw, tp in zip(window, raws, taps))
    window = [(win + raw)[len(raw):] for win, raw in zip(window, raws)]   # the last W-1 rows of xcat so far
    qn, kn, gs, betas, outs = [], [], [], [], []
    for j in range(len(ts)):                                           # position-parallel part
      qn.append(_round(qs[j] * lax.rsqrt(jnp.sum(qs[j] * qs[j]) + L2_EPS), act) * scale)
      kn.append(_round(ks[j] * lax.rsqrt(jnp.sum(ks[j] * ks[j]) + L2_EPS), act))
      gs.append(lower_bound * _sigmoid(a * (fs[j] + dtb)))
      betas.append(_sigmoid(bs[j]))
    for j in range(len(ts)):                                           # the serial recurrence
      k = kn[j]
      s = s * jnp.exp(gs[j])[:, None]                                  # diag(e^g) S
      kv = jnp.sum(s * k[:, None], axis=0)                             # S^T k  [BV]
      s = s + k[:, None] * (betas[j] * (vs[j] - kv))[None, :]
      outs.append(jnp.sum(s * qn[j][:, None], axis=0))                 # o_t = S^T q
    for j, t in enumerate(ts):
      if epilogue:                                                     # the model's kda_output_gate
        o = _round(outs[j], act)
        o = o * lax.rsqrt(jnp.sum(o * o) / bv + eps)
        o_ref[b, t, pl.ds(v0, bv)] = (o * w_norm * _sigmoid(gates[j])).astype(act)
      else:
        o_ref[b, t, h, pl.ds(vb * bv, bv)] = outs[j].astype(act)         # R(o)
      vo_ref[l, b, t, h, pl.ds(vb * bv, bv)] = vs[j]
      for i in range(3):                                               # the raw rows, for the commit's slide
        raw_ref[l, b, t, pl.ds(i * c_all + v0, bv)] = own[i][j]

    @pl.when(vb == 0)
    def _():
      for j, t in enumerate(ts):
        ko_ref[l, b, t, h, :] = kn[j]
        go_ref[l, b, t, h, :] = gs[j]
        bo_ref[l, b, t, h] = betas[j]


def _commit_kernel(n_ref, s_in, cs_in, raw_ref, k_ref, v_ref, g_ref, beta_ref, s_ref, cs_ref, *, b_n, t_len,
                   width, h_n, dk, bv):
  lb, h, vb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  l, b = lb // b_n, lb % b_n
  cols = pl.ds(vb * bv, bv)
  n = n_ref[b]
  s = s_in[l, b, h, :, cols]                                           # [Dk, BV]
  ks = [k_ref[l, b, t, h, :] for t in range(t_len)]                    # all loads first
  es = [jnp.exp(g_ref[l, b, t, h, :]) for t in range(t_len)]
  vs = [v_ref[l, b, t, h, cols] for t in range(t_len)]
  betas = [beta_ref[l, b, t, h] for t in range(t_len)]
  window = _slid_window(cs_in, raw_ref, l, b, n, h * dk + vb * bv, bv, h_n * dk, t_len, width)
  for t in range(t_len):
    s_new = s * es[t][:, None]
    kv = jnp.sum(s_new * ks[t][:, None], axis=0)
    s_new = s_new + ks[t][:, None] * (betas[t] * (vs[t] - kv))[None, :]
    s = jnp.where(t < n, s_new, s)
  s_ref[l, b, h, :, cols] = s
  _store_window(cs_ref, l, b, window)


def _rows_shape(n_layers, bsz, t, h, dk, c, act):
  S = jax.ShapeDtypeStruct
  return KdaRows(S((n_layers, bsz, t, 3 * c), act), S((n_layers, bsz, t, h, dk), F32),
                 S((n_layers, bsz, t, h, dk), F32), S((n_layers, bsz, t, h, dk), F32), S((n_layers, bsz, t, h), F32))


@functools.partial(jax.jit, static_argnames=("lower_bound", "eps", "config"))
def kda_verify(proj, b_raw, A_log, dt_bias, conv_w, conv_state, rec_state, layer, rows=None, *, lower_bound=-5.0,
               o_norm=None, eps=1e-6, config=None):
  """Pallas (Triton) verify of KDA layer `layer`, the model's kda_inputs + kda_recurrent (its verify path), with
  o_norm given + its kda_output_gate.

  proj [B, T, S, C] the fused projection (raw q, k, v, f streams first, then the out gate; streams past those the
  call needs are not read), b_raw [B, T, H], A_log [H], dt_bias [C], conv_w [3, C, 1, W], conv_state
  [L, B, W-1, 3, C] and rec_state [L, B, H, Dk, Dv] f32 (read at `layer`, never written), layer int32 scalar;
  rows: the KdaRows [L, ...] the layers verified before wrote, written here at `layer` in place (their outputs
  alias them: donate them), or None: allocated, the other layers' rows undefined until their own verify writes
  them. o_norm [Dv] (S >= 5) and eps (the model's rms_norm_eps): fold the output epilogue in (one program per
  head, see the module docstring).
  -> (o, rows); o in the activation dtype (the projection's): without o_norm R(o) [B, T, H, Dv] (the model's
  kda_output_gate rounds the recurrence's output there first), with it the gated, normed [B, T, H*Dv] (o_proj's
  input, kda_output_gate's)."""
  cfg = config or KdaConfig()
  bsz, t, n_streams, c = proj.shape
  h = b_raw.shape[-1]
  dk = c // h
  n_layers, dv = rec_state.shape[0], rec_state.shape[-1]
  width = conv_w.shape[-1]
  epilogue = o_norm is not None
  bv = dv if epilogue else cfg.block_v
  num_warps = (cfg.epilogue_num_warps or max(1, dv // 32)) if epilogue else cfg.num_warps
  assert n_streams >= (5 if epilogue else 4) and conv_w.shape == (3, c, 1, width), (proj.shape, conv_w.shape)
  assert rec_state.shape == (n_layers, bsz, h, dk, dv), rec_state.shape
  assert conv_state.shape == (n_layers, bsz, width - 1, 3, c), conv_state.shape
  assert dv == dk and dv % bv == 0, (dk, dv, bv)
  assert not epilogue or o_norm.shape == (dv,), o_norm.shape
  extra = (o_norm,) if epilogue else ()
  out_rows = _rows_shape(n_layers, bsz, t, h, dk, c, proj.dtype)
  if rows is None:
    in_rows, aliases = (), {}
  else:
    rows = KdaRows(*rows)
    in_rows = (rows.qkv_raw.reshape(n_layers, bsz, t, 3 * c),) + tuple(rows[1:])
    assert [(a.shape, a.dtype) for a in in_rows] == [(a.shape, a.dtype) for a in out_rows], (in_rows, out_rows)
    aliases = {8 + len(extra) + i: 1 + i for i in range(len(in_rows))}
  kern = functools.partial(_verify_kernel, t_len=t, width=width, h_n=h, dk=dk, bv=bv, lower_bound=float(lower_bound),
                           eps=float(eps) if epilogue else None, chunk=cfg.chunk_rows)
  o_shape = (bsz, t, h * dv) if epilogue else (bsz, t, h, dv)
  o, raw, k, v, g, beta = pl.pallas_call(
      kern, grid=(bsz, h, dv // bv),
      out_shape=(jax.ShapeDtypeStruct(o_shape, proj.dtype),) + tuple(out_rows),
      input_output_aliases=aliases,
      compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1),
      interpret=cfg.interpret, name="kda_verify",
  )(jnp.asarray(layer, jnp.int32).reshape(1), proj.reshape(bsz, t, n_streams * c), b_raw, A_log, dt_bias,
    conv_w.reshape(3 * c, 1, width), conv_state.reshape(n_layers, bsz, width - 1, 3 * c), rec_state, *extra,
    *in_rows)
  return o, KdaRows(raw.reshape(n_layers, bsz, t, 3, c), k, v, g, beta)


@functools.partial(jax.jit, static_argnames=("config",))
def kda_commit(rec_state, conv_state, rows, n_accept, *, config=None):
  """Pallas (Triton) commit of every layer: the state after the first n_accept[b] verified positions (the model's
  kda_replay) and the conv window slid by them (slide_window), in one call.

  rec_state [L, B, H, Dk, Dv] f32, conv_state [L, B, W-1, 3, C], rows: the verify pass's KdaRows [L, ...],
  n_accept [B] (<= T) -> (rec_state, conv_state), aliasing their inputs (donate them to update in place)."""
  cfg = config or KdaConfig()
  n_layers, bsz, h, dk, dv = rec_state.shape
  rows = KdaRows(*rows)
  t = rows.k.shape[2]
  width = conv_state.shape[2] + 1
  c = h * dk
  assert conv_state.shape == (n_layers, bsz, width - 1, 3, c), conv_state.shape
  assert rows.qkv_raw.shape == (n_layers, bsz, t, 3, c) and dv == dk, (rows.qkv_raw.shape, rec_state.shape)
  kern = functools.partial(_commit_kernel, b_n=bsz, t_len=t, width=width, h_n=h, dk=dk, bv=cfg.block_v)
  flat_window = conv_state.reshape(n_layers, bsz, width - 1, 3 * c)
  state, window = pl.pallas_call(
      kern, grid=(n_layers * bsz, h, dv // cfg.block_v),
      out_shape=(jax.ShapeDtypeStruct(rec_state.shape, rec_state.dtype),
                 jax.ShapeDtypeStruct(flat_window.shape, flat_window.dtype)),
      input_output_aliases={1: 0, 2: 1},
      compiler_params=plt.CompilerParams(num_warps=cfg.num_warps, num_stages=1),
      interpret=cfg.interpret, name="kda_commit",
  )(n_accept.astype(jnp.int32), rec_state, flat_window, rows.qkv_raw.reshape(n_layers, bsz, t, 3 * c),
    rows.k, rows.v, rows.g, rows.beta)
  return state, window.reshape(conv_state.shape)
