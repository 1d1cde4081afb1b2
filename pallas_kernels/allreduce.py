"""One-shot all-reduce of a few rows, fused with the residual add and the next RMSNorm (Mosaic GPU, peer to peer).

Shape legend: N devices on the mesh axis, T rows (batch folded in; 1-17 in decode / NEXTN verify), D hidden
(2560 for Ling-3.0-flash), P the partials' dtype (f32: the MoE's down projections; bf16: an output projection).

Math (the model's, per device; ling_jax.layers.norms.rms_norm and the layer boundary `x + y` of
ling_jax.model are the references, compile.sharding's psum of the partial sums the reduction):
    y        = sum_{d = 0..N-1} partial_d          fp32 accumulation, d in device order 0, 1, ..., N-1
    residual = residual + y.astype(residual.dtype) (the stream's add: y rounded first, then the add)
    normed   = rms_norm(residual, weight, eps)     fp32 statistics, bf16(x r), then weight * that
Every device sums the same N slots in the same order with the same code, so the result is bit-identical on
every device (the replicated residual stays replicated), and a row depends only on its own row: the rows of
the batch and the device a partial came from do not change the arithmetic (no atomics, no split reduction).

Kernel plan (one launch per call, inside `jax.shard_map` over the mesh axis; one CTA per row, T CTAs):
  1. CTA t loads its row of this device's partial [D] into registers, stores it into its own slot
     slots[me, t] and, through `plgpu.remote_ref`, into slots[me, t] of every peer (plain st.global over
     NVLink: no multicast / multimem, no NCCL);
  2. a system-scope release fence (each thread's remote stores are visible before the flag), then one
     `pl.semaphore_signal(sem, device_id=peer)` per peer on that CTA's semaphore (block-local, so row t's
     flag only orders row t's data), then it waits for N - 1 signals;
  3. it reads the N slots of row t in device order, sums in fp32, rounds to the stream's dtype, adds the
     residual row, computes the row's RMSNorm and stores both rows.
The slots buffer [N, T, D] is a kernel output (XLA allocates it per call; the collective metadata of the
launch gives every device its peers' addresses of it); Mosaic's launch has a cross-device barrier before the
kernel (`skip_device_barrier=False`), so a peer's slots and zero-initialised semaphores exist before anyone
writes into them. The semaphores are back at 0 when the kernel ends (the wait decrements).

Bytes each device moves per call: sends (N - 1) T D |P| over NVLink (T = 17, bf16: 87 KB per peer; f32:
174 KB), receives the same, and reads N T D |P| + T D (2 + 2) + 2 D, writes T D (|P| + 4) locally: at most
~0.9 MB for N = 4, T = 17, f32, i.e. < 1 us of HBM and ~0.4 us of one NV18 direction (~450 GB/s) even at T = 17.

Expected latency (why this can beat NCCL's 18-19 us for one small dependent all-reduce on two H200s): the
data are too small for bandwidth to matter; the cost is fixed latency. NCCL's all-reduce runs its own kernel
(protocol setup, a ring/tree of steps with a flag handshake per step, proxy bookkeeping) and then XLA runs the
add and the norm as 1-2 more kernels (~2-3 us launch + gap each). Here: one kernel launch (~2-4 us, no PDL),
Mosaic's pre-launch device barrier (one small cross-device sync), one NVLink store + flag round trip (~1-2 us),
and the combine (~1 us for a 5-10 KB row per CTA): ~5-8 us in total against ~18 + 2 x ~3 us, if the barrier
is as cheap as one flag exchange. bench/kernels_allreduce.py measures both on nvidia-h200-x2; the barrier is
the unknown (if it dominates, the next step is persistent semaphores with an in-kernel ready handshake, which
Mosaic cannot express yet: its GMEM semaphores are zero-filled at every launch).

Limits (checked, ValueError names the values): 1 <= T <= max_rows, D a multiple of 128 x vec (one row is one
warpgroup's strided vector), P in (f32, bf16), residual and weight in the stream's dtype (bf16 or f32), the
mesh axis of N >= 2 devices in row-major device order (Mosaic's requirement). The CPU interpreter runs no
GMEM semaphores or remote refs: `combine` (step 3 alone, on already gathered slots) is what CPU tests
interpret; the whole kernel is checked by lowering for CUDA and by the bench on two GPUs.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.pallas import mosaic_gpu as plgpu

PARTIAL_DTYPES = (jnp.float32, jnp.bfloat16)
STREAM_DTYPES = (jnp.bfloat16, jnp.float32)


@dataclass(frozen=True)
class AllReduceConfig:
    """vec: elements per thread per vector access of a row (the row is [D] in a warpgroup-strided layout:
      D must be a multiple of 128 x vec), None for the widest of 8 / 4 / 2 / 1 that divides D (2560: 4);
    max_rows: the largest T the one-CTA-per-row plan takes (a prefill chunk of more rows stays on psum: there
      bandwidth, not latency, matters);
    interpret: run `combine` in the Mosaic GPU interpreter (CPU tests; the exchange cannot be interpreted)."""

    vec: int | None = None
    max_rows: int = 64
    interpret: bool = False

    def __post_init__(self):
        if self.vec not in (None, 1, 2, 4, 8):
            raise ValueError(f"vec={self.vec} must be 1, 2, 4 or 8")
        if self.max_rows < 1:
            raise ValueError(f"max_rows={self.max_rows} must be >= 1")

    def check(self, partial_shape, partial_dtype, residual, weight):
        if len(partial_shape) != 2:
            raise ValueError(f"partial shape {tuple(partial_shape)} is not [T, D]")
        t, d = partial_shape
        if not 1 <= t <= self.max_rows:
            raise ValueError(f"rows T={t} outside 1..max_rows={self.max_rows}")
        if d % (128 * (self.vec or 1)):
            raise ValueError(f"hidden D={d} is not a multiple of 128 x vec={128 * (self.vec or 1)} (one row is one "
                             "warpgroup's strided vector)")
        if jnp.dtype(partial_dtype) not in map(jnp.dtype, PARTIAL_DTYPES):
            raise ValueError(f"partial dtype {jnp.dtype(partial_dtype)} not in f32 / bf16")
        if residual.shape != (t, d):
            raise ValueError(f"residual shape {residual.shape} != partial's {(t, d)}")
        if residual.dtype not in map(jnp.dtype, STREAM_DTYPES) or weight.dtype != residual.dtype:
            raise ValueError(f"residual {residual.dtype} and weight {weight.dtype} must share a dtype in bf16 / f32")
        if weight.shape != (d,):
            raise ValueError(f"norm weight shape {weight.shape} != ({d},)")


def takes(partial, residual, weight, config: AllReduceConfig | None = None) -> bool:
    """Whether the kernel takes these operands (the caller runs psum where it does not)."""
    try:
        (config or AllReduceConfig()).check(partial.shape, partial.dtype, residual, weight)
    except ValueError:
        return False
    return True


def _row(ref, cfg: AllReduceConfig):
    """A [D] GMEM row -> registers, warpgroup-strided (each thread vec contiguous elements at a time)."""
    (d,) = ref.shape
    vec = cfg.vec or max(v for v in (8, 4, 2, 1) if d % (128 * v) == 0)
    return plgpu.load(ref, layout=plgpu.Layout.WG_STRIDED(ref.shape, vec_size=vec))


def _combine_row(slot_rows, residual_ref, weight_ref, new_residual_ref, normed_ref, *, eps, cfg):
    """Step 3 for one row: the N slot rows summed in device order (fp32), rounded to the stream's dtype, added
    to the residual row, then rms_norm as ling_jax.layers.norms computes it."""
    dtype = residual_ref.dtype
    acc = _row(slot_rows[0], cfg).astype(jnp.float32)
    for slot in slot_rows[1:]:
        acc = acc + _row(slot, cfg).astype(jnp.float32)
    x = (_row(residual_ref, cfg).astype(jnp.float32) + acc.astype(dtype).astype(jnp.float32)).astype(dtype)
    new_residual_ref[...] = x
    xf = x.astype(jnp.float32)
    r = lax.rsqrt(jnp.sum(xf * xf) / xf.shape[0] + eps)
    normed = (xf * r).astype(dtype).astype(jnp.float32)
    normed_ref[...] = (_row(weight_ref, cfg).astype(jnp.float32) * normed).astype(dtype)


def _fence_release_sys():
    """fence.acq_rel.sys by every thread: its stores (remote ones included) are visible system-wide before
    whatever it or, after the barrier inside the signal, its CTA does next."""

    @plgpu.inline_mgpu()
    def fence(ctx):
        del ctx
        mgpu.utils.inline_ptx("fence.acq_rel.sys;", has_side_effects=True)

    fence()


def _allreduce_kernel(partial_ref, residual_ref, weight_ref, new_residual_ref, normed_ref, slots_ref, sem_ref,
                      *, axis: str, n: int, eps: float, cfg: AllReduceConfig):
    t = lax.axis_index("row")
    me = lax.axis_index(axis)
    own = _row(partial_ref.at[t], cfg)
    slots_ref.at[me, t][...] = own
    peers = [lax.rem(me + k, jnp.int32(n)) for k in range(1, n)]
    for peer in peers:  # one-shot: my partial row into every peer's slot `me`
        plgpu.remote_ref(slots_ref, peer).at[me, t][...] = own
    _fence_release_sys()
    for peer in peers:
        pl.semaphore_signal(sem_ref, 1, device_id=peer)
    pl.semaphore_wait(sem_ref, n - 1)
    _combine_row([slots_ref.at[d, t] for d in range(n)], residual_ref.at[t], weight_ref, new_residual_ref.at[t],
                 normed_ref.at[t], eps=eps, cfg=cfg)


def allreduce_residual_norm(partial, residual, weight, *, eps: float, axis: str,
                            config: AllReduceConfig | None = None):
    """(residual + psum(partial).astype(residual.dtype), rms_norm of that) in one kernel. Call inside
    `jax.shard_map` over mesh axis `axis` (every device passes its own partial [T, D] and the same residual
    [T, D] and weight [D]); returns (new_residual [T, D], normed [T, D]), equal on every device."""
    cfg = config or AllReduceConfig()
    if cfg.interpret:
        raise ValueError("allreduce_residual_norm with interpret=True: the Mosaic GPU interpreter runs no GMEM "
                         "semaphores or remote refs; interpret `combine` on gathered slots instead")
    n = lax.axis_size(axis)
    if n < 2:
        raise ValueError(f"mesh axis {axis!r} has {n} device(s); the all-reduce needs >= 2 (one device: no psum)")
    cfg.check(partial.shape, partial.dtype, residual, weight)
    t, d = partial.shape
    kernel = plgpu.kernel(
        functools.partial(_allreduce_kernel, axis=axis, n=n, eps=float(eps), cfg=cfg),
        out_type=(jax.ShapeDtypeStruct((t, d), residual.dtype), jax.ShapeDtypeStruct((t, d), residual.dtype),
                  jax.ShapeDtypeStruct((n, t, d), partial.dtype)),
        scratch_types=[plgpu.SemaphoreType.REGULAR],
        grid=(t,), grid_names=("row",),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup))
    new_residual, normed, _ = kernel(partial, residual, weight)
    return new_residual, normed


def _combine_kernel(slots_ref, residual_ref, weight_ref, new_residual_ref, normed_ref, *, eps: float,
                    cfg: AllReduceConfig):
    t = lax.axis_index("row")
    _combine_row([slots_ref.at[d, t] for d in range(slots_ref.shape[0])], residual_ref.at[t], weight_ref,
                 new_residual_ref.at[t], normed_ref.at[t], eps=eps, cfg=cfg)


def combine(slots, residual, weight, *, eps: float, config: AllReduceConfig | None = None):
    """Step 3 of the all-reduce alone, on gathered slots [N, T, D] (slot d = device d's partial): the same
    `_combine_row` the collective kernel runs after its exchange. The CPU tests interpret this; on a GPU it is
    the single-device view of the kernel (no exchange)."""
    cfg = config or AllReduceConfig()
    n, t, d = slots.shape
    cfg.check((t, d), slots.dtype, residual, weight)
    out = jax.ShapeDtypeStruct((t, d), residual.dtype)
    kernel = plgpu.kernel(
        functools.partial(_combine_kernel, eps=float(eps), cfg=cfg), out_type=(out, out),
        grid=(t,), grid_names=("row",),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=plgpu.InterpretGPUParams() if cfg.interpret else None)
    return kernel(slots, residual, weight)
