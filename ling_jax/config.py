"""Model configuration: one frozen dataclass, named presets, and the HF config.json reader.

Field names follow the Hugging Face config keys of BailingMoeV3 (`model_type: bailing_hybrid`) so that
`from_hf_config` is a plain mapping (the clamp lists come from SGLang's keys, see CLAMP_KEYS). config.json must
carry every key that sets a shape or the math (REQUIRED_KEYS); a missing key, a value of the wrong type, or a value
of a key the math assumes that we do not implement (IMPLEMENTED_VALUES) is an error naming the key. Derived facts
(which layer is MLA, which is MoE, clamp limits per layer, parameter counts) are properties, computed from the
fields, never stored twice.

    python -m ling_jax.config --preset ling3-flash
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from dataclasses import dataclass, field
from typing import Any

from ling_jax.errors import CheckpointError, read_json_object

HF_MODEL_TYPES = ("bailing_hybrid",)


_POSITIVE = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "head_dim", "vocab_size",
             "layer_group_size", "num_experts", "num_experts_per_tok", "moe_intermediate_size", "n_group", "topk_group",
             "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "short_conv_kernel_size")


@dataclass(frozen=True)
class ModelConfig:
    """BailingMoeV3 hyper-parameters (HF key names)."""

    name: str = "custom"
    hidden_size: int = 2560
    intermediate_size: int = 6144  # dense SwiGLU width (layers < first_k_dense_replace)
    num_hidden_layers: int = 42
    num_attention_heads: int = 32
    head_dim: int = 128  # KDA head dim (K = V) and MLA v head dim source
    vocab_size: int = 157184
    rms_norm_eps: float = 1e-6
    rope_theta: float = 6e6
    partial_rotary_factor: float = 0.5
    max_position_embeddings: int = 262144
    layer_group_size: int = 6
    first_k_dense_replace: int = 2
    # MoE
    num_experts: int = 512
    num_experts_per_tok: int = 8
    num_shared_experts: int = 1
    moe_intermediate_size: int = 768
    moe_shared_expert_intermediate_size: int = 768
    n_group: int = 8
    topk_group: int = 4
    routed_scaling_factor: float = 2.5
    norm_topk_prob: bool = True
    # MLA
    q_lora_rank: int | None = None
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    # KDA
    short_conv_kernel_size: int = 4
    kda_lower_bound: float = -5.0
    # MTP
    num_nextn_predict_layers: int = 1
    tie_word_embeddings: bool = False
    eos_token_id: int = 156895
    pad_token_id: int = 156892
    # SwiGLU clamps, one limit per layer (target layers then MTP layers); 0.0 = off. config.json keys
    # expert_swiglu_limit_list / share_expert_swiglu_limit_list (see CLAMP_KEYS). Both kinds compute
    # min(silu(gate), L) * clip(up, -L, L) (SGLang's deployment). apply_swiglu_clamps=False drops them, which is what
    # HF's remote code computes (it ignores the lists); on by default, the model was trained with them.
    routed_swiglu_limits: tuple[float, ...] = ()
    shared_swiglu_limits: tuple[float, ...] = ()
    apply_swiglu_clamps: bool = True

    def __post_init__(self):
        for key in _POSITIVE:
            if getattr(self, key) < 1:
                raise ValueError(f"{key}={getattr(self, key)} must be >= 1")
        for key in ("first_k_dense_replace", "num_nextn_predict_layers", "num_shared_experts"):
            if getattr(self, key) < 0:
                raise ValueError(f"{key}={getattr(self, key)} must be >= 0")
        n = self.num_total_layers
        for key in ("routed_swiglu_limits", "shared_swiglu_limits"):
            limits = getattr(self, key)
            if limits and len(limits) != n:
                raise ValueError(f"{key} has {len(limits)} entries, expected {n} (target + MTP layers)")
        if self.num_experts % self.n_group:
            raise ValueError(f"num_experts={self.num_experts} not divisible by n_group={self.n_group}")
        if self.topk_group > self.n_group:
            raise ValueError(f"topk_group={self.topk_group} > n_group={self.n_group}")
        if self.num_experts_per_tok > self.topk_group * (self.num_experts // self.n_group):
            raise ValueError("num_experts_per_tok exceeds the experts in the kept groups")
        if self.rotary_dim != self.qk_rope_head_dim:
            raise ValueError(
                f"rotary dim head_dim*partial_rotary_factor={self.rotary_dim} != qk_rope_head_dim={self.qk_rope_head_dim}"
            )
        if self.num_experts_per_tok > 1 and (self.num_experts // self.n_group) < 2:
            raise ValueError("group scoring takes the top-2 experts of each group: need >= 2 experts per group")

    # ---- layer layout -------------------------------------------------------------------------------------
    @property
    def num_total_layers(self) -> int:
        return self.num_hidden_layers + self.num_nextn_predict_layers

    def is_mla(self, i: int) -> bool:
        """Layer i is gated MLA every `layer_group_size` layers and in the ragged tail; MTP layers are MLA."""
        full_groups = self.num_hidden_layers // self.layer_group_size * self.layer_group_size
        return i >= self.num_hidden_layers or (i + 1) % self.layer_group_size == 0 or i >= full_groups

    def is_moe(self, i: int) -> bool:
        return i >= self.first_k_dense_replace

    @property
    def mla_layers(self) -> tuple[int, ...]:
        """Target MLA layer indices (the MTP layer's cache lives in the draft state)."""
        return tuple(i for i in range(self.num_hidden_layers) if self.is_mla(i))

    @property
    def kda_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_hidden_layers) if not self.is_mla(i))

    @property
    def mtp_layers(self) -> tuple[int, ...]:
        return tuple(range(self.num_hidden_layers, self.num_total_layers))

    def routed_limit(self, i: int) -> float:
        if not self.apply_swiglu_clamps or not self.routed_swiglu_limits:
            return 0.0
        return float(self.routed_swiglu_limits[i])

    def shared_limit(self, i: int) -> float:
        if not self.apply_swiglu_clamps or not self.shared_swiglu_limits:
            return 0.0
        return float(self.shared_swiglu_limits[i])

    # ---- derived dims -------------------------------------------------------------------------------------
    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kda_dim(self) -> int:
        """Channels of each KDA stream (q, k, v, f, g): heads x head_dim."""
        return self.num_attention_heads * self.head_dim

    @property
    def mla_cache_dim(self) -> int:
        """Per token per MLA layer: normalised latent (kv_lora_rank) + shared rotary key (qk_rope_head_dim)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def shared_width(self) -> int:
        return self.moe_shared_expert_intermediate_size * max(self.num_shared_experts, 1)

    # ---- parameter counts ---------------------------------------------------------------------------------
    def param_counts(self) -> dict[str, int]:
        """Parameters by part, and the float32 share. For ling3-flash the total (127,486,405,600) and the F32 share
        (165,472) equal the Hugging Face Hub's safetensors metadata of inclusionAI/Ling-3.0-flash; ling3-tiny's
        total_without_mtp (7,893,392,800) that of inclusionAI/Ling-3.0-tiny (tests/test_weights.py pins both)."""
        from ling_jax.weights import param_spec  # local: weights imports config

        counts = {"embedding": 0, "lm_head": 0, "target_layers": 0, "mtp": 0, "norm": 0, "float32": 0}
        for name, info in param_spec(self).items():
            n = 1
            for s in info.shape:
                n *= s
            if info.dtype == "float32":
                counts["float32"] += n
            if name == "model.word_embeddings.weight":
                counts["embedding"] += n
            elif name == "lm_head.weight":
                counts["lm_head"] += n
            elif name == "model.norm.weight":
                counts["norm"] += n
            elif int(name.split(".")[2]) >= self.num_hidden_layers:
                counts["mtp"] += n
            else:
                counts["target_layers"] += n
        counts["total"] = sum(v for k, v in counts.items() if k != "float32")
        counts["total_without_mtp"] = counts["total"] - counts["mtp"]
        return counts

    def replace(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw)


# ---- presets ----------------------------------------------------------------------------------------------


def _flash_clamps(n_layers: int, n_mtp: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Ling-3.0-flash's limits (its config.json lists): routed 4.0 on 35..41; shared 5.0 on 34..39, 7.0 on 40..41."""
    routed = [4.0 if 35 <= i <= 41 else 0.0 for i in range(n_layers + n_mtp)]
    shared = [5.0 if 34 <= i <= 39 else 7.0 if 40 <= i <= 41 else 0.0 for i in range(n_layers + n_mtp)]
    return tuple(routed), tuple(shared)


