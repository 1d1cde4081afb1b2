"""DSpark block drafting: lossless greedy (block 4 over 256 tokens, block 8, 3 steps per dispatch), planted mismatch
with committed KDA/MLA states and the draft context, the confidence schedule (only the verify length changes),
sampled verdict with a proposed-length limit, state pollution, one program per step without host transfers,
config/checkpoint round trip, and the training CLI against a checkpoint dir and an xz token corpus (with a
self-distillation pool; the loss falls).

Compiled programs are shared (lru_cache'd Generators over one 3-layer target), so each test pays mostly run time."""

import functools
import io
import json
import lzma
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ling_jax import dspark
from ling_jax.config import get_preset
from ling_jax.dspark_step import draft_block, dspark_step_with_drafts, verify_length
from ling_jax.errors import CheckpointError
from ling_jax.runner import Generator, count_compiles
from ling_jax.sampling import SamplingOptions, sampled_verdict
from ling_jax.spec import SpecConfig, spec_from_flags
from ling_jax.weights import init_params, save_hf_checkpoint
from tests.conftest import rel_err

PROMPTS = [[3, 7, 1, 9, 4], [11, 2, 2, 5, 8, 10, 6, 1, 3]]
KW = dict(max_len=288, chunked_prefill_size=16, dtype=jnp.float32)


def draft_config(cfg, block: int) -> dspark.DSparkConfig:
    return dspark.DSparkConfig(hidden_size=cfg.hidden_size, num_hidden_layers=1, num_attention_heads=2,
                               num_key_value_heads=1, head_dim=16, intermediate_size=32, vocab_size=cfg.vocab_size,
                               block_size=block, target_layer_ids=(-1, 1, cfg.num_hidden_layers - 1),
                               num_target_layers=cfg.num_hidden_layers, mask_token_id=0, markov_rank=8)


@functools.lru_cache(maxsize=None)
def model():
    """test-tiny cut to its first layer group: KDA+dense, KDA+MoE, MLA+MoE (every target layer kind; DSpark drafts
    without the MTP layer, so there is none), clamps on; a 12-token vocabulary, so a random draft agrees often
    enough to exercise acceptance."""
    cfg = get_preset("test-tiny").replace(name="dspark-tiny", num_hidden_layers=3, num_nextn_predict_layers=0,
                                          vocab_size=12, eos_token_id=1, pad_token_id=0,
                                          routed_swiglu_limits=(0.0, 0.6, 0.6), shared_swiglu_limits=(0.0, 0.5, 0.5))
    return cfg, init_params(cfg, 0, jnp.float32)


@functools.lru_cache(maxsize=None)
def generator(block: int, decode_steps: int = 1):
    cfg, params = model()
    if block == 0:
        return Generator(cfg, params, **KW)
    dcfg = draft_config(cfg, block)
    return Generator(cfg, params, spec=SpecConfig("DSPARK", block), draft=(dcfg, dspark.init_params(dcfg, block)),
                     decode_steps=decode_steps, **KW)


@functools.lru_cache(maxsize=None)
def verify_program():
    """verify -> verdict -> commit -> project for injected drafts and proposed lengths (block 4, greedy)."""
    gen = generator(4)
    return jax.jit(functools.partial(dspark_step_with_drafts, cfg=gen.cfg, dcfg=gen.dcfg, is_greedy=True))


@functools.lru_cache(maxsize=None)
def plain(prompt: int, n: int) -> list[int]:
    return generator(0).generate(PROMPTS[prompt], max_new_tokens=n, stop_token_ids=())[0]


def test_block4_greedy_equals_plain_greedy_in_one_program_per_step():
    """256 tokens of block-4 DSpark = plain greedy; the step is one program with no host transfer, and a second
    request compiles nothing."""
    gen = generator(4)
    out, stats = gen.generate(PROMPTS[0], max_new_tokens=256, stop_token_ids=())
    want = plain(0, 256)
    assert out == want, f"first divergence at {next(i for i, (a, b) in enumerate(zip(out, want)) if a != b)}"
    assert max(stats.accept_lengths) > 1, "no draft accepted: acceptance not exercised"
    assert 1 < stats.mean_accept_length <= 5 and sum(stats.accept_lengths) >= 255
    state, _, _ = gen.prefill(PROMPTS[0], SamplingOptions().device(12), jax.random.key(0), True)
    step = gen.step_fn(True)
    hlo = step.lower(gen.run_params, state).as_text()
    for op in ("host_callback", "infeed", "outfeed", "stablehlo.send", "stablehlo.recv"):
        assert op not in hlo, op
    # a prompt of another length takes other prefill buckets (compiled on first use, or by runner.warm_up)
    first, _ = gen.generate(PROMPTS[1], max_new_tokens=20, stop_token_ids=())
    with jax.transfer_guard("disallow"):
        state, _ = step(gen.run_params, state)
    with count_compiles() as names:
        again, stats = gen.generate(PROMPTS[1], max_new_tokens=20, stop_token_ids=())
    assert names == [], names
    assert again == first
    assert stats.verify_steps >= 1


