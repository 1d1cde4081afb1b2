"""Train/inference parity of the DSpark draft: the trainer's teacher-forced block (ling_jax.train.dspark.block_logits:
one target prefill over the text, context rows t < a, block [x_a, MASK...]) gives the distributions and confidences
that the DSpark step drafts from (ling_jax.dspark_step.draft_block: the context K/V cache filled by the prefill and
by the projected verify rows, Markov decode left to right), when the text is the committed prefix, the bonus and
the step's own drafts. Also: the captured target features are the residual stream AFTER layer i (the last one
renormed by the final norm is the target's hidden state; -1 is the embedding), the greedy continuation the
self-distillation pool is made of equals plain greedy decoding, and the neutral greedy step's argmax-only Markov
decode drafts what the general path drafts."""

import jax
import jax.numpy as jnp
import numpy as np

from ling_jax import dspark
from ling_jax.dspark_step import draft_block
from ling_jax.layers.norms import rms_norm
from ling_jax.model import embed, forward
from ling_jax.sampling import SamplingOptions
from ling_jax.state import init_state
from ling_jax.train.dspark import block_logits, greedy_continuations
from tests.test_dspark import PROMPTS, generator, model, plain, verify_program

T = 40  # the teacher-forced window (one compiled shape): committed prefix + bonus + drafts, zero padded


def markov_draft(dcfg, seed: int) -> dict:
    """Random draft weights with a non-zero Markov head (init_params starts it at 0, which would hide it)."""
    dp = dspark.init_params(dcfg, seed)
    w2 = dp["markov_head"]["markov_w2"]["weight"]
    dp["markov_head"]["markov_w2"]["weight"] = 3.0 * jax.random.normal(jax.random.key(seed), w2.shape)
    dp["confidence_head"]["proj"]["bias"] = jnp.full((1,), 0.3)
    return dp


def test_teacher_forced_block_equals_the_step_draft_over_prefill_and_verified_context():
    """Three anchors: after the prefill, after a step accepting 2 of 4 drafts (context rows from the verify pass)
    and after one accepting all 4. Sampled drafting at temperature 1 (q is the whole distribution, and the Markov
    inputs are the sampled drafts, not the text's tokens); fp32 to 1e-5."""
    gen = generator(4)
    cfg, params, dcfg, G = gen.cfg, gen.params, gen.dcfg, 4
    dp = markov_draft(dcfg, 5)
    prompt = PROMPTS[1]
    truth = prompt + plain(1, 24)  # plain greedy: the drafts injected below, one of them made wrong
    state = gen.init_fn(True)(SamplingOptions().device(cfg.vocab_size), jax.random.key(3))
    for chunk in gen.prefill_chunks(prompt):  # greedy prefill and verify; the drafts are sampled at temperature 1
        state, bonus, _ = gen.prefill_fn(True)((params, dp), state, *chunk)
    state = state.replace(sampling=SamplingOptions(temperature=1.0).device(cfg.vocab_size))
    draft = jax.jit(lambda p, d, s: draft_block(p, d, s, dcfg, is_greedy=False))
    teacher = jax.jit(lambda t, a: block_logits(dp, params, t, a, cfg, dcfg))
    for wrong in (2, G, None):  # the first wrong injected draft of each verify step
        L, bonus = int(state.target.lengths[0]), int(state.bonus[0])
        assert bonus == truth[L]
        drafts, q, conf = jax.device_get(draft(params, dp, state))
        text = np.zeros((1, T), np.int32)
        text[0, : L + G] = truth[:L] + [bonus] + drafts[0, : G - 1].tolist()
        logits, h, prev, _ = teacher(jnp.asarray(text), jnp.array([[L]], jnp.int32))
        assert prev[0, 0].tolist() == [bonus] + drafts[0, : G - 1].tolist()
        want = jax.nn.log_softmax(logits[0, 0], axis=-1)
        assert float(jnp.max(jnp.abs(jnp.log(q[0]) - want))) <= 1e-5, L
        c = jax.nn.sigmoid(dspark.confidence_logit(dp, h, prev))[0, 0]
        assert float(jnp.max(jnp.abs(c - conf[0]))) <= 1e-5
        if wrong is None:
            break
        inject = np.array(truth[L + 1 : L + 1 + G], np.int32)
        if wrong < G:
            inject[wrong] = (inject[wrong] + 1) % cfg.vocab_size
        state, out = verify_program()(params, dp, state, jnp.asarray(inject[None]), None, jnp.array([G], jnp.int32))
        assert int(out.n_emit[0]) == min(wrong, G) + 1


