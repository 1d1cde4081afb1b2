"""The parameter spec and every way parameters come to exist: HF safetensors, random init, orbax.

`array_spec(cfg)` declares each array of the JAX parameter pytree ONCE: shape, dtype, logical axes, init,
and the HF tensors it is assembled from (experts and the KDA streams are stacked on a leading axis).
`param_spec(cfg)` is the same table keyed by HF tensor name. Everything else derives from these two.
"""

from __future__ import annotations

import functools
import json
import os
import zlib
from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from ling_jax import quant
from ling_jax.config import ModelConfig, to_hf_dict
from ling_jax.errors import CheckpointError
from ling_jax.safetensors_io import DTYPES, open_checkpoint, save_file

F32_INITS = ("a_log", "dt_bias", "expert_bias")  # arrays kept in float32 whatever the model dtype


@dataclass(frozen=True)
class ArrayInfo:
    """One array of the parameter pytree.

    shape/axes: the JAX array; dtype: "model" (the weight dtype) or "float32";
    hf: [(hf_name, stack_index or None)]: stacked parts fill shape[1:] at index i of axis 0.
    init: how random init draws it; fan_in: the scale of "normal" init.
    """

    path: tuple
    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    hf: tuple[tuple[str, int | None], ...]
    init: str = "normal"
    fan_in: int = 1

    @property
    def dtype(self) -> str:
        return "float32" if self.init in F32_INITS else "model"

    @property
    def hf_shape(self) -> tuple[int, ...]:
        return self.shape[1:] if self.hf[0][1] is not None else self.shape


@dataclass(frozen=True)
class HFEntry:
    shape: tuple[int, ...]
    dtype: str
    axes: tuple[str | None, ...]
    path: tuple
    stack_index: int | None


def _w(path, prefix, name, out, inp, axes, init="normal"):
    return ArrayInfo(path, (out, inp), axes, ((f"{prefix}.{name}.weight", None),), init, fan_in=inp)


def _norm(path, hf_name, dim):
    return ArrayInfo(path, (dim,), (None,), ((hf_name, None),), "ones")


def _mlp(path, prefix, D, F, ax):
    return [
        _w(path + ("gate_proj",), prefix, "gate_proj", F, D, (ax, "embed")),
        _w(path + ("up_proj",), prefix, "up_proj", F, D, (ax, "embed")),
        _w(path + ("down_proj",), prefix, "down_proj", D, F, ("embed", ax)),
    ]


def _kda(path, pre, cfg):
    D, H, K, W = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.short_conv_kernel_size
    C = H * K
    streams = ("q_proj", "k_proj", "v_proj", "f_proj", "g_proj")
    return [
        ArrayInfo(path + ("w_qkvfg",), (5, C, D), (None, "heads", "embed"),
                  tuple((f"{pre}.{s}.weight", i) for i, s in enumerate(streams)), fan_in=D),
        ArrayInfo(path + ("conv_w",), (3, C, 1, W), (None, "heads", None, None),
                  tuple((f"{pre}.{s}_conv1d.weight", i) for i, s in enumerate("qkv")), "conv", fan_in=W),
        _w(path + ("b_proj",), pre, "b_proj", H, D, ("heads", "embed")),
        ArrayInfo(path + ("A_log",), (H,), ("heads",), ((f"{pre}.A_log", None),), "a_log"),
        ArrayInfo(path + ("dt_bias",), (C,), ("heads",), ((f"{pre}.dt_bias", None),), "dt_bias"),
        _norm(path + ("o_norm",), f"{pre}.o_norm.weight", K),
        _w(path + ("o_proj",), pre, "o_proj", D, C, ("embed", "heads")),
    ]


