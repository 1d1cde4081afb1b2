"""Checkpoint I/O: HF safetensors both ways (ours, the torch writer's, transformers' save_pretrained), orbax,
parameter counts, config.json keys as real checkpoints write them. The error cases: tests/test_checkpoint_errors.py."""

import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from ling_jax.config import from_hf_config, get_preset, to_hf_dict
from ling_jax.safetensors_io import CheckpointError, SafetensorsFile, save_file
from ling_jax.weights import (
    array_spec, count, get_path, init_params, load_hf_checkpoint, param_spec, restore_orbax, save_hf_checkpoint,
    save_orbax,
)


def test_param_counts_match_published_totals():
    """The published totals are the Hugging Face Hub's safetensors metadata of the released checkpoints (the
    "Safetensors" panel of each model page, i.e. https://huggingface.co/api/models/<repo>?expand[]=safetensors):
    inclusionAI/Ling-3.0-flash: total 127,486,405,600 parameters, of them F32 165,472 (BF16 127,486,240,128);
    inclusionAI/Ling-3.0-tiny: total 7,893,392,800 (the BF16 GGUF conversion reports the same n_params in
    llama.cpp). /work/shared/LING3_MODEL.md records that recomputing them from the config reproduces both."""
    assert count(get_preset("ling3-flash")) == 127_486_405_600
    c = get_preset("ling3-flash").param_counts()
    assert c["total"] == 127_486_405_600 and c["float32"] == 165_472
    assert c["total"] - c["float32"] == 127_486_240_128
    assert get_preset("ling3-tiny").param_counts()["total_without_mtp"] == 7_893_392_800


def test_config_cli_prints_total():
    out = subprocess.run([sys.executable, "-m", "ling_jax.config", "--preset", "ling3-flash"], capture_output=True,
                         text=True, check=True).stdout
    assert "127,486,405,600" in out


def test_flash_layout_and_clamps():
    cfg = get_preset("ling3-flash")
    assert cfg.mla_layers == (5, 11, 17, 23, 29, 35, 41) and len(cfg.kda_layers) == 35
    assert cfg.routed_limit(35) == 4.0 and cfg.routed_limit(34) == 0.0
    assert cfg.shared_limit(34) == 5.0 and cfg.shared_limit(40) == 7.0 and cfg.shared_limit(33) == 0.0
    assert cfg.replace(apply_swiglu_clamps=False).routed_limit(35) == 0.0


def test_hf_config_round_trip_and_unknown_model_type(tmp_path):
    cfg = get_preset("test-wide")
    d = to_hf_dict(cfg)
    (tmp_path / "config.json").write_text(json.dumps(d))
    assert from_hf_config(str(tmp_path)).replace(name=cfg.name) == cfg
    d["model_type"] = "llama"
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match="unsupported model_type 'llama'"):
        from_hf_config(str(tmp_path))


@pytest.fixture(scope="module")
def torch_ckpt(tmp_path_factory):
    from tests.reference.checkpoint import write_random_checkpoint

    d = tmp_path_factory.mktemp("ref")
    model = write_random_checkpoint(to_hf_dict(get_preset("test-tiny")), d, seed=3, dtype=torch.bfloat16, shards=3)
    return str(d), model


def test_torch_written_checkpoint_loads_and_jax_written_loads_in_torch(torch_ckpt, tmp_path):
    from tests.reference.checkpoint import load_reference

    ckpt, model = torch_ckpt
    cfg = from_hf_config(ckpt)
    params = load_hf_checkpoint(cfg, ckpt, jnp.bfloat16)
    sd = model.state_dict()
    for name, e in param_spec(cfg).items():  # every tensor landed where the spec says, bit for bit
        leaf = np.asarray(get_path(params, e.path).astype(jnp.float32))
        got = leaf if e.stack_index is None else leaf[e.stack_index]
        np.testing.assert_array_equal(got, sd[name].float().numpy(), err_msg=name)
    out = tmp_path / "jax-written"
    save_hf_checkpoint(cfg, params, str(out), max_shard_bytes=200_000)
    assert (out / "model.safetensors.index.json").exists()
    back = load_reference(str(out))
    for name, t in back.state_dict().items():
        assert torch.equal(t, sd[name]), name
    again = load_hf_checkpoint(cfg, str(out), jnp.bfloat16)
    jax.tree.map(np.testing.assert_array_equal, again, params)


