"""Oracle tests for the torch reference (tests/reference/bailing_torch.py) against independent code:
fla-core's naive KDA recurrence and gate, transformers' DeepSeek-V3 router and MLA attention; plus checkpoint
round trips. CPU only, small shapes.
"""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch

from tests.reference import bailing_torch as ref
from tests.reference.checkpoint import load_reference, read_tensors, tiny_config, write_random_checkpoint

with warnings.catch_warnings():  # fla warns that triton is unavailable and falls back to CPU
    warnings.simplefilter("ignore")
    from fla.ops.kda.gate import naive_kda_lowerbound_gate
    from fla.ops.kda.naive import naive_recurrent_kda
from transformers.models.deepseek_v3.configuration_deepseek_v3 import DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (DeepseekV3Attention, DeepseekV3RotaryEmbedding,
                                                                  DeepseekV3TopkRouter)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


# ---------------------------------------------------------------------------------------------------------------
# KDA vs fla-core 0.6.0


def _kda_inputs(B, T, H, K, V, seed):
    gen = torch.Generator().manual_seed(seed)
    q = ref.l2norm(torch.randn(B, T, H, K, generator=gen))
    k = ref.l2norm(torch.randn(B, T, H, K, generator=gen))
    v = torch.randn(B, T, H, V, generator=gen)
    f = torch.randn(B, T, H, K, generator=gen)
    A_log = torch.log(1 + 15 * torch.rand(H, generator=gen))
    dt_bias = 0.5 * torch.randn(H * K, generator=gen)
    beta = torch.rand(B, T, H, generator=gen)
    S0 = 0.3 * torch.randn(B, H, K, V, generator=gen)
    return q, k, v, f, A_log, dt_bias, beta, S0


@pytest.mark.parametrize("B,T,H,K,V,seed,with_state", [
    (1, 17, 2, 16, 16, 0, False), (2, 33, 3, 32, 16, 1, True), (1, 64, 4, 8, 24, 2, True)])
def test_kda_recurrence_matches_fla_naive(B, T, H, K, V, seed, with_state):
    q, k, v, f, A_log, dt_bias, beta, S0 = _kda_inputs(B, T, H, K, V, seed)
    g = ref.kda_gate(f, A_log, dt_bias, -5.0)
    S0 = S0 if with_state else None
    o, S = ref.kda_recurrence(q, k, v, g, beta, scale=K ** -0.5, initial_state=S0)
    o_fla, S_fla = naive_recurrent_kda(q, k, v, g, beta, scale=K ** -0.5, initial_state=S0,
                                       output_final_state=True)
    assert o.shape == o_fla.shape == (B, T, H, V) and S.shape == S_fla.shape == (B, H, K, V)
    assert rel_err(o, o_fla) <= 1e-5, rel_err(o, o_fla)
    assert rel_err(S, S_fla) <= 1e-5, rel_err(S, S_fla)
    # fla's default scale (scale=None) is K^-0.5, the scale the model uses.
    o_def, _ = naive_recurrent_kda(q, k, v, g, beta, initial_state=S0)
    assert rel_err(o, o_def) <= 1e-5


@pytest.mark.parametrize("shape,seed", [((1, 5, 2, 16), 0), ((2, 7, 4, 8), 1), ((3, 4, 1, 32), 2)])
def test_kda_gate_matches_fla_naive(shape, seed):
    B, T, H, K = shape
    _, _, _, f, A_log, dt_bias, _, _ = _kda_inputs(B, T, H, K, K, seed)
    g = ref.kda_gate(f.bfloat16(), A_log, dt_bias, -5.0)
    g_fla = naive_kda_lowerbound_gate(f.bfloat16(), A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0)
    assert g.dtype == g_fla.dtype == torch.float32
    assert rel_err(g, g_fla) <= 1e-6, rel_err(g, g_fla)
    assert bool((g <= 0).all() and (g >= -5.0).all())  # open interval, but fp32 saturates at the ends


# ---------------------------------------------------------------------------------------------------------------
# Router vs transformers DeepseekV3TopkRouter


@pytest.mark.parametrize("E,G,TG,A,norm,scale,dtype,seed", [
    (16, 4, 2, 4, True, 2.5, torch.float32, 0),
    (64, 8, 4, 8, True, 2.5, torch.bfloat16, 1),
    (32, 1, 1, 6, False, 1.0, torch.float32, 2),
    (128, 8, 3, 8, True, 1.7, torch.bfloat16, 3)])
