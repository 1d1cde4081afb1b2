"""Trace-time checks of the TMA copies of our Mosaic GPU kernels (one place: every kernel that TMA-copies into
shared memory calls these while it is traced, so a bad layout is a ValueError naming the kernel and the buffer
on the CPU, in interpret mode and when lowering, instead of CUDA_ERROR_MISALIGNED_ADDRESS on the GPU).

What a TMA copy (cp.async.bulk.tensor) needs, and what broke on the H200:
  * its SMEM address 128-byte aligned (SMEM_ALIGN). fused_linear_fp8 copied 1-row boxes into an SMEM scale
    table of 80-byte rows (20 f32 columns): row j began at 80 j bytes and the first run faulted (commit 853da19
    padded the rows to 128 bytes). The fp8 MoE's w8a8 form pipelined [1, N] f32 activation-scale blocks: at
    N = 16 a block is 64 bytes, so every odd pipeline slot began 64 bytes off (the H200's second fault);
  * the box's innermost dimension a multiple of 16 bytes (BOX_INNER_ALIGN), and the GMEM array's strides
    (every dimension but the innermost) multiples of 16 bytes (cuTensorMapEncodeTiled's rules).
Where an SMEM address comes from: the buffer's allocation (Mosaic starts each scratch buffer of a run_scoped group
at a multiple of ALLOCATION_ALIGN, 1024 in this jax; `check_scratch` models that packing so that a jax which
packs tighter shows up as an error, not a fault) plus the offset of the copied view inside the buffer: a static
index adds index x stride bytes, a dynamic one (a ring slot) may be any multiple of its stride, so that stride
itself must be a multiple of 128. emit_pipeline's copies are not ours to see: `check_pipeline` checks its slots
(slot i of a [stages, *block] buffer begins i x block bytes in).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import mosaic_gpu as plgpu

SMEM_ALIGN = 128       # bytes: a TMA's shared-memory address
BOX_INNER_ALIGN = 16   # bytes: a TMA box's innermost dimension, and every GMEM stride
# jax internals read at trace time: a ref's transforms (indexers, the allocation's tiling / swizzle), concrete
# index values, and Mosaic's allocation alignment (16, a packing allocator, if jax stops defining it).
from jax._src import core as _jax_core
from jax._src.pallas.mosaic_gpu import core as _mgpu_core
from jax._src.state.indexing import NDIndexer as _NDIndexer, Slice as _Slice

ALLOCATION_ALIGN = int(getattr(_mgpu_core, "SMEM_ALIGNMENT", 16))


def _nbytes(shape, dtype) -> int:
  return math.prod(shape) * jnp.dtype(dtype).itemsize


def _concrete(v):
  """An index's value if it is known at trace time (a Python int, or a tracer of a constant), else None."""
  if isinstance(v, (int, np.integer)):
    return int(v)
  value = _jax_core.to_concrete_value(v)
  return None if value is None else int(value)


def _fail(kernel, buffer, what):
  raise ValueError(f"{kernel}: TMA copy into SMEM buffer {buffer!r}: {what}")


def check_box(kernel: str, buffer: str, shape, dtype, *, offset: int = 0, dynamic_strides=(), align=SMEM_ALIGN):
  """One TMA box of `shape` x `dtype` landing at `offset` bytes from an aligned SMEM base, plus any multiple of
  each of `dynamic_strides` (the byte strides of the run-time indices): raises a ValueError naming the kernel,
  the buffer, its byte size and offset unless every such address is `align`-byte aligned (128; a swizzled buffer
  its swizzle's repeat, `required_align`) and the box's innermost dimension is a multiple of 16 bytes."""
  size, item = _nbytes(shape, dtype), jnp.dtype(dtype).itemsize
  inner = (shape[-1] if len(shape) else 1) * item
  if inner % BOX_INNER_ALIGN:
    _fail(kernel, buffer, f"box {tuple(shape)} {jnp.dtype(dtype).name} ({size} B) has a {inner}-byte innermost "
          f"dimension; TMA boxes need a multiple of {BOX_INNER_ALIGN} bytes")
  why = (f"TMA writes only to {SMEM_ALIGN}-byte aligned shared memory" if align == SMEM_ALIGN else
         f"a {align // 8}-byte swizzle repeats every {align} bytes: the tile must start on one")
  if offset % align:
    _fail(kernel, buffer, f"box {tuple(shape)} {jnp.dtype(dtype).name} ({size} B) lands at byte offset {offset}, "
          f"not a multiple of {align} ({why}: pad the buffer's rows / blocks)")
  for stride in dynamic_strides:
    if stride % align:
      _fail(kernel, buffer, f"box {tuple(shape)} {jnp.dtype(dtype).name} ({size} B) lands at byte offset {offset} "
            f"+ a run-time index x {stride} B, and {stride} is not a multiple of {align} ({why}; odd indices "
            f"misalign: pad each indexed row / slot to a multiple of {align} bytes)")


def required_align(ref) -> int:
  """The alignment a TMA destination view needs: 128 bytes, or for a buffer allocated with a W-byte swizzle the
  swizzle's repeat, 8 W bytes (1024 for 128 B: the pattern is a function of the address bits, so a tile that
  starts elsewhere lands permuted, which no fault reports)."""
  swizzles = [t.swizzle for t in getattr(ref, "transforms", ()) if isinstance(t, _mgpu_core.UnswizzleRef)]
  return max([SMEM_ALIGN] + [8 * w for w in swizzles])


