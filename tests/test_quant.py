"""Block fp8 (ling_jax/quant.py): the quantisation against a numpy loop over blocks, the DeepSeek-V3 checkpoint
layout both ways, every mismatch error, and the model on fp8 weights."""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from ling_jax import quant
from ling_jax.config import get_preset
from ling_jax.layers.moe import dense_mlp
from ling_jax.layers.norms import rms_norm
from ling_jax.model import forward, lm_logits
from ling_jax.quant import Fp8Weight
from ling_jax.safetensors_io import CheckpointError, SafetensorsFile, save_file
from ling_jax.state import init_state
from ling_jax.weights import init_params, param_spec, load_hf_checkpoint, load_params, quantize_params, \
    save_hf_checkpoint
from tests.conftest import rel_err

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)


def blockwise_oracle(w: np.ndarray):
    """Independent statement of the math: a Python loop over 128 x 128 blocks (ragged at the edges)."""
    n, k = w.shape
    nn, nk = -(-n // 128), -(-k // 128)
    w8, s = np.zeros((n, k), E4M3), np.zeros((nn, nk), np.float32)
    for i in range(nn):
        for j in range(nk):
            blk = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128].astype(np.float32)
            s[i, j] = np.abs(blk).max() / np.float32(448.0)
            if s[i, j] > 0:
                w8[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] = (blk / s[i, j]).astype(E4M3)
    return w8, s


def test_quantize_matches_blockwise_oracle_on_ragged_shape():
    w = np.array(jax.random.normal(jax.random.key(0), (200, 300), jnp.float32) * 0.05)
    w[128:, 256:] = 0.0                                     # one all-zero (ragged) block
    w[:128, :128] *= 40.0                                   # blocks with very different ranges
    w = w.astype(ml_dtypes.bfloat16)                        # a bf16 checkpoint's weight
    q = quant.quantize(jnp.asarray(w))
    want8, want_s = blockwise_oracle(w)
    assert q.w8.dtype == jnp.float8_e4m3fn and q.w8.shape == (200, 300)
    assert q.scale_inv.dtype == jnp.float32 and q.scale_inv.shape == (2, 3) == quant.scale_shape((200, 300))
    # XLA:CPU divides through a reciprocal (1 ulp off IEEE): scales to 1 ulp, w8 equal but for rare ties
    np.testing.assert_allclose(np.asarray(q.scale_inv), want_s, rtol=2.5e-7)
    got8, want8 = np.asarray(q.w8, np.float32), want8.astype(np.float32)
    assert np.mean(got8 != want8) < 1e-3 and np.all(np.abs(got8 - want8) <= np.abs(want8) * 2.0**-3)
    assert want_s[1, 2] == 0 and np.all(np.asarray(q.w8, np.float32)[128:, 256:] == 0)
    deq = np.asarray(quant.dequantize(q, jnp.float32))
    assert np.all(deq[128:, 256:] == 0) and np.all(np.isfinite(deq))
    # e4m3 keeps 3 mantissa bits: each element within half an ulp (2^-4 relative) or the subnormal step
    scale = np.repeat(np.repeat(want_s, 128, 0), 128, 1)[:200, :300]
    w = w.astype(np.float32)
    assert np.all(np.abs(deq - w) <= np.maximum(np.abs(w) * 2.0**-4, scale * 2.0**-9) * 1.001)
    assert np.abs(np.asarray(q.w8, np.float32)).max() == 448.0


def test_leading_axes_quantise_each_matrix_alone():
    w = jax.random.normal(jax.random.key(1), (3, 96, 256), jnp.float32) * jnp.array([1.0, 10.0, 0.01])[:, None, None]
    q = quant.quantize(w)
    assert q.scale_inv.shape == (3, 1, 2)
    for e in range(3):
        one = quant.quantize(w[e])
        np.testing.assert_array_equal(np.asarray(q.scale_inv[e]), np.asarray(one.scale_inv))
        np.testing.assert_array_equal(np.asarray(q.w8[e], np.float32), np.asarray(one.w8, np.float32))
    picked = quant.take(q, jnp.array([2, 0]))
    np.testing.assert_array_equal(np.asarray(quant.dense(picked, jnp.float32)),
                                  np.asarray(quant.dequantize(q, jnp.float32))[[2, 0]])
    assert quant.dense(w, jnp.bfloat16) is w                # dense weights pass through untouched


