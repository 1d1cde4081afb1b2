"""The reduced draft vocabulary (ling_jax/draft_vocab.py): hot tokens from counts, EAGLE-3's d2t / t2d both ways
and on disk, every inconsistent file an error, the draft's logits against the full lm_head, and lossless NEXTN
(greedy with the reduced draft vocabulary equals plain greedy)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from compile.stages import slice_config
from ling_jax import draft_vocab
from ling_jax.config import get_preset
from ling_jax.errors import CheckpointError
from ling_jax.model import lm_logits
from ling_jax.runner import Generator
from ling_jax.safetensors_io import save_file
from ling_jax.spec import SpecConfig
from ling_jax.weights import init_params

PROMPTS = [[3, 7, 1, 9, 4], [11, 2, 2, 5, 8, 10, 6, 1, 3]]


def test_hot_tokens_are_the_most_frequent_with_ties_to_the_lower_id():
    counts = np.array([5, 0, 9, 5, 1, 9, 0, 5])
    assert draft_vocab.hot_tokens(counts, 3).tolist() == [0, 2, 5]  # 9, 9, then the first 5 (id 0)
    assert draft_vocab.hot_tokens(counts, 5).tolist() == [0, 2, 3, 5, 7]
    with pytest.raises(ValueError, match="n=9"):
        draft_vocab.hot_tokens(counts, 9)


def test_eagle3_layout_round_trip_on_disk(tmp_path):
    ids = np.array([0, 3, 4, 10, 15], np.int32)
    d2t, t2d = draft_vocab.to_eagle3(ids, 16)
    # EAGLE-3: target id = draft id + d2t[draft id]; t2d marks the target ids in the draft vocabulary
    assert d2t.dtype == np.int64 and d2t.tolist() == [0, 2, 2, 7, 11]
    assert [i + d2t[i] for i in range(5)] == ids.tolist()
    assert t2d.dtype == bool and np.flatnonzero(t2d).tolist() == ids.tolist()
    draft_vocab.save(str(tmp_path / draft_vocab.FILE), ids, 16, source="unit test", tokens_counted=42)
    np.testing.assert_array_equal(draft_vocab.load(str(tmp_path), 16), ids)  # a directory: its draft_vocab file
    assert draft_vocab.metadata(str(tmp_path / draft_vocab.FILE)) == {"source": "unit test", "tokens_counted": "42"}


@pytest.mark.parametrize("tensors,match", [
    ({"d2t": np.array([0, 2], np.int64), "t2d": np.eye(1, 16, 0, bool)[0]}, "t2d marks 1 tokens but d2t maps 2"),
    ({"d2t": np.array([0, -1], np.int64), "t2d": np.zeros(16, bool)}, "ascending distinct"),
    ({"d2t": np.array([0, 2], np.int64), "t2d": np.zeros(8, bool)}, "vocabulary is 16"),
    ({"d2t": np.array([0, 2], np.int64)}, "missing \\['t2d'\\]"),
])
def test_inconsistent_file_is_an_error(tmp_path, tensors, match):
    path = str(tmp_path / "dv.safetensors")
    save_file(tensors, path)
    with pytest.raises(CheckpointError, match=match):
        draft_vocab.load(path, 16)


def test_draft_logits_are_the_full_head_on_the_hot_set_and_minus_inf_elsewhere():
    V, D = 512, 64
    k = jax.random.split(jax.random.key(0), 3)
    params = {"embed": jax.random.normal(k[0], (V, D)), "lm_head": jax.random.normal(k[1], (V, D))}
    ids = np.array([1, 5, 77, 300, 511], np.int32)
    h = jax.random.normal(k[2], (2, 3, D), jnp.float32)
    got = np.asarray(draft_vocab.draft_logits(draft_vocab.with_draft_vocab(params, ids), h))
    full = np.asarray(lm_logits(params, h))
    np.testing.assert_allclose(got[..., ids], full[..., ids], rtol=1e-5, atol=1e-5)
    rest = np.setdiff1d(np.arange(V), ids)
    assert np.all(np.isneginf(got[..., rest]))
    np.testing.assert_array_equal(np.asarray(draft_vocab.draft_logits(params, h)), full)  # none: the full head
    assert "draft_vocab" not in draft_vocab.with_draft_vocab(draft_vocab.with_draft_vocab(params, ids), None)


def test_nextn_with_reduced_draft_vocab_equals_plain_greedy():
    # 12 tokens: random drafts agree with the target often enough to exercise acceptance (tests/test_spec.py);
    # test-tiny's first 3 layers keep every layer kind
    cfg = slice_config(get_preset("test-tiny"), 3).replace(vocab_size=12, eos_token_id=1, pad_token_id=0)
    params = init_params(cfg, 0, jnp.float32)
    kw = dict(max_len=128, chunked_prefill_size=16, dtype=jnp.float32)
    plain = Generator(cfg, params, **kw)
    want = [plain.generate(p, max_new_tokens=96, stop_token_ids=())[0] for p in PROMPTS]
    counts = np.bincount(np.concatenate(want), minlength=cfg.vocab_size)
    ids = draft_vocab.hot_tokens(counts, 6)  # half the vocabulary: some of the target's tokens are never drafted
    assert not np.isin(np.concatenate(want), ids).all()
    spec = Generator(cfg, draft_vocab.with_draft_vocab(params, ids), spec=SpecConfig("NEXTN", 3), **kw)
    accepts = []
    for p, w in zip(PROMPTS, want):
        got, stats = spec.generate(p, max_new_tokens=96, stop_token_ids=())
        assert got == w, f"first divergence at {next(i for i, (a, b) in enumerate(zip(got, w)) if a != b)}"
        accepts += stats.accept_lengths
    assert max(accepts) > 1 and min(accepts) == 1  # drafts accepted, and some rejected