def smem_view(ref):
  """(shape, dtype, static byte offset, byte strides of the run-time indices) of an SMEM view `ref` (a buffer,
  or buffer.at[...] chains of static / dynamic indices and slices). The buffer's own tiling and swizzle (its
  allocation transforms) are layouts of whole [rows, cols] tiles: indexing the leading dimensions of such a
  buffer strides row-major; an index into its two tiled dimensions is not modelled (a clear error)."""
  transforms = tuple(getattr(ref, "transforms", ()))
  indexers = [t for t in transforms if isinstance(t, _NDIndexer)]
  layout = transforms[:len(transforms) - len(indexers)]
  if any(not isinstance(t, _LAYOUTS) for t in layout) or any(not isinstance(t, _NDIndexer)
                                                               for t in transforms[len(layout):]):
    raise ValueError(f"smem_view: transforms {transforms} are not an allocation layout followed by indexers")
  item = jnp.dtype(ref.dtype).itemsize
  offset, dynamic = 0, []
  for n, t in enumerate(indexers):
    shape = tuple(t.shape)
    if n == 0:
      strides = [item * math.prod(shape[d + 1:]) for d in range(len(shape))]
    kept = []
    for d, idx in enumerate(t.indices):
      start = idx.start if isinstance(idx, _Slice) else idx
      value = _concrete(start)
      if layout and n == 0 and d >= len(shape) - 2 and value != 0:
        raise ValueError(f"smem_view: index {idx} into a tiled dimension of a {shape} buffer is not modelled")
      if value is None:
        dynamic.append(strides[d])
      else:
        offset += value * strides[d]
      if isinstance(idx, _Slice):
        kept.append(strides[d])
    strides = kept
  return tuple(ref.shape), ref.dtype, offset, tuple(dynamic)


def check_gmem(kernel: str, buffer: str, src):
  """The GMEM side of a TMA: every stride of the source array but the innermost a multiple of 16 bytes."""
  base = src.ref if getattr(src, "transforms", ()) else src
  shape, item = tuple(base.shape), jnp.dtype(base.dtype).itemsize
  for d in range(len(shape) - 1):
    stride = item * math.prod(shape[d + 1:])
    if stride % BOX_INNER_ALIGN and shape[d] > 1:
      raise ValueError(f"{kernel}: TMA copy into {buffer!r} from a GMEM array {shape} {jnp.dtype(base.dtype).name}: "
                       f"dimension {d} strides {stride} B, not a multiple of {BOX_INNER_ALIGN} (TMA descriptors)")


def copy_gmem_to_smem(src, dst, barrier, *, kernel: str, buffer: str, **kwargs):
  """plgpu.copy_gmem_to_smem after `check_box` on the destination view and `check_gmem` on the source."""
  shape, dtype, offset, dynamic = smem_view(dst)
  check_box(kernel, buffer, shape, dtype, offset=offset, dynamic_strides=dynamic, align=required_align(dst))
  check_gmem(kernel, buffer, src)
  plgpu.copy_gmem_to_smem(src, dst, barrier, **kwargs)


def check_pipeline(kernel: str, blocks, stages: int):
  """emit_pipeline's TMA destinations: each (buffer name, block shape, dtype) is copied into slot i of a
  [stages, *block] SMEM buffer, i x block bytes in (stages > 1: the block's bytes must be a multiple of 128)."""
  for name, shape, dtype in blocks:
    check_box(kernel, name, shape, dtype, dynamic_strides=(_nbytes(shape, dtype),) if stages > 1 else ())


def check_scratch(kernel: str, named, align: int | None = None):
  """Scratch buffers (name, plgpu.SMEM(...) or a Barrier / accumulator, which take no scratch SMEM) of one
  run_scoped group, packed in order as Mosaic packs them (each start rounded up to `align`, by default
  ALLOCATION_ALIGN): every buffer must start 128-byte aligned. Returns the byte offsets of the SMEM buffers."""
  align = ALLOCATION_ALIGN if align is None else align
  offsets, at = {}, 0
  for name, alloc in named:
    if getattr(alloc, "memory_space", None) != plgpu.SMEM:
      continue
    at = -(-at // align) * align
    if at % SMEM_ALIGN:
      _fail(kernel, name, f"scratch buffer {tuple(alloc.shape)} {jnp.dtype(alloc.dtype).name} "
            f"({_nbytes(alloc.shape, alloc.dtype)} B) starts at byte {at} of its group (the buffers before it "
            f"pack to {at} B with {align}-byte allocation alignment), not a multiple of {SMEM_ALIGN}")
    offsets[name] = at
    at += _nbytes(alloc.shape, alloc.dtype)
  return offsets


def pad_to(n: int, dtype, align: int = SMEM_ALIGN) -> int:
  """n elements of dtype rounded up to a whole number of `align`-byte units (a TMA-aligned row or block)."""
  per = max(1, align // jnp.dtype(dtype).itemsize)
  return -(-n // per) * per


_LAYOUTS = (_mgpu_core.UnswizzleRef, _mgpu_core.UntilingTransform)   # an SMEM buffer's allocation transforms