_FLASH_ROUTED, _FLASH_SHARED = _flash_clamps(42, 1)

PRESETS: dict[str, ModelConfig] = {
    "ling3-flash": ModelConfig(
        name="ling3-flash",
        routed_swiglu_limits=_FLASH_ROUTED,
        shared_swiglu_limits=_FLASH_SHARED,
    ),
    "ling3-tiny": ModelConfig(
        name="ling3-tiny",
        hidden_size=1536,
        intermediate_size=4608,
        num_hidden_layers=24,
        num_attention_heads=16,
        layer_group_size=4,
        first_k_dense_replace=1,
        num_experts=128,
        moe_intermediate_size=512,
        moe_shared_expert_intermediate_size=512,
        q_lora_rank=256,
        num_nextn_predict_layers=0,
    ),
    # The shipped demo model (trained by ling_jax.train): every layer kind, ~15M parameters, ~31 MB in bf16.
    "ling-demo": ModelConfig(
        name="ling-demo",
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=8,
        num_attention_heads=4,
        head_dim=64,
        vocab_size=4096,
        layer_group_size=4,
        first_k_dense_replace=1,
        num_experts=16,
        num_experts_per_tok=4,
        moe_intermediate_size=96,
        moe_shared_expert_intermediate_size=96,
        n_group=4,
        topk_group=2,
        kv_lora_rank=128,
        qk_nope_head_dim=64,
        qk_rope_head_dim=32,
        v_head_dim=64,
        max_position_embeddings=8192,
        eos_token_id=0,
        pad_token_id=1,
    ),
    # Small configs for tests: every layer kind occurs (KDA, MLA, dense, MoE, MTP).
    "test-tiny": ModelConfig(
        name="test-tiny",
        hidden_size=128,
        intermediate_size=192,
        num_hidden_layers=6,
        num_attention_heads=4,
        head_dim=32,
        partial_rotary_factor=0.5,
        vocab_size=512,
        layer_group_size=3,
        first_k_dense_replace=1,
        num_experts=16,
        num_experts_per_tok=4,
        moe_intermediate_size=48,
        moe_shared_expert_intermediate_size=48,
        n_group=4,
        topk_group=2,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        max_position_embeddings=4096,
        eos_token_id=1,
        pad_token_id=0,
        routed_swiglu_limits=(0.0, 0.0, 0.0, 0.0, 0.6, 0.6, 0.6),
        shared_swiglu_limits=(0.0, 0.0, 0.0, 0.5, 0.5, 0.0, 0.5),
    ),
    "test-qlora": ModelConfig(
        name="test-qlora",
        hidden_size=96,
        intermediate_size=160,
        num_hidden_layers=8,
        num_attention_heads=2,
        head_dim=48,
        partial_rotary_factor=0.5,
        vocab_size=384,
        layer_group_size=4,
        first_k_dense_replace=2,
        num_experts=32,
        num_experts_per_tok=6,
        moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=40,
        n_group=8,
        topk_group=3,
        q_lora_rank=48,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=24,
        v_head_dim=24,
        max_position_embeddings=4096,
        eos_token_id=1,
        pad_token_id=0,
    ),
    "test-wide": ModelConfig(
        name="test-wide",
        hidden_size=256,
        intermediate_size=256,
        num_hidden_layers=7,
        num_attention_heads=4,
        head_dim=64,
        partial_rotary_factor=0.5,
        vocab_size=640,
        layer_group_size=3,
        first_k_dense_replace=1,
        num_experts=64,
        num_experts_per_tok=8,
        moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=64,
        n_group=8,
        topk_group=4,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=32,
        v_head_dim=48,
        max_position_embeddings=4096,
        eos_token_id=1,
        pad_token_id=0,
        routed_swiglu_limits=(0.0,) * 5 + (0.5, 0.5, 0.5),
        shared_swiglu_limits=(0.0,) * 4 + (0.4,) * 4,
    ),
}
# The v2 demo model (issue 14): ling-demo's layout, wider (320, 5 heads), 64-wide experts and a 192-wide shared
# expert, 18.0M parameters, 36 MB in bf16; trained on the stdlib + dev-environment packages corpus.
PRESETS["ling-demo-v2"] = PRESETS["ling-demo"].replace(
    name="ling-demo-v2", hidden_size=320, intermediate_size=960, num_attention_heads=5, moe_intermediate_size=64,
    moe_shared_expert_intermediate_size=192)

