"""--num-continuous-decode-steps 4 (SGLang's flag: 4 decode steps per dispatch) through the real server. Every reply
must equal the N = 1 batch-1 server's (tests/conftest.py batch1_server: same random weights, seed 3, same tokenizer)
byte for byte: greedy and seeded sampling, max_tokens that are not a multiple of 4, a stop string and a stop token
that end generation inside a 4-step dispatch (the steps after them are computed and dropped), and the streamed
chunks concatenate to the non-stream text. /get_server_info reports N."""

from __future__ import annotations

import json

import httpx
import pytest

from ling_jax.tokenizer import load_tokenizer
from tests.serve_helpers import Server, make_model_dir

N = 4
PROMPT = "The quick brown fox"
SAMPLED = {"temperature": 0.9, "top_p": 0.95, "seed": 7}


@pytest.fixture(scope="module")
def servers(batch1_server, tmp_path_factory):
    """(the N = 1 server, the N = 4 server) over the same weights and tokenizer."""
    d = tmp_path_factory.mktemp("serve-multistep")
    srv = Server(make_model_dir(str(d / "model")), str(d / "server.log"), "--random-weights", "--seed", "3",
                 "--num-continuous-decode-steps", str(N))
    yield batch1_server, srv
    srv.stop()


def _post(server, path: str, body: dict) -> dict:
    r = httpx.post(server.url + path, json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _stream(server, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", server.url + path, json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def _same_reply(servers, sampling: dict, text: str = PROMPT) -> dict:
    """/generate on both servers (non-stream and stream): the N = 4 reply equals the N = 1 reply in ids, text,
    finish reason and the verify steps counted; the streamed text deltas concatenate to it. Returns it."""
    body = {"text": text, "sampling_params": sampling}
    one, many = (_post(s, "/generate", body) for s in servers)
    for key in ("output_ids", "text"):
        assert many[key] == one[key], key
    for key in ("finish_reason", "completion_tokens", "spec_verify_ct"):  # steps past the end are not counted
        assert many["meta_info"][key] == one["meta_info"][key], key
    events = _stream(servers[1], "/generate", body)
    assert events[-1]["output_ids"] == many["output_ids"] and events[-1]["text"] == many["text"]
    return many


@pytest.mark.parametrize("sampling", [{"temperature": 0}, SAMPLED], ids=["greedy", "seeded"])
def test_replies_equal_one_step_per_dispatch(servers, sampling):
    for n in (13, 6):  # not multiples of N: the last dispatch runs past max_new_tokens
        g = _same_reply(servers, {"max_new_tokens": n, "ignore_eos": True, **sampling})
        assert g["meta_info"]["finish_reason"] == {"type": "length", "length": n} and len(g["output_ids"]) == n
    lp = {"input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 9, "ignore_eos": True, **sampling},
          "return_logprob": True, "top_logprobs_num": 2}
    one, many = (_post(s, "/generate", lp)["meta_info"] for s in servers)
    assert [t for _, t, _ in many["output_token_logprobs"]] == [t for _, t, _ in one["output_token_logprobs"]]
    assert [v for v, _, _ in many["output_token_logprobs"]] == pytest.approx(
        [v for v, _, _ in one["output_token_logprobs"]], abs=1e-5)
    # the OpenAI route: non-stream text equals N = 1's, the streamed chunks concatenate to it
    body = {"model": "model", "prompt": PROMPT, "max_tokens": 11, **sampling}
    one, many = (_post(s, "/v1/completions", body)["choices"][0] for s in servers)
    assert (many["text"], many["finish_reason"]) == (one["text"], one["finish_reason"])
    chunks = _stream(servers[1], "/v1/completions", body)
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == many["text"]


def _stops_inside_a_dispatch(servers, sampling: dict, candidates) -> dict:
    """The first candidate stop (a sampling_params update) whose N = 1 run ends at a step that is not a
    dispatch's last one at N = 4 (steps 1..4 are dispatch 1, ...), so the N = 4 server computes steps past it."""
    for stop in candidates:
        sp = {**sampling, **stop}
        m = _post(servers[0], "/generate", {"text": PROMPT, "sampling_params": sp})["meta_info"]
        if m["finish_reason"]["type"] == "stop" and m["spec_verify_ct"] % N:
            return sp
    raise AssertionError("no candidate stop ends inside a dispatch")


@pytest.mark.parametrize("sampling", [{"temperature": 0}, SAMPLED], ids=["greedy", "seeded"])
def test_stop_inside_a_dispatch_is_cut_exactly(servers, sampling):
    tok = load_tokenizer(servers[1].model_path)
    base = {"max_new_tokens": 40, "ignore_eos": True, **sampling}
    ids = _post(servers[0], "/generate", {"text": PROMPT, "sampling_params": base})["output_ids"]
    full = tok.decode(ids)
    # stop strings: 3 characters starting where token k's text starts (their first occurrence in the text)
    starts = [len(tok.decode(ids[:k])) for k in range(3, len(ids) - 2)]
    strings = [{"stop": full[p : p + 3]} for p in starts if full.find(full[p : p + 3]) == p and full[p : p + 3].strip()]
    sp = _stops_inside_a_dispatch(servers, base, strings)
    g = _same_reply(servers, sp)
    assert g["text"] == full[: full.index(sp["stop"])]
    assert g["meta_info"]["finish_reason"] == {"type": "stop", "matched": sp["stop"]}
    # stop token ids: a token that first appears at output position k >= 3
    tokens = [{"stop_token_ids": [t]} for k, t in enumerate(ids) if k >= 3 and t not in ids[:k]]
    sp = _stops_inside_a_dispatch(servers, base, tokens)
    g = _same_reply(servers, sp)
    k = ids.index(sp["stop_token_ids"][0])
    assert g["output_ids"] == ids[: k + 1] and g["text"] == tok.decode(ids[:k])


def test_server_info_reports_the_steps_and_the_generator_runs_them(servers):
    one, many = (httpx.get(s.url + "/get_server_info").json() for s in servers)
    assert (one["num_continuous_decode_steps"], many["num_continuous_decode_steps"]) == (1, N)
    assert many["max_running_requests"] == 1
    # the Generator's reserved rows (2 dispatches of N steps of 4 verify rows) bound max_new_tokens: 8 at N = 1,
    # 32 at N = 4, so a request that fits the N = 1 server's context is refused by the N = 4 server
    body = {"input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 512 - 4 - 8}}
    r = httpx.post(servers[1].url + "/generate", json=body, timeout=60)
    assert r.status_code == 400 and "+ 32 reserved speculative rows exceeds the context length 512" in r.text, r.text