def _mla(path, pre, cfg):
    D, H = cfg.hidden_size, cfg.num_attention_heads
    out = []
    if cfg.q_lora_rank is None:
        out.append(_w(path + ("q_proj",), pre, "q_proj", H * cfg.qk_head_dim, D, ("heads", "embed")))
    else:
        out += [
            _w(path + ("q_a_proj",), pre, "q_a_proj", cfg.q_lora_rank, D, (None, "embed")),
            _norm(path + ("q_a_layernorm",), f"{pre}.q_a_layernorm.weight", cfg.q_lora_rank),
            _w(path + ("q_b_proj",), pre, "q_b_proj", H * cfg.qk_head_dim, cfg.q_lora_rank, ("heads", None)),
        ]
    out += [
        _w(path + ("kv_a_proj_with_mqa",), pre, "kv_a_proj_with_mqa", cfg.mla_cache_dim, D, (None, "embed")),
        _norm(path + ("kv_a_layernorm",), f"{pre}.kv_a_layernorm.weight", cfg.kv_lora_rank),
        _w(path + ("kv_b_proj",), pre, "kv_b_proj", H * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank,
           ("heads", None)),
        _w(path + ("g_proj",), pre, "g_proj", H, D, ("heads", "embed")),
        _w(path + ("dense",), pre, "dense", D, H * cfg.v_head_dim, ("embed", "heads")),
    ]
    return out


def _moe(path, pre, cfg):
    D, E, I = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    ex = lambda proj: tuple((f"{pre}.experts.{e}.{proj}.weight", e) for e in range(E))
    return [
        ArrayInfo(path + ("gate_w",), (E, D), (None, "embed"), ((f"{pre}.gate.weight", None),), fan_in=D),
        ArrayInfo(path + ("expert_bias",), (E,), (None,), ((f"{pre}.gate.expert_bias", None),), "expert_bias"),
        ArrayInfo(path + ("w_gate",), (E, I, D), ("expert", "expert_mlp", "embed"), ex("gate_proj"), fan_in=D),
        ArrayInfo(path + ("w_up",), (E, I, D), ("expert", "expert_mlp", "embed"), ex("up_proj"), fan_in=D),
        ArrayInfo(path + ("w_down",), (E, D, I), ("expert", "embed", "expert_mlp"), ex("down_proj"), fan_in=I),
        *_mlp(path + ("shared",), f"{pre}.shared_experts", D, cfg.shared_width, "mlp"),
    ]


def _block(path, i, cfg):
    pre = f"model.layers.{i}"
    D = cfg.hidden_size
    out = [
        _norm(path + ("input_norm",), f"{pre}.input_layernorm.weight", D),
        _norm(path + ("post_norm",), f"{pre}.post_attention_layernorm.weight", D),
    ]
    out += _mla(path + ("attn",), f"{pre}.attention", cfg) if cfg.is_mla(i) else _kda(path + ("attn",), f"{pre}.attention", cfg)
    if cfg.is_moe(i):
        out += _moe(path + ("mlp",), f"{pre}.mlp", cfg)
    else:
        out += _mlp(path + ("mlp",), f"{pre}.mlp", D, cfg.intermediate_size, "mlp")
    return out


def array_spec(cfg: ModelConfig) -> list[ArrayInfo]:
    D, V = cfg.hidden_size, cfg.vocab_size
    spec = [
        ArrayInfo(("embed",), (V, D), ("vocab", "embed"), (("model.word_embeddings.weight", None),), "embedding"),
        _norm(("final_norm",), "model.norm.weight", D),
    ]
    if not cfg.tie_word_embeddings:
        spec.append(ArrayInfo(("lm_head",), (V, D), ("vocab", "embed"), (("lm_head.weight", None),), fan_in=D))
    for i in range(cfg.num_hidden_layers):
        spec += _block(("layers", i), i, cfg)
    for j, i in enumerate(cfg.mtp_layers):
        pre = f"model.layers.{i}"
        spec += [
            _norm(("mtp", j, "enorm"), f"{pre}.enorm.weight", D),
            _norm(("mtp", j, "hnorm"), f"{pre}.hnorm.weight", D),
            _w(("mtp", j, "eh_proj"), pre, "eh_proj", D, 2 * D, (None, "embed")),
            _norm(("mtp", j, "final_norm"), f"{pre}.final_layernorm.weight", D),
        ]
        spec += _block(("mtp", j), i, cfg)
    return spec


def param_spec(cfg: ModelConfig) -> dict[str, HFEntry]:
    """HF tensor name -> HFEntry (its own shape, dtype, logical axes, and where it lands in the pytree)."""
    out = {}
    for a in array_spec(cfg):
        axes = a.axes[1:] if a.hf[0][1] is not None else a.axes
        for name, idx in a.hf:
            out[name] = HFEntry(a.hf_shape, a.dtype, axes, a.path, idx)
    return out