def test_router_matches_deepseek_v3(E, G, TG, A, norm, scale, dtype, seed):
    C, N = 32, 96
    cfg = ref.BailingConfigRef.from_dict(tiny_config(
        hidden_size=C, num_experts=E, n_group=G, topk_group=TG, num_experts_per_tok=A, norm_topk_prob=norm,
        routed_scaling_factor=scale))
    gen = torch.Generator().manual_seed(seed)
    router = ref.Router(cfg, dtype)
    with torch.no_grad():
        router.weight.copy_(torch.randn(E, C, generator=gen) / math.sqrt(C))
        router.expert_bias.copy_(0.1 * torch.randn(E, generator=gen))
    x = torch.randn(N, C, generator=gen).to(dtype)
    ids, w = router(x)

    hf_cfg = DeepseekV3Config(hidden_size=C, n_routed_experts=E, num_experts_per_tok=A, n_group=G, topk_group=TG,
                              norm_topk_prob=norm, routed_scaling_factor=scale)
    hf = DeepseekV3TopkRouter(hf_cfg)
    with torch.no_grad():
        hf.weight.copy_(router.weight.float())
        hf.e_score_correction_bias.copy_(router.expert_bias)
        _, w_hf, ids_hf = hf(x)
    # HF returns unsorted top-k: compare as sets, weights aligned by expert id.
    ids_s, order = ids.sort(-1)
    ids_hf_s, order_hf = ids_hf.sort(-1)
    assert torch.equal(ids_s, ids_hf_s)
    err = (w.gather(1, order) - w_hf.gather(1, order_hf)).abs().max().item()
    assert err <= 1e-6, err
    if norm:
        torch.testing.assert_close(w.sum(-1), torch.full((N,), scale), rtol=1e-5, atol=1e-5)


def test_router_bias_selects_but_does_not_weight():
    cfg = ref.BailingConfigRef.from_dict(tiny_config(num_experts=8, n_group=1, topk_group=1, num_experts_per_tok=2,
                                                     norm_topk_prob=False, routed_scaling_factor=1.0))
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0, -2.0, -3.0, -4.0]])
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 2.0])
    ids, w = ref.route(logits, bias, cfg)
    assert sorted(ids[0].tolist()) == [0, 7]  # expert 7 chosen through its bias
    torch.testing.assert_close(w[0].sort().values, torch.sigmoid(torch.tensor([-4.0, 3.0])))


# ---------------------------------------------------------------------------------------------------------------
# MLA vs transformers DeepseekV3Attention (interleaved RoPE, no output gate: compare before the gate)


@pytest.mark.parametrize("q_lora_rank,T,seed,start,theta", [
    (None, 9, 0, 3, 1e4), (24, 16, 1, 200_000, 6e6), (None, 5, 2, 70_000, 1e4)])
def test_mla_matches_deepseek_v3_attention(q_lora_rank, T, seed, start, theta):
    d = tiny_config(q_lora_rank=q_lora_rank, rope_theta=theta)
    cfg = ref.BailingConfigRef.from_dict(d)
    gen = torch.Generator().manual_seed(seed)
    mla = ref.MLAAttention(cfg, torch.float32)
    with torch.no_grad():
        for name, p in mla.named_parameters():
            init = 1 + 0.1 * torch.randn(p.shape, generator=gen) if "layernorm" in name else \
                torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1])
            p.copy_(init)
    B, C, H = 2, cfg.hidden_size, cfg.num_attention_heads
    x = torch.randn(B, T, C, generator=gen)
    positions = torch.arange(T) + start  # absolute positions (fp32 angles, as HF)
    o = mla.attend(x, positions)  # [B, T, H, Dv]

    hf_cfg = DeepseekV3Config(
        hidden_size=C, num_attention_heads=H, num_key_value_heads=H, q_lora_rank=q_lora_rank,
        kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim, qk_rope_head_dim=cfg.qk_rope_head_dim,
        v_head_dim=cfg.v_head_dim, rope_interleave=True, max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta}, rms_norm_eps=1e-6)
    hf_cfg._attn_implementation = "eager"
    hf = DeepseekV3Attention(hf_cfg, layer_idx=0)
    W_o = torch.randn(C, H * cfg.v_head_dim, generator=gen) / math.sqrt(H * cfg.v_head_dim)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(W_o if name == "o_proj.weight" else mla.get_parameter(name))
        cos, sin = DeepseekV3RotaryEmbedding(hf_cfg)(x, positions[None])
        mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
        out_hf, _ = hf(x, (cos, sin), mask)
    out = ref.linear(o.reshape(B, T, -1), W_o)
    assert rel_err(out, out_hf) <= 1e-5, rel_err(out, out_hf)