def test_greedy_logprobs_equal_plain_decoding_and_the_step_without_them_emits_the_same():
    """With top_logprobs the DSpark step's logprobs of its emitted tokens are plain decoding's (the oracle: the
    same target, one token a step); without, the step is compiled without them and emits the same tokens."""
    plain, ds = generator(0), generator(4)
    want, want_st = plain.generate(PROMPTS[1], max_new_tokens=24, stop_token_ids=(), top_logprobs=2)
    got, got_st = ds.generate(PROMPTS[1], max_new_tokens=24, stop_token_ids=(), top_logprobs=2)
    assert got == want and len(got_st.token_logprobs) == len(got_st.top_logprobs) == 24
    np.testing.assert_allclose(got_st.token_logprobs, want_st.token_logprobs, rtol=1e-5, atol=1e-5)
    assert [[t for t, _ in row] for row in got_st.top_logprobs] == [[t for t, _ in row] for row in want_st.top_logprobs]
    bare, bare_st = ds.generate(PROMPTS[1], max_new_tokens=24, stop_token_ids=())
    assert bare == want and bare_st.token_logprobs == []
    state = ds.init_fn(True)(SamplingOptions().device(ds.cfg.vocab_size), jax.random.key(0))
    assert jax.eval_shape(ds.step(True, False), ds.run_params, state)[1].logprobs is None


def test_block8_greedy_equals_plain_greedy():
    out, stats = generator(8).generate(PROMPTS[1], max_new_tokens=48, stop_token_ids=())
    assert out == plain(1, 48)
    assert max(stats.accept_lengths) > 1 and 1 <= stats.mean_accept_length <= 9


def test_three_steps_per_dispatch_equal_one_step_per_dispatch():
    """Generator(decode_steps=3) runs the DSpark step in a lax.scan: same tokens, same accept length step for step."""
    one, s1 = generator(4).generate(PROMPTS[1], max_new_tokens=40, stop_token_ids=())
    many, s3 = generator(4, 3).generate(PROMPTS[1], max_new_tokens=40, stop_token_ids=())
    assert many == one == plain(1, 40)
    assert s3.accept_lengths == s1.accept_lengths and max(s1.accept_lengths) > 1
    assert s3.finish_reason == s1.finish_reason == "length"


def test_confidence_schedule_changes_only_the_verify_length():
    """Same prefilled state, 16 steps each: the static relay (the Generator's step) and the confidence-scheduled one
    (draft_block -> verify_length -> the verify program) emit the same token stream as plain greedy; the scheduled
    one proposed fewer than G drafts at some steps (its length histogram)."""
    gen = generator(4)
    sched = SpecConfig("DSPARK", 4, dspark_verify="confidence", confidence_threshold=0.3)
    draft = jax.jit(lambda pp, s: draft_block(pp[0], pp[1], s, gen.dcfg, is_greedy=True))

    def scheduled(pp, state):
        drafts, q, conf = draft(pp, state)
        return verify_program()(pp[0], pp[1], state, drafts, q, verify_length(conf, sched))

    runs = []
    for step in (gen.step_fn(True), scheduled):
        state, first, _ = gen.prefill(PROMPTS[0], SamplingOptions().device(12), jax.random.key(0), True)
        out = [int(first[0])]
        for _ in range(16):
            state, o = step(gen.run_params, state)
            out += np.asarray(o.tokens[0, : int(o.n_emit[0])]).tolist()
        runs.append((out, np.asarray(state.length_hist)))
    (a, hist_static), (b, hist_sched) = runs
    n = min(len(a), len(b))
    assert a[:n] == b[:n] == plain(0, 256)[:n] and n >= 17
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
    for _ in range(24):
        pstate, out = pstep(params, pstate)
        tokens.append(int(out.tokens[0, 0]))
        plain_states[int(pstate.target.lengths[0])] = keep(pstate)
    state, bonus, _ = gen.prefill(prompt, sp, key, True)
    step = verify_program()
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
        # the oracle of the draft context: a fresh (chunked) prefill of the committed tokens 0..L-1 as a prompt
        ref, _, _ = gen.prefill(prompt + emitted[:-1], sp, key, True)
        assert rel_err(state.ctx_k[:, :, :L], ref.ctx_k[:, :, :L]) <= 1e-4
        assert rel_err(state.ctx_v[:, :, :L], ref.ctx_v[:, :, :L]) <= 1e-4
    # the on-device histograms: accepted 0, 2, 4, 2, 1, 3 drafts of proposed lengths 4, 4, 4, 2, 4, 4
    assert state.accept_hist.tolist() == [1, 1, 2, 1, 1]
    assert state.length_hist.tolist() == [0, 0, 1, 0, 5]


