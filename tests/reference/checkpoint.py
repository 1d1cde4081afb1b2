"""Write / read HF-layout BailingMoeV3 checkpoints (config.json + safetensors) from the torch reference.

Two writers: `write_random_checkpoint` (safetensors.torch, A_log / dt_bias / expert_bias kept in float32 as the
reference holds them) and `save_pretrained_checkpoint` (transformers' own `PreTrainedModel.save_pretrained` of
`model.to(dtype)`: the `dtype` config key, every float tensor in one dtype, HF's shard names and index).
Random weights are scaled so activations stay O(1): projections ~ N(0, 1/fan_in), norms ~ 1 + 0.1 N, KDA
A_log = log U(1, 16), dt_bias ~ 0.1 N, expert_bias ~ 0.1 N (same order as sigmoid-score gaps, so it matters).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from tests.reference.bailing_torch import FP32_PARAM_SUFFIXES, BailingConfigRef, BailingMoeV3Ref

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def _init_tensor(name: str, shape: torch.Size, gen: torch.Generator, bias_std: float = 0.5) -> torch.Tensor:
    """Deterministic fp32 init for one parameter, chosen by its checkpoint name."""
    randn = lambda: torch.randn(shape, generator=gen)  # noqa: E731
    if name.endswith("attention.A_log"):
        return torch.log(1.0 + 15.0 * torch.rand(shape, generator=gen))
    if name.endswith("attention.dt_bias"):
        return 0.1 * randn()
    if name.endswith("mlp.gate.expert_bias"):
        return bias_std * randn()
    if name.endswith(("norm.weight", "layernorm.weight")):
        return 1.0 + 0.1 * randn()
    if name.endswith("word_embeddings.weight"):
        return randn()
    if name.endswith("conv1d.weight"):  # [C, 1, W]
        return 0.5 * randn()
    if name.endswith("f_proj.weight"):  # keep exp(A_log) * (f + dt_bias) from saturating everywhere
        return 0.3 * randn() / math.sqrt(shape[-1])
    if name.endswith("mlp.gate.weight"):  # router: logits O(0.5), so the bias spread decides close calls
        return 0.5 * randn() / math.sqrt(shape[-1])
    if name.endswith(("o_proj.weight", "attention.dense.weight", "down_proj.weight")):
        # writes into the residual stream: small, so a bf16 rounding in one layer is not amplified by the next
        return 0.3 * randn() / math.sqrt(shape[-1])
    if len(shape) == 2:  # every other projection: N(0, 1/fan_in)
        return randn() / math.sqrt(shape[-1])
    raise ValueError(f"no init rule for {name} {tuple(shape)}")


def checkpoint_names(model: BailingMoeV3Ref) -> list[str]:
    """Tensor names stored on disk (lm_head.weight is dropped when tied)."""
    names = list(model.state_dict().keys())
    if model.cfg.tie_word_embeddings:
        names.remove("lm_head.weight")
    return names


def _param_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if name.endswith(FP32_PARAM_SUFFIXES) else dtype


def random_reference(config_dict: dict[str, Any], seed: int, dtype: torch.dtype = torch.bfloat16,
                     expert_bias_std: float = 0.5) -> BailingMoeV3Ref:
    """The reference with deterministic random weights (see `_init_tensor`), drawn in fp32 and cast per tensor.

    expert_bias_std: spread of the router bias. In a random model many top-k decisions are near ties; a bf16
    rounding flips some of them, a discrete jump that no tolerance covers. A wider bias spread (e.g. 2.0)
    widens the gaps so two bf16 implementations can be compared at 2e-2."""
    model = BailingMoeV3Ref(BailingConfigRef.from_dict(config_dict), dtype)
    gen = torch.Generator().manual_seed(seed)
    sd = model.state_dict()
    with torch.no_grad():
        for name in sorted(checkpoint_names(model)):  # sorted: the draw order does not depend on module order
            sd[name].copy_(_init_tensor(name, sd[name].shape, gen, expert_bias_std).to(sd[name].dtype))
    return model


def write_random_checkpoint(config_dict: dict[str, Any], out_dir: str | Path, seed: int,
                            dtype: torch.dtype = torch.bfloat16, shards: int = 1,
                            expert_bias_std: float = 0.5) -> BailingMoeV3Ref:
    """Build the reference with deterministic random weights, write config.json + safetensors, return it."""
    model = random_reference(config_dict, seed, dtype, expert_bias_std)
    sd, names = model.state_dict(), checkpoint_names(model)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    full = dict(config_dict)
    full.update(model_type="bailing_hybrid", architectures=["BailingMoeV3ForCausalLM"],
                torch_dtype=DTYPE_NAMES[dtype])
    (out / "config.json").write_text(json.dumps(full, indent=2))
    tensors = {n: sd[n].detach().contiguous().clone() for n in names}
    if shards <= 1:
        save_file(tensors, str(out / SINGLE_FILE), metadata={"format": "pt"})
        return model
    groups: list[list[str]] = [[] for _ in range(shards)]
    for i, n in enumerate(names):  # contiguous slices, so each shard holds whole layers where possible
        groups[min(i * shards // len(names), shards - 1)].append(n)
    weight_map, total = {}, 0
    for k, group in enumerate(groups):
        fname = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: tensors[n] for n in group}, str(out / fname), metadata={"format": "pt"})
        for n in group:
            weight_map[n] = fname
            total += tensors[n].numel() * tensors[n].element_size()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2))
    return model


def save_pretrained_checkpoint(config_dict: dict[str, Any], out_dir: str | Path, seed: int,
                               dtype: torch.dtype = torch.bfloat16, max_shard_size: str = "200KB",
                               expert_bias_std: float = 0.5) -> BailingMoeV3Ref:
    """The reference's random weights saved the way a user saves Ling-3.0: transformers'
    `model.to(dtype).save_pretrained(out_dir)`. transformers (>= 4.56) writes config.json with `dtype` (not
    `torch_dtype`), `transformers_version` and whatever keys config_dict holds; `.to(dtype)` also casts A_log,
    dt_bias and expert_bias, so a bf16 save stores them in BF16. Returns the reference loaded back from out_dir
    (those three upcast to float32), i.e. exactly the values a loader of these files sees."""
    from transformers import PretrainedConfig, PreTrainedModel

    class BailingMoeV3Config(PretrainedConfig):
        model_type = "bailing_hybrid"

    class BailingMoeV3ForCausalLM(PreTrainedModel):  # the class name becomes config.json's `architectures`
        config_class = BailingMoeV3Config

        def __init__(self, config, ref: BailingMoeV3Ref):
            super().__init__(config)
            self.model, self.lm_head = ref.model, ref.lm_head  # state_dict names = the checkpoint names

    ref = random_reference(config_dict, seed, torch.float32, expert_bias_std)
    hf = BailingMoeV3ForCausalLM(BailingMoeV3Config(**config_dict), ref).to(dtype)
    hf.save_pretrained(str(out_dir), max_shard_size=max_shard_size)
    return load_reference(out_dir)


def read_tensors(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a single-file or sharded (index.json) safetensors checkpoint."""
    d = Path(model_dir)
    if (d / INDEX_FILE).exists():
        weight_map = json.loads((d / INDEX_FILE).read_text())["weight_map"]
        tensors: dict[str, torch.Tensor] = {}
        for fname in sorted(set(weight_map.values())):
            part = load_file(str(d / fname))
            stray = [n for n in part if weight_map.get(n) != fname]
            if stray:
                raise KeyError(f"{fname} holds tensors not mapped to it in the index: {stray[:5]}")
            tensors.update(part)
        missing = set(weight_map) - set(tensors)
        if missing:
            raise KeyError(f"index lists tensors absent from the shards: {sorted(missing)[:5]}")
        return tensors
    return load_file(str(d / SINGLE_FILE))


