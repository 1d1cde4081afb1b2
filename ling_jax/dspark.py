"""The DSpark block drafter (DeepSpec's Qwen3-shaped draft, SGLang's `LingDSparkModel`): pure functions.

Shape legend: B batch, N blocks per sequence (1 when decoding, the sampled anchors when training), G = gamma = block
size, S context slots, Ld draft layers, H query heads, Hk kv heads, R = H / Hk, Dh head dim, D hidden (= the
target's), C = len(target_layer_ids) * D, V vocab, M markov rank.

Context (once per committed position t, cached): the target's residual stream after the layers `target_layer_ids`
at t, concatenated, then
    c_t = RMSNorm(fc(feat_t))                                     (hidden_norm)
    K_l[t] = RoPE_t(k_norm(k_proj_l c_t)),  V_l[t] = v_proj_l c_t   for every draft layer l
Block at anchor position a (the bonus token, not yet fed to the target): tokens [x_a, MASK x (G-1)] at positions
a..a+G-1, through Ld Qwen3 decoder layers whose attention reads [context rows t < a ; the whole block]
(bidirectional inside the block); h = RMSNorm(x) (norm). Slot k predicts the token at a+k+1 (DeepSpec's
convention: every slot, slot 0 included), with the target's lm_head and a Markov correction from the previous token:
    logits_k = lm_head(h_k) + W2 W1[x_{k-1}]        (x_{-1} = the anchor; decoded left to right)
    c_k = sigmoid(w . [h_k ; W1[x_{k-1}]] + b)      (confidence: P(slot k accepted | earlier accepted))
The embedding and lm_head are the target's (frozen); the draft checkpoint holds neither.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from ling_jax.errors import CheckpointError, read_json_object
from ling_jax.layers.norms import rms_norm
from ling_jax.layers.rope import apply_rope_half, rope_angles

ARCHITECTURES = ("LingDSparkModel", "Qwen3DSparkModel", "DSparkDraftModel")


@dataclass(frozen=True)
class DSparkConfig:
    """The draft's config.json (HF keys of DeepSpec / SGLang; `dflash_config` holds target_layer_ids and
    mask_token_id)."""

    hidden_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 768
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    vocab_size: int = 4096
    block_size: int = 8
    target_layer_ids: tuple[int, ...] = (1, 2, 3, 4, 5)
    num_target_layers: int = 8
    mask_token_id: int = 1
    markov_rank: int = 256
    enable_confidence_head: bool = True

    def __post_init__(self):
        for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                  "intermediate_size", "vocab_size", "block_size", "markov_rank", "num_target_layers"):
            if getattr(self, k) < 1:
                raise ValueError(f"DSpark {k}={getattr(self, k)} must be >= 1")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"DSpark num_attention_heads={self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")
        if self.head_dim % 2:
            raise ValueError(f"DSpark head_dim={self.head_dim} must be even (rotate-half RoPE)")
        if not self.target_layer_ids or list(self.target_layer_ids) != sorted(set(self.target_layer_ids)):
            raise ValueError(f"DSpark target_layer_ids={list(self.target_layer_ids)} must be non-empty, strictly "
                             f"increasing")
        if not all(-1 <= i < self.num_target_layers for i in self.target_layer_ids):
            raise ValueError(f"DSpark target_layer_ids={list(self.target_layer_ids)} outside -1..{self.num_target_layers - 1}")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"DSpark mask_token_id={self.mask_token_id} outside the vocabulary [0, {self.vocab_size})")

    @property
    def context_dim(self) -> int:
        return len(self.target_layer_ids) * self.hidden_size

    def replace(self, **kw) -> "DSparkConfig":
        return dataclasses.replace(self, **kw)

    def check_target(self, target) -> None:
        """The draft shares the target's embedding, lm_head and hidden states: the shapes must agree."""
        for mine, theirs in (("hidden_size", "hidden_size"), ("vocab_size", "vocab_size"),
                             ("num_target_layers", "num_hidden_layers")):
            if getattr(self, mine) != getattr(target, theirs):
                raise CheckpointError(f"DSpark draft {mine}={getattr(self, mine)} does not match the target's "
                                      f"{theirs}={getattr(target, theirs)}")