def test_sampled_verdict_with_limit_reproduces_target_distribution():
    """With only d_1 proposed (limit 1) of K = 3, the token after an accepted d_1 is the bonus drawn from p_1
    (nothing subtracted), so it must follow p_1; the first token follows p_0. N = 200k trials, tolerance > 5 sigma."""
    V, K, N = 6, 3, 200_000

    @jax.jit
    def trials(key):
        ks = jax.random.split(key, 4)
        logits = 2 * jax.random.normal(ks[0], (1, K + 1, V))
        p = jax.nn.softmax(logits, axis=-1)
        q = jax.nn.softmax(logits[:, :K] + jax.random.normal(ks[1], (1, K, V)), axis=-1)
        p, q = jnp.broadcast_to(p, (N, K + 1, V)), jnp.broadcast_to(q, (N, K, V))
        drafts = jax.random.categorical(ks[2], jnp.log(q), axis=-1).astype(jnp.int32)
        return p[0], drafts, sampled_verdict(ks[3], drafts, q, p, jnp.ones((N,), jnp.int32))

    p, drafts, (n, bonus) = jax.device_get(trials(jax.random.key(1)))
    assert int(n.max()) == 1
    first = np.bincount(np.where(n >= 1, drafts[:, 0], bonus), minlength=V) / N
    assert np.max(np.abs(first - p[0])) < 0.006
    acc = n == 1
    second = np.bincount(bonus[acc], minlength=V) / acc.sum()
    assert acc.sum() > N // 4 and np.max(np.abs(second - p[1])) < 0.006 * np.sqrt(N / acc.sum())


def test_no_state_pollution_greedy_sampled_greedy():
    gen = generator(4)
    s = [gen.generate(PROMPTS[1], max_new_tokens=20, temperature=t, seed=seed, stop_token_ids=())[0]
         for t, seed in [(0.8, 1), (1.3, 2), (0.8, 1)]]
    again, _ = gen.generate(PROMPTS[0], max_new_tokens=40, stop_token_ids=())
    assert again == plain(0, 256)[:40] and s[0] == s[2] and s[0] != s[1]


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


def write_xz_tokens(out_dir, split: str, ids) -> None:
    """tokens-{split}.npy.xz: the .npy bytes, xz-compressed (ling_jax.train.corpus --compress)."""
    buf = io.BytesIO()
    np.save(buf, np.asarray(ids, np.uint16))
    (out_dir / f"tokens-{split}.npy.xz").write_bytes(lzma.compress(buf.getvalue()))


def test_training_cli_on_a_checkpoint_dir_and_xz_tokens(tmp_path):
    """python -m ling_jax.train.dspark against a saved target and a compressed token corpus: the loss falls over
    30 steps, metrics are bounded, and the draft dir (3 files) loads back as a DSpark draft of that target."""
    from ling_jax.train import dspark as train

    cfg, params = model()
    target, data, out = tmp_path / "target", tmp_path / "data", tmp_path / "draft"
    save_hf_checkpoint(cfg, params, str(target))
    data.mkdir()
    period = np.random.default_rng(0).integers(0, 12, 24)  # a periodic stream: every window is a rotation of it
    write_xz_tokens(data, "train", np.tile(period, 20))
    write_xz_tokens(data, "heldout", np.tile(period, 3))
    args = ["--target", str(target), "--data", str(data), "--out", str(out), "--steps", "30", "--batch", "2",
            "--seq", "16", "--anchors", "4", "--block-size", "4", "--layers", "1", "--context-layers", "2",
            "--markov-rank", "8", "--lr", "3e-3", "--warmup", "1", "--compute-dtype", "float32", "--eval-windows",
            "2", "--log-every", "1", "--distill-seqs", "3", "--distill-prompt", "6", "--distill-batch", "2",
            "--distill-fraction", "0.5", "--kl-weight", "0.5"]
    report = train.main(args)
    losses = [r["loss"] for r in report["rows"]]
    assert len(losses) == 30 and np.mean(losses[-5:]) < 0.8 * np.mean(losses[:3]), losses
    last = report["rows"][-1]
    assert 1.0 <= last["expected_accept"] <= 5.0 and 1.0 <= last["greedy_accept"] <= 5.0
    assert 0.0 <= last["l1"] <= 2.0 and len(last["top1_by_slot"]) == 4
    assert 1.0 <= report["final"]["heldout_expected_accept"] <= 5.0
    assert 1.0 <= report["final"]["heldout_greedy_greedy_accept"] <= 5.0 and last["kl"] >= 0.0
    assert sorted(os.listdir(out)) == ["config.json", "metrics.json", "model.safetensors"]
    assert json.loads((out / "metrics.json").read_text())["steps"] == 30
    dcfg = dspark.load_config(str(out))
    dcfg.check_target(cfg)
    assert (dcfg.block_size, dcfg.num_key_value_heads, dcfg.num_attention_heads) == (4, 2, 4)
    assert dcfg.mask_token_id == cfg.pad_token_id and len(dcfg.target_layer_ids) == 2
    dspark.load_params(dcfg, str(out), jnp.float32)
    write_xz_tokens(data, "train", np.tile(period, 20) + 1)  # id 12 is outside the target's 12-token vocabulary
    with pytest.raises(ValueError, match="vocab_size 12"):
        train.main(args)