# ---- pytree assembly ---------------------------------------------------------------------------------------


def unflatten(spec: list[ArrayInfo], leaves: list[Any]) -> dict:
    """Build the nested params dict (lists for layer indices) from path-ordered leaves."""
    root: dict = {}
    for a, leaf in zip(spec, leaves):
        node = root
        for key in a.path[:-1]:
            node = node.setdefault(key, {})
        node[a.path[-1]] = leaf

    def fix(node):
        if isinstance(node, dict):
            node = {k: fix(v) for k, v in node.items()}
            if node and all(isinstance(k, int) for k in node):
                return [node[k] for k in sorted(node)]
        return node

    return fix(root)


def get_path(params, path):
    for key in path:
        params = params[key]
    return params


def resolve_dtype(info: ArrayInfo, dtype) -> jnp.dtype:
    return jnp.dtype(jnp.float32) if info.dtype == "float32" else jnp.dtype(dtype)


def check_quantization(quantization: str | None) -> None:
    if quantization not in (None, *quant.QUANTIZATIONS):
        raise ValueError(f"quantization={quantization!r} not in {(None, *quant.QUANTIZATIONS)}")


def is_fp8(a: ArrayInfo, quantization: str | None) -> bool:
    """Whether array `a` is block fp8 under `quantization` (quant.fp8_policy of its first HF tensor)."""
    return quantization == "fp8" and quant.fp8_policy(a.hf[0][0], a.hf_shape)


def abstract_params(cfg: ModelConfig, dtype=jnp.bfloat16, shardings: Callable | None = None,
                    quantization: str | None = None) -> dict:
    """ShapeDtypeStruct pytree (with shardings when `shardings(info)` is given): no device memory.
    quantization="fp8": the arrays quant.fp8_policy picks as quant.Fp8Weight(w8, scale_inv) structs."""
    check_quantization(quantization)
    spec = array_spec(cfg)
    leaves = []
    for a in spec:
        sh = shardings(a) if shardings else None
        leaves.append(quant.abstract(a.shape, sh) if is_fp8(a, quantization)
                      else jax.ShapeDtypeStruct(a.shape, resolve_dtype(a, dtype), sharding=sh))
    return unflatten(spec, leaves)


# ---- random init ----------------------------------------------------------------------------------------------


def _draw(init: str, shape, dtype, fan_in: int, key):
    """Deterministic draws chosen so a random model has O(1) activations and a non-degenerate router."""
    if init == "ones":
        return (1.0 + 0.1 * jax.random.normal(key, shape, jnp.float32)).astype(dtype)
    if init == "a_log":
        return jnp.log(jax.random.uniform(key, shape, jnp.float32, 1.0, 16.0))
    if init == "dt_bias":
        return 0.5 * jax.random.normal(key, shape, jnp.float32)
    if init == "expert_bias":
        return 0.05 * jax.random.normal(key, shape, jnp.float32)
    if init == "embedding":
        return jax.random.normal(key, shape, jnp.float32).astype(dtype)
    if init == "conv":
        return (0.5 * jax.random.normal(key, shape, jnp.float32)).astype(dtype)
    return (jax.random.normal(key, shape, jnp.float32) * fan_in**-0.5).astype(dtype)


def init_program(a: ArrayInfo, dtype, sharding=None, quantization: str | None = None):
    """The jitted `key -> array` that draws `a` (an Fp8Weight drawn directly in fp8 when is_fp8(a))."""
    return _draw_program(a.init, a.shape, resolve_dtype(a, dtype), a.fan_in, sharding, is_fp8(a, quantization))


@functools.lru_cache(maxsize=512)
def _draw_program(init: str, shape: tuple, dt, fan_in, sharding, fp8: bool):
    """One jitted draw per signature for the whole process: a fresh jax.jit per init_params call recompiled its
    20-44 programs every time (~10 s per model on the CI's CPU, in every test module that draws parameters)."""
    if fp8:
        sh = None if sharding is None else quant.Fp8Weight(sharding, sharding)
        return jax.jit(functools.partial(quant.random_fp8, shape=shape, fan_in=fan_in), out_shardings=sh)
    return jax.jit(functools.partial(_draw, init, shape, dt, fan_in), out_shardings=sharding)