def evenly_spaced_layers(num_target_layers: int, n: int) -> tuple[int, ...]:
    """DFlash/DSpark's default feature layers: n evenly spaced in [1, num_target_layers - 3]; a target too shallow
    for n distinct layers there spaces them over all of its layers [0, num_target_layers - 1]."""
    if not 1 <= n <= num_target_layers:
        raise ValueError(f"{n} context layers of a {num_target_layers}-layer target: need 1..{num_target_layers}")
    if n == 1:
        return (num_target_layers // 2,)
    start, end = 1, max(1, num_target_layers - 3)
    if end - start + 1 < n:
        start, end = 0, num_target_layers - 1
    return tuple(int(round(start + i * (end - start) / (n - 1))) for i in range(n))


# ---- config.json ------------------------------------------------------------------------------------------------


def _get(d: dict, key: str, path: str, default=None, required: bool = True):
    sub = d.get("dflash_config") or {}
    v = sub.get(key, d.get(key, default))
    if v is None and required:
        raise CheckpointError(f"{path}: missing key {key!r} (DSpark draft config)")
    return v


def config_from_hf(d: dict, path: str = "config.json") -> DSparkConfig:
    arch = (d.get("architectures") or [None])[0]
    if arch not in ARCHITECTURES:
        raise CheckpointError(f"{path}: architectures[0]={arch!r}: a DSpark draft is one of {list(ARCHITECTURES)}")
    if d.get("speculators_model_type") == "dspark":
        raise CheckpointError(f"{path}: a speculators-convention DSpark checkpoint (slot j predicts anchor+j) is not "
                              f"supported; DeepSpec's convention (slot k predicts anchor+k+1) is")
    refused = {"markov_head_type": ("vanilla",), "hidden_act": ("silu",), "attention_bias": (False,),
               "rope_scaling": (None,), "confidence_head_with_markov": (True,)}
    for key, ok in refused.items():
        v = _get(d, key, path, ok[0], required=False)
        if v not in ok:
            raise CheckpointError(f"{path}: {key}={v!r} is not implemented (supported: {list(ok)})")
    if any(t != "full_attention" for t in d.get("layer_types") or []):
        raise CheckpointError(f"{path}: layer_types={d['layer_types']}: only full_attention draft layers are implemented")
    n_layers = int(_get(d, "num_hidden_layers", path))
    n_target = int(_get(d, "num_target_layers", path))
    ids = _get(d, "target_layer_ids", path, required=False)
    try:
        return DSparkConfig(
            hidden_size=int(_get(d, "hidden_size", path)), num_hidden_layers=n_layers,
            num_attention_heads=int(_get(d, "num_attention_heads", path)),
            num_key_value_heads=int(_get(d, "num_key_value_heads", path)), head_dim=int(_get(d, "head_dim", path)),
            intermediate_size=int(_get(d, "intermediate_size", path)),
            rms_norm_eps=float(_get(d, "rms_norm_eps", path)), rope_theta=float(_get(d, "rope_theta", path)),
            vocab_size=int(_get(d, "vocab_size", path)), block_size=int(_get(d, "block_size", path)),
            target_layer_ids=tuple(int(i) for i in ids) if ids else evenly_spaced_layers(n_target, n_layers),
            num_target_layers=n_target, mask_token_id=int(_get(d, "mask_token_id", path)),
            markov_rank=int(_get(d, "markov_rank", path)),
            enable_confidence_head=bool(_get(d, "enable_confidence_head", path, True, required=False)))
    except ValueError as e:
        raise CheckpointError(f"{path}: {e}") from None


def config_to_hf(c: DSparkConfig) -> dict:
    return {"architectures": ["LingDSparkModel"], "model_type": "qwen3", "hidden_size": c.hidden_size,
            "num_hidden_layers": c.num_hidden_layers, "num_attention_heads": c.num_attention_heads,
            "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim,
            "intermediate_size": c.intermediate_size, "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
            "vocab_size": c.vocab_size, "hidden_act": "silu", "attention_bias": False, "rope_scaling": None,
            "tie_word_embeddings": False, "block_size": c.block_size, "num_target_layers": c.num_target_layers,
            "dflash_config": {"target_layer_ids": list(c.target_layer_ids), "mask_token_id": c.mask_token_id},
            "markov_rank": c.markov_rank, "markov_head_type": "vanilla",
            "enable_confidence_head": c.enable_confidence_head, "confidence_head_with_markov": True,
            "torch_dtype": "bfloat16"}


def load_config(model_dir: str) -> DSparkConfig:
    path = os.path.join(model_dir, "config.json")
    if not os.path.exists(path):
        raise CheckpointError(f"{model_dir}: no config.json (--speculative-draft-model-path must be a DSpark draft dir)")
    return config_from_hf(read_json_object(path), path)


# ---- weights (HF names of DeepSpec's Qwen3DSparkModel) -------------------------------------------------------


def weight_shapes(c: DSparkConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape (torch Linear layout [out, in])."""
    D, Dh, H, Hk, F = c.hidden_size, c.head_dim, c.num_attention_heads, c.num_key_value_heads, c.intermediate_size
    s = {"fc.weight": (D, c.context_dim), "hidden_norm.weight": (D,), "norm.weight": (D,),
         "markov_head.markov_w1.weight": (c.vocab_size, c.markov_rank),
         "markov_head.markov_w2.weight": (c.vocab_size, c.markov_rank)}
    if c.enable_confidence_head:
        s |= {"confidence_head.proj.weight": (1, D + c.markov_rank), "confidence_head.proj.bias": (1,)}
    for i in range(c.num_hidden_layers):
        p = f"layers.{i}."
        s |= {p + "input_layernorm.weight": (D,), p + "post_attention_layernorm.weight": (D,),
              p + "self_attn.q_proj.weight": (H * Dh, D), p + "self_attn.k_proj.weight": (Hk * Dh, D),
              p + "self_attn.v_proj.weight": (Hk * Dh, D), p + "self_attn.o_proj.weight": (D, H * Dh),
              p + "self_attn.q_norm.weight": (Dh,), p + "self_attn.k_norm.weight": (Dh,),
              p + "mlp.gate_proj.weight": (F, D), p + "mlp.up_proj.weight": (F, D), p + "mlp.down_proj.weight": (D, F)}
    return s


def init_params(c: DSparkConfig, seed: int = 0, dtype=jnp.float32) -> dict:
    """Random draft weights: normal(0, 1/sqrt(fan_in)) matrices, unit norms, zero confidence bias."""
    keys = iter(jax.random.split(jax.random.key(seed), 4 * len(weight_shapes(c))))
    flat = {}
    for name, shape in weight_shapes(c).items():
        if name.endswith("norm.weight"):
            flat[name] = jnp.ones(shape, dtype)
        elif name.endswith("bias"):
            flat[name] = jnp.zeros(shape, dtype)
        else:
            std = 0.02 if "markov" in name else shape[-1] ** -0.5
            flat[name] = (std * jax.random.normal(next(keys), shape, jnp.float32)).astype(dtype)
    flat["markov_head.markov_w2.weight"] = jnp.zeros_like(flat["markov_head.markov_w2.weight"])  # starts neutral
    return unflatten(flat)


def unflatten(flat: dict) -> dict:
    """{HF name: array} -> the nested pytree the functions below read (nested dicts mirroring the names)."""
    tree: dict = {}
    for name, a in flat.items():
        node, parts = tree, name.split(".")
        for k in parts[:-1]:
            node = node.setdefault(k, {})
        node[parts[-1]] = a
    if "layers" in tree:
        tree["layers"] = [tree["layers"][str(i)] for i in range(len(tree["layers"]))]
    return tree


def flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in (enumerate(tree) if isinstance(tree, list) else tree.items()):
        name = f"{prefix}{k}"
        out |= flatten(v, name + ".") if isinstance(v, (dict, list)) else {name: v}
    return out


def load_params(c: DSparkConfig, model_dir: str, dtype=jnp.bfloat16) -> dict:
    from ling_jax.safetensors_io import open_checkpoint

    where = open_checkpoint(model_dir)
    want = weight_shapes(c)
    skipped = ("embed_tokens.", "lm_head.", "rotary_emb.")  # the target's (SGLang skips them too)
    extra = sorted(n for n in where if n not in want and not n.startswith(skipped))
    if extra:
        raise CheckpointError(f"{model_dir}: unexpected DSpark tensors {extra[:5]} (config: {c.num_hidden_layers} "
                              f"layers, confidence head {c.enable_confidence_head})")
    flat = {}
    for name, shape in want.items():
        if name not in where:
            raise CheckpointError(f"{model_dir}: DSpark tensor {name} missing")
        a = where[name].tensor(name)
        if tuple(a.shape) != shape:
            raise CheckpointError(f"{model_dir}: DSpark tensor {name}: expected shape {shape}, found {tuple(a.shape)}")
        flat[name] = jnp.asarray(np.asarray(a, np.float32), dtype)
    return unflatten(flat)


def save(c: DSparkConfig, params: dict, out_dir: str) -> None:
    """config.json + one bf16 model.safetensors (HF layout, loadable by load_params and by SGLang's names)."""
    import ml_dtypes

    from ling_jax.safetensors_io import save_file

    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config_to_hf(c), f, indent=1)
    flat = {k: np.asarray(jnp.asarray(v, jnp.float32)).astype(ml_dtypes.bfloat16) for k, v in flatten(params).items()}
    save_file(flat, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})


# ---- the math ---------------------------------------------------------------------------------------------------


def _heads(x, n, Dh):
    return x.reshape(x.shape[:-1] + (n, Dh))


def context_kv(dp, feats, positions, c: DSparkConfig):
    """feats [B, T, C] target features at positions int32[B, T] -> (K, V) [Ld, B, T, Hk, Dh] for every draft layer."""
    ctx = rms_norm(jnp.einsum("btc,dc->btd", feats.astype(dp["fc"]["weight"].dtype), dp["fc"]["weight"]),
                   dp["hidden_norm"]["weight"], c.rms_norm_eps)
    cos, sin = rope_angles(positions, c.head_dim, c.rope_theta)  # [B, T, Dh/2]
    ks, vs = [], []
    for lp in dp["layers"]:
        a = lp["self_attn"]
        k = rms_norm(_heads(jnp.einsum("btd,ed->bte", ctx, a["k_proj"]["weight"]), c.num_key_value_heads, c.head_dim),
                     a["k_norm"]["weight"], c.rms_norm_eps)
        ks.append(apply_rope_half(k, cos[:, :, None], sin[:, :, None]))
        vs.append(_heads(jnp.einsum("btd,ed->bte", ctx, a["v_proj"]["weight"]), c.num_key_value_heads, c.head_dim))
    return jnp.stack(ks), jnp.stack(vs)


def _attention(a, x, ctx_k, ctx_v, ctx_live, cos, sin, c: DSparkConfig):
    """x [B, N, G, D] (normed); ctx_k/v [B, S, Hk, Dh]; ctx_live bool[B, N, S] (context rows block n may read)."""
    Hk, R, Dh = c.num_key_value_heads, c.num_attention_heads // c.num_key_value_heads, c.head_dim
    q = rms_norm(_heads(jnp.einsum("bngd,ed->bnge", x, a["q_proj"]["weight"]), Hk * R, Dh), a["q_norm"]["weight"],
                 c.rms_norm_eps)
    k = rms_norm(_heads(jnp.einsum("bngd,ed->bnge", x, a["k_proj"]["weight"]), Hk, Dh), a["k_norm"]["weight"],
                 c.rms_norm_eps)
    v = _heads(jnp.einsum("bngd,ed->bnge", x, a["v_proj"]["weight"]), Hk, Dh)
    q = apply_rope_half(q, cos[..., None, :], sin[..., None, :]).reshape(q.shape[:3] + (Hk, R, Dh))
    k = apply_rope_half(k, cos[..., None, :], sin[..., None, :])
    scale = Dh ** -0.5
    s_ctx = jnp.einsum("bngkrd,bskd->bnkrgs", q, ctx_k, preferred_element_type=jnp.float32) * scale
    s_blk = jnp.einsum("bngkrd,bnpkd->bnkrgp", q, k, preferred_element_type=jnp.float32) * scale
    s_ctx = jnp.where(ctx_live[:, :, None, None, None, :], s_ctx, -jnp.inf)
    w = jax.nn.softmax(jnp.concatenate([s_ctx, s_blk], axis=-1), axis=-1)  # the block row is always live
    S = ctx_k.shape[1]
    o = (jnp.einsum("bnkrgs,bskd->bngkrd", w[..., :S].astype(v.dtype), ctx_v)
         + jnp.einsum("bnkrgp,bnpkd->bngkrd", w[..., S:].astype(v.dtype), v))
    return jnp.einsum("bnge,de->bngd", o.reshape(o.shape[:3] + (-1,)), a["o_proj"]["weight"])


def block_hidden(dp, embed_w, block_tokens, anchors, ctx_k, ctx_v, c: DSparkConfig):
    """The draft forward over N blocks per sequence.

    block_tokens int32[B, N, G] ([anchor, MASK, ...]); anchors int32[B, N] (position of slot 0); ctx_k/v
    [Ld, B, S, Hk, Dh] with row t = position t. Block n reads context rows t < anchors[b, n].
    Returns h [B, N, G, D] after the final norm."""
    G = block_tokens.shape[-1]
    x = jnp.take(embed_w, block_tokens, axis=0).astype(dp["norm"]["weight"].dtype)
    cos, sin = rope_angles(anchors[..., None] + jnp.arange(G), c.head_dim, c.rope_theta)  # [B, N, G, Dh/2]
    live = jnp.arange(ctx_k.shape[2])[None, None, :] < anchors[..., None]  # [B, N, S]
    for l, lp in enumerate(dp["layers"]):
        h = rms_norm(x, lp["input_layernorm"]["weight"], c.rms_norm_eps)
        x = x + _attention(lp["self_attn"], h, ctx_k[l], ctx_v[l], live, cos, sin, c)
        h = rms_norm(x, lp["post_attention_layernorm"]["weight"], c.rms_norm_eps)
        m = lp["mlp"]
        g = jnp.einsum("bngd,fd->bngf", h, m["gate_proj"]["weight"])
        u = jnp.einsum("bngd,fd->bngf", h, m["up_proj"]["weight"])
        x = x + jnp.einsum("bngf,df->bngd", jax.nn.silu(g) * u, m["down_proj"]["weight"])
    return rms_norm(x, dp["norm"]["weight"], c.rms_norm_eps)


def markov_embed(dp, prev):
    """W1[x_{k-1}]: prev int32[...] -> [..., M]. Gathered clamped: prev is always a token id (the bonus, a draft or
    the text's token), so the values are jnp.take's, and XLA fuses a clamped gather into its consumer (the W2 matvec:
    one launch a Markov slot at batch 1; the default fill mode adds a select launch of its own)."""
    return jnp.take(dp["markov_head"]["markov_w1"]["weight"], prev, axis=0, mode="clip")


def markov_bias(dp, prev):
    """W2 W1[x_{k-1}] -> f32[..., V], added to slot k's base logits."""
    return jnp.einsum("...m,vm->...v", markov_embed(dp, prev), dp["markov_head"]["markov_w2"]["weight"],
                      preferred_element_type=jnp.float32)


def confidence_logit(dp, h, prev):
    """w . [h_k ; W1[x_{k-1}]] + b -> f32[...] (sigmoid of it is c_k)."""
    p = dp["confidence_head"]["proj"]
    feat = jnp.concatenate([h.astype(jnp.float32), markov_embed(dp, prev).astype(jnp.float32)], axis=-1)
    return feat @ p["weight"][0].astype(jnp.float32) + p["bias"][0].astype(jnp.float32)


def param_count(c: DSparkConfig) -> int:
    return sum(int(np.prod(s)) for s in weight_shapes(c).values())
