"""DSpark block drafting: lossless greedy (blocks 4 and 8), planted mismatch with committed KDA/MLA states and the
draft context, the confidence schedule (only the verify length changes), sampled verdict with a proposed-length
limit, state pollution, one program per step without host transfers, config/checkpoint round trip, training loss."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ling_jax import dspark
from ling_jax.config import get_preset
from ling_jax.dspark_step import dspark_step_with_drafts
from ling_jax.errors import CheckpointError
from ling_jax.model import forward
from ling_jax.runner import Generator, count_compiles
from ling_jax.sampling import SamplingOptions, sampled_verdict
from ling_jax.spec import SpecConfig, spec_from_flags
from ling_jax.state import init_state
from ling_jax.weights import init_params
from tests.conftest import rel_err

PROMPTS = [[3, 7, 1, 9, 4], [11, 2, 2, 5, 8, 10, 6, 1, 3]]
KW = dict(max_len=320, chunked_prefill_size=16, dtype=jnp.float32)


def draft_config(cfg, block: int) -> dspark.DSparkConfig:
    return dspark.DSparkConfig(hidden_size=cfg.hidden_size, num_hidden_layers=1, num_attention_heads=2,
                               num_key_value_heads=1, head_dim=16, intermediate_size=32, vocab_size=cfg.vocab_size,
                               block_size=block, target_layer_ids=(-1, 1, cfg.num_hidden_layers - 1),
                               num_target_layers=cfg.num_hidden_layers, mask_token_id=0, markov_rank=8)


@functools.lru_cache(maxsize=None)
def model(vocab: int = 12):
    """A random target with a small vocabulary (a random draft then agrees often enough to exercise acceptance)."""
    cfg = get_preset("test-tiny").replace(vocab_size=vocab, eos_token_id=1, pad_token_id=0)
    return cfg, init_params(cfg, 0, jnp.float32)


@functools.lru_cache(maxsize=None)
def generator(block: int, verify: str = "static", threshold: float = 0.5):
    cfg, params = model()
    if block == 0:
        return Generator(cfg, params, **KW)
    dcfg = draft_config(cfg, block)
    spec = SpecConfig("DSPARK", block, dspark_verify=verify, confidence_threshold=threshold)
    return Generator(cfg, params, spec=spec, draft=(dcfg, dspark.init_params(dcfg, block)), **KW)


@pytest.mark.parametrize("block,prompt,n", [(4, 0, 256), (8, 1, 96)])
def test_dspark_greedy_equals_plain_greedy(block, prompt, n):
    plain, _ = generator(0).generate(PROMPTS[prompt], max_new_tokens=n, stop_token_ids=())
    out, stats = generator(block).generate(PROMPTS[prompt], max_new_tokens=n, stop_token_ids=())
    assert out == plain, f"first divergence at {next(i for i, (a, b) in enumerate(zip(out, plain)) if a != b)}"
    assert len(out) == n and max(stats.accept_lengths) > 1, "no draft accepted: acceptance not exercised"
    assert 1 <= stats.mean_accept_length <= block + 1


def test_confidence_schedule_changes_only_the_verify_length():
    """Same prefilled state, 16 steps each: the static and the confidence-scheduled relays emit the same token
    stream as plain greedy; the scheduled one proposed fewer than G drafts at some steps (its length histogram)."""
    sp = SamplingOptions().device(12)
    runs = []
    for gen in (generator(4), generator(4, "confidence", 0.3)):
        state, first, _ = gen.prefill(PROMPTS[0], sp, jax.random.key(0), True)
        out, step = [int(first[0])], gen.step_fn(True)
        for _ in range(16):
            state, o = step(gen.run_params, state)
            out += np.asarray(o.tokens[0, : int(o.n_emit[0])]).tolist()
        runs.append((out, np.asarray(state.length_hist)))
    (a, hist_static), (b, hist_sched) = runs
    n = min(len(a), len(b))
    plain, _ = generator(0).generate(PROMPTS[0], max_new_tokens=256, stop_token_ids=())
    assert a[:n] == b[:n] == plain[:n] and n >= 17
    assert hist_static.tolist() == [0, 0, 0, 0, 16]
    assert hist_sched[:4].sum() > 0 and hist_sched.sum() == 16


def test_planted_mismatch_commits_plain_state_and_draft_context():
    plain_gen, gen = generator(0), generator(4)
    cfg, params, dcfg, dp = gen.cfg, gen.params, gen.dcfg, gen.run_params[1]
    G, prompt = 4, PROMPTS[1]
    sp, key = SamplingOptions().device(cfg.vocab_size), jax.random.key(0)
    pstate, first, _ = plain_gen.prefill(prompt, sp, key, True)
    pstep = plain_gen.step_fn(True)  # donates its state: keep copies
    keep = lambda s: jax.tree.map(jnp.copy, s.target)
    tokens, plain_states = [int(first[0])], {int(pstate.target.lengths[0]): keep(pstate)}
    for _ in range(30):
        pstate, out = pstep(params, pstate)
        tokens.append(int(out.tokens[0, 0]))
        plain_states[int(pstate.target.lengths[0])] = keep(pstate)
    state, bonus, _ = gen.prefill(prompt, sp, key, True)
    step = jax.jit(functools.partial(dspark_step_with_drafts, cfg=cfg, dcfg=dcfg, is_greedy=True))
    # the oracle: the draft context of a fresh causal prefill over the committed tokens (padded to one shape)
    ctx_ref = jax.jit(lambda toks: dspark.context_kv(dp, forward(params, toks, init_state(cfg, 1, toks.shape[1],
                      jnp.float32), cfg, mode="prefill", capture=dcfg.target_layer_ids).layer_hidden,
                      jnp.arange(toks.shape[1])[None], dcfg))
    emitted = [int(bonus[0])]
    for j, limit in [(0, 4), (2, 4), (4, 4), (4, 2), (1, 4), (3, 4)]:  # j = first wrong draft; limit = proposed
        pos = len(emitted)
        drafts = np.array(tokens[pos : pos + G], np.int32)
        if j < G:
            drafts[j] = (drafts[j] + 1) % cfg.vocab_size
        state, out = step(params, dp, state, jnp.asarray(drafts[None]), None, jnp.array([limit], jnp.int32))
        n_emit = int(out.n_emit[0])
        assert n_emit == min(j, limit) + 1, (j, limit, n_emit)
        emitted += [int(t) for t in out.tokens[0, :n_emit]]
        assert emitted == tokens[: len(emitted)]
        L = int(state.target.lengths[0])
        assert L == len(prompt) + len(emitted) - 1
        want = plain_states[L]
        assert rel_err(state.target.kda_recurrent, want.kda_recurrent) <= 1e-5
        assert rel_err(state.target.kda_conv, want.kda_conv) <= 1e-5
        assert rel_err(state.target.mla_cache[:, :, :L], want.mla_cache[:, :, :L]) <= 1e-5
        committed = np.zeros((1, 48), np.int32)
        committed[0, :L] = prompt + emitted[:-1]  # positions 0..L-1
        k_ref, v_ref = ctx_ref(jnp.asarray(committed))
        assert rel_err(state.ctx_k[:, :, :L], k_ref[:, :, :L]) <= 1e-4
        assert rel_err(state.ctx_v[:, :, :L], v_ref[:, :, :L]) <= 1e-4


def test_sampled_verdict_with_limit_reproduces_target_distribution():
    """With only d_1 proposed (limit 1) of K = 3, the token after an accepted d_1 is the bonus drawn from p_1
    (nothing subtracted), so it must follow p_1; the first token follows p_0. N = 200k trials, tolerance > 5 sigma."""
    V, K, N = 6, 3, 200_000
    ks = jax.random.split(jax.random.key(1), 4)
    logits = 2 * jax.random.normal(ks[0], (1, K + 1, V))
    p = jax.nn.softmax(logits, axis=-1)
    q = jax.nn.softmax(logits[:, :K] + jax.random.normal(ks[1], (1, K, V)), axis=-1)
    p, q = jnp.broadcast_to(p, (N, K + 1, V)), jnp.broadcast_to(q, (N, K, V))
    drafts = jax.random.categorical(ks[2], jnp.log(q), axis=-1).astype(jnp.int32)
    n, bonus = jax.jit(sampled_verdict)(ks[3], drafts, q, p, jnp.ones((N,), jnp.int32))
    assert int(n.max()) == 1
    first = np.bincount(np.asarray(jnp.where(n >= 1, drafts[:, 0], bonus)), minlength=V) / N
    assert np.max(np.abs(first - np.asarray(p[0, 0]))) < 0.006
    acc = np.asarray(n) == 1
    second = np.bincount(np.asarray(bonus)[acc], minlength=V) / acc.sum()
    assert acc.sum() > N // 4 and np.max(np.abs(second - np.asarray(p[0, 1]))) < 0.006 * np.sqrt(N / acc.sum())


def test_no_state_pollution_greedy_sampled_greedy():
    gen = generator(4)
    first, _ = gen.generate(PROMPTS[0], max_new_tokens=40, stop_token_ids=())
    s = [gen.generate(PROMPTS[1], max_new_tokens=30, temperature=t, seed=seed, stop_token_ids=())[0]
         for t, seed in [(0.8, 1), (1.3, 2), (0.8, 1)]]
    again, _ = gen.generate(PROMPTS[0], max_new_tokens=40, stop_token_ids=())
    assert again == first and s[0] == s[2] and s[0] != s[1]


def test_one_program_per_step_without_host_transfers():
    gen = generator(4)
    gen.generate(PROMPTS[0], max_new_tokens=12, stop_token_ids=())  # compiles
    state, _, _ = gen.prefill(PROMPTS[0], SamplingOptions().device(12), jax.random.key(0), True)
    step = gen.step_fn(True)
    hlo = step.lower(gen.run_params, state).as_text()
    for op in ("host_callback", "infeed", "outfeed", "stablehlo.send", "stablehlo.recv"):
        assert op not in hlo, op
    with count_compiles() as names:
        with jax.transfer_guard("disallow"):
            state, out = step(gen.run_params, state)
        out, stats = gen.generate(PROMPTS[1], max_new_tokens=20, stop_token_ids=())
    assert names == [], names
    assert stats.verify_steps >= 1


def test_checkpoint_round_trip_and_refused_configs(tmp_path):
    cfg, _ = model()
    dcfg = draft_config(cfg, 4)
    dp = dspark.init_params(dcfg, 3)
    dspark.save(dcfg, dp, str(tmp_path))
    assert dspark.load_config(str(tmp_path)) == dcfg
    back = dspark.load_params(dcfg, str(tmp_path), jnp.float32)
    bf16 = jax.tree.map(lambda a: a.astype(jnp.bfloat16).astype(jnp.float32), dp)
    assert all(bool(jnp.array_equal(a, b)) for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(bf16)))
    hf = dspark.config_to_hf(dcfg)
    for bad, msg in [({"markov_head_type": "gated"}, "markov_head_type"), ({"speculators_model_type": "dspark"},
                     "speculators"), ({"architectures": ["LlamaForCausalLM"]}, "architectures")]:
        with pytest.raises(CheckpointError, match=msg):
            dspark.config_from_hf(hf | bad)
    spec, d2 = spec_from_flags("DSPARK", None, None, None, str(tmp_path))
    assert (spec.num_steps, spec.draft_tokens, d2) == (4, 5, dcfg)
    with pytest.raises(ValueError, match="drop --speculative-num-steps"):
        spec_from_flags("DSPARK", 5, None, None, str(tmp_path))
    with pytest.raises(ValueError, match="needs --speculative-draft-model-path"):
        spec_from_flags("DSPARK", None, None, None, None)


def test_training_loss_falls_and_metrics_are_bounded():
    from ling_jax.train import dspark as train

    cfg, params = model()
    dcfg = draft_config(cfg, 4)
    tc = train.DSparkTrainConfig(batch=2, seq=16, anchors=4, compute_dtype="float32")
    tokens = jax.random.randint(jax.random.key(0), (2, 16), 0, 12)
    tx = train.make_optimizer(3e-3, 30, 1, 0.0, 1.0)
    dp = dspark.init_params(dcfg, 0)
    grad = jax.jit(jax.value_and_grad(lambda d: train.losses(d, params, tokens, jax.random.key(1), cfg, dcfg, tc),
                                      has_aux=True))
    opt, first = tx.init(dp), None
    for _ in range(30):
        (loss, m), g = grad(dp)
        first = float(loss) if first is None else first
        upd, opt = tx.update(g, opt, dp)
        dp = jax.tree.map(lambda a, u: a + u, dp, upd)
    assert float(loss) < 0.8 * first, (first, float(loss))
    assert 1.0 <= float(m["expected_accept"]) <= 5.0 and 1.0 <= float(m["greedy_accept"]) <= 5.0
    assert 0.0 <= float(m["l1"]) <= 2.0 and m["top1_by_slot"].shape == (4,)