@functools.lru_cache(maxsize=512)
def _compiled_draw(init: str, shape: tuple, dt, fan_in, sharding, fp8: bool):
    """_draw_program compiled ahead of time, so the executable is this cache's own: jax.clear_caches() (which the
    test suite runs after every module) drops jit caches, not this, and the next module's init_params compiles
    nothing (a second test-tiny init after clear_caches: 12.7 s -> 0.4 s on a 2-core CPU). At most 512 small
    programs stay alive."""
    return _draw_program(init, shape, dt, fan_in, sharding, fp8).lower(jax.eval_shape(jax.random.key, 0)).compile()


def init_params(cfg: ModelConfig, seed: int = 0, dtype=jnp.bfloat16, shardings: Callable | None = None,
                quantization: str | None = None, progress: Callable | None = None) -> dict:
    """Random parameters drawn on device, each array from its own key (fold_in of a hash of its path), so the
    values depend on neither sharding nor order; each array is born sharded (`shardings(info)`). One small
    program per distinct (init, shape, dtype, sharding): layers repeat, so a 42-layer model compiles ~30.
    quantization="fp8": the arrays quant.fp8_policy picks are drawn directly in fp8 (quant.random_fp8), array by
    array, so the bf16 model never exists (Ling-3.0-flash: 128 GB fp8 on one H200, where bf16 needs 255 GB)."""
    check_quantization(quantization)
    spec = array_spec(cfg)
    base = jax.random.key(seed)
    # under a trace (jax.eval_shape / jit of init_params) the key is a tracer, which an executable cannot take
    draw = _draw_program if isinstance(base, jax.core.Tracer) else _compiled_draw
    programs: dict = {}
    leaves = []
    for n, a in enumerate(spec):
        sh = shardings(a) if shardings else None
        sig = (a.init, a.shape, resolve_dtype(a, dtype), a.fan_in, sh, is_fp8(a, quantization))
        if sig not in programs:
            programs[sig] = draw(*sig)
        salt = zlib.crc32("/".join(map(str, a.path)).encode()) & 0x7FFFFFFF
        leaves.append(programs[sig](jax.random.fold_in(base, salt)))
        if progress:
            progress(n + 1, len(spec))
    return unflatten(spec, leaves)


# ---- HF checkpoints -------------------------------------------------------------------------------------------


_DTYPE_NAMES = {"bfloat16": "BF16", "float32": "F32", "float16": "F16"}


def _checkpoint_dtype(model_dir: str, where: dict) -> np.dtype:
    """The weight dtype config.json declares: `dtype` (transformers >= 4.56) or `torch_dtype` (older); neither:
    the dtype of the stored word embedding. Every "model" tensor must be stored in it."""
    file = os.path.join(model_dir, "config.json")
    try:
        with open(file) as f:
            d = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{file}: cannot read the checkpoint dtype: {e}") from None
    declared = {k: d[k] for k in ("dtype", "torch_dtype") if d.get(k) is not None}
    if len(set(declared.values())) > 1:
        raise CheckpointError(f"{file}: dtype={declared['dtype']!r} disagrees with torch_dtype="
                              f"{declared['torch_dtype']!r}")
    if not declared:
        return where["model.word_embeddings.weight"].header["model.word_embeddings.weight"][0]
    key, name = next(iter(declared.items()))
    if name not in _DTYPE_NAMES:
        raise CheckpointError(f"{file}: {key}={name!r} is not supported (expected one of {sorted(_DTYPE_NAMES)})")
    return DTYPES[_DTYPE_NAMES[name]]