def load_reference(model_dir: str | Path, dtype: torch.dtype | None = None) -> BailingMoeV3Ref:
    """Load a checkpoint into the reference; strict: missing or unexpected tensors (or shapes) raise."""
    d = Path(model_dir)
    config = json.loads((d / "config.json").read_text())
    if dtype is None:  # transformers >= 4.56 writes `dtype`, older versions `torch_dtype`
        dtype = {v: k for k, v in DTYPE_NAMES.items()}[config.get("dtype") or config.get("torch_dtype", "float32")]
    model = BailingMoeV3Ref(BailingConfigRef.from_dict(config), dtype)
    tensors = read_tensors(d)
    sd = model.state_dict()
    expected = set(checkpoint_names(model))
    missing, unexpected = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
    if missing or unexpected:
        raise KeyError(f"checkpoint mismatch: missing {missing[:8]} ({len(missing)}), "
                       f"unexpected {unexpected[:8]} ({len(unexpected)})")
    with torch.no_grad():
        for name in expected:
            t = tensors[name]
            if t.shape != sd[name].shape:
                raise ValueError(f"{name}: checkpoint shape {tuple(t.shape)} != model {tuple(sd[name].shape)}")
            sd[name].copy_(t.to(_param_dtype(name, dtype)))
    return model


def tiny_config(**overrides: Any) -> dict[str, Any]:
    """A small HF config dict with every feature on: KDA + MLA (+ a tail MLA layer), dense + MoE, q-LoRA off,
    MTP layer, clamps active (the limit lists cover the MTP layer too). 4 layers with group 3: layers 0,1 KDA,
    2 MLA, 3 MLA (tail), MTP layer 4 MLA. Includes the keys the math assumes, at the values Ling-3.0 ships."""
    cfg: dict[str, Any] = dict(
        hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4, head_dim=16,
        vocab_size=128, rms_norm_eps=1e-6, rope_theta=6e6, partial_rotary_factor=0.5, layer_group_size=3,
        first_k_dense_replace=1, num_experts=16, num_experts_per_tok=4, num_shared_experts=1,
        moe_intermediate_size=32, moe_shared_expert_intermediate_size=32, n_group=4, topk_group=2,
        routed_scaling_factor=2.5, norm_topk_prob=True, q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, short_conv_kernel_size=4, kda_lower_bound=-5.0,
        num_nextn_predict_layers=1, tie_word_embeddings=False, max_position_embeddings=4096,
        expert_swiglu_limit_list=[0.0, 0.0, 0.0, 1.0, 1.0], share_expert_swiglu_limit_list=[0.0, 0.0, 0.5, 0.5, 2.0],
        apply_swiglu_clamps=True, kda_safe_gate=True, no_kda_lora=True, rope_interleave=True, use_qkv_bias=False,
        gated_attention_proj_granularity_type="head_wise", hidden_act="silu")
    cfg.update(overrides)
    return cfg
