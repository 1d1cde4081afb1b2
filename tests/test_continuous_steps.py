"""Continuous decode steps (SGLang's --num-continuous-decode-steps): N steps per dispatch give the same tokens,
accept lengths, sampled outputs and logprobs as one step per dispatch, and stop where one step per dispatch stops."""

import functools
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from compile.stages import slice_config
from ling_jax.config import get_preset
from ling_jax.runner import Generator
from ling_jax.spec import SpecConfig
from ling_jax.weights import init_params

PROMPT = [3, 7, 1, 9, 4, 11, 2]


# a 12-token vocabulary, so random drafts are accepted often enough to exercise partial acceptance; 3 layers
# (KDA + dense, KDA + MoE, MLA + MoE, then the MTP layer): every layer kind at half of test-tiny's depth
CFG = slice_config(get_preset("test-tiny"), 3).replace(vocab_size=12, eos_token_id=1, pad_token_id=0)


@functools.lru_cache(maxsize=None)
def params():
    return init_params(CFG, 5, jnp.float32)  # drawn once: every init_params call compiles its ~20 draw programs


@functools.lru_cache(maxsize=None)
def generator(steps: int, decode_steps: int):
    spec = SpecConfig("NEXTN", steps) if steps else SpecConfig("NONE")
    return Generator(CFG, params(), spec=spec, max_len=256, chunked_prefill_size=16, dtype=jnp.float32,
                     decode_steps=decode_steps)


@pytest.mark.parametrize("steps,decode_steps", [(0, 4), (3, 4)])
def test_n_steps_per_dispatch_equal_one_step_per_dispatch(steps, decode_steps):
    one, s1 = generator(steps, 1).generate(PROMPT, max_new_tokens=50, stop_token_ids=())
    many, sn = generator(steps, decode_steps).generate(PROMPT, max_new_tokens=50, stop_token_ids=())
    assert many == one and len(many) == 50 and sn.finish_reason == "length"
    # the same steps ran: same accept lengths, step for step (the last dispatch's extra steps are not counted)
    assert sn.accept_lengths == s1.accept_lengths
    if steps:
        plain, _ = generator(0, 1).generate(PROMPT, max_new_tokens=50, stop_token_ids=())
        assert many == plain
        assert max(sn.accept_lengths) > 1


def test_stop_inside_a_dispatch_drops_what_follows():
    full, _ = generator(3, 4).generate(PROMPT, max_new_tokens=60, stop_token_ids=())
    stop = full[17]
    out, stats = generator(3, 4).generate(PROMPT, max_new_tokens=60, stop_token_ids=(stop,))
    assert out == full[: full.index(stop) + 1] and stats.finish_reason == "stop"
    short, stats = generator(3, 4).generate(PROMPT, max_new_tokens=7, stop_token_ids=())
    assert short == full[:7] and stats.finish_reason == "length"


def test_sampled_tokens_and_logprobs_do_not_depend_on_steps_per_dispatch():
    kw = dict(max_new_tokens=40, stop_token_ids=(), temperature=0.9, top_p=0.95, seed=3, top_logprobs=2)
    one, s1 = generator(3, 1).generate(PROMPT, **kw)
    many, sn = generator(3, 4).generate(PROMPT, **kw)
    assert many == one
    np.testing.assert_allclose(sn.token_logprobs, s1.token_logprobs, rtol=1e-6, atol=1e-6)
    assert [[i for i, _ in t] for t in sn.top_logprobs] == [[i for i, _ in t] for t in s1.top_logprobs]
    assert len(sn.token_logprobs) == 40


def test_context_slack_covers_two_dispatches_and_bad_values_are_rejected():
    gen = generator(3, 4)
    with pytest.raises(ValueError, match="speculative rows exceeds the context length"):
        gen.check_request(200, 30)  # 200 + 30 + 2 * 4 * 4 rows > 256
    gen.check_request(200, 24)
    with pytest.raises(ValueError, match="decode_steps"):
        Generator(gen.cfg, gen.params, decode_steps=0)
    r = subprocess.run([sys.executable, "-m", "ling_jax.generate", "--model", "test-tiny", "--prompt-ids", "3,4",
                        "--num-continuous-decode-steps", "0"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1] == (
        "error: --num-continuous-decode-steps must be >= 1, got 0")