def test_activations_quantise_per_row_and_128_column_group():
    """quantize_activations: a Python loop over each row's 128-column groups (ragged last group, an all-zero
    group) as the oracle; fake_quantize_activations is the dequantised round trip in x's dtype."""
    x = np.array(jax.random.normal(jax.random.key(2), (3, 300), jnp.float32))
    x[0, :128] *= 100.0                                     # groups with very different ranges
    x[1, 128:256] = 0.0                                     # an all-zero group
    x = x.astype(ml_dtypes.bfloat16)
    q = quant.quantize_activations(jnp.asarray(x))
    assert q.x8.dtype == jnp.float8_e4m3fn and q.x8.shape == (3, 300) and q.scale.shape == (3, 3)
    for t in range(3):
        for g in range(3):
            grp = x[t, g * 128:(g + 1) * 128].astype(np.float32)
            want_s = np.abs(grp).max() / np.float32(448.0)
            np.testing.assert_allclose(np.asarray(q.scale[t, g]), want_s, rtol=2.5e-7)
            got8 = np.asarray(q.x8[t, g * 128:(g + 1) * 128], np.float32)
            want8 = (grp / want_s).astype(E4M3).astype(np.float32) if want_s > 0 else np.zeros_like(grp)
            assert np.mean(got8 != want8) < 2e-2 and np.all(np.abs(got8 - want8) <= np.abs(want8) * 2.0**-3)
    assert np.all(np.asarray(q.x8, np.float32)[1, 128:256] == 0) and float(q.scale[1, 1]) == 0.0
    fq = quant.fake_quantize_activations(jnp.asarray(x))
    assert fq.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(fq), np.asarray(quant.dequantize_activations(q, jnp.bfloat16)))
    xf, fqf = x.astype(np.float32), np.asarray(fq, np.float32)
    scale = np.repeat(np.asarray(q.scale), 128, axis=1)[:, :300]
    assert np.all(np.abs(fqf - xf) <= np.maximum(np.abs(xf) * 2.0**-4, scale * 2.0**-9) * 1.01)


def test_fake_quantize_keeps_its_rounding_when_xla_simplifies_fp_conversions():
    """The e4m3 round trip inside one jit survives XLA's SimplifyFPConversions (the H200 compiler runs it under the
    default xla_allow_excess_precision: f32 -> e4m3 -> f32 became f32, and the kernels' "quantised" references
    were the unquantised math). XLA:CPU runs the same pass with its oneDNN custom-call option: the bare chain
    loses the rounding there (the control), quant's round trip keeps it, bit for bit the plain compile's."""
    x = jax.random.normal(jax.random.key(3), (4, 256), jnp.float32)
    # the GPU's default excess precision (tests/conftest.py turns it off for the suite) and the pass
    simplify = {"xla_allow_excess_precision": True, "xla_cpu_experimental_onednn_custom_call": True}

    def bare(a):  # the chain as quant wrote it before the barrier
        q = quant.quantize_activations(a)
        return q.x8.astype(jnp.float32) * jnp.repeat(q.scale, 128, axis=-1)

    bare_out = jax.jit(bare).lower(x).compile(compiler_options=simplify)(x)
    assert float(jnp.max(jnp.abs(bare_out - x))) < 1e-5      # the pass is on: the rounding is gone
    plain = jax.jit(quant.fake_quantize_activations)(x)
    assert float(jnp.max(jnp.abs(plain - x))) > 1e-2         # e4m3 keeps 3 mantissa bits
    kept = jax.jit(quant.fake_quantize_activations).lower(x).compile(compiler_options=simplify)(x)
    np.testing.assert_array_equal(np.asarray(kept), np.asarray(plain))


def test_quantize_activations_sees_its_input_rounded_to_its_dtype():
    """An x made in the same jit (a norm's f32 math rounded to bf16) is quantised as the bf16 x it is: under
    xla_allow_excess_precision (the GPU default) XLA would skip that rounding, and e4m3 turns the difference into
    whole e4m3 steps (~1/16 of them flip). The oracle: the same bf16 x materialised by a jit of its own."""
    k = jax.random.split(jax.random.key(4), 2)
    a = (3 * jax.random.normal(k[0], (6, 512), jnp.float32)).astype(jnp.bfloat16)
    w = (1 + 0.1 * jax.random.normal(k[1], (512,), jnp.float32)).astype(jnp.bfloat16)
    make_x = lambda a, w: rms_norm(a, w, 1e-6)                   # the model's norm: a bf16 product w * normed
    fused = jax.jit(lambda a, w: quant.quantize_activations(make_x(a, w))).lower(a, w).compile(
        compiler_options={"xla_allow_excess_precision": True})(a, w)
    split = quant.quantize_activations(jax.jit(make_x)(a, w))
    np.testing.assert_array_equal(np.asarray(fused.x8, np.float32), np.asarray(split.x8, np.float32))
    np.testing.assert_array_equal(np.asarray(fused.scale), np.asarray(split.scale))