def validate_checkpoint(cfg: ModelConfig, model_dir: str, check_finite: bool = False) -> dict:
    """Check names, shapes and dtypes of every tensor against the spec before reading any data; with
    check_finite, also read every tensor once and reject one holding inf or nan (names it). Returns
    {tensor name: the SafetensorsFile holding it}.

    dtypes: each weight is stored in the checkpoint dtype, or as block fp8 with its scales where config.json's
    quantization_config says so (checked by quant.stored_fp8). A_log, dt_bias and expert_bias are float32 in the
    reference; `model.to(torch.bfloat16).save_pretrained(...)` stores them in the checkpoint dtype instead, so that
    is accepted too and the loader upcasts them to float32 (their values are then the rounded ones)."""
    where = open_checkpoint(model_dir)
    spec = param_spec(cfg)
    fp8 = _stored_fp8(cfg, model_dir, where)
    missing = sorted(set(spec) - set(where))
    extra = sorted(set(where) - set(spec) - {name + quant.SCALE_SUFFIX for name in fp8})
    if missing or extra:
        raise CheckpointError(
            f"{model_dir}: checkpoint does not match {cfg.name}: "
            f"missing {len(missing)} tensor(s) {missing[:5]}, unexpected {len(extra)} tensor(s) {extra[:5]}"
        )
    wdt = _checkpoint_dtype(model_dir, where)
    for name, e in spec.items():
        dt, shape, _ = where[name].header[name]
        if tuple(shape) != tuple(e.shape):
            raise CheckpointError(f"{where[name].path}: tensor {name}: expected shape {e.shape}, found {tuple(shape)}")
        if name in fp8:
            continue
        allowed = (np.dtype(np.float32), wdt) if e.dtype == "float32" else (wdt,)
        if dt not in allowed:
            want = " or ".join(dict.fromkeys(str(a) for a in allowed))
            raise CheckpointError(f"{where[name].path}: tensor {name}: expected dtype {want}, found {dt}")
    if check_finite:
        for name in spec:
            _check_finite(where[name], name)
    return where


# IEEE layout: a value is inf or nan iff all its exponent bits are set (e4m3fn: S.1111.111 is its only NaN).
_EXPONENT_BITS = {np.dtype(np.float32): (np.uint32, 0x7F800000), DTYPES["BF16"]: (np.uint16, 0x7F80),
                  DTYPES["F16"]: (np.uint16, 0x7C00)}


def _check_finite(sf, name: str, chunk: int = 1 << 24) -> None:
    """Raise naming the tensor if it holds inf or nan: an exponent-bits test over the raw memmap, in chunks."""
    t = sf.tensor(name)
    if t.dtype not in _EXPONENT_BITS:
        return  # fp8 weights: their scales (F32) are checked; e4m3fn stores no inf
    uint, mask = _EXPONENT_BITS[t.dtype]
    bits = t.reshape(-1).view(uint)
    bad, first = 0, None
    for start in range(0, bits.size, chunk):
        hits = np.flatnonzero((bits[start : start + chunk] & mask) == mask)
        if hits.size and first is None:
            first = start + int(hits[0])
        bad += hits.size
    if bad:
        at = tuple(int(i) for i in np.unravel_index(first, t.shape))
        raise CheckpointError(f"{sf.path}: tensor {name}: expected finite values, found {bad} inf/nan "
                              f"(first at index {at}: {t[at]})")


def _stored_fp8(cfg: ModelConfig, model_dir: str, where: dict) -> set[str]:
    """HF names stored as block fp8 (each checked against config.json's quantization_config)."""
    with open(os.path.join(model_dir, "config.json")) as f:
        qcfg = quant.read_quantization_config(json.load(f), f"{model_dir}/config.json")
    return quant.stored_fp8(param_spec(cfg), where, qcfg, model_dir)


def fp8_activations_note(model: str, quantization: str | None, fp8_activations: str) -> str:
    """One line for the log: which activation numerics the run's fp8 weights take (Numerics.fp8_activations).
    An fp8 checkpoint's activation_scheme "dynamic" permits quantising activations per token (SGLang / vLLM serve it
    w8a8); the default here stays "none" (weight-only) until the GPU timing of both decides."""
    config = os.path.join(model, "config.json")
    scheme = None
    if os.path.isdir(model) and os.path.exists(config):
        with open(config) as f:
            q = json.load(f).get("quantization_config")
        scheme = None if q is None else q.get("activation_scheme", "dynamic")
    if scheme is None and quantization is None:
        return (f"fp8 activations: {fp8_activations} (no fp8 weights: bf16 linears never quantise their input, "
                "so this changes nothing)")
    source = (f"fp8 checkpoint, activation_scheme {scheme!r}" if scheme is not None
              else "weights quantised to fp8 while loading")
    what = ("each fp8 GEMM's input quantised per token and 128 columns (w8a8, as SGLang serves the format)"
            if fp8_activations == "dynamic" else
            "weight-only fp8, bf16 activations (the default; --fp8-activations dynamic quantises them)")
    return f"fp8 activations: {fp8_activations} ({source}): {what}"