def test_orbax_round_trip(tmp_path):
    cfg = get_preset("test-qlora")
    params = init_params(cfg, 5, jnp.bfloat16)
    save_orbax(params, str(tmp_path / "orbax"))
    back = restore_orbax(cfg, str(tmp_path / "orbax"), jnp.bfloat16)
    jax.tree.map(np.testing.assert_array_equal, back, params)


def test_random_init_is_deterministic_and_not_degenerate():
    cfg = get_preset("test-tiny")
    a, b = init_params(cfg, 7, jnp.bfloat16), init_params(cfg, 7, jnp.bfloat16)
    jax.tree.map(np.testing.assert_array_equal, a, b)
    c = init_params(cfg, 8, jnp.bfloat16)
    assert not np.array_equal(a["embed"], c["embed"])
    n_f32 = 0
    for info in array_spec(cfg):
        leaf = get_path(a, info.path)
        assert leaf.shape == info.shape, info.path
        assert leaf.dtype == (jnp.float32 if info.dtype == "float32" else jnp.bfloat16), info.path
        values = np.asarray(leaf, np.float32)
        assert np.all(np.isfinite(values)) and values.std() > 0, info.path  # norms too: 1 + 0.1 N
        n_f32 += info.dtype == "float32"
    # A_log, dt_bias per KDA layer; expert_bias per MoE layer (the MTP layer's too)
    assert n_f32 == 2 * len(cfg.kda_layers) + sum(cfg.is_moe(i) for i in range(cfg.num_total_layers))


# ---- config.json and tensors as real checkpoints write them -------------------------------------------------------


def _real_style_config(**overrides):
    """The keys a released Ling-3.0 config.json carries beyond ours (transformers 5 style), on tiny dims."""
    from tests.reference.checkpoint import tiny_config

    d = tiny_config(expert_swiglu_limit_list=[0, 0, 0, 1.0], share_expert_swiglu_limit_list=[0, None, 0.5, 0.5],
                    rope_parameters={"rope_type": "default", "rope_theta": 6e6, "partial_rotary_factor": 0.5},
                    kda_lower_bound=-5, model_type="bailing_hybrid", architectures=["BailingMoeV3ForCausalLM"],
                    dtype="bfloat16", num_key_value_heads=4, use_qk_norm=True, router_dtype="fp32",
                    topk_method="noaux_tc", score_function="sigmoid", transformers_version="5.8.1")
    del d["apply_swiglu_clamps"], d["rope_theta"]
    d.update(overrides)
    return d


def test_config_keys_as_real_checkpoints_write_them():
    from ling_jax.config import from_hf_dict

    cfg = from_hf_dict(_real_style_config())
    assert cfg.rope_theta == 6e6 and cfg.kda_lower_bound == -5.0 and cfg.apply_swiglu_clamps
    # SGLang's reading of the lists: entry i limits layer i; null / 0 = off; past the end (the MTP layer 4) = off
    assert [cfg.routed_limit(i) for i in range(5)] == [0.0, 0.0, 0.0, 1.0, 0.0]
    assert [cfg.shared_limit(i) for i in range(5)] == [0.0, 0.0, 0.5, 0.5, 0.0]
    full = from_hf_dict(_real_style_config(expert_swiglu_limit_list=[0, 0, 0, 1.0, 4.0]))
    assert full.routed_limit(4) == 4.0  # a list covering the MTP layer too
    none = from_hf_dict(_real_style_config(expert_swiglu_limit_list=None, share_expert_swiglu_limit_list=None))
    assert none.routed_swiglu_limits == () and none.routed_limit(3) == 0.0
    assert from_hf_dict(_real_style_config(apply_swiglu_clamps=False)).routed_limit(3) == 0.0
    # any shape, not only ling3-flash's: the limits come from the checkpoint's own keys
    wide = to_hf_dict(get_preset("test-wide"))
    assert wide["expert_swiglu_limit_list"] == list(get_preset("test-wide").routed_swiglu_limits)
    assert "routed_swiglu_limits" not in wide and wide["kda_safe_gate"] is True


