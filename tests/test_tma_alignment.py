"""pallas_kernels/tma.py: the trace-time TMA alignment checks of the Mosaic GPU kernels. The two layouts that
faulted on the H200 (CUDA_ERROR_MISALIGNED_ADDRESS) are rejected with an error naming the kernel, the buffer and
its bytes: fused_linear_fp8's 80-byte scale rows (before commit 853da19) and the fp8 MoE w8a8 form's 64-byte
[1, 16] activation-scale blocks; the current configs pass, and every TMA copy of the kernels goes through the
checks (the buffers each lowering checked are listed and compared)."""
import dataclasses

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ling_jax import quant
from pallas_kernels import fused_linear as fl
from pallas_kernels import moe_mosaic, tma
from pallas_kernels.fused_linear_fp8 import Fp8Ring, norm_linear_fp8
from pallas_kernels.moe_mosaic import MosaicMoeConfig
from pallas_kernels.moe_mosaic_fp8 import moe_fp8
from tests.cuda_lowering import S, lower_cuda

BF, F8, F32 = jnp.bfloat16, jnp.float8_e4m3fn, jnp.float32


def test_check_box_rules():
  tma.check_box("k", "ok", (1, 32), F32, offset=128, dynamic_strides=(128, 8192))
  with pytest.raises(ValueError, match=r"k: TMA copy into SMEM buffer 'rows': box \(1, 20\) float32 \(80 B\) "
                                       r"lands at byte offset 80, not a multiple of 128"):
    tma.check_box("k", "rows", (1, 20), F32, offset=80)
  with pytest.raises(ValueError, match=r"'slots': box \(1, 16\) float32 \(64 B\) lands at byte offset 0 \+ a "
                                       r"run-time index x 64 B"):
    tma.check_pipeline("k", [("slots", (1, 16), F32)], stages=4)
  tma.check_pipeline("k", [("one slot", (1, 16), F32)], stages=1)   # a single slot: only the base, aligned
  with pytest.raises(ValueError, match=r"12-byte innermost dimension"):
    tma.check_box("k", "narrow", (4, 3), F32)
  assert tma.pad_to(16, F32) == 32 and tma.pad_to(20, F32) == 32 and tma.pad_to(64, F32) == 64
  assert tma.pad_to(100, F8) == 128


def test_check_scratch_models_the_packing():
  """Mosaic starts each scratch buffer at a multiple of its allocation alignment (1024 in this jax): fine. A
  tighter packer would put a big buffer right after a small one, off the 128-byte TMA alignment."""
  named = [("scale rows", plgpu.SMEM((1, 20), F32)), ("barrier", plgpu.Barrier(num_barriers=2)),
           ("weight ring", plgpu.SMEM((4, 64, 128), F8))]
  assert tma.ALLOCATION_ALIGN % tma.SMEM_ALIGN == 0
  assert tma.check_scratch("k", named) == {"scale rows": 0, "weight ring": tma.ALLOCATION_ALIGN}
  with pytest.raises(ValueError, match=r"k: TMA copy into SMEM buffer 'weight ring': scratch buffer "
                                       r"\(4, 64, 128\) float8_e4m3fn \(32768 B\) starts at byte 80"):
    tma.check_scratch("k", named, align=16)


def test_smem_view_offsets():
  """Static indices add index x stride, run-time ones (a ring slot) contribute their stride; the allocation's
  tiling / swizzle is looked through for leading-dimension indices."""
  views = []

  def kernel(x_gmem, o_gmem):
    def scope(ring, rows):
      j = jax.lax.axis_index("n")
      views.extend(tma.smem_view(v) for v in (ring.at[j], rows.at[pl.ds(3, 1)], rows, rows.at[pl.ds(j, 2)]))
      views.append((tma.required_align(ring.at[j]), tma.required_align(rows.at[pl.ds(3, 1)])))
    pl.run_scoped(scope, plgpu.SMEM((4, 64, 128), F8, transforms=fl._swizzled(1, 128)), plgpu.SMEM((8, 20), F32))

  k = plgpu.kernel(kernel, out_type=S((8,), F32), grid=(1,), grid_names=("n",),
                   compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
                   interpret=plgpu.InterpretGPUParams())
  jax.jit(k).trace(S((64, 256), F8))
  assert views == [((64, 128), F8, 0, (8192,)), ((1, 20), F32, 240, ()), ((8, 20), F32, 0, ()),
                   ((2, 20), F32, 0, (80,)), (1024, 128)]   # the 128 B swizzle's 1024-byte repeat
  with pytest.raises(ValueError, match=r"'x8': .* \+ a run-time index x 512 B, and 512 is not a multiple of 1024 "
                                       r"\(a 128-byte swizzle repeats every 1024 bytes"):
    tma.check_box("k", "x8", (4, 128), F8, dynamic_strides=(512,), align=1024)


def _swiglu_fp8(scale_cols, src_cols=None):
  """fused_linear_fp8 (gate, up) at K = 2560 (nK = 20 scale columns) with `scale_cols` columns per SMEM scale row,
  reading GMEM scale rows of `src_cols` (default scale_cols: the scales padded to it) columns."""
  n = scale_cols if src_cols is None else src_cols
  def f(x, nw, g8, gs, u8, us):
    xs, nws = fl.normed_inputs(x, nw)
    flat = lambda sc: jnp.pad(sc, ((0, 0), (0, n - sc.shape[1]))).reshape(-1)
    return fl._call(xs, nws, None, ((g8, u8),), (fl.Proj("swiglu"),), 1e-6, fl.LinearConfig(),
                    fp8=Fp8Ring(scale_cols, src_cols=src_cols), scales=(flat(gs), flat(us)))
  return f