def test_policy_follows_deepseek_skip_list():
    spec = param_spec(get_preset("test-tiny"))
    picked = {n for n, e in spec.items() if quant.fp8_policy(n, e.shape)}
    for n in ("lm_head.weight", "model.word_embeddings.weight", "model.layers.1.mlp.gate.weight",
              "model.layers.6.eh_proj.weight", "model.norm.weight", "model.layers.0.attention.q_conv1d.weight",
              "model.layers.1.mlp.gate.expert_bias", "model.layers.0.attention.A_log"):
        assert n in spec and n not in picked, n
    for n in ("model.layers.2.attention.kv_b_proj.weight", "model.layers.0.attention.q_proj.weight",
              "model.layers.0.attention.b_proj.weight", "model.layers.1.mlp.experts.7.down_proj.weight",
              "model.layers.1.mlp.shared_experts.down_proj.weight", "model.layers.0.mlp.up_proj.weight",
              "model.layers.6.attention.dense.weight"):
        assert n in picked, n


@pytest.fixture(scope="module")
def tiny():
    cfg = get_preset("test-tiny")
    return cfg, init_params(cfg, 3, jnp.bfloat16)


@pytest.fixture(scope="module")
def fp8_ckpt(tiny, tmp_path_factory):
    cfg, params = tiny
    d = str(tmp_path_factory.mktemp("fp8"))
    save_hf_checkpoint(cfg, quantize_params(cfg, params), d)
    return d


def test_checkpoint_layout_and_round_trip(tiny, fp8_ckpt):
    cfg, params = tiny
    conf = json.load(open(os.path.join(fp8_ckpt, "config.json")))["quantization_config"]
    assert conf["quant_method"] == "fp8" and conf["fmt"] == "e4m3" and conf["weight_block_size"] == [128, 128]
    assert conf["activation_scheme"] == "dynamic"
    assert {"lm_head", "model.layers.1.mlp.gate", "model.layers.6.eh_proj"} <= set(conf["modules_to_not_convert"])
    sf = SafetensorsFile(os.path.join(fp8_ckpt, "model.safetensors"))
    raw = json.loads(open(sf.path, "rb").read(8 + int.from_bytes(open(sf.path, "rb").read(8), "little"))[8:])
    w = "model.layers.1.mlp.experts.5.down_proj.weight"    # [D=128, I=48]: one ragged block
    assert raw[w]["dtype"] == "F8_E4M3" and raw[w]["shape"] == [128, 48]
    assert raw[w + "_scale_inv"]["dtype"] == "F32" and raw[w + "_scale_inv"]["shape"] == [1, 1]
    assert raw["model.layers.0.attention.q_proj.weight_scale_inv"]["shape"] == [1, 1]
    assert raw["model.layers.2.attention.kv_b_proj.weight_scale_inv"]["shape"] == [2, 1]   # [256, 64]
    for name in ("lm_head.weight", "model.word_embeddings.weight", "model.layers.1.mlp.gate.weight"):
        assert raw[name]["dtype"] == "BF16" and name + "_scale_inv" not in raw
    back = load_hf_checkpoint(cfg, fp8_ckpt)
    want = quantize_params(cfg, params)
    assert isinstance(back["layers"][1]["mlp"]["w_down"], Fp8Weight)
    assert back["layers"][1]["mlp"]["w_down"].scale_inv.shape == (16, 1, 1)
    eq = lambda a, b: np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    jax.tree.map(eq, back, want)
    assert jax.tree.structure(back) == jax.tree.structure(want)


def test_quantization_flag_quantises_bf16_checkpoint_while_loading(tiny, tmp_path):
    cfg, params = tiny
    save_hf_checkpoint(cfg, params, str(tmp_path))
    got = load_params(cfg, str(tmp_path), quantization="fp8")
    want = quantize_params(cfg, params)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32)),
                 got, want)
    with pytest.raises(ValueError, match="quantization='int4'"):
        load_params(cfg, str(tmp_path), quantization="int4")


def _variant(src, dst, tensors=None, config=None):
    shutil.copytree(src, dst)
    path = os.path.join(dst, "model.safetensors")
    if tensors:
        sf = SafetensorsFile(path)
        t = {n: np.array(sf.tensor(n)) for n in sf.header}
        tensors(t)
        save_file(t, path)
    if config:
        c = json.load(open(os.path.join(dst, "config.json")))
        config(c)
        json.dump(c, open(os.path.join(dst, "config.json"), "w"))
    return str(dst)