def _reader(where: dict, a: ArrayInfo, shape: tuple[int, ...], dt, suffix: str = ""):
    """The callback that reads array `a` (or its `suffix` companion, e.g. fp8 scales, of `shape`) for one index."""
    stacked = a.hf[0][1] is not None

    def read(index):
        index = tuple(index) + (slice(None),) * (len(shape) - len(tuple(index)))
        if not stacked:
            name = a.hf[0][0] + suffix
            return np.asarray(where[name].tensor(name)[index], dtype=dt)
        parts = range(*index[0].indices(shape[0]))
        out = None
        for j, i in enumerate(parts):  # one host buffer: each stacked part is copied (and cast) into its row
            row = where[a.hf[i][0] + suffix].tensor(a.hf[i][0] + suffix)[index[1:]]
            if out is None:
                out = np.empty((len(parts), *row.shape), dt)
            out[j] = row
        return out

    return read


def load_hf_checkpoint(cfg: ModelConfig, model_dir: str, dtype=jnp.bfloat16, shardings: Callable | None = None,
                       progress: Callable | None = None, quantization: str | None = None) -> dict:
    """Load an HF checkpoint dir into the params pytree. Each device reads only its own slice of each tensor
    (jax.make_array_from_callback over numpy memmaps). Weights are cast to `dtype`; A_log, dt_bias and expert_bias
    become float32 whatever they are stored in (a bf16 save stores them in bf16: upcast, see validate_checkpoint).
    Weights the checkpoint stores as block fp8 load as quant.Fp8Weight; quantization="fp8" also quantises the
    bf16 ones quant.fp8_policy picks, array by array.

    Streamed: the model never exists on the host. Each array is read from the memmaps into one host buffer
    (stacked experts: ~1 GB fp8 for a Ling MoE layer), put on its device(s), and dropped; before the next array
    is read the previous one's transfer is waited for, so at most two arrays' host buffers are alive at once."""
    check_quantization(quantization)
    where = validate_checkpoint(cfg, model_dir)
    fp8 = _stored_fp8(cfg, model_dir, where)
    spec = array_spec(cfg)

    def place(a, shape, read):
        if shardings is None:
            return jnp.asarray(read(()))
        return jax.make_array_from_callback(shape, shardings(a), read)

    leaves = []
    for n, a in enumerate(spec):
        if leaves:  # the previous array's transfer is done: its host buffer can go
            jax.block_until_ready(leaves[-1])
        names = [name for name, _ in a.hf]
        stored = [name in fp8 for name in names]
        if any(stored) and not all(stored):
            raise CheckpointError(f"{model_dir}: tensor {names[stored.index(False)]} is not fp8 but "
                                  f"{names[stored.index(True)]} is: the parts of one stacked array must agree")
        if all(stored):
            leaf = quant.Fp8Weight(place(a, a.shape, _reader(where, a, a.shape, quant.FP8)),
                                   place(a, quant.scale_shape(a.shape),
                                         _reader(where, a, quant.scale_shape(a.shape), np.float32, quant.SCALE_SUFFIX)))
        else:
            leaf = place(a, a.shape, _reader(where, a, a.shape, resolve_dtype(a, dtype)))
            if quantization == "fp8" and quant.fp8_policy(names[0], a.hf_shape):
                leaf = quant.quantize(leaf)
        leaves.append(leaf)
        if progress:
            progress(n + 1, len(spec))
    return unflatten(spec, leaves)


def quantize_params(cfg: ModelConfig, params: dict) -> dict:
    """Every array quant.fp8_policy picks (and not already fp8) as block fp8; the rest unchanged."""
    spec = array_spec(cfg)
    leaves = []
    for a in spec:
        leaf = get_path(params, a.path)
        if quant.fp8_policy(a.hf[0][0], a.hf_shape) and not isinstance(leaf, quant.Fp8Weight):
            leaf = quant.quantize(leaf)
        leaves.append(leaf)
    return unflatten(spec, leaves)