def test_rejects_the_old_80_byte_scale_rows_and_accepts_the_padded_ones():
  """Before 853da19 the scale rows were padded to 4 columns only: 20 f32 = 80 bytes at K = 2560, and the up
  weight's row (row 1) landed 80 bytes in. Since 2026-12-07 the 20-column GMEM rows are copied as they are (no
  XLA pad) into the table's 32-column (128-byte) rows."""
  args = (S((1, 2560), BF), S((2560,), BF), S((128, 2560), F8), S((1, 20), F32), S((128, 2560), F8), S((1, 20), F32))
  with pytest.raises(ValueError, match=r"fused_linear_fp8: TMA copy into SMEM buffer 'scale rows': box \(20,\) "
                                       r"float32 \(80 B\) lands at byte offset 80"):
    lower_cuda(_swiglu_fp8(20), *args)
  assert "custom_call @mosaic_gpu" in lower_cuda(_swiglu_fp8(32), *args)
  assert "custom_call @mosaic_gpu" in lower_cuda(_swiglu_fp8(32, src_cols=20), *args)


def test_fp8_scales_reach_the_kernel_unpadded():
  """norm_linear_fp8 at K = 2560 (nK = 20: 80-byte rows, a TMA box) hands the kernel the checkpoint's scales
  flattened, with no pad in the program; at K = 768 (nK = 6: 24 bytes, no TMA box) it pads them to 8 columns."""
  def lowered(k):
    w = (S((256, k), F8), S((2, -(-k // 128)), F32))
    f = lambda x, nw, w8, s: norm_linear_fp8(x, nw, ((w8, s),), projs=(fl.Proj(),), eps=1e-6)
    return lower_cuda(f, S((1, k), BF), S((k,), BF), *w)
  assert "stablehlo.pad" not in lowered(2560)
  assert "stablehlo.pad" in lowered(768)


def _moe_args(t, d=256, i=384, e=16, a=2):
  pair = lambda shape: quant.Fp8Weight(S(shape, F8), S(quant.scale_shape(shape), F32))
  xq = (S((t, d), F8), S((t, d // 128), F32))
  return (xq, S((t, a), jnp.int32), S((t, a), F32), pair((e, i, d)), pair((e, i, d)), pair((e, d, i)),
          (pair((i, d)), pair((i, d)), pair((d, i))))


W8A8 = MosaicMoeConfig(fp8_activations=True, block_i=128, n_tokens=16, up_stages=3, down_stages=3, split_k=1)


def test_rejects_the_64_byte_w8a8_scale_blocks(monkeypatch):
  """The w8a8 form as first run on the H200: [1, N = 16] f32 activation-scale blocks (64 B) in a 3-slot pipeline
  (moe_fp8 unjitted and a config of this test's own: nothing cached from another trace)."""
  monkeypatch.setattr(moe_mosaic, "scale_columns", lambda n: n)
  f = lambda *a: moe_fp8.__wrapped__(*a[:6], shared=a[6], config=W8A8)
  with pytest.raises(ValueError, match=r"moe_mosaic_fp8 up \(w8a8\): TMA copy into SMEM buffer 'x scales': box "
                                       r"\(1, 16\) float32 \(64 B\) lands at byte offset 0 \+ a run-time index x 64 B"):
    lower_cuda(f, *_moe_args(6))


def test_every_copy_is_checked_and_the_defaults_pass(monkeypatch):
  """The buffers each kernel's lowering checks (a TMA copy that bypassed tma would be missing here), for the
  default configs: fused_linear_fp8 (each scale_on) and the fp8 MoE (weight default and w8a8 at N = 16)."""
  seen = []
  check = tma.check_box
  monkeypatch.setattr(tma, "check_box", lambda kernel, buffer, *a, **k: (seen.append((kernel, buffer)),
                                                                        check(kernel, buffer, *a, **k)))
  x, nw, w = S((6, 2560), BF), S((2560,), BF), (S((256, 2560), F8), S((2, 20), F32))
  for scale_on in ("partial", "weight", "e4m3"):
    seen.clear()
    lower_cuda(lambda x, nw, w8, s: norm_linear_fp8(x, nw, ((w8, s),), projs=(fl.Proj(),), eps=1e-6,
                                                     scale_on=scale_on), x, nw, *w)
    assert {b for _, b in seen} == {"weight ring", "x chunks", "norm weights", "scale rows"}, scale_on
    assert {k for k, _ in seen} == {"fused_linear_fp8"}
  for cfg in (MosaicMoeConfig(), dataclasses.replace(W8A8, up_stages=4, down_stages=4)):
    seen.clear()
    args = _moe_args(6)
    if not cfg.fp8_activations:
      args = (S((6, 256), BF),) + args[1:]
    lower_cuda(lambda *a: moe_fp8.__wrapped__(*a[:6], shared=a[6], config=cfg), *args)
    want = {"gate tiles", "up tiles", "x tiles", "weight scale row", "routing weights wc", "down tiles", "h tiles"}
    assert {b for _, b in seen} == want | ({"x scales", "h scales"} if cfg.fp8_activations else set())
