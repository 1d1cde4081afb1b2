"""The whole model in fp8 on one device (issue 12, item 3): random init drawn directly in fp8 array by array, the
streamed checkpoint loader against an independent eager read of every file, the memory plan and the
step floor's fp8 bytes, and the bench's dry run."""

import json
import os
import subprocess
import sys

import jax
import jax.extend
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from ling_jax import memory, quant
from ling_jax.config import get_preset
from ling_jax.weights import abstract_params, array_spec, get_path, init_params, load_hf_checkpoint, \
    quantize_params, save_hf_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
is_fp8_leaf = lambda x: isinstance(x, quant.Fp8Weight)


@pytest.fixture(scope="module")
def tiny():
    cfg = get_preset("test-tiny")
    return cfg, init_params(cfg, 3, jnp.bfloat16)


def test_fp8_init_has_the_quantised_tree_and_the_bf16_init_statistics():
    cfg = get_preset("test-tiny")
    got = init_params(cfg, 3, jnp.bfloat16, quantization="fp8")
    # the tree `--quantization fp8` makes of a bf16 model (abstract: nothing is drawn or quantised)
    want = jax.eval_shape(lambda p: quantize_params(cfg, p), abstract_params(cfg, jnp.bfloat16))
    assert jax.tree.structure(got) == jax.tree.structure(want)
    spec = jax.tree.leaves(abstract_params(cfg, jnp.bfloat16, quantization="fp8"))
    for g, w, s in zip(jax.tree.leaves(got), jax.tree.leaves(want), spec, strict=True):
        assert (g.shape, g.dtype) == (w.shape, w.dtype) == (s.shape, s.dtype)
    n_fp8 = 0
    for a in array_spec(cfg):
        g = get_path(got, a.path)
        if not is_fp8_leaf(g):
            continue
        n_fp8 += 1
        *_, n, k = a.shape
        u = np.repeat(np.repeat(np.asarray(g.scale_inv), 128, -2), 128, -1)[..., :n, :k]  # each block's scale
        w = np.asarray(g.w8, np.float32) * u
        assert np.all(np.isfinite(w)), a.path
        # the bf16 draw's spread (normal init: std fan_in^-1/2) times the blocks' random scale factors U(0.8, 1.2)
        want_std = a.fan_in**-0.5 * np.sqrt(np.mean((u * quant.RANDOM_SPAN * a.fan_in**0.5) ** 2))
        assert abs(w.std() / want_std - 1) < 0.15, a.path
    assert n_fp8 == sum(isinstance(get_path(want, a.path), quant.Fp8Weight) for a in array_spec(cfg)) > 10


def test_random_fp8_draws_stacked_experts_without_a_full_size_f32_array():
    shape, fan_in = (40, 128, 256), 256  # 40 > RANDOM_ROWS_PER_DRAW: drawn in batches of 32 experts
    draw = jax.jit(lambda k: quant.random_fp8(k, shape, fan_in))
    q = draw(jax.random.key(1))
    assert q.w8.dtype == jnp.float8_e4m3fn and q.w8.shape == shape
    assert q.scale_inv.dtype == jnp.float32 and q.scale_inv.shape == (40, 1, 2)
    s = np.asarray(q.scale_inv) * quant.RANDOM_SPAN * fan_in**0.5
    assert s.min() >= 0.8 - 1e-6 and s.max() <= 1.2 + 1e-6 and s.std() > 0.05  # the scales differ by block
    w = np.asarray(quant.dequantize(q, jnp.float32))
    assert abs(w.std() * fan_in**0.5 - 1) < 0.05 and np.all(np.isfinite(w))
    assert not np.array_equal(w[0], w[33])  # experts of different batches differ
    np.testing.assert_array_equal(np.asarray(draw(jax.random.key(1)).w8, np.float32), np.asarray(q.w8, np.float32))
    # no f32 intermediate as large as the array: the draw happens 32 experts at a time
    jaxpr = jax.make_jaxpr(lambda k: quant.random_fp8(k, shape, fan_in))(jax.random.key(1))
    sizes = []

    def walk(jx):
        for eqn in jx.eqns:
            sizes.extend(int(np.prod(v.aval.shape)) for v in eqn.outvars
                         if getattr(v.aval, "dtype", None) == jnp.float32)
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jaxpr.jaxpr)
    assert max(sizes) <= 32 * 128 * 256 < np.prod(shape)


_ST_DTYPES = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "BF16": ml_dtypes.bfloat16, "F32": np.float32}


