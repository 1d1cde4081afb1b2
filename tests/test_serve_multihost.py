"""Multi-host serving on CPU: two processes joined by jax.distributed (gloo collectives), one device each, one
TP2 mesh, 2 decode steps per dispatch (--num-continuous-decode-steps). Process 0 serves HTTP; process 1 follows it
in lockstep (serve/lockstep.py). The leader's replies must equal an unsharded in-process Generator's at one step per
dispatch, across greedy, sampled and early-closed requests, and the follower must leave cleanly when the leader
stops."""

from __future__ import annotations

import signal

import httpx
import jax.numpy as jnp
import pytest

from ling_jax.runner import Generator
from ling_jax.spec import SpecConfig
from ling_jax.weights import init_params
from serve.lockstep import OP_STREAM, decode_header, encode_header
from tests.serve_helpers import MODEL_CFG, Server, free_port, make_model_dir

ONE_DEVICE = {"XLA_FLAGS": "--xla_force_host_platform_device_count=1"}


def test_header_round_trip():
    h = encode_header(OP_STREAM, 5, 16, 33, 1234, temperature=0.7, top_p=0.9, stop_token_ids=(0, 7), top_logprobs=0)
    op, kw, n, bucket = decode_header(h)
    assert (op, n, bucket) == (OP_STREAM, 5, 16)
    assert kw == dict(max_new_tokens=33, seed=1234, temperature=pytest.approx(0.7), top_p=pytest.approx(0.9),
                      stop_token_ids=(0, 7), top_logprobs=0)
    none = decode_header(encode_header(OP_STREAM, stop_token_ids=None))[1]
    assert none["stop_token_ids"] is None and none["top_logprobs"] is None  # the step program without logprobs
    with pytest.raises(ValueError, match="at most"):
        encode_header(OP_STREAM, stop_token_ids=tuple(range(100)))


@pytest.fixture(scope="module")
def two_hosts(tmp_path_factory):
    d = tmp_path_factory.mktemp("multihost")
    model = make_model_dir(str(d / "model"), tokenizer=False)
    coord = f"127.0.0.1:{free_port()}"
    # the lockstep protocol is batch-1: one request at a time (continuous batching refuses --nnodes > 1); 2 decode
    # steps per dispatch: the per-chunk flags then follow the steps of one dispatch (the N = 1 reference must agree)
    flags = ["--random-weights", "--seed", "3", "--tp-size", "2", "--dist-init-addr", coord, "--nnodes", "2",
             "--max-running-requests", "1", "--num-continuous-decode-steps", "2"]
    follower = Server(model, str(d / "follower.log"), *flags, "--node-rank", "1", env=ONE_DEVICE, wait=False)
    try:
        leader = Server(model, str(d / "leader.log"), *flags, "--node-rank", "0", env=ONE_DEVICE,
                        timeout_s=900)
    except BaseException:
        print(follower.log()[-3000:])
        follower.stop()
        raise
    yield leader, follower
    leader.stop()
    follower.stop()


def _generate(url, ids, **sampling):
    r = httpx.post(url + "/generate", json={"input_ids": ids, "sampling_params": sampling}, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def test_leader_serves_what_one_process_computes_and_follower_leaves(two_hosts):
    leader, follower = two_hosts
    cfg = MODEL_CFG
    ref = Generator(cfg, init_params(cfg, 3, jnp.float32), spec=SpecConfig("NEXTN", 3, 1, 4), max_len=512,
                    dtype=jnp.float32)
    prompt = [5, 17, 99, 3, 42, 8]
    want, _ = ref.generate(prompt, max_new_tokens=40, stop_token_ids=(cfg.eos_token_id,))

    greedy = dict(max_new_tokens=40, temperature=0.0)
    first = _generate(leader.url, prompt, **greedy)
    assert first["output_ids"] == want
    # a sampled request, a stream closed early by max_new_tokens, then greedy again: lockstep kept throughout
    sampled = _generate(leader.url, prompt, max_new_tokens=30, temperature=1.0, top_p=0.9, seed=11)
    ref_sampled, _ = ref.generate(prompt, max_new_tokens=30, temperature=1.0, top_p=0.9, seed=11,
                                  stop_token_ids=(cfg.eos_token_id,))
    assert sampled["output_ids"] == ref_sampled
    assert len(_generate(leader.url, prompt, max_new_tokens=3, temperature=0.0)["output_ids"]) == 3
    assert _generate(leader.url, prompt, **greedy)["output_ids"] == want
    assert follower.proc.poll() is None  # still following

    leader.proc.send_signal(signal.SIGINT)
    assert leader.proc.wait(60) == 0
    assert follower.proc.wait(60) == 0, follower.log()[-3000:]
    assert "leader shut down after" in follower.log()