def test_rope_is_relative():
    """q.k after RoPE depends only on the position difference (checks the pair layout and inv_freq)."""
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 1, 1, 8, generator=gen), torch.randn(1, 1, 1, 8, generator=gen)
    dots = []
    for p in (0, 5, 1000):
        qr = ref.apply_rope_interleaved(q, torch.tensor([p + 7]), 6e6)
        kr = ref.apply_rope_interleaved(k, torch.tensor([p]), 6e6)
        dots.append((qr * kr).sum().item())
    assert max(dots) - min(dots) < 1e-4, dots
    # pair 0 rotates by pos * theta^0 = pos radians
    x = torch.tensor([1.0, 0, 0, 0, 0, 0, 0, 0]).view(1, 1, 1, 8)
    y = ref.apply_rope_interleaved(x, torch.tensor([1]), 6e6).flatten()
    torch.testing.assert_close(y[:2], torch.tensor([math.cos(1.0), math.sin(1.0)]))


def test_short_conv_matches_decode_steps():
    """Batched causal conv == the decode recurrence with a [C, W-1] state of the last inputs."""
    gen = torch.Generator().manual_seed(0)
    C, W, T = 12, 4, 9
    x, w = torch.randn(1, T, C, generator=gen), torch.randn(C, 1, W, generator=gen)
    y = ref.causal_short_conv(x, w)
    state = torch.zeros(C, W - 1)
    for t in range(T):
        cat = torch.cat([state, x[0, t, :, None]], dim=1)  # [C, W]
        torch.testing.assert_close(y[0, t], torch.nn.functional.silu((w[:, 0] * cat).sum(-1)))
        state = cat[:, 1:]


# ---------------------------------------------------------------------------------------------------------------
# Layer pattern, clamps, checkpoints, whole model


def test_layer_pattern():
    flash = ref.BailingConfigRef.from_dict(tiny_config(num_hidden_layers=42, layer_group_size=6,
                                                       first_k_dense_replace=2, expert_swiglu_limit_list=None,
                                                       share_expert_swiglu_limit_list=None))
    assert [i for i in range(43) if flash.is_mla(i)] == [5, 11, 17, 23, 29, 35, 41, 42]
    assert [i for i in range(43) if not flash.is_moe(i)] == [0, 1]
    tiny = ref.BailingConfigRef.from_dict(tiny_config())
    assert [tiny.is_mla(i) for i in range(5)] == [False, False, True, True, True]
    with pytest.raises(ValueError, match="rotary dim"):
        ref.BailingConfigRef.from_dict(tiny_config(partial_rotary_factor=0.25))


def test_swiglu_clamps_follow_config_switch():
    """The clamp as SGLang deploys it (limit after the SiLU), with limits read the SGLang way from the lists."""
    gen = torch.Generator().manual_seed(0)
    x = 3 * torch.randn(5, 16, generator=gen)
    outs = {}
    for limit in (0.5, 0.0):
        m = ref.SwiGLU(16, 8, torch.float32, limit=limit)
        with torch.no_grad():
            for p in m.parameters():
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
        outs[limit] = m(x)
    gate = ref.linear(x, m.gate_proj.weight)
    up = ref.linear(x, m.up_proj.weight)
    silu = torch.nn.functional.silu
    torch.testing.assert_close(outs[0.5], ref.linear(silu(gate).clamp(max=0.5) * up.clamp(-0.5, 0.5),
                                                     m.down_proj.weight))
    old = ref.linear(silu(gate.clamp(max=0.5)) * up.clamp(-0.5, 0.5), m.down_proj.weight)  # clamp before the SiLU
    assert not torch.allclose(outs[0.5], old) and not torch.allclose(outs[0.5], outs[0.0])
    on = ref.BailingConfigRef.from_dict(tiny_config())
    off = ref.BailingConfigRef.from_dict(tiny_config(apply_swiglu_clamps=False))
    assert (on.routed_limit(3), on.shared_limit(4), off.routed_limit(3), off.shared_limit(4)) == (1.0, 2.0, 0, 0)
    short = ref.BailingConfigRef.from_dict(tiny_config(expert_swiglu_limit_list=[0, 0, 0, 3.0]))
    assert (short.routed_limit(3), short.routed_limit(4)) == (3.0, 0.0)  # past the end of the list: no clamp


@pytest.mark.parametrize("dtype,shards,tie", [(torch.float32, 1, False), (torch.bfloat16, 3, False),
                                              (torch.float32, 2, True)])
