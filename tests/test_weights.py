"""Checkpoint I/O: HF safetensors both ways, orbax, parameter counts, and every error case."""

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
    assert count(get_preset("ling3-flash")) == 127_486_405_600
    c = get_preset("ling3-flash").param_counts()
    assert c["total"] == 127_486_405_600 and c["float32"] == 165_472
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
    a, b = init_params(cfg, 7, jnp.float32), init_params(cfg, 7, jnp.float32)
    jax.tree.map(np.testing.assert_array_equal, a, b)
    c = init_params(cfg, 8, jnp.float32)
    assert not np.array_equal(a["embed"], c["embed"])
    for info in array_spec(cfg):
        leaf = get_path(a, info.path)
        assert leaf.shape == info.shape and np.all(np.isfinite(leaf)) and float(jnp.std(leaf)) > 0 or info.init == "ones"
        assert leaf.dtype == (jnp.float32 if info.dtype == "float32" else jnp.float32)


# ---- error cases: each names the tensor or file, expected vs found -------------------------------------------


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _rewrite_single(ckpt_dir, mutate):
    """Rewrite a one-file checkpoint through `mutate(dict of numpy arrays)`."""
    path = os.path.join(ckpt_dir, "model.safetensors")
    sf = SafetensorsFile(path)
    tensors = {n: np.array(sf.tensor(n)) for n in sf.header}
    mutate(tensors)
    save_file(tensors, path)


@pytest.fixture
def single_ckpt(tmp_path):
    cfg = get_preset("test-tiny")
    d = tmp_path / "ok"
    save_hf_checkpoint(cfg, init_params(cfg, 1, jnp.bfloat16), str(d))
    return cfg, str(d)


def test_missing_tensor_is_named(single_ckpt, tmp_path):
    cfg, d = single_ckpt
    d = _copy(d, tmp_path / "missing")
    _rewrite_single(d, lambda t: t.pop("model.layers.1.attention.A_log"))
    with pytest.raises(CheckpointError, match=r"missing 1 tensor\(s\) \['model.layers.1.attention.A_log'\]"):
        load_hf_checkpoint(cfg, d)


def test_extra_tensor_is_named(single_ckpt, tmp_path):
    cfg, d = single_ckpt
    d = _copy(d, tmp_path / "extra")
    _rewrite_single(d, lambda t: t.__setitem__("model.layers.0.attention.bogus", np.zeros(3, np.float32)))
    with pytest.raises(CheckpointError, match=r"unexpected 1 tensor\(s\) \['model.layers.0.attention.bogus'\]"):
        load_hf_checkpoint(cfg, d)


def test_wrong_shape_is_named(single_ckpt, tmp_path):
    cfg, d = single_ckpt
    d = _copy(d, tmp_path / "shape")
    name = "model.layers.2.attention.kv_b_proj.weight"
    _rewrite_single(d, lambda t: t.__setitem__(name, t[name][:-1]))
    with pytest.raises(CheckpointError, match=rf"{name}: expected shape \(256, 64\), found \(255, 64\)"):
        load_hf_checkpoint(cfg, d)


def test_wrong_dtype_is_named(single_ckpt, tmp_path):
    cfg, d = single_ckpt
    d = _copy(d, tmp_path / "dtype")
    name = "model.layers.3.mlp.gate.expert_bias"
    _rewrite_single(d, lambda t: t.__setitem__(name, t[name].astype(np.float16)))
    with pytest.raises(CheckpointError, match=rf"{name}: expected dtype float32, found float16"):
        load_hf_checkpoint(cfg, d)


def test_truncated_file_is_named(single_ckpt, tmp_path):
    cfg, d = single_ckpt
    d = _copy(d, tmp_path / "trunc")
    path = os.path.join(d, "model.safetensors")
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size - 100)
    with pytest.raises(CheckpointError, match=r"model.safetensors: truncated: tensor .* ends at byte"):
        load_hf_checkpoint(cfg, d)


def test_missing_shard_and_unknown_model_type(torch_ckpt, tmp_path):
    ckpt, _ = torch_ckpt
    d = _copy(ckpt, tmp_path / "shard")
    cfg = from_hf_config(d)
    os.remove(os.path.join(d, "model-00002-of-00003.safetensors"))
    with pytest.raises(CheckpointError, match=r"shard .*model-00002-of-00003.safetensors .* does not exist"):
        load_hf_checkpoint(cfg, d)
    conf = json.loads(open(os.path.join(d, "config.json")).read())
    conf["model_type"] = "bailing_moe"
    open(os.path.join(d, "config.json"), "w").write(json.dumps(conf))
    with pytest.raises(ValueError, match="unsupported model_type 'bailing_moe'"):
        from_hf_config(d)


def test_no_checkpoint_files(tmp_path):
    cfg = get_preset("test-tiny")
    (tmp_path / "config.json").write_text(json.dumps(to_hf_dict(cfg)))
    with pytest.raises(CheckpointError, match="neither model.safetensors.index.json nor model.safetensors"):
        load_hf_checkpoint(cfg, str(tmp_path))
