"""Independent PyTorch (CPU) reference of BailingMoeV3 (Ling-3.0), the oracle the JAX model is tested against.

Written from the HF remote-code `modeling_bailing_moe_v3.py` semantics (facts summarised in ling_jax/layers/*.py docstrings).
Parameter names match the HF checkpoint exactly (prefix `model.`), so `state_dict()` IS the checkpoint.

Precision policy (mirrors HF): projections run in the weight dtype (bf16 or fp32); RMSNorm, RoPE, softmax, the
KDA gate / beta / recurrence / output gate, the router and the expert combine run in fp32.

Shape legend:
  B batch, T tokens, C hidden size, H heads, D KDA head dim (K = V = D), N = B*T flattened tokens,
  Dn / Dr / Dv MLA nope / rope / value head dims, R kv_lora_rank, E experts, A activated experts per token,
  G expert groups.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

FP32_PARAM_SUFFIXES = ("attention.A_log", "attention.dt_bias", "mlp.gate.expert_bias")


@dataclasses.dataclass(frozen=True)
class BailingConfigRef:
    """Architecture hyper-parameters, built from an HF `config.json` dict (HF key names)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    partial_rotary_factor: float
    layer_group_size: int
    first_k_dense_replace: int
    num_experts: int
    num_experts_per_tok: int
    num_shared_experts: int
    moe_intermediate_size: int
    moe_shared_expert_intermediate_size: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    short_conv_kernel_size: int = 4
    kda_lower_bound: float = -5.0
    num_nextn_predict_layers: int = 0
    tie_word_embeddings: bool = False
    # SwiGLU clamp limits, SGLang's keys and reading: entry i limits layer i (MTP layers continue the count);
    # 0, null or past the end of the list = no clamp. HF's remote code ignores them (apply_swiglu_clamps=False).
    expert_swiglu_limit_list: tuple[float, ...] | None = None  # routed experts
    share_expert_swiglu_limit_list: tuple[float, ...] | None = None  # the shared expert
    apply_swiglu_clamps: bool = True

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "BailingConfigRef":
        names = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in d.items() if k in names}
        for key, v in (d.get("rope_parameters") or {}).items():  # transformers >= 5 may keep rope_theta only here
            if key in ("rope_theta", "partial_rotary_factor"):
                kw.setdefault(key, v)
        for key in ("expert_swiglu_limit_list", "share_expert_swiglu_limit_list"):
            if kw.get(key) is not None:
                kw[key] = tuple(float(x or 0.0) for x in kw[key])
        return cls(**kw)

    def __post_init__(self):
        if self.rope_dim != self.qk_rope_head_dim:
            raise ValueError(f"rotary dim int(head_dim {self.head_dim} * partial_rotary_factor "
                             f"{self.partial_rotary_factor}) = {self.rope_dim} != qk_rope_head_dim "
                             f"{self.qk_rope_head_dim}")
        if self.num_experts % self.n_group:
            raise ValueError(f"num_experts {self.num_experts} not divisible by n_group {self.n_group}")

    @property
    def rope_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def num_total_layers(self) -> int:
        return self.num_hidden_layers + self.num_nextn_predict_layers

    def is_mla(self, i: int) -> bool:
        g = self.layer_group_size
        return (i + 1) % g == 0 or i >= (self.num_hidden_layers // g) * g

    def is_moe(self, i: int) -> bool:
        return i >= self.first_k_dense_replace

    def routed_limit(self, i: int) -> float:
        return self._limit(self.expert_swiglu_limit_list, i)

    def shared_limit(self, i: int) -> float:
        return self._limit(self.share_expert_swiglu_limit_list, i)

    def _limit(self, limits: tuple[float, ...] | None, i: int) -> float:
        if not self.apply_swiglu_clamps or limits is None or i >= len(limits):
            return 0.0
        return float(limits[i])


# ----------------------------------------------------------------------------------------------------------------
# Small pieces


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w^T in the weight dtype."""
    return F.linear(x.to(w.dtype), w)


class RMSNorm(nn.Module):
    """w * (x_f32 * rsqrt(mean(x^2) + eps)).to(dtype); weight used as is."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * y.to(self.weight.dtype)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last dim, in fp32."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def apply_rope_interleaved(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate pairs (2i, 2i+1) of the last dim by pos * theta^(-2i/Dr), in fp32, cast back.

    x: [B, T, ..., Dr]; positions: [T]. Angles in fp32 exactly as HF computes them. Pairs stay in place (HF's interleave variant permutes the output into
    [evens | odds] order, identically for q and k, so q.k is the same).
    """
    dr = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, dr, 2, dtype=torch.float32) / dr))  # [Dr/2], fp32 like HF
    ang = positions.float()[:, None] * inv_freq[None, :]  # [T, Dr/2]; fp32 angles (HF) lose ~1e-2 rad by 2^18
    cos, sin = torch.cos(ang), torch.sin(ang)
    shape = (1, x.shape[1]) + (1,) * (x.dim() - 3) + (dr // 2,)
    cos, sin = cos.view(shape), sin.view(shape)
    xf = x.float()
    x0, x1 = xf[..., 0::2], xf[..., 1::2]
    y0 = x0 * cos - x1 * sin
    y1 = x0 * sin + x1 * cos
    return torch.stack([y0, y1], dim=-1).flatten(-2).to(x.dtype)


def causal_short_conv(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Depthwise causal conv + SiLU: y_t[c] = silu(sum_j w[c, 0, j] x_{t-W+1+j}[c]), left zero pad W-1.

    x: [B, T, C]; w: [C, 1, W]. Accumulates in fp32, returns x.dtype.
    """
    W = w.shape[-1]
    xt = F.pad(x.float().transpose(1, 2), (W - 1, 0))  # [B, C, T+W-1]
    y = F.conv1d(xt, w.float(), groups=w.shape[0])  # [B, C, T]
    return F.silu(y).transpose(1, 2).to(x.dtype)


def kda_gate(f: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float) -> torch.Tensor:
    """g = lower_bound * sigmoid(exp(A_log[h]) * (f + dt_bias[h, :])) in fp32.

    f: [..., H, D]; A_log: [H]; dt_bias: [H*D]. Returns [..., H, D] fp32 in (lower_bound, 0).
    """
    H, D = f.shape[-2:]
    z = f.float() + dt_bias.float().view(H, D)
    return lower_bound * torch.sigmoid(A_log.float().exp().view(H, 1) * z)


def kda_recurrence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   scale: float, initial_state: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated delta rule with per-channel decay, a plain loop over T, all in fp32.

    q, k, g: [B, T, H, K]; v: [B, T, H, V]; beta: [B, T, H]; initial_state: [B, H, K, V] or None (zeros).
    Returns o [B, T, H, V] fp32 and the final state S [B, H, K, V] fp32.
      S <- diag(exp g_t) S
      S <- S + beta_t k_t (v_t - S^T k_t)^T
      o_t = S^T (scale q_t)
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    S = torch.zeros(B, H, K, V) if initial_state is None else initial_state.float().clone()
    o = torch.empty(B, T, H, V)
    for t in range(T):
        S = S * g[:, t].exp()[..., None]  # [B, H, K, V]
        pred = torch.einsum("bhk,bhkv->bhv", k[:, t], S)  # S^T k
        S = S + torch.einsum("bhk,bhv->bhkv", beta[:, t, :, None] * k[:, t], v[:, t] - pred)
        o[:, t] = torch.einsum("bhk,bhkv->bhv", q[:, t] * scale, S)
    return o, S


# ----------------------------------------------------------------------------------------------------------------
# Attention


class KDAAttention(nn.Module):
    """Kimi delta attention with lower-bounded sigmoid gate (weights under `layers.i.attention.*`)."""

    def __init__(self, cfg: BailingConfigRef, dtype: torch.dtype):
        super().__init__()
        C, H, D, W = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.short_conv_kernel_size
        self.H, self.D, self.lower_bound, self.eps = H, D, cfg.kda_lower_bound, cfg.rms_norm_eps
        for name, out in (("q", H * D), ("k", H * D), ("v", H * D), ("f", H * D), ("g", H * D), ("b", H)):
            setattr(self, f"{name}_proj", nn.Linear(C, out, bias=False, dtype=dtype))
        for name in ("q", "k", "v"):
            setattr(self, f"{name}_conv1d", nn.Conv1d(H * D, H * D, W, groups=H * D, bias=False, dtype=dtype))
        self.o_proj = nn.Linear(H * D, C, bias=False, dtype=dtype)
        self.A_log = nn.Parameter(torch.empty(H, dtype=torch.float32))
        self.dt_bias = nn.Parameter(torch.empty(H * D, dtype=torch.float32))
        self.o_norm = RMSNorm(D, self.eps, dtype)  # HF: FusedRMSNormGated(eps=config.rms_norm_eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        H, D = self.H, self.D
        q = causal_short_conv(linear(x, self.q_proj.weight), self.q_conv1d.weight).view(B, T, H, D)
        k = causal_short_conv(linear(x, self.k_proj.weight), self.k_conv1d.weight).view(B, T, H, D)
        v = causal_short_conv(linear(x, self.v_proj.weight), self.v_conv1d.weight).view(B, T, H, D)
        q, k = l2norm(q).to(x.dtype), l2norm(k).to(x.dtype)  # fla's l2norm returns the input dtype
        f = linear(x, self.f_proj.weight).view(B, T, H, D)
        g = kda_gate(f, self.A_log, self.dt_bias, self.lower_bound)  # [B, T, H, D] fp32
        beta = torch.sigmoid(linear(x, self.b_proj.weight).float())  # [B, T, H]
        o, _ = kda_recurrence(q, k, v, g, beta, scale=D ** -0.5)  # [B, T, H, D] fp32
        o = o.to(x.dtype).float()  # the recurrent kernel returns v.dtype
        # gated RMSNorm, fp32: RMSNorm_D(o) * o_norm.weight * sigmoid(g_proj(x))
        gate = torch.sigmoid(linear(x, self.g_proj.weight).float()).view(B, T, H, D)
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + self.eps) * self.o_norm.weight.float() * gate
        return linear(o.to(x.dtype).reshape(B, T, H * D), self.o_proj.weight)


class MLAAttention(nn.Module):
    """Gated multi-head latent attention (full, un-absorbed form), causal over the given T positions."""

    def __init__(self, cfg: BailingConfigRef, dtype: torch.dtype):
        super().__init__()
        C, H = cfg.hidden_size, cfg.num_attention_heads
        self.cfg, self.H = cfg, H
        Dq = cfg.qk_head_dim
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(C, H * Dq, bias=False, dtype=dtype)
        else:
            self.q_a_proj = nn.Linear(C, cfg.q_lora_rank, bias=False, dtype=dtype)
            # the latent norms keep HF's BailingMoeV3RMSNorm default eps 1e-6, whatever rms_norm_eps says
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, 1e-6, dtype)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, H * Dq, bias=False, dtype=dtype)
        self.kv_a_proj_with_mqa = nn.Linear(C, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=False, dtype=dtype)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, 1e-6, dtype)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, H * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False,
                                   dtype=dtype)
        self.g_proj = nn.Linear(C, H, bias=False, dtype=dtype)
        self.dense = nn.Linear(H * cfg.v_head_dim, C, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        o = self.attend(x, positions)  # [B, T, H, Dv]
        gate = torch.sigmoid(linear(x, self.g_proj.weight).float())  # [B, T, H] fp32, head-wise
        o = (o.float() * gate[..., None]).to(x.dtype)
        return linear(o.reshape(B, T, -1), self.dense.weight)

    def attend(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Causal MLA before the output gate: x [B, T, C] -> o [B, T, H, Dv]."""
        cfg, H = self.cfg, self.H
        B, T, _ = x.shape
        Dn, Dr, Dv, R = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        if cfg.q_lora_rank is None:
            q = linear(x, self.q_proj.weight)
        else:
            q = linear(self.q_a_layernorm(linear(x, self.q_a_proj.weight)), self.q_b_proj.weight)
        q = q.view(B, T, H, Dn + Dr)
        q_nope, q_rope = q[..., :Dn], q[..., Dn:]  # [B, T, H, Dn], [B, T, H, Dr]
        c = linear(x, self.kv_a_proj_with_mqa.weight)  # [B, T, R + Dr]
        latent = self.kv_a_layernorm(c[..., :R])  # [B, T, R]
        k_rope = c[..., R:].unsqueeze(2)  # [B, T, 1, Dr], shared by all heads
        kv = linear(latent, self.kv_b_proj.weight).view(B, T, H, Dn + Dv)
        k_nope, v = kv[..., :Dn], kv[..., Dn:]  # [B, T, H, Dn], [B, T, H, Dv]
        q_rope = apply_rope_interleaved(q_rope, positions, cfg.rope_theta)
        k_rope = apply_rope_interleaved(k_rope, positions, cfg.rope_theta)
        qh = torch.cat([q_nope, q_rope], -1).transpose(1, 2)  # [B, H, T, Dn+Dr]
        kh = torch.cat([k_nope, k_rope.expand(B, T, H, Dr)], -1).transpose(1, 2)  # [B, H, T, Dn+Dr]
        vh = v.transpose(1, 2)  # [B, H, T, Dv]
        scores = (qh @ kh.transpose(-1, -2)).float() / math.sqrt(Dn + Dr)  # [B, H, T, T]
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        p = torch.softmax(scores, dim=-1).to(vh.dtype)
        return (p @ vh).transpose(1, 2)  # [B, T, H, Dv]


# ----------------------------------------------------------------------------------------------------------------
# Feed-forward


class SwiGLU(nn.Module):
    """down(act(gate(x), up(x))); `limit` > 0 clamps as SGLang deploys Ling-3.0 (`_swiglu_silu_clamp_mul`, routed
    and shared experts alike): min(silu(gate), L) * clip(up, -L, L), the limit after the SiLU."""

    def __init__(self, hidden: int, inter: int, dtype: torch.dtype, limit: float = 0.0):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False, dtype=dtype)
        self.up_proj = nn.Linear(hidden, inter, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(inter, hidden, bias=False, dtype=dtype)
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = linear(x, self.gate_proj.weight), linear(x, self.up_proj.weight)
        L = self.limit
        if L > 0:  # min(silu(gate), L) * clip(up, ±L)
            h = F.silu(gate).clamp(max=L) * up.clamp(-L, L)
        else:
            h = F.silu(gate) * up
        return linear(h, self.down_proj.weight)


class Router(nn.Module):
    """DeepSeek-V3 noaux_tc router: sigmoid scores, expert_bias for selection only, group-limited top-k."""

    def __init__(self, cfg: BailingConfigRef, dtype: torch.dtype):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size, dtype=dtype))
        self.expert_bias = nn.Parameter(torch.empty(cfg.num_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [N, C] -> (ids [N, A] int64, weights [N, A] fp32)."""
        return route(x.float() @ self.weight.float().T, self.expert_bias, self.cfg)


def route(logits: torch.Tensor, expert_bias: torch.Tensor, cfg: BailingConfigRef
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [N, E] fp32 -> (ids [N, A], weights [N, A] fp32)."""
    N, E = logits.shape
    G, A = cfg.n_group, cfg.num_experts_per_tok
    s = torch.sigmoid(logits.float())  # [N, E]
    sb = s + expert_bias.float()  # biased scores: selection only
    group_score = sb.view(N, G, E // G).topk(2, dim=-1).values.sum(-1)  # [N, G]
    keep = group_score.topk(cfg.topk_group, dim=-1).indices  # [N, topk_group]
    group_mask = torch.zeros(N, G, dtype=torch.bool).scatter_(1, keep, True)
    expert_mask = group_mask[:, :, None].expand(N, G, E // G).reshape(N, E)
    ids = sb.masked_fill(~expert_mask, float("-inf")).topk(A, dim=-1).indices  # [N, A]
    w = s.gather(1, ids)  # unbiased scores
    if cfg.norm_topk_prob:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return ids, w * cfg.routed_scaling_factor


class MoE(nn.Module):
    def __init__(self, cfg: BailingConfigRef, layer: int, dtype: torch.dtype):
        super().__init__()
        C = cfg.hidden_size
        self.gate = Router(cfg, dtype)
        self.experts = nn.ModuleList(
            SwiGLU(C, cfg.moe_intermediate_size, dtype, cfg.routed_limit(layer))
            for _ in range(cfg.num_experts))
        self.shared_experts = None
        if cfg.num_shared_experts > 0:
            self.shared_experts = SwiGLU(C, cfg.moe_shared_expert_intermediate_size * cfg.num_shared_experts,
                                         dtype, cfg.shared_limit(layer))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        xf = x.reshape(-1, shape[-1])  # [N, C]
        ids, w = self.gate(xf)  # [N, A], [N, A]
        y = torch.zeros(xf.shape, dtype=torch.float32)  # routed sum in fp32
        for e in ids.unique().tolist():
            tok, slot = (ids == e).nonzero(as_tuple=True)
            y.index_add_(0, tok, self.experts[e](xf[tok]).float() * w[tok, slot, None])
        if self.shared_experts is not None:
            y = y + self.shared_experts(xf).float()  # shared expert is not scaled
        return y.to(x.dtype).view(shape)


# ----------------------------------------------------------------------------------------------------------------
# Blocks and model


class DecoderLayer(nn.Module):
    def __init__(self, cfg: BailingConfigRef, layer: int, dtype: torch.dtype):
        super().__init__()
        C = cfg.hidden_size
        self.input_layernorm = RMSNorm(C, cfg.rms_norm_eps, dtype)
        self.attention = MLAAttention(cfg, dtype) if cfg.is_mla(layer) else KDAAttention(cfg, dtype)
        self.post_attention_layernorm = RMSNorm(C, cfg.rms_norm_eps, dtype)
        self.mlp = MoE(cfg, layer, dtype) if cfg.is_moe(layer) else SwiGLU(C, cfg.intermediate_size, dtype)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.input_layernorm(x), positions)
        return x + self.mlp(self.post_attention_layernorm(x))


class MTPLayer(DecoderLayer):
    """NEXTN head block: enorm/hnorm/eh_proj in front of a decoder block, final_layernorm after."""

    def __init__(self, cfg: BailingConfigRef, layer: int, dtype: torch.dtype):
        super().__init__(cfg, layer, dtype)
        C = cfg.hidden_size
        self.enorm = RMSNorm(C, cfg.rms_norm_eps, dtype)
        self.hnorm = RMSNorm(C, cfg.rms_norm_eps, dtype)
        self.eh_proj = nn.Linear(2 * C, C, bias=False, dtype=dtype)
        self.final_layernorm = RMSNorm(C, cfg.rms_norm_eps, dtype)


class BailingInner(nn.Module):
    def __init__(self, cfg: BailingConfigRef, dtype: torch.dtype):
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(
            [DecoderLayer(cfg, i, dtype) for i in range(cfg.num_hidden_layers)]
            + [MTPLayer(cfg, i, dtype) for i in range(cfg.num_hidden_layers, cfg.num_total_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)


class BailingMoeV3Ref(nn.Module):
    """The whole model; `state_dict()` keys are the HF checkpoint names."""

    def __init__(self, cfg: BailingConfigRef, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.cfg, self.dtype = cfg, dtype
        self.model = BailingInner(cfg, dtype)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.word_embeddings.weight

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """input_ids [B, T] -> {logits [B, T, V] fp32, hidden [B, T, C] (after the final norm)}, empty state."""
        assert input_ids.dim() == 2, input_ids.shape
        T = input_ids.shape[1]
        positions = torch.arange(T) if positions is None else positions
        x = self.model.word_embeddings(input_ids)  # [B, T, C]
        for layer in self.model.layers[: self.cfg.num_hidden_layers]:
            x = layer(x, positions)
        hidden = self.model.norm(x)
        return {"logits": linear(hidden, self.lm_head.weight).float(), "hidden": hidden}

    @torch.no_grad()
    def mtp_forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor | None = None,
                    layer: int = 0) -> torch.Tensor:
        """NEXTN head. Row t pairs token input_ids[:, t] (= tok_{t+1}) with target hidden state hidden[:, t].

        input_ids [B, T], hidden [B, T, C] (target, after final norm) -> logits [B, T, V] fp32.
        """
        assert input_ids.shape == hidden.shape[:2], (input_ids.shape, hidden.shape)
        T = input_ids.shape[1]
        positions = torch.arange(T) if positions is None else positions
        blk = self.model.layers[self.cfg.num_hidden_layers + layer]
        e = blk.enorm(self.model.word_embeddings(input_ids))
        h = blk.hnorm(hidden.to(self.dtype))
        x = linear(torch.cat([e, h], dim=-1), blk.eh_proj.weight)  # [B, T, C]
        x = blk(x, positions)
        return linear(blk.final_layernorm(x), self.lm_head.weight).float()
