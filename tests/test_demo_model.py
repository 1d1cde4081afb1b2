"""The shipped demo checkpoint (models/ling-demo): loads, NEXTN is lossless on it, drafts get accepted, and its
tokenizer round-trips held-out stdlib files."""

import functools
import json
import os

import jax.numpy as jnp
import pytest

from ling_jax.config import load_config
from ling_jax.runner import Generator
from ling_jax.spec import SpecConfig
from ling_jax.tokenizer import load_tokenizer
from ling_jax.train import corpus
from ling_jax.weights import load_params

MODEL = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models", "ling-demo")
NEW_TOKENS = 64

pytestmark = pytest.mark.skipif(not os.path.exists(os.path.join(MODEL, "model.safetensors.index.json")),
                                reason="models/ling-demo is not checked out")


@functools.lru_cache(maxsize=None)
def model():
    """The bf16 checkpoint upcast (exactly) to float32: in fp32 the 1-row decode and the multi-row verify agree to
    rounding, so greedy NEXTN must equal plain greedy token for token. (In bf16 they round differently and
    near-tied greedy choices can flip; bench/eval_accept.py --dtype bfloat16 reports how often.)"""
    cfg = load_config(MODEL)
    return cfg, load_params(cfg, MODEL, dtype=jnp.float32), load_tokenizer(MODEL)


def heldout_texts() -> list[str]:
    root, paths = corpus.stdlib_files()
    out = []
    for p in paths:
        if corpus.heldout(p, 2):
            with open(os.path.join(root, p), "rb") as f:
                try:
                    out.append(f.read().decode("utf-8"))
                except UnicodeDecodeError:
                    pass
    return out


def heldout_prompt(n: int = 32) -> list[int]:
    """n tokens from inside the held-out file http/client.py (a function body: code, not license text)."""
    _, _, tok = model()
    root, _ = corpus.stdlib_files()
    text = open(os.path.join(root, "http", "client.py"), encoding="utf-8").read()
    start = text.index("    def _read_status(self):")
    return tok.encode(text[start:])[:n]


def test_checkpoint_config_and_tokenizer():
    cfg, params, tok = model()
    assert cfg.vocab_size == 4096 and cfg.num_nextn_predict_layers == 1 and cfg.eos_token_id == 0
    with open(os.path.join(MODEL, "config.json")) as f:
        assert json.load(f)["torch_dtype"] == "bfloat16"
    assert params["mtp"][0]["mlp"]["expert_bias"].dtype == jnp.float32
    assert tok.eos_ids == (0,) and tok.token_id("<|pad|>") == 1
    assert "<|assistant|>" in tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_tokenizer_round_trips_heldout_files():
    _, _, tok = model()
    texts = heldout_texts()
    assert len(texts) >= 5
    for text in texts:
        assert tok.decode(tok.encode(text)) == text


def test_nextn_is_lossless_and_accepts_drafts():
    cfg, params, _ = model()
    prompt = heldout_prompt()
    max_len = 160
    plain, _ = Generator(cfg, params, max_len=max_len, dtype=jnp.float32).generate(
        prompt, max_new_tokens=NEW_TOKENS, stop_token_ids=())
    assert len(plain) == NEW_TOKENS
    for k in (1, 5):
        out, stats = Generator(cfg, params, spec=SpecConfig("NEXTN", k), max_len=max_len, dtype=jnp.float32).generate(
            prompt, max_new_tokens=NEW_TOKENS, stop_token_ids=())
        assert out == plain, f"NEXTN steps={k} differs from plain greedy"
        if k == 5:
            assert stats.mean_accept_length > 1.5, stats.as_dict()


def test_deterministic_inference_bf16_greedy_equals_plain_256_tokens():
    """The correctness gate in bf16: with RuntimeOptions.target_rows (every target pass runs one fixed row count),
    256 greedy tokens of NEXTN (steps 3 and 5) are byte-identical to plain greedy. Without it, bf16 decode rows
    (1-row matmuls) and verify rows (K+1-row matmuls) round differently and near-ties flip (2 of 8 prompts identical
    on ling-demo, bench/results/eval-accept-h200-bf16-2026-11-30.json)."""
    from ling_jax.model import Numerics, RuntimeOptions
    from ling_jax.spec import deterministic_rows

    cfg = load_config(MODEL)
    params = load_params(cfg, MODEL, dtype=jnp.bfloat16)
    _, _, tok = model()
    root, _ = corpus.stdlib_files()
    text = open(os.path.join(root, "http", "client.py"), encoding="utf-8").read()
    prompts = [tok.encode(text[text.index(s):])[:48] for s in
               ("    def _read_status(self):", "    def begin(self):", "    def _safe_read(self, amt):")]
    kw = dict(max_len=48 + 256 + 32, dtype=jnp.bfloat16)
    opts = RuntimeOptions(numerics=Numerics(target_rows=deterministic_rows(6)))
    assert opts.numerics.target_rows == 8
    plain = Generator(cfg, params, opts=opts, **kw)
    want = [plain.generate(p, max_new_tokens=256, stop_token_ids=())[0] for p in prompts]
    for k in (3, 5):
        gen = Generator(cfg, params, spec=SpecConfig("NEXTN", k), opts=opts, **kw)
        for p, w in zip(prompts, want):
            out, stats = gen.generate(p, max_new_tokens=256, stop_token_ids=())
            assert out == w, f"steps={k}: first difference at {next(i for i, (a, b) in enumerate(zip(out, w)) if a != b)}"
            assert stats.mean_accept_length > 1.3, stats.as_dict()