def read_whole_file(path) -> dict:
    """The independent oracle: a safetensors file read whole into numpy (u64 header length, JSON header, data)."""
    raw = open(path, "rb").read()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    header.pop("__metadata__", None)
    out = {}
    for name, h in header.items():
        lo, hi = h["data_offsets"]
        out[name] = np.frombuffer(raw[8 + n + lo:8 + n + hi], _ST_DTYPES[h["dtype"]]).reshape(h["shape"])
    return out


def test_streamed_loader_equals_an_eager_read_of_every_shard(tiny, tmp_path):
    cfg, params = tiny
    d = str(tmp_path)
    save_hf_checkpoint(cfg, quantize_params(cfg, params), d, max_shard_bytes=200_000)  # several shards
    shards = sorted(f for f in os.listdir(d) if f.endswith(".safetensors"))
    assert len(shards) > 3
    eager = {}
    for f in shards:
        eager.update(read_whole_file(os.path.join(d, f)))
    seen = []
    got = load_hf_checkpoint(cfg, d, progress=lambda i, n: seen.append((i, n)))
    assert seen[-1] == (len(array_spec(cfg)),) * 2
    bits = lambda x: np.asarray(x).view(np.uint8)
    for a in array_spec(cfg):
        leaf = get_path(got, a.path)
        parts = [(leaf.w8, ""), (leaf.scale_inv, quant.SCALE_SUFFIX)] if is_fp8_leaf(leaf) else [(leaf, "")]
        for arr, suffix in parts:
            names = [n + suffix for n, _ in a.hf]
            want = eager[names[0]] if a.hf[0][1] is None else np.stack([eager[n] for n in names])
            if a.dtype == "float32":
                want = want.astype(np.float32)
            assert arr.dtype == want.dtype and arr.shape == want.shape, (a.path, suffix)
            np.testing.assert_array_equal(bits(arr), bits(want), err_msg=str(a.path))
    assert isinstance(got["layers"][1]["mlp"]["w_gate"], quant.Fp8Weight)
    assert eager["model.layers.1.mlp.experts.0.gate_proj.weight"].dtype == np.dtype(ml_dtypes.float8_e4m3fn)


def test_memory_plan_of_ling_flash_in_fp8():
    cfg = get_preset("ling3-flash")
    fp8, bf16 = memory.weight_bytes(cfg, jnp.bfloat16, "fp8"), memory.weight_bytes(cfg, jnp.bfloat16)
    # inclusionAI/Ling-3.0-flash-fp8 is 128.4 GB (LING3_MODEL.md); the bf16 model 255 GB
    assert abs(sum(fp8.values()) / 1e9 - 128.4) < 0.1 and abs(sum(bf16.values()) / 1e9 - 255) < 1
    assert fp8["bfloat16"] == 2 * 2 * 157184 * 2560 + fp8["bfloat16"] % (2 * 157184 * 2560)  # embed + lm_head bf16
    assert fp8["fp8 scales"] * 128 * 128 / 4 == pytest.approx(fp8["fp8"], rel=0.01)
    one_h200 = int(0.95 * 139 * 2**30)
    assert memory.default_context_length(cfg, jnp.bfloat16, 2048, device_bytes=one_h200, quantization="fp8",
                                         fraction=0.97) >= 8192
    with pytest.raises(ValueError, match="room for 0 context slots"):
        memory.default_context_length(cfg, jnp.bfloat16, 2048, device_bytes=one_h200)  # bf16 does not fit


def test_step_floor_counts_fp8_bytes():
    from bench.bench_step import byte_model
    from compile.mesh import make_mesh
    from compile.sharding import ShardingRules

    cfg = get_preset("ling3-flash")
    mesh, rules = make_mesh(1), ShardingRules.tensor_parallel()
    g8, e8 = byte_model(cfg, mesh, rules, "fp8")
    g16, e16 = byte_model(cfg, mesh, rules)
    D, I = cfg.hidden_size, cfg.moe_intermediate_size
    assert e16 == 3 * I * D * 2
    assert e8 == 3 * I * D + 4 * (2 * 6 * 20 + 20 * 6)  # w8 + one expert's f32 block scales (768 = 6 x 128)
    assert g8["lm_head"] == g16["lm_head"] == 157184 * 2560 * 2  # lm_head stays bf16
    assert g8["layer2"] < 0.55 * g16["layer2"]  # attention, router (bf16), shared expert of a MoE layer


def test_bench_dry_run_prints_the_plan():
    out = subprocess.run([sys.executable, "-m", "bench.bench_step", "--preset", "test-tiny", "--quantization", "fp8",
                          "--tp", "1", "--ctx", "64", "--steps", "2", "--dry-run", "--no-init-compile"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    for text in ("weights", "fp8 scales", "headroom", "random init:", "traced plain0", "traced nextn2",
                 "layers/2   MLA + MoE"):
        assert text in out.stdout, (text, out.stdout[-2000:])