def test_checkpoint_round_trip(tmp_path, dtype, shards, tie):
    d = tiny_config(tie_word_embeddings=tie)
    m = write_random_checkpoint(d, tmp_path / "a", seed=7, dtype=dtype, shards=shards)
    files = sorted(p.name for p in (tmp_path / "a").iterdir())
    if shards == 1:
        assert files == ["config.json", "model.safetensors"]
    else:
        assert "model.safetensors.index.json" in files and f"model-0000{shards}-of-0000{shards}.safetensors" in files
        index = json.loads((tmp_path / "a" / "model.safetensors.index.json").read_text())
        assert set(index["weight_map"]) == set(m.state_dict()) - ({"lm_head.weight"} if tie else set())
    config = json.loads((tmp_path / "a" / "config.json").read_text())
    assert config["model_type"] == "bailing_hybrid" and config["architectures"] == ["BailingMoeV3ForCausalLM"]
    tensors = read_tensors(tmp_path / "a")
    assert tensors["model.layers.0.attention.A_log"].dtype == torch.float32
    assert tensors["model.layers.1.mlp.gate.expert_bias"].dtype == torch.float32
    assert tensors["model.layers.1.mlp.gate.weight"].dtype == dtype
    assert tensors["model.layers.0.attention.q_conv1d.weight"].shape == (64, 1, 4)
    assert "model.layers.4.eh_proj.weight" in tensors and "model.layers.2.attention.kv_b_proj.weight" in tensors

    m2 = load_reference(tmp_path / "a")
    assert m2.dtype == dtype
    for name, t in m.state_dict().items():
        assert torch.equal(t, m2.state_dict()[name]), name
    ids = torch.randint(0, d["vocab_size"], (2, 11), generator=torch.Generator().manual_seed(0))
    out, out2, out3 = m(ids), m2(ids), m2(ids)
    assert out["logits"].dtype == torch.float32 and out["logits"].shape == (2, 11, d["vocab_size"])
    assert out["hidden"].shape == (2, 11, d["hidden_size"]) and out["hidden"].dtype == dtype
    assert torch.equal(out["logits"], out2["logits"]) and torch.equal(out2["logits"], out3["logits"])
    assert torch.isfinite(out["logits"]).all() and 0.3 < out["logits"].std().item() < 10
    mtp = m2.mtp_forward(ids[:, 1:], out["hidden"][:, :-1])
    assert mtp.shape == (2, 10, d["vocab_size"]) and torch.isfinite(mtp).all()

    if shards != 1:
        return
    # same seed -> same bytes; other seed -> other weights
    m_same = write_random_checkpoint(d, tmp_path / "b", seed=7, dtype=dtype, shards=1)
    assert all(torch.equal(t, m_same.state_dict()[n]) for n, t in m.state_dict().items())
    m_other = write_random_checkpoint(d, tmp_path / "c", seed=8, dtype=dtype, shards=1)
    assert not torch.equal(m.lm_head.weight, m_other.lm_head.weight)


def test_load_is_strict(tmp_path):
    from safetensors.torch import save_file
    write_random_checkpoint(tiny_config(), tmp_path, seed=0, dtype=torch.float32)
    tensors = read_tensors(tmp_path)
    tensors.pop("model.layers.0.attention.dt_bias")
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(KeyError, match="dt_bias"):
        load_reference(tmp_path)
    tensors["model.layers.0.attention.dt_bias"] = torch.zeros(64)
    tensors["model.layers.0.attention.extra.weight"] = torch.zeros(3)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(KeyError, match="extra"):
        load_reference(tmp_path)


def test_bf16_model_tracks_fp32(tmp_path):
    """Same (bf16-representable) weights run in bf16 and fp32: logits agree to bf16 precision."""
    d = tiny_config(q_lora_rank=16)
    write_random_checkpoint(d, tmp_path, seed=3, dtype=torch.bfloat16)
    m16, m32 = load_reference(tmp_path), load_reference(tmp_path, dtype=torch.float32)
    ids = torch.randint(0, d["vocab_size"], (1, 13), generator=torch.Generator().manual_seed(1))
    o16, o32 = m16(ids), m32(ids)
    assert rel_err(o16["logits"], o32["logits"]) < 5e-2
    assert rel_err(m16.mtp_forward(ids, o16["hidden"]), m32.mtp_forward(ids, o32["hidden"])) < 5e-2


def test_forward_is_causal(tmp_path):
    """Changing the last token changes only the last position (KDA conv/recurrence and MLA are causal)."""
    d = tiny_config()
    m = write_random_checkpoint(d, tmp_path, seed=5, dtype=torch.float32)
    ids = torch.randint(0, d["vocab_size"], (1, 10), generator=torch.Generator().manual_seed(2))
    ids2 = ids.clone()
    ids2[0, -1] = (ids[0, -1] + 1) % d["vocab_size"]
    a, b = m(ids)["logits"], m(ids2)["logits"]
    # not bitwise: the per-expert token batches differ, so BLAS may block the matmuls differently
    torch.testing.assert_close(a[:, :-1], b[:, :-1], rtol=1e-5, atol=1e-5)
    assert (a[:, -1] - b[:, -1]).abs().max() > 1e-2
