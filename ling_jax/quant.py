"""Block fp8 weights in the DeepSeek-V3 layout (as inclusionAI publishes Ling-3.0-flash-fp8): the math and the
checkpoint format.

Shape legend: N output rows, K input columns of one linear weight [N, K] (leading axes, e.g. experts, are kept),
B = 128 the block edge, nN = ceil(N / B), nK = ceil(K / B).

    per block (i, j) of W:  s[i, j] = amax |W[iB:(i+1)B, jB:(j+1)B]| / 448      (448 = the largest e4m3 value)
                            W8 = round_e4m3(W / s)          W ~ W8 * s          (s is stored as `weight_scale_inv`)
Ragged edges (N or K not a multiple of B) form smaller blocks: the ceil in nN, nK. An all-zero block gets s = 0
and W8 = 0 (DeepSeek's weight_quant computes 0 / 0 = NaN there; we keep its scale and store zeros, which
dequantise to the exact block). Dequantising is the reference the kernels are tested against:
    W = bf16(f32(W8) * repeat(s))         (the scale applied in fp32, one rounding to the activation dtype)

Checkpoint format (config.json `quantization_config`):
    {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], "activation_scheme": "dynamic",
     "modules_to_not_convert": [module names kept in bf16]}     (vLLM-style files call the list "ignored_layers")
and each quantised linear as `<module>.weight` F8_E4M3 [N, K] + `<module>.weight_scale_inv` F32 [nN, nK].
Which tensors are fp8 follows the checkpoint; a weight whose storage contradicts the config is an error naming it.
`--quantization fp8` quantises a bf16 checkpoint while it loads, with DeepSeek's policy (`fp8_policy`): every
2-D linear weight except the embedding, lm_head, the MoE router gate and the MTP eh_proj.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from ling_jax.safetensors_io import CheckpointError

BLOCK = 128
FP8 = jnp.float8_e4m3fn
FP8_MAX = 448.0  # jnp.finfo(float8_e4m3fn).max
QUANTIZATIONS = ("fp8",)
ACTIVATION_SCHEMES = ("dynamic",)  # the checkpoint's: "static" would ship input scales we do not use
# What the model does with the input of an fp8-weight GEMM (model.Numerics.fp8_activations): "none" keeps it in the
# activation dtype (weight-only fp8: the weight is dequantised), "dynamic" quantises it per token and 128-column
# group first (the w8a8 SGLang / vLLM serve this format with: gemm_input, below).
ACTIVATIONS = ("none", "dynamic")
SCALE_SUFFIX = "_scale_inv"
NOT_QUANTISED = ("lm_head.weight", ".mlp.gate.weight", ".eh_proj.weight", "word_embeddings.weight")


class Fp8Weight(NamedTuple):
    """One block-fp8 weight (a pytree): w8 [..., N, K] float8_e4m3fn, scale_inv [..., nN, nK] float32."""

    w8: jax.Array
    scale_inv: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.w8.shape)


def scale_shape(shape: tuple[int, ...], block: int = BLOCK) -> tuple[int, ...]:
    """[..., N, K] -> [..., ceil(N / block), ceil(K / block)]."""
    *lead, n, k = shape
    return (*lead, math.ceil(n / block), math.ceil(k / block))


def _blocks(w, block):
    """[..., N, K] -> zero-padded [..., nN, bn, nK, bk] for block = (bn, bk) (zeros never raise a block's amax)."""
    *lead, n, k = w.shape
    bn, bk = block
    nn, nk = -(-n // bn), -(-k // bk)
    pad = [(0, 0)] * len(lead) + [(0, nn * bn - n), (0, nk * bk - k)]
    return jnp.pad(w, pad).reshape(*lead, nn, bn, nk, bk)


def _expand(scale, shape, block):
    """scale [..., nN, nK] -> [..., N, K]: each block's scale repeated over its elements (ragged edges cropped)."""
    n, k = shape[-2:]
    s = jnp.repeat(jnp.repeat(scale, block[0], axis=-2), block[1], axis=-1)
    return s[..., :n, :k]


def _quantize(w, block):
    """w [..., N, K] -> (w8, scale [..., ceil(N / bn), ceil(K / bk)]) for blocks block = (bn, bk)."""
    wf = w.astype(jnp.float32)
    amax = jnp.max(jnp.abs(_blocks(wf, block)), axis=(-3, -1))  # [..., nN, nK]
    scale = amax / FP8_MAX
    safe = jnp.where(scale > 0, scale, 1.0)  # all-zero block: W / 1 = 0 (not 0 / 0)
    return (wf / _expand(safe, w.shape, block)).astype(FP8), scale


@jax.jit
def quantize(w) -> Fp8Weight:
    """w [..., N, K] (bf16 / f32) -> Fp8Weight, one scale per 128 x 128 block of the last two axes."""
    return Fp8Weight(*_quantize(w, (BLOCK, BLOCK)))


def dequantize(q: Fp8Weight, dtype=jnp.bfloat16) -> jax.Array:
    """W = f32(W8) * repeat(scale_inv), rounded once to dtype."""
    s = _expand(q.scale_inv.astype(jnp.float32), q.w8.shape, (BLOCK, BLOCK))
    return (q.w8.astype(jnp.float32) * s).astype(dtype)


# ---- activations: dynamic per-token block fp8 (the checkpoint's activation_scheme "dynamic") --------------------
#
# What SGLang / DeepGEMM run for DeepSeek-style block-fp8 checkpoints (w8a8): each row (token) of an activation
# [..., K] is cut into 128-column groups g, and each group takes its own scale when the GEMM runs:
#     s[g] = amax |x[g B:(g+1) B]| / 448        x8 = round_e4m3(x / s)        x ~ x8 * s
# (ragged last group as the weights'; an all-zero group gets s = 0 and x8 = 0). The model does this where
# Numerics.fp8_activations is "dynamic" (gemm_input): the numerics of the e4m3 kernels (fused_linear_fp8's "e4m3"
# form, the fp8 MoE's w8a8 form), whose reference is the model's jnp with its inputs through
# fake_quantize_activations.


class Fp8Activations(NamedTuple):
    """Activations quantised per row and 128-column group: x8 [..., T, K] float8_e4m3fn, scale [..., T, nK] f32."""

    x8: jax.Array
    scale: jax.Array


@jax.jit
def quantize_activations(x) -> Fp8Activations:
    """x [..., T, K] (bf16 / f32) -> Fp8Activations: quantize's math on 1 x 128 blocks (a scale per row and group).
    The barrier pins x to its dtype's values first: the e4m3 rounding turns any excess precision of its input into
    whole e4m3 steps (a bf16-ulp change of x flips ~1/16 of the roundings), and under xla_allow_excess_precision
    (the GPU default) XLA drops the bf16 rounding of an x made in the same jit (rms_norm's output: the e4m3
    kernels' references then differed from the kernels, which quantise the bf16 x, by ~1.2e-2 instead of ~3e-3)."""
    return Fp8Activations(*_quantize(jax.lax.optimization_barrier(x), (1, BLOCK)))


def dequantize_activations(q: Fp8Activations, dtype=jnp.bfloat16) -> jax.Array:
    """x = f32(x8) * repeat(scale) over each group, rounded once to dtype.
    The optimization barrier keeps the e4m3 rounding when x8 was made in the same jit (fake_quantize_activations,
    the kernels' references): XLA's SimplifyFPConversions, which the GPU compiler runs under its default
    xla_allow_excess_precision, rewrites the chain f32 -> e4m3 -> f32 as f32, so without the barrier the
    "quantised" reference on the H200 was the unquantised one (fused_linear_fp8 e4m3's check read rel err 2.6e-2,
    identical to its distance from the unquantised model). The barrier outlives that pass (the GPU compiler
    expands barriers after scheduling); it costs one fusion boundary on a [T, K] activation."""
    x8 = jax.lax.optimization_barrier(q.x8)
    return (x8.astype(jnp.float32) * _expand(q.scale.astype(jnp.float32), x8.shape, (1, BLOCK))).astype(dtype)


def fake_quantize_activations(x):
    """x through the dynamic activation fp8 and back, in x's dtype: what an e4m3 x e4m3 GEMM sees of x."""
    return dequantize_activations(quantize_activations(x), x.dtype)


def gemm_input(x, w, fp8_activations: bool):
    """x [..., K] as the GEMM with weight w [..., N, K] reads it: through fake_quantize_activations where w is block
    fp8 and fp8_activations (Numerics.fp8_activations == "dynamic"), else x itself (bf16 weights never quantise
    their input)."""
    return fake_quantize_activations(x) if fp8_activations and isinstance(w, Fp8Weight) else x


def dense(w, dtype):
    """A weight as the dense array its einsum takes: dequantised to `dtype` when fp8, else unchanged."""
    return dequantize(w, dtype) if isinstance(w, Fp8Weight) else w


def take(w, ids):
    """w[ids] along the leading (expert) axis, for a dense array or an Fp8Weight (both parts gathered)."""
    if isinstance(w, Fp8Weight):
        return Fp8Weight(w.w8[ids], w.scale_inv[ids])
    return w[ids]


def abstract(shape: tuple[int, ...], sharding=None) -> Fp8Weight:
    """The ShapeDtypeStructs of one block-fp8 weight of `shape` (both parts take the weight's sharding)."""
    return Fp8Weight(jax.ShapeDtypeStruct(shape, FP8, sharding=sharding),
                     jax.ShapeDtypeStruct(scale_shape(shape), jnp.float32, sharding=sharding))


# Random fp8 weights are drawn in fp8: W8 = e4m3(clip(SPAN z)), z ~ N(0, 1), and one scale per block
# s = fan_in^-1/2 / SPAN x U(0.8, 1.2), so W = W8 s has the bf16 init's std (fan_in^-1/2) and the scales differ
# from block to block (a kernel that applies the wrong block's scale gets a different answer). SPAN = 2^6 keeps
# |z| < 7 inside e4m3's 448; the clip keeps the rare larger draw finite (e4m3fn has no inf).
RANDOM_SPAN = 64.0
RANDOM_ROWS_PER_DRAW = 32  # stacked experts are drawn this many at a time: a large f32 draw never exists


def random_fp8(key, shape: tuple[int, ...], fan_in: int) -> Fp8Weight:
    """A random block-fp8 weight [..., N, K] drawn directly in fp8 (no bf16 or f32 copy of the whole array)."""
    kw, ks = jax.random.split(key)
    draw = lambda k, s: jnp.clip(RANDOM_SPAN * jax.random.normal(k, s, jnp.float32), -FP8_MAX, FP8_MAX).astype(FP8)
    if len(shape) == 3 and shape[0] > RANDOM_ROWS_PER_DRAW:  # [E, N, K]: one expert per map step, in batches
        w8 = jax.lax.map(lambda k: draw(k, shape[1:]), jax.random.split(kw, shape[0]),
                         batch_size=RANDOM_ROWS_PER_DRAW)
    else:
        w8 = draw(kw, shape)
    s = jax.random.uniform(ks, scale_shape(shape), jnp.float32, 0.8, 1.2) * (fan_in**-0.5 / RANDOM_SPAN)
    return Fp8Weight(w8, s)


def nbytes(w) -> int:
    """Bytes an array, ShapeDtypeStruct or Fp8Weight of either occupies (fp8 part + its f32 scales)."""
    return sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(w))


def quantize_numpy(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The same quantisation on the host (checkpoint writers): -> (w8 float8_e4m3fn, scale_inv float32)."""
    q = quantize(jnp.asarray(w))
    return np.asarray(q.w8), np.asarray(q.scale_inv)


# ---- which weights -----------------------------------------------------------------------------------------------


def fp8_policy(hf_name: str, hf_shape: tuple[int, ...]) -> bool:
    """Whether `--quantization fp8` quantises this HF tensor (DeepSeek's bf16_cast_fp8 skip list, 2-D weights)."""
    return len(hf_shape) == 2 and hf_name.endswith(".weight") and not hf_name.endswith(NOT_QUANTISED)


def can_be_fp8(hf_name: str, hf_shape: tuple[int, ...]) -> bool:
    """Whether a checkpoint may store this tensor as fp8: any 2-D linear weight (the embedding is a lookup)."""
    return len(hf_shape) == 2 and hf_name.endswith(".weight") and not hf_name.endswith("word_embeddings.weight")


def module_name(hf_name: str) -> str:
    return hf_name[: -len(".weight")] if hf_name.endswith(".weight") else hf_name


# ---- config.json ---------------------------------------------------------------------------------------------------


class Fp8Config(NamedTuple):
    """The parsed `quantization_config` of a block-fp8 checkpoint."""

    block: tuple[int, int]
    not_converted: frozenset[str]  # module names kept in bf16


def quantization_config(not_converted) -> dict:
    """The `quantization_config` we write (DeepSeek-V3's keys plus the HF list of unconverted modules)."""
    return {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [BLOCK, BLOCK], "activation_scheme": "dynamic",
            "modules_to_not_convert": sorted(not_converted)}


def read_quantization_config(config: dict, where: str = "config.json") -> Fp8Config | None:
    """config.json dict -> Fp8Config, or None for an unquantised checkpoint. Any value not implemented is an error."""
    q = config.get("quantization_config")
    if q is None:
        return None
    if q.get("quant_method") != "fp8":
        raise CheckpointError(f"{where}: quantization_config.quant_method={q.get('quant_method')!r}: only 'fp8' "
                              "(block fp8, DeepSeek-V3 layout) is implemented")
    if q.get("fmt", "e4m3") != "e4m3":
        raise CheckpointError(f"{where}: quantization_config.fmt={q['fmt']!r}: only 'e4m3' is implemented")
    if list(q.get("weight_block_size") or []) != [BLOCK, BLOCK]:
        raise CheckpointError(f"{where}: quantization_config.weight_block_size={q.get('weight_block_size')!r}: "
                              f"only [{BLOCK}, {BLOCK}] is implemented")
    if q.get("activation_scheme", "dynamic") not in ACTIVATION_SCHEMES:
        raise CheckpointError(f"{where}: quantization_config.activation_scheme={q['activation_scheme']!r}: only "
                              f"{ACTIVATION_SCHEMES} is implemented (activations quantised per token and 128 columns when they "
                              "run: --fp8-activations dynamic, or kept bf16: none)")
    names = list(q.get("modules_to_not_convert") or []) + list(q.get("ignored_layers") or [])
    return Fp8Config((BLOCK, BLOCK), frozenset(names))


def stored_fp8(spec: dict, where: dict, qcfg: Fp8Config | None, model_dir: str) -> set[str]:
    """The HF names (keys of the param spec) this checkpoint stores as block fp8, after checking each one:
    F8_E4M3 weight with an F32 `_scale_inv` of the block shape, a tensor that may be fp8, a quantization_config
    that does not list it as unconverted. `where`: tensor name -> SafetensorsFile."""
    fp8 = np.dtype(ml_dtypes.float8_e4m3fn)
    out = set()
    for name, e in spec.items():
        sname = name + SCALE_SUFFIX
        is_fp8 = name in where and where[name].header[name][0] == fp8
        if not is_fp8:
            if sname in where:
                raise CheckpointError(f"{where[sname].path}: {sname} scales tensor {name}, which is not F8_E4M3")
            continue
        path = where[name].path
        if qcfg is None:
            raise CheckpointError(f"{path}: tensor {name} is F8_E4M3 but config.json has no quantization_config")
        if module_name(name) in qcfg.not_converted:
            raise CheckpointError(f"{path}: tensor {name} is F8_E4M3 but quantization_config lists "
                                  f"{module_name(name)!r} in modules_to_not_convert")
        if not can_be_fp8(name, e.shape):
            raise CheckpointError(f"{path}: tensor {name} {e.shape} is F8_E4M3; only 2-D linear weights can be fp8")
        if sname not in where:
            raise CheckpointError(f"{path}: tensor {name} is F8_E4M3 but its scales {sname} are missing")
        dt, shape, _ = where[sname].header[sname]
        if dt != np.dtype(np.float32) or tuple(shape) != scale_shape(e.shape):
            raise CheckpointError(f"{where[sname].path}: tensor {sname}: expected float32 {scale_shape(e.shape)}, "
                                  f"found {dt} {tuple(shape)}")
        out.add(name)
    return out


__all__ = ["Fp8Weight", "Fp8Config", "quantize", "dequantize", "dense", "take", "quantize_numpy", "abstract",
           "Fp8Activations", "quantize_activations", "dequantize_activations", "fake_quantize_activations",
           "gemm_input", "ACTIVATIONS",
           "random_fp8", "nbytes", "fp8_policy",
           "can_be_fp8", "quantization_config", "read_quantization_config", "stored_fp8", "scale_shape", "BLOCK"]