def save_hf_checkpoint(cfg: ModelConfig, params: dict, out_dir: str, max_shard_bytes: int = 2**31) -> None:
    """Write params as an HF-layout checkpoint (config.json + safetensors, sharded with an index when large)."""
    os.makedirs(out_dir, exist_ok=True)
    tensors: dict[str, np.ndarray] = {}
    model_dtype, not_converted, n_fp8 = None, set(), 0
    for a in array_spec(cfg):
        leaf = jax.device_get(get_path(params, a.path))
        parts = [(leaf.w8, ""), (leaf.scale_inv, quant.SCALE_SUFFIX)] if isinstance(leaf, quant.Fp8Weight) else [(leaf, "")]
        n_fp8 += len(parts) == 2
        for arr, suffix in parts:
            arr = np.asarray(arr)
            if a.dtype == "model" and not suffix and len(parts) == 1:
                model_dtype = arr.dtype
            for name, idx in a.hf:
                tensors[name + suffix] = arr if idx is None else arr[idx]
                if len(parts) == 1 and quant.can_be_fp8(name, a.hf_shape):
                    not_converted.add(quant.module_name(name))
    d = to_hf_dict(cfg)
    if str(model_dtype) not in _DTYPE_NAMES:
        raise ValueError(f"weights are {model_dtype}: a checkpoint stores one of {sorted(_DTYPE_NAMES)}")
    # transformers >= 4.56 reads `dtype`, older versions `torch_dtype`: write both (numpy's names are torch's)
    d["dtype"] = d["torch_dtype"] = str(model_dtype)
    if n_fp8:
        d["quantization_config"] = quant.quantization_config(not_converted)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(d, f, indent=1)
    shards, cur, size = [], {}, 0
    for name, arr in tensors.items():
        if cur and size + arr.nbytes > max_shard_bytes:
            shards.append(cur)
            cur, size = {}, 0
        cur[name] = arr
        size += arr.nbytes
    shards.append(cur)
    if len(shards) == 1:
        save_file(shards[0], os.path.join(out_dir, "model.safetensors"), {"format": "pt"})
        return
    weight_map = {}
    for k, shard in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(out_dir, fname), {"format": "pt"})
        weight_map.update({name: fname for name in shard})
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": sum(t.nbytes for t in tensors.values())}, "weight_map": weight_map}, f)


# ---- orbax -------------------------------------------------------------------------------------------------------


def save_orbax(params: dict, path: str) -> None:
    import orbax.checkpoint as ocp

    ckpt = ocp.StandardCheckpointer()
    ckpt.save(os.path.abspath(path), params, force=True)
    ckpt.wait_until_finished()


def restore_orbax(cfg: ModelConfig, path: str, dtype=jnp.bfloat16, shardings: Callable | None = None) -> dict:
    import orbax.checkpoint as ocp

    target = abstract_params(cfg, dtype, shardings)
    if shardings is None:  # restore onto the default device
        dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        target = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=dev), target)
    return ocp.StandardCheckpointer().restore(os.path.abspath(path), target)


def load_params(cfg: ModelConfig, model: str, *, dtype=jnp.bfloat16, seed: int = 0, shardings=None, progress=None,
                quantization: str | None = None):
    """A preset name -> random init (seeded); a directory -> its HF checkpoint (CheckpointError when it does not
    match cfg or cannot be read). quantization="fp8": the weights quant.fp8_policy picks as block fp8 (a
    checkpoint's fp8 tensors load as fp8 either way; a preset's fp8 arrays are drawn in fp8, see init_params)."""
    check_quantization(quantization)
    if os.path.isdir(model):
        return load_hf_checkpoint(cfg, model, dtype, shardings, progress, quantization)
    return init_params(cfg, seed, dtype, shardings, quantization, progress)


def count(cfg: ModelConfig) -> int:
    return sum(int(np.prod(e.shape)) for e in param_spec(cfg).values())


__all__ = [
    "ArrayInfo", "HFEntry", "array_spec", "param_spec", "init_params", "abstract_params", "load_hf_checkpoint",
    "save_hf_checkpoint", "validate_checkpoint", "quantize_params", "save_orbax", "restore_orbax", "load_params", "CheckpointError",
]