TEST_PRESETS = ("test-tiny", "test-qlora", "test-wide")


def get_preset(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise KeyError(f"unknown preset {name!r}; known: {sorted(PRESETS)}")
    return PRESETS[name]


# ---- HF config.json ---------------------------------------------------------------------------------------

# Keys config.json may leave out: BailingMoeV3Config's default is ours (tie_word_embeddings false), the tokenizer
# names the stop tokens, or the key is our own switch. Every other field sets a shape or the math and must be there:
# HF's class defaults describe another size than ours (Ling-3.0-flash), so filling one in builds another model.
OPTIONAL_KEYS = ("tie_word_embeddings", "eos_token_id", "pad_token_id", "apply_swiglu_clamps")
_NOT_HF_KEYS = ("name", "routed_swiglu_limits", "shared_swiglu_limits")  # the clamps come from CLAMP_KEYS
REQUIRED_KEYS = tuple(f.name for f in dataclasses.fields(ModelConfig) if f.name not in OPTIONAL_KEYS + _NOT_HF_KEYS)

# Keys the math assumes and the one value ling_jax implements (what Ling-3.0 ships; an absent key means that value).
IMPLEMENTED_VALUES: dict[str, Any] = {
    "kda_safe_gate": True,  # KDA forget gate kda_lower_bound * sigmoid(...); false is fla's unbounded gate
    "no_kda_lora": True,  # full-rank KDA f_proj / g_proj; false means low-rank f_a/f_b and g_a/g_b pairs
    "rope_interleave": True,  # RoPE rotates interleaved pairs (2i, 2i+1)
    "use_qkv_bias": False,  # no bias on q_a_proj / kv_a_proj_with_mqa / attention.dense
    "gated_attention_proj_granularity_type": "head_wise",  # MLA output gate: one sigmoid per head
    "hidden_act": "silu",
}

# Per-layer SwiGLU clamp limits: the checkpoint's key -> our field. HF's modeling code ignores these keys; SGLang
# applies them (without them users report garbage tokens and HumanEval 88.4 -> 71.3), and so do we unless
# apply_swiglu_clamps is false. Our old key names are rejected, never read as something else.
CLAMP_KEYS = {"expert_swiglu_limit_list": "routed_swiglu_limits",
              "share_expert_swiglu_limit_list": "shared_swiglu_limits"}


def from_hf_dict(d: dict[str, Any], name: str = "hf") -> ModelConfig:
    """Map a BailingMoeV3 HF config dict to a ModelConfig. ValueError naming the key for: an unknown model_type,
    a missing required key, a value of the wrong type, a value we do not implement."""
    model_type = d.get("model_type")
    if model_type not in HF_MODEL_TYPES:
        raise ValueError(f"unsupported model_type {model_type!r} (expected one of {HF_MODEL_TYPES})")
    for key, want in IMPLEMENTED_VALUES.items():
        if key in d and (d[key] != want or type(d[key]) is not type(want)):
            raise ValueError(f"{key}={d[key]!r} is not implemented (ling_jax implements {key}={want!r}, "
                             f"what Ling-3.0 ships)")
    for key, field_name in CLAMP_KEYS.items():
        if field_name in d:
            raise ValueError(f"{field_name} is not a BailingMoeV3 key: write the limits as {key}")
    d = {**d, **_rope_keys(d)}
    defaults = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
    kw: dict[str, Any] = {}
    for key in REQUIRED_KEYS + OPTIONAL_KEYS:
        if key in d and not (key in OPTIONAL_KEYS and d[key] is None):
            kw[key] = _typed(key, d[key], defaults[key])
        elif key in REQUIRED_KEYS:
            raise ValueError(f"missing required key {key!r}")
    n_layers, n_mtp = kw["num_hidden_layers"], kw["num_nextn_predict_layers"]
    for key, field_name in CLAMP_KEYS.items():
        kw[field_name] = _clamp_limits(key, d.get(key), n_layers, n_mtp)
    return ModelConfig(name=name, **kw)


def _typed(key: str, v: Any, default: Any) -> Any:
    """config.json value -> the field's type; a value of another type is an error naming the key."""
    if key in ("eos_token_id", "pad_token_id") and isinstance(v, list) and v:
        v = v[0]  # HF allows a list of stop ids; the tokenizer supplies the rest
    is_int = isinstance(v, int) and not isinstance(v, bool)
    if key == "q_lora_rank":
        ok = v is None or is_int
    elif isinstance(default, bool):
        ok = isinstance(v, bool)
    elif isinstance(default, int):
        ok = is_int
    else:  # float fields take JSON integers too ("kda_lower_bound": -5)
        ok = is_int or isinstance(v, float)
        v = float(v) if ok else v
    if not ok:
        want = "an integer or null" if key == "q_lora_rank" else type(default).__name__
        raise ValueError(f"{key}: expected {want}, found {v!r}")
    return v


def _rope_keys(d: dict[str, Any]) -> dict[str, Any]:
    """rope_theta / partial_rotary_factor from the top level or (transformers >= 5) rope_parameters; no scaling."""
    if d.get("rope_scaling") not in (None, {}):
        raise ValueError(f"rope_scaling={d['rope_scaling']!r} is not supported (Ling-3.0 uses none)")
    rp = d.get("rope_parameters") or {}
    if not isinstance(rp, dict) or rp.get("rope_type", "default") != "default":
        raise ValueError(f"rope_parameters={rp!r} is not supported (expected rope_type 'default', no scaling)")
    out = {}
    for key in ("rope_theta", "partial_rotary_factor"):
        top, inner = d.get(key), rp.get(key)
        if top is not None and inner is not None and top != inner:
            raise ValueError(f"{key}={top!r} disagrees with rope_parameters.{key}={inner!r}")
        if top is None and inner is not None:
            out[key] = inner
    return out


def _clamp_limits(key: str, limits: Any, n_layers: int, n_mtp: int) -> tuple[float, ...]:
    """SGLang's reading of a limit list: entry i is layer i's limit, 0 or null = no clamp, and a layer past the
    end of the list is not clamped. The list covers the target layers and may cover the MTP layers too; any
    other length is an error, not a guess. Returns one limit per layer (target then MTP), () when null."""
    if limits is None:
        return ()
    if not isinstance(limits, list) or len(limits) not in (n_layers, n_layers + n_mtp):
        found = f"{len(limits)} entries" if isinstance(limits, list) else repr(limits)
        raise ValueError(f"{key}: expected a list of {n_layers} (num_hidden_layers) or {n_layers + n_mtp} "
                         f"(+ num_nextn_predict_layers) limits, found {found}")
    out = []
    for i, x in enumerate(limits):
        x = 0.0 if x is None else x
        if isinstance(x, bool) or not isinstance(x, (int, float)) or x < 0:
            raise ValueError(f"{key}[{i}]: expected a limit >= 0 (0 = off), found {x!r}")
        out.append(float(x))
    return tuple(out + [0.0] * (n_layers + n_mtp - len(out)))


def from_hf_config(path: str) -> ModelConfig:
    """Read `config.json` (a file or a checkpoint directory holding one); any problem is a CheckpointError
    naming the file."""
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise CheckpointError(f"{file}: no such file (a checkpoint directory holds its config.json)")
    d = read_json_object(file)
    try:
        return from_hf_dict(d, name=os.path.basename(os.path.dirname(os.path.abspath(file))))
    except ValueError as e:
        raise CheckpointError(f"{file}: {e}") from None


def to_hf_dict(cfg: ModelConfig) -> dict[str, Any]:
    """The config.json we write for our own checkpoints: HF keys (the clamp lists under SGLang's names, one entry
    per layer including MTP) plus our apply_swiglu_clamps switch."""
    d: dict[str, Any] = {
        "model_type": "bailing_hybrid",
        "architectures": ["BailingMoeV3ForCausalLM"],
        "rope_scaling": None,
        "qk_head_dim": cfg.qk_head_dim,
        **IMPLEMENTED_VALUES,
    }
    for f in dataclasses.fields(cfg):
        if f.name not in _NOT_HF_KEYS:
            d[f.name] = getattr(cfg, f.name)
    for key, field_name in CLAMP_KEYS.items():
        if getattr(cfg, field_name):  # the lists only when the model has them
            d[key] = list(getattr(cfg, field_name))
    return d


def load_config(model: str) -> ModelConfig:
    """A preset name or a checkpoint directory."""
    if model in PRESETS:
        return PRESETS[model]
    if os.path.exists(model):
        return from_hf_config(model)
    raise ValueError(f"--model {model!r} is neither a preset ({sorted(PRESETS)}) nor a path")


def summary(cfg: ModelConfig) -> str:
    c = cfg.param_counts()
    lines = [
        f"preset            {cfg.name}",
        f"hidden / layers   {cfg.hidden_size} / {cfg.num_hidden_layers} (+{cfg.num_nextn_predict_layers} MTP)",
        f"KDA layers        {len(cfg.kda_layers)}: {list(cfg.kda_layers)}",
        f"MLA layers        {len(cfg.mla_layers)}: {list(cfg.mla_layers)}",
        f"dense / MoE       {cfg.first_k_dense_replace} dense, {cfg.num_hidden_layers - cfg.first_k_dense_replace} MoE "
        f"({cfg.num_experts} experts, top-{cfg.num_experts_per_tok}, {cfg.n_group} groups keep {cfg.topk_group})",
        f"vocab             {cfg.vocab_size}",
        f"params embedding  {c['embedding']:,}",
        f"params lm_head    {c['lm_head']:,}",
        f"params layers     {c['target_layers']:,}",
        f"params MTP        {c['mtp']:,}",
        f"params float32    {c['float32']:,}",
        f"total without MTP {c['total_without_mtp']:,}",
        f"total parameters  {c['total']:,}",
        f"bf16 bytes        {2 * (c['total'] - c['float32']) + 4 * c['float32']:,}",
    ]
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default=None, help=f"one of {sorted(PRESETS)}")
    p.add_argument("--config", default=None, help="an HF config.json or checkpoint dir")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    try:
        cfg = from_hf_config(a.config) if a.config else get_preset(a.preset or "ling3-flash")
    except (CheckpointError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if a.json:
        print(json.dumps({"config": to_hf_dict(cfg), "params": cfg.param_counts()}, indent=1))
    else:
        print(summary(cfg))
    return 0


if __name__ == "__main__":
    sys.exit(main())
