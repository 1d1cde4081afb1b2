"""The DSpark trainer's anchors and its eval-anchor metric: --anchor-window puts the training step's anchors in the
first N generated positions after the pool's prompt (the positions the training step itself passes to the loss);
the heldout_eval_* metric equals a direct teacher-forced computation at every anchor of the window, and its
verify walk reproduces the accept lengths of the real greedy DSpark step (ling_jax.runner.Generator) step by step."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ling_jax.runner import Generator
from ling_jax.spec import SpecConfig
from ling_jax.train import dspark as train
from ling_jax.train.dspark_eval import eval_anchor_metrics, verify_walk, window_accepts
from tests.test_dspark import KW, draft_config, generator, model
from tests.test_dspark_parity import markov_draft
from tests.test_dspark_train_run import tiny_run

P, N, G = 6, 21, 4  # prompt, generated positions verified (not a multiple of the 8 anchors of a call), block
T = P + N + G + 3  # every slot's label inside the text


def anchors_of(tc, keys, B, T):
    return np.stack([np.asarray(train.train_anchors(jax.random.key(k), tc, B, T, G)) for k in keys])


def test_training_anchors_fall_in_the_window_and_cover_it():
    """[6, 26) of a 40-token window, 8 anchors a row, 4 rows, 50 keys: every anchor inside, distinct and sorted
    in its row, every position of the window drawn, none more than twice its uniform share (80)."""
    tc = train.DSparkTrainConfig(anchors=8, anchor_start=6, anchor_window=20)
    got = anchors_of(tc, range(50), 4, 40)
    assert got.shape == (50, 4, 8) and got.min() == 6 and got.max() == 25
    assert np.all(np.diff(got, axis=-1) > 0)
    counts = np.bincount(got.ravel(), minlength=40)[6:26]
    assert counts.min() > 40 and counts.max() < 160, counts
    with pytest.raises(ValueError, match="needs --seq >= 30"):
        tc.anchor_range(29, G)


def test_no_window_keeps_the_old_anchors():
    """anchor_window 0: the anchors of the old sampler (same key, same draws), over all of [0, T - G)."""
    tc = train.DSparkTrainConfig(anchors=8)
    got = anchors_of(tc, range(50), 4, 40)
    old = np.stack([np.asarray(jnp.sort(jnp.argsort(jax.random.uniform(jax.random.key(k), (4, 36)), axis=1)[:, :8],
                                        axis=1)) for k in range(50)])
    assert np.array_equal(got, old) and got.min() == 0 and got.max() == 35


def test_the_training_step_passes_window_anchors_to_the_loss(monkeypatch):
    """train_step (run eagerly) with 3 of 4 rows from a pool: the anchors it hands to `losses` in 5 steps all lie
    in [P, P + N), and the step still trains (finite loss, updated weights)."""
    cfg, params = model()
    dcfg = draft_config(cfg, G)
    tc = train.DSparkTrainConfig(batch=4, seq=T, anchors=8, distill_fraction=0.75, anchor_start=P, anchor_window=N,
                                 compute_dtype="float32")
    seen, real = [], train.losses

    def spy(dp, params, tokens, anchors, *rest):
        seen.append(np.asarray(anchors))
        return real(dp, params, tokens, anchors, *rest)

    monkeypatch.setattr(train, "losses", spy)
    rng = np.random.default_rng(0)
    corpus, pool = jnp.asarray(rng.integers(2, 12, 400), jnp.int32), jnp.asarray(rng.integers(2, 12, (5, T)), jnp.int32)
    tx = train.make_optimizer(0.0, 1.0)
    dp = dspark_params = markov_draft(dcfg, 1)
    opt_state = tx.init(dp)
    for i in range(5):
        dp, opt_state, m = train.train_step(dp, opt_state, params, corpus, pool, jax.random.key(i), jnp.float32(1e-3),
                                            cfg, dcfg, tc, tx)
        assert np.isfinite(float(m["loss"]))
    got = np.stack(seen)
    assert got.shape == (5, 4, 8) and got.min() >= P and got.max() < P + N
    assert len(np.unique(got)) > N // 2  # spread over the window, not one fixed set
    assert float(jnp.max(jnp.abs(dp["fc"]["weight"] - dspark_params["fc"]["weight"]))) > 0.0


@functools.lru_cache(maxsize=None)
def greedy_texts():
    """3 prompts of P tokens and their plain greedy continuation to T tokens (fp32 Generator, EOS ignored)."""
    prompts = [[3, 7, 2, 9, 4, 5], [11, 2, 2, 5, 8, 10], [6, 10, 4, 4, 2, 3]]
    return np.asarray([p + generator(0).generate(p, max_new_tokens=T - P, stop_token_ids=())[0] for p in prompts],
                      np.int32)


def eval_program(cfg, dcfg, anchors: int):
    tc = train.DSparkTrainConfig(batch=2, seq=T, anchors=anchors, compute_dtype="float32")
    return jax.jit(lambda dp, params, w, a: train.losses(dp, params, w, a, cfg, dcfg, tc)[1])


def test_eval_anchor_metric_equals_direct_teacher_forced_accept():
    """window_accepts (3 texts in batches of 2, 21 anchors in calls of 8: both padded) equals, at every anchor a
    in [P, P + N), 1 + the leading slots k whose draft argmax is the text's x_{a+k+1} (block_logits on that one
    anchor; a greedy text's next token is the target's argmax); the metric is their mean."""
    cfg, params = model()
    dcfg = draft_config(cfg, G)
    dp = markov_draft(dcfg, 5)
    texts = greedy_texts()
    accept = window_accepts(eval_program(cfg, dcfg, 8), dp, params, texts, P, N, 2, 8)
    one = jax.jit(lambda t, a: train.block_logits(dp, params, t, a, cfg, dcfg)[0])
    want = np.zeros((len(texts), N), np.int64)
    for i, text in enumerate(texts):
        for j, a in enumerate(range(P, P + N)):
            draft = np.asarray(jnp.argmax(one(jnp.asarray(text[None]), jnp.array([[a]], jnp.int32)), -1))[0, 0]
            want[i, j] = 1 + np.cumprod(draft == text[a + 1 : a + 1 + G]).sum()
    assert accept.shape == (3, N) and np.array_equal(accept, want), (accept, want)
    assert 1.0 < want.mean() < G + 1 and len(np.unique(want)) >= 3  # a draft that is sometimes right
    m = eval_anchor_metrics(accept, N, G)
    assert m["heldout_eval_greedy_accept"] == pytest.approx(want.mean())
    assert m["heldout_eval_window"] == N and m["heldout_eval_prompts"] == 3


def test_verify_walk_is_the_real_dspark_steps_accept():
    """The walk through window_accepts' lengths (from the prompt's end, next anchor = anchor + accept, until N
    tokens are out) is, per prompt, the list of accept lengths of the real greedy DSpark step (Generator, block 4,
    the same draft, fp32) generating N tokens; walk_accept is their pooled mean (eval_accept's mean accept)."""
    cfg, params = model()
    dcfg = draft_config(cfg, G)
    dp = markov_draft(dcfg, 5)
    texts = greedy_texts()
    accept = window_accepts(eval_program(cfg, dcfg, 8), dp, params, texts, P, N, 2, 8)
    gen = Generator(cfg, params, spec=SpecConfig("DSPARK", G), draft=(dcfg, dp), **KW)
    real = []
    for text in texts:
        out, st = gen.generate(text[:P].tolist(), max_new_tokens=N, stop_token_ids=())
        assert out == text[P : P + N].tolist()  # lossless: the texts are the step's output
        real.append(st.accept_lengths)
    assert verify_walk(accept, N) == real
    assert sum(map(len, real)) >= 2 * len(texts) and len({x for r in real for x in r}) >= 2
    m = eval_anchor_metrics(accept, N, G)
    assert m["heldout_eval_walk_accept"] == pytest.approx(np.mean(np.concatenate(real)))
    flat = np.concatenate(real)
    assert m["heldout_eval_walk_acceptance_rate_per_position"] == pytest.approx(
        [np.mean(flat - 1 >= j) for j in range(1, G + 1)])


def test_cli_anchor_window_and_eval_metric_in_metrics_json(tmp_path):
    """--anchor-window 6 in a 16-token window after a 6-token prompt (block 4): metrics.json records the anchor
    range [6, 12), the eval-anchor metric (window clipped to the 6 positions --seq holds) and the pool's epochs;
    a window that does not fit --seq is refused before anything runs."""
    _, out, args = tiny_run(tmp_path)
    report = train.main(args + ["--steps", "3", "--anchor-window", "6", "--eval-prompts", "4"])
    f = report["final"]
    assert report["anchor_range"] == [6, 12] and report["pool_epochs"] == pytest.approx(3 * 1 / 3)
    assert f["heldout_eval_window"] == 6 and 1 <= f["heldout_eval_prompts"] <= 4
    assert 1.0 <= f["heldout_eval_greedy_accept"] <= G + 1 and 1.0 <= f["heldout_eval_walk_accept"] <= G + 1
    assert len(f["heldout_eval_walk_accept_by_prompt"]) == f["heldout_eval_prompts"]
    with pytest.raises(ValueError, match="needs --seq >= 17"):
        train.main(args + ["--steps", "3", "--anchor-window", "7"])
