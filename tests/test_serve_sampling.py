"""The sampling fields and logprobs through the real server (subprocess, loopback, NEXTN 3 steps): SGLang-native
/generate and the OpenAI API (official client). Each field must reach the device (a visible effect), and fields
that are not implemented must be refused with a 400 naming them."""

from __future__ import annotations

import httpx
import pytest

from serve.lockstep import decode_sampling, encode_sampling
from serve.protocol import MAX_LOGIT_BIAS

openai = pytest.importorskip("openai")

IDS = [5, 6, 7, 8, 9, 10]


@pytest.fixture(scope="module")
def server(batch1_server):
    return batch1_server  # tests/conftest.py: shared with test_serve_api


def _generate(server, status=200, top=None, **sampling):
    body = {"input_ids": IDS, "sampling_params": {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True,
                                                  **sampling}}
    if top is not None:
        body.update(return_logprob=True, top_logprobs_num=top)
    r = httpx.post(server.url + "/generate", json=body, timeout=120)
    assert r.status_code == status, r.text
    return r.json()


def test_generate_fields_reach_the_device(server):
    greedy = _generate(server)["output_ids"]
    assert len(set(greedy)) < len(greedy), "the greedy output has no repeat: the penalties could not show"
    assert _generate(server, temperature=1.0, top_k=1, seed=5)["output_ids"] == greedy
    assert greedy[0] not in _generate(server, logit_bias={str(greedy[0]): -100})["output_ids"]
    penalised = _generate(server, repetition_penalty=2.0, frequency_penalty=1.5, presence_penalty=1.0)["output_ids"]
    assert penalised != greedy
    r = _generate(server, top=3)
    m = r["meta_info"]
    assert r["output_ids"] == greedy
    assert [i for _, i, _ in m["output_token_logprobs"]] == greedy
    for (lp, tok, _), top in zip(m["output_token_logprobs"], m["output_top_logprobs"]):
        assert lp <= 0 and len(top) == 3 and top[0][1] == tok  # a greedy token is its row's most likely one
        assert abs(top[0][0] - lp) < 1e-6 and top[0][0] >= top[1][0] >= top[2][0]
    assert _generate(server)["output_ids"] == greedy, "greedy output changed after sampled requests"
    for field, value in [("n", 2), ("json_schema", "{}"), ("regex", "a+"), ("min_new_tokens", 3)]:
        err = _generate(server, 400, **{field: value})["error"]
        assert err["param"] == f"sampling_params.{field}", err


def test_openai_fields_reach_the_device(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    kw = dict(model=model, prompt=IDS, max_tokens=16, temperature=0)
    c = client.completions.create(logprobs=2, **kw).choices[0]
    lp = c.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 16
    assert all(v <= 0 for v in lp.token_logprobs) and all(len(t) <= 2 for t in lp.top_logprobs)
    assert all(abs(max(t.values()) - v) < 1e-6 for t, v in zip(lp.top_logprobs, lp.token_logprobs))  # greedy
    first = _generate(server)["output_ids"][0]
    assert client.completions.create(logit_bias={str(first): -100}, **kw).choices[0].text != c.text
    assert client.completions.create(frequency_penalty=2.0, presence_penalty=1.0, **kw).choices[0].text != c.text
    assert client.completions.create(**kw).choices[0].text == c.text
    msgs = [{"role": "user", "content": "Say something."}]
    ch = client.chat.completions.create(model=model, messages=msgs, max_tokens=6, temperature=0, logprobs=True,
                                        top_logprobs=2).choices[0]
    assert len(ch.logprobs.content) >= 1
    for t in ch.logprobs.content:
        assert t.logprob <= 0 and len(t.top_logprobs) == 2 and abs(t.top_logprobs[0].logprob - t.logprob) < 1e-6
    stream = client.chat.completions.create(model=model, messages=msgs, max_tokens=6, temperature=0, logprobs=True,
                                            stream=True)
    streamed = [t.logprob for chunk in stream if chunk.choices and chunk.choices[0].logprobs
                for t in chunk.choices[0].logprobs.content]
    assert streamed == pytest.approx([t.logprob for t in ch.logprobs.content])
    for bad, param in [(dict(n=2), "n"), (dict(response_format={"type": "json_object"}), "response_format")]:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=model, messages=msgs, max_tokens=4, **bad)
        assert e.value.body["param"] == param, e.value.body


def test_lockstep_sampling_record_round_trip():
    """Multi-host followers rebuild the leader's sampling fields from a fixed-size record."""
    kw = dict(top_k=5, min_p=0.125, repetition_penalty=1.5, presence_penalty=-0.5, frequency_penalty=0.25,
              logit_bias=((3, -100.0), (7, 2.5)))
    assert decode_sampling(encode_sampling(**kw)) == kw
    assert decode_sampling(encode_sampling()) == dict(top_k=-1, min_p=0.0, repetition_penalty=1.0,
                                                      presence_penalty=0.0, frequency_penalty=0.0, logit_bias=())
    with pytest.raises(ValueError, match="at most"):
        encode_sampling(logit_bias=((1, 1.0),) * (MAX_LOGIT_BIAS + 1))
