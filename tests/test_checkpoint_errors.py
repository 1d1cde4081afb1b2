"""Every checkpoint problem is one CheckpointError whose message is one line naming the file or tensor, expected vs
found; `python -m ling_jax.generate` and `python -m serve.launch_server` print it as `error: <message>` and exit 2
(no traceback). Cases: truncated file, wrong shape, missing / extra tensor, wrong dtype, corrupt safetensors header,
corrupt index, corrupt tokenizer.json, config.json (missing key, bad value, corrupt JSON), non-finite values
(--check-weights)."""

import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ling_jax import generate
from ling_jax.config import from_hf_config, get_preset
from ling_jax.errors import CheckpointError
from ling_jax.safetensors_io import SafetensorsFile, save_file
from ling_jax.tokenizer import load_tokenizer
from ling_jax.weights import abstract_params, load_hf_checkpoint, save_hf_checkpoint, validate_checkpoint
from serve import launch_server

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CFG = get_preset("test-tiny")


def _params(seed: int) -> dict:
    """Random numpy parameters of the right shapes and dtypes (no device work: these tests never run the model)."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda s: (0.1 * rng.standard_normal(s.shape)).astype(s.dtype),
                        abstract_params(CFG, jnp.bfloat16))


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """A valid bf16 test-tiny checkpoint in one file, with a (tiny) tokenizer.json."""
    from tokenizers import Tokenizer, models

    d = tmp_path_factory.mktemp("good")
    save_hf_checkpoint(CFG, _params(1), str(d))
    Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]")).save(str(d / "tokenizer.json"))
    return str(d)


@pytest.fixture
def ckpt(good, tmp_path):
    """A fresh copy of the good checkpoint for one test to break."""
    return shutil.copytree(good, tmp_path / "ckpt")


def _rewrite(ckpt_dir, mutate):
    """Rewrite the one-file checkpoint through `mutate(dict of numpy arrays)`."""
    path = os.path.join(ckpt_dir, "model.safetensors")
    sf = SafetensorsFile(path)
    tensors = {n: np.array(sf.tensor(n)) for n in sf.header}
    mutate(tensors)
    save_file(tensors, path)


def _raises(fn, message: str):
    """fn() raises a CheckpointError with exactly `message` (one line)."""
    with pytest.raises(CheckpointError) as e:
        fn()
    assert "\n" not in str(e.value)
    assert str(e.value) == message
    return message


def _config(ckpt_dir, edit):
    path = os.path.join(ckpt_dir, "config.json")
    with open(path) as f:
        d = json.load(f)
    edit(d)
    with open(path, "w") as f:
        json.dump(d, f)
    return path


# ---- the CLIs: one line on stderr, exit status 2 ------------------------------------------------------------


def _cli(module, *args):
    r = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True,
                       timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert "Traceback" not in r.stderr, r.stderr
    return r.returncode, r.stderr.strip().splitlines()


def test_generate_cli_truncated_file_one_line_exit_2(ckpt):
    path = os.path.join(ckpt, "model.safetensors")
    sf, size = SafetensorsFile(path), os.path.getsize(path)
    last = max(sf.header, key=lambda n: sf.header[n][2])  # the tensor stored last (> 100 bytes) is cut
    end = sf.data_start + sf.header[last][2] + sf.tensor(last).nbytes
    assert end == size
    with open(path, "r+b") as f:
        f.truncate(size - 100)
    rc, err = _cli("ling_jax.generate", "--model", str(ckpt), "--prompt-ids", "1,2", "--max-new-tokens", "1")
    assert rc == 2
    assert err[-1] == f"error: {path}: truncated: tensor {last} ends at byte {end}, file has {size - 100}"


def test_generate_cli_config_missing_key_one_line_exit_2(ckpt):
    path = _config(ckpt, lambda d: d.pop("num_hidden_layers"))
    rc, err = _cli("ling_jax.generate", "--model", str(ckpt), "--prompt-ids", "1,2", "--max-new-tokens", "1")
    assert rc == 2 and err[-1] == f"error: {path}: missing required key 'num_hidden_layers'"


def test_server_cli_wrong_dtype_one_line_exit_2(ckpt):
    name = "model.layers.2.attention.kv_b_proj.weight"
    _rewrite(ckpt, lambda t: t.__setitem__(name, t[name].astype(np.float32)))
    rc, err = _cli("serve.launch_server", "--model-path", str(ckpt), "--port", "1")
    path = os.path.join(ckpt, "model.safetensors")
    assert rc == 2 and err[-1] == f"error: {path}: tensor {name}: expected dtype bfloat16, found float32"


def test_cli_mains_report_checkpoint_errors(ckpt, capsys):
    """In-process: both mains return 2 with one line for a missing tensor, a corrupt tokenizer.json, a
    non-finite value under --check-weights; --check-weights of a preset is a usage error."""
    name = "model.layers.1.attention.A_log"
    _rewrite(ckpt, lambda t: t.pop(name))
    want = f"{ckpt}: checkpoint does not match ckpt: missing 1 tensor(s) ['{name}'], unexpected 0 tensor(s) []"
    for main, argv in ((generate.main, ["--model", str(ckpt), "--prompt-ids", "1"]),
                       (launch_server.main, ["--model-path", str(ckpt)])):
        assert main(argv) == 2
        assert capsys.readouterr().err.strip().splitlines()[-1] == f"error: {want}"
    assert generate.main(["--model", "test-tiny", "--prompt-ids", "1", "--check-weights"]) == 2
    assert "--check-weights checks a checkpoint directory" in capsys.readouterr().err
    assert launch_server.main(["--model-path", str(ckpt), "--random-weights", "--check-weights"]) == 2
    assert "--check-weights checks a checkpoint directory's files" in capsys.readouterr().err


def test_check_weights_names_the_non_finite_tensor(ckpt, capsys):
    name = "model.layers.2.mlp.experts.5.up_proj.weight"

    def poison(t):
        t[name] = t[name].copy()
        t[name][3, 7] = np.inf
        t[name][4, 0] = np.nan

    _rewrite(ckpt, poison)
    validate_checkpoint(CFG, str(ckpt))  # off by default: names, shapes and dtypes are fine
    want = (f"{os.path.join(ckpt, 'model.safetensors')}: tensor {name}: expected finite values, found 2 inf/nan "
            f"(first at index (3, 7): inf)")
    _raises(lambda: validate_checkpoint(CFG, str(ckpt), check_finite=True), want)
    assert generate.main(["--model", str(ckpt), "--prompt-ids", "1", "--check-weights"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"error: {want}"


# ---- safetensors files ----------------------------------------------------------------------------------------


def test_wrong_shape_is_named(ckpt):
    name = "model.layers.2.attention.kv_b_proj.weight"
    _rewrite(ckpt, lambda t: t.__setitem__(name, t[name][:-1]))
    path = os.path.join(ckpt, "model.safetensors")
    _raises(lambda: load_hf_checkpoint(CFG, str(ckpt)),
            f"{path}: tensor {name}: expected shape (256, 64), found (255, 64)")


def test_extra_tensor_is_named(ckpt):
    _rewrite(ckpt, lambda t: t.__setitem__("model.layers.0.attention.bogus", np.zeros(3, np.float32)))
    _raises(lambda: load_hf_checkpoint(CFG, str(ckpt)), f"{ckpt}: checkpoint does not match test-tiny: missing 0 "
            f"tensor(s) [], unexpected 1 tensor(s) ['model.layers.0.attention.bogus']")


def test_wrong_dtype_is_named_and_bf16_scalars_load(ckpt):
    path = os.path.join(ckpt, "model.safetensors")
    name = "model.layers.3.mlp.gate.expert_bias"
    _rewrite(ckpt, lambda t: t.__setitem__(name, t[name].astype(np.float16)))
    _raises(lambda: load_hf_checkpoint(CFG, str(ckpt)),
            f"{path}: tensor {name}: expected dtype float32 or bfloat16, found float16")
    # stored in the checkpoint dtype (bf16), as model.to(bf16).save_pretrained writes it: loads, upcast to f32
    import ml_dtypes

    _rewrite(ckpt, lambda t: t.__setitem__(name, t[name].astype(ml_dtypes.bfloat16)))
    params = load_hf_checkpoint(CFG, str(ckpt))
    got = params["layers"][3]["mlp"]["expert_bias"]
    assert got.dtype == jnp.float32
    np.testing.assert_array_equal(got, SafetensorsFile(path).tensor(name).astype(np.float32))


def test_truncated_and_corrupt_headers_are_named(ckpt):
    path = os.path.join(ckpt, "model.safetensors")
    raw = open(path, "rb").read()
    n = int.from_bytes(raw[:8], "little")
    bad = bytearray(raw)
    bad[8:12] = b"{{x:"  # not JSON any more
    open(path, "wb").write(bytes(bad))
    with pytest.raises(CheckpointError) as e:
        load_hf_checkpoint(CFG, str(ckpt))
    assert str(e.value).startswith(f"{path}: corrupt safetensors header: expected JSON, found ")
    assert "\n" not in str(e.value)
    header = json.loads(raw[8:8 + n])
    name = next(k for k in header if k != "__metadata__")
    header[name] = {"dtype": "BF16", "shape": [2]}
    blob = json.dumps(header).encode()
    open(path, "wb").write(len(blob).to_bytes(8, "little") + blob + raw[8 + n:])
    _raises(lambda: load_hf_checkpoint(CFG, str(ckpt)), f"{path}: corrupt safetensors header: tensor {name}: "
            f"expected {{dtype, shape, data_offsets}}, found {json.dumps(header[name])}")
    open(path, "wb").write(raw[:5])
    _raises(lambda: SafetensorsFile(path), f"{path}: truncated: expected an 8-byte header length, found 5 bytes")
    open(path, "wb").write((10**9).to_bytes(8, "little") + raw[8:100])
    _raises(lambda: SafetensorsFile(path),
            f"{path}: truncated or not safetensors: the header length says {10**9 + 8} bytes, the file has 100")


def test_sharded_checkpoint_errors_are_named(tmp_path):
    d = tmp_path / "sharded"
    save_hf_checkpoint(CFG, _params(2), str(d), max_shard_bytes=300_000)
    index = os.path.join(d, "model.safetensors.index.json")
    weight_map = json.load(open(index))["weight_map"]
    shard = sorted(set(weight_map.values()))[1]
    first = next(n for n, f in weight_map.items() if f == shard)
    os.rename(d / shard, d / "moved")
    _raises(lambda: load_hf_checkpoint(CFG, str(d)),
            f"shard {os.path.join(d, shard)} named in {index} (for {first}) does not exist")
    os.rename(d / "moved", d / shard)
    open(index, "w").write('{"weight_map": ')
    with pytest.raises(CheckpointError, match=rf"^{index}: corrupt index: expected JSON, found "):
        load_hf_checkpoint(CFG, str(d))
    for f in set(weight_map.values()) | {index}:
        os.remove(d / f)
    _raises(lambda: load_hf_checkpoint(CFG, str(d)),
            f"{d}: neither model.safetensors.index.json nor model.safetensors")


# ---- tokenizer files ------------------------------------------------------------------------------------------


def test_corrupt_tokenizer_files_are_named(ckpt):
    tok = os.path.join(ckpt, "tokenizer.json")
    assert load_tokenizer(str(ckpt)).tok.token_to_id("b") == 1
    open(tok, "w").write('{"version": "1.0", "model": ')
    with pytest.raises(CheckpointError) as e:
        load_tokenizer(str(ckpt))
    assert str(e.value).startswith(f"{tok}: corrupt tokenizer.json: expected a `tokenizers` JSON file, found ")
    assert "\n" not in str(e.value)
    os.remove(tok)
    assert load_tokenizer(str(ckpt)) is None  # no tokenizer.json at all: token ids only, not an error


def test_corrupt_tokenizer_config_is_named(good, tmp_path):
    d = shutil.copytree(good, tmp_path / "tc")
    conf = os.path.join(d, "tokenizer_config.json")
    open(conf, "w").write("[1, 2")
    with pytest.raises(CheckpointError, match=rf"^{conf}: corrupt tokenizer_config.json: expected JSON, found "):
        load_tokenizer(str(d))


# ---- config.json ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("edit,message", [
    (lambda d: d.pop("num_hidden_layers"), "missing required key 'num_hidden_layers'"),
    (lambda d: d.pop("head_dim"), "missing required key 'head_dim'"),
    (lambda d: d.update(kda_safe_gate=False),
     "kda_safe_gate=False is not implemented (ling_jax implements kda_safe_gate=True, what Ling-3.0 ships)"),
    (lambda d: d.update(rope_interleave=False),
     "rope_interleave=False is not implemented (ling_jax implements rope_interleave=True, what Ling-3.0 ships)"),
    (lambda d: d.update(use_qkv_bias=True),
     "use_qkv_bias=True is not implemented (ling_jax implements use_qkv_bias=False, what Ling-3.0 ships)"),
    (lambda d: d.update(no_kda_lora=False),
     "no_kda_lora=False is not implemented (ling_jax implements no_kda_lora=True, what Ling-3.0 ships)"),
    (lambda d: d.update(gated_attention_proj_granularity_type="element_wise"),
     "gated_attention_proj_granularity_type='element_wise' is not implemented (ling_jax implements "
     "gated_attention_proj_granularity_type='head_wise', what Ling-3.0 ships)"),
    (lambda d: d.update(gated_attention_proj_granularity_type=None),
     "gated_attention_proj_granularity_type=None is not implemented (ling_jax implements "
     "gated_attention_proj_granularity_type='head_wise', what Ling-3.0 ships)"),
    (lambda d: d.update(hidden_act="gelu"),
     "hidden_act='gelu' is not implemented (ling_jax implements hidden_act='silu', what Ling-3.0 ships)"),
    (lambda d: d.update(expert_swiglu_limit_list=[0.5] * 3),
     "expert_swiglu_limit_list: expected a list of 6 (num_hidden_layers) or 7 (+ num_nextn_predict_layers) "
     "limits, found 3 entries"),
    (lambda d: d.update(share_expert_swiglu_limit_list=[0, 0, 0, 0, -1.0, 0]),
     "share_expert_swiglu_limit_list[4]: expected a limit >= 0 (0 = off), found -1.0"),
    (lambda d: d.update(routed_swiglu_limits=[0.0] * 7),
     "routed_swiglu_limits is not a BailingMoeV3 key: write the limits as expert_swiglu_limit_list"),
    (lambda d: d.update(hidden_size="128"), "hidden_size: expected int, found '128'"),
    (lambda d: d.update(norm_topk_prob=1), "norm_topk_prob: expected bool, found 1"),
    (lambda d: d.update(rope_parameters={"rope_type": "yarn", "factor": 4.0}),
     "rope_parameters={'rope_type': 'yarn', 'factor': 4.0} is not supported (expected rope_type 'default', "
     "no scaling)"),
    (lambda d: d.update(rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
     "rope_theta=6000000.0 disagrees with rope_parameters.rope_theta=10000.0"),
    (lambda d: d.update(model_type="bailing_moe"),
     "unsupported model_type 'bailing_moe' (expected one of ('bailing_hybrid',))"),
    (lambda d: d.update(num_experts=0), "num_experts=0 must be >= 1"),
])
def test_config_json_errors_name_the_key(ckpt, edit, message):
    path = _config(ckpt, edit)
    _raises(lambda: from_hf_config(str(ckpt)), f"{path}: {message}")


def test_config_json_unreadable_and_dtype_keys(ckpt):
    path = os.path.join(ckpt, "config.json")
    good = open(path).read()
    open(path, "w").write('{"model_type": ')
    with pytest.raises(CheckpointError, match=rf"^{path}: corrupt config.json: expected JSON, found "):
        from_hf_config(str(ckpt))
    os.remove(path)
    _raises(lambda: from_hf_config(str(ckpt)), f"{path}: no such file (a checkpoint directory holds its config.json)")
    open(path, "w").write(good)
    # dtype (transformers >= 4.56) and torch_dtype (older) must agree; either alone names the dtype
    _config(ckpt, lambda d: d.update(dtype="float32"))
    _raises(lambda: load_hf_checkpoint(CFG, str(ckpt)),
            f"{path}: dtype='float32' disagrees with torch_dtype='bfloat16'")
    _config(ckpt, lambda d: (d.pop("dtype"), d.update(torch_dtype="int8")))
    _raises(lambda: load_hf_checkpoint(CFG, str(ckpt)),
            f"{path}: torch_dtype='int8' is not supported (expected one of ['bfloat16', 'float16', 'float32'])")
    _config(ckpt, lambda d: (d.pop("torch_dtype"), d.update(dtype="float32")))
    _raises(lambda: validate_checkpoint(CFG, str(ckpt)), f"{os.path.join(ckpt, 'model.safetensors')}: tensor "
            "model.word_embeddings.weight: expected dtype float32, found bfloat16")
    _config(ckpt, lambda d: d.pop("dtype"))  # neither key: the stored embedding's dtype
    validate_checkpoint(CFG, str(ckpt))