@pytest.mark.parametrize("dt", ["float32", "bfloat16"])
def test_save_pretrained_checkpoint_loads_and_matches_reference(tmp_path, dt):
    """A checkpoint written by transformers' own save_pretrained of `model.to(dtype)` (HF names, shard names and
    index, the `dtype` key, A_log / dt_bias / expert_bias in BF16 in a bf16 save, SGLang's clamp-list keys covering
    the target layers only, transformers-5 rope_parameters) loads unmodified, and the JAX logits match the torch
    reference run on the same files. rms_norm_eps = 1e-2 tells the MLA latent norms' fixed eps (1e-6) from the
    eps the other norms take: the fp32 match at 1e-5 needs both right."""
    from ling_jax.safetensors_io import DTYPES, open_checkpoint
    from ling_jax.state import init_state
    from tests.conftest import jitted_forward, rel_err
    from tests.reference.bailing_torch import SwiGLU
    from tests.reference.checkpoint import save_pretrained_checkpoint

    conf = _real_style_config(q_lora_rank=16, rms_norm_eps=1e-2)
    del conf["dtype"], conf["transformers_version"], conf["model_type"], conf["architectures"]  # save_pretrained's
    tdt, dtype = {"float32": (torch.float32, jnp.float32), "bfloat16": (torch.bfloat16, jnp.bfloat16)}[dt]
    ref = save_pretrained_checkpoint(conf, tmp_path, seed=4, dtype=tdt, expert_bias_std=2.0)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["dtype"] == dt and "torch_dtype" not in written and "transformers_version" in written
    assert written["architectures"] == ["BailingMoeV3ForCausalLM"] and written["model_type"] == "bailing_hybrid"
    assert (tmp_path / "model.safetensors.index.json").exists()
    where = open_checkpoint(str(tmp_path))
    for name in ("model.layers.0.attention.A_log", "model.layers.1.attention.dt_bias",
                 "model.layers.2.mlp.gate.expert_bias"):
        assert where[name].header[name][0] == DTYPES["BF16" if dt == "bfloat16" else "F32"], name

    cfg = from_hf_config(str(tmp_path))
    assert [cfg.routed_limit(i) for i in range(5)] == [0.0, 0.0, 0.0, 1.0, 0.0]
    params = load_hf_checkpoint(cfg, str(tmp_path), dtype)
    a_log = params["layers"][0]["attn"]["A_log"]
    assert a_log.dtype == jnp.float32  # upcast from BF16 in the bf16 save
    np.testing.assert_array_equal(a_log, ref.model.layers[0].attention.A_log.detach().numpy())

    tokens = np.asarray(jax.random.randint(jax.random.key(9), (2, 12), 0, cfg.vocab_size), np.int32)
    want = ref.forward(torch.from_numpy(tokens).long())["logits"].numpy()
    tol = 1e-5 if dt == "float32" else 2e-2

    logits, _ = jitted_forward(cfg, "prefill")(params, tokens, init_state(cfg, 2, 32, dtype), jnp.full((2,), 12))
    assert rel_err(logits, want) <= tol
    if dt == "float32":  # the clamps bite in this checkpoint: the reference without them is far off
        for module in ref.modules():
            if isinstance(module, SwiGLU):
                module.limit = 0.0
        assert rel_err(logits, ref.forward(torch.from_numpy(tokens).long())["logits"].numpy()) > 100 * tol