Q = "model.layers.0.attention.q_proj.weight"
EXPERT = "model.layers.1.mlp.experts.3.up_proj.weight"
ERRORS = [
    ("unconverted", None, lambda c: c["quantization_config"]["modules_to_not_convert"].append(Q[:-7]),
     rf"{Q} is F8_E4M3 but quantization_config lists 'model.layers.0.attention.q_proj' in modules_to_not_convert"),
    ("no-scale", lambda t: t.pop(Q + "_scale_inv"), None, rf"{Q} is F8_E4M3 but its scales {Q}_scale_inv are missing"),
    ("scale-shape", lambda t: t.__setitem__(Q + "_scale_inv", np.ones((2, 1), np.float32)), None,
     rf"{Q}_scale_inv: expected float32 \(1, 1\), found float32 \(2, 1\)"),
    ("no-config", None, lambda c: c.pop("quantization_config"), rf"{Q} is F8_E4M3 but config.json has no quantization_config"),
    ("stray-scale", lambda t: t.__setitem__("lm_head.weight_scale_inv", np.ones((4, 1), np.float32)), None,
     r"lm_head.weight_scale_inv scales tensor lm_head.weight, which is not F8_E4M3"),
    ("one-expert", lambda t: (t.__setitem__(EXPERT, t[EXPERT].astype(np.float32).astype(ml_dtypes.bfloat16)),
                              t.pop(EXPERT + "_scale_inv")), None,
     rf"tensor {EXPERT} is not fp8 but model.layers.1.mlp.experts.0.up_proj.weight is"),
    ("method", None, lambda c: c["quantization_config"].__setitem__("quant_method", "awq"), r"quant_method='awq'"),
    ("block", None, lambda c: c["quantization_config"].__setitem__("weight_block_size", [1, 128]),
     r"weight_block_size=\[1, 128\]: only \[128, 128\]"),
    ("static", None, lambda c: c["quantization_config"].__setitem__("activation_scheme", "static"),
     r"activation_scheme='static'"),
]


@pytest.mark.parametrize("label,tensors,config,match", ERRORS, ids=[e[0] for e in ERRORS])
def test_mismatch_is_a_clear_error(tiny, fp8_ckpt, tmp_path, label, tensors, config, match):
    cfg, _ = tiny
    d = _variant(fp8_ckpt, tmp_path / label, tensors, config)
    with pytest.raises(CheckpointError, match=match):
        load_hf_checkpoint(cfg, d)


def test_model_runs_on_fp8_weights(tiny):
    """Verify-mode logits (every layer kind; MTP excluded) with fp8 weights equal those of the same weights
    dequantised up front: every use site dequantises (an einsum on an Fp8Weight would fail)."""
    cfg, params = tiny
    q = quantize_params(cfg, params)
    deq = jax.tree.map(lambda w: quant.dense(w, jnp.bfloat16), q, is_leaf=lambda w: isinstance(w, Fp8Weight))
    tokens = jax.random.randint(jax.random.key(4), (1, 6), 0, cfg.vocab_size)
    state = init_state(cfg, 1, 32, jnp.bfloat16)
    run = jax.jit(lambda p: lm_logits(p, forward(p, tokens, state, cfg, mode="verify").hidden))
    got, want, bf16 = run(q), run(deq), run(params)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert rel_err(got, bf16) > 1e-3                       # the fp8 weights were used, not the bf16 ones
    # one layer: fp8 rounding (3 mantissa bits) costs a few percent (a random 6-layer model amplifies it)
    x = jax.random.normal(jax.random.key(5), (6, cfg.hidden_size), jnp.bfloat16)
    mlp = lambda p: dense_mlp(p["layers"][0]["mlp"], x)
    assert 5e-3 < rel_err(mlp(q), mlp(params)) < 0.06


def test_quantization_flags_parse():
    from ling_jax import generate
    from serve import launch_server

    a = generate.build_parser().parse_args(["--model", "m", "--prompt-ids", "1", "--quantization", "fp8"])
    assert a.quantization == "fp8"
    assert launch_server.build_parser().parse_args(["--model-path", "m", "--quantization", "fp8"]).quantization == "fp8"
    with pytest.raises(SystemExit):
        generate.build_parser().parse_args(["--model", "m", "--prompt-ids", "1", "--quantization", "int4"])