def test_captured_features_are_the_residual_after_each_layer():
    """capture=(i,) returns x after layer i: the last layer's renormed by the final norm is the output hidden
    state, -1 is the token embedding, and layer 0's differs from both."""
    cfg, params = model()
    tokens = jnp.asarray([PROMPTS[1]], jnp.int32)
    n = cfg.num_hidden_layers
    out = forward(params, tokens, init_state(cfg, 1, 16, jnp.float32), cfg, mode="prefill", capture=(-1, 0, n - 1))
    D = cfg.hidden_size
    emb, first, last = out.layer_hidden[..., :D], out.layer_hidden[..., D : 2 * D], out.layer_hidden[..., 2 * D :]
    assert float(jnp.max(jnp.abs(emb - embed(params, tokens)))) == 0.0
    assert float(jnp.max(jnp.abs(rms_norm(last, params["final_norm"], cfg.rms_norm_eps) - out.hidden))) <= 1e-6
    assert float(jnp.max(jnp.abs(first - emb))) > 1e-3 and float(jnp.max(jnp.abs(first - last))) > 1e-3


def test_greedy_continuations_equal_plain_greedy():
    cfg, params = model()
    prompts = jnp.asarray([PROMPTS[0][:5], PROMPTS[1][:5]], jnp.int32)
    got = jax.jit(lambda p, t: greedy_continuations(p, t, 12, cfg))(params, prompts)
    for i in range(2):
        want = generator(0).generate(PROMPTS[i][:5], max_new_tokens=12, stop_token_ids=())[0]
        assert np.asarray(got[i]).tolist() == PROMPTS[i][:5] + want


def test_neutral_greedy_markov_decode_drafts_as_the_general_path():
    """The greedy step of neutral requests (adjusts_logits=False: argmax-only Markov decode, no transform, no
    counts; confidence of all slots after the chain) drafts exactly the tokens of the general path (adjust_logits
    on neutral fields, the chain's counts, confidence slot by slot in the chain: what the trainer's parity above
    pins), with the same confidences, on random draft weights whose Markov head changes the drafts; over the prefill's
    anchor and two verified ones. The runner gives that program to neutral greedy requests without logprobs only."""
    gen = generator(4)
    cfg, params, dcfg, G = gen.cfg, gen.params, gen.dcfg, 4
    dp = markov_draft(dcfg, 11)
    w1 = dp["markov_head"]["markov_w1"]["weight"]  # rows of norm ~1 (not init's 0.02): the bias moves the argmax
    dp["markov_head"]["markov_w1"]["weight"] = jax.random.normal(jax.random.key(12), w1.shape)
    flat = jax.tree.map(lambda x: x, dp)  # the same draft without its Markov bias
    flat["markov_head"]["markov_w2"]["weight"] = jnp.zeros_like(dp["markov_head"]["markov_w2"]["weight"])
    drafts_of = {a: jax.jit(lambda p, d, s, a=a: draft_block(p, d, s, dcfg, is_greedy=True, adjusts_logits=a))
                 for a in (True, False)}
    state, _, _ = gen.prefill(PROMPTS[0], SamplingOptions().device(cfg.vocab_size), jax.random.key(0), True)
    state = jax.tree.map(jnp.copy, state)
    markov_changed = 0
    for _ in range(3):
        general, q, conf = jax.device_get(drafts_of[True](params, dp, state))
        fast, q_fast, conf_fast = jax.device_get(drafts_of[False](params, dp, state))
        assert q is None and q_fast is None
        assert fast.tolist() == general.tolist()
        np.testing.assert_allclose(conf_fast, conf, rtol=1e-6, atol=1e-6)
        markov_changed += int(np.any(jax.device_get(drafts_of[False](params, flat, state)[0]) != fast))
        state, out = verify_program()(params, dp, state, jnp.asarray(fast), None, jnp.array([G], jnp.int32))
    assert markov_changed >= 1, "the Markov head never changed a draft: the chain's dependence is not exercised"
    neutral, penalised = SamplingOptions(), SamplingOptions(presence_penalty=0.5)
    assert not gen.adjusts_logits(neutral, False)
    assert gen.adjusts_logits(neutral, True) and gen.adjusts_logits(penalised, False)
    assert gen.adjusts_logits(SamplingOptions(temperature=0.7), False)
