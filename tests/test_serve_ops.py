"""Operations against the real server (serve_helpers.MODEL_CFG, a checkpoint dir without a tokenizer): --api-key
on every route but /health, what an authenticated caller sees in server info, --max-queued-requests (503),
--request-timeout (504), and what a server without a tokenizer answers (text endpoints 400, token ids work). Only
short token-id prompts here: each request must finish well inside the 0.5 s timeout unless it is meant to run out."""

from __future__ import annotations

import json
import random

import httpx
import pytest

from serve.engine import Engine
from serve.http_io import ServeOptions
from tests.serve_helpers import Server, make_model_dir

KEY = "s3cret-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
LONG = {"input_ids": [9, 10, 11], "sampling_params": {"max_new_tokens": 480, "temperature": 0, "ignore_eos": True}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("serve-ops")
    # one request at a time: the queue-full case counts one running and one waiting request
    model = make_model_dir(str(d / "no-tokenizer"), tokenizer=False)
    srv = Server(model, str(d / "server.log"), "--random-weights", "--max-running-requests", "1", "--api-key", KEY,
                 "--max-queued-requests", "1", "--request-timeout", "0.5", "--dist-init-addr", "10.1.2.3:5000")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as c:
        yield c


@pytest.mark.parametrize("method,path", [("GET", "/v1/models"), ("GET", "/server_info"), ("GET", "/metrics"),
                                         ("POST", "/generate"), ("GET", "/health_generate"),
                                         ("POST", "/abort_request"), ("GET", "/no/such/route")])
def test_api_key_required(server, method, path):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.request(method, server.url + path, headers=headers, json={})
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert r.json()["error"]["code"] == "invalid_api_key"


def test_health_is_open_and_authenticated_calls_work(server, http):
    assert httpx.get(server.url + "/health").status_code == 200
    assert http.get("/health_generate").status_code == 200
    g = http.post("/generate", json={"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4,
                                                                                  "temperature": 0}})
    assert g.status_code == 200 and len(g.json()["output_ids"]) >= 1


def test_server_info_for_an_authenticated_caller(server, http):
    info = http.get("/server_info").json()
    assert info["dist_init_addr"] == "10.1.2.3:5000"  # shown to a caller that has the key
    assert "api_key" not in info and KEY not in json.dumps(info)
    assert info["model_path"] == server.model_path and info["tokenizer_path"] is None
    assert http.get("/model_info").json()["served_model_name"] == "no-tokenizer"  # the dir's name


def test_queue_full_is_503(server, http):
    """One running, one waiting (the limit), the next one refused; the two time out by themselves (504)."""
    with http.stream("POST", "/generate", json={**LONG, "stream": True}) as running:
        lines = running.iter_lines()  # kept: dropping the iterator would close the stream
        next(lines)  # it runs
        with http.stream("POST", "/generate", json={**LONG, "stream": True}) as waiting:
            assert waiting.status_code == 200  # headers come at submit: it is queued
            r = http.post("/generate", json=LONG)
            assert r.status_code == 503 and r.json()["error"]["code"] == "queue_full"
            for it in (lines, waiting.iter_lines()):
                events = [line[6:] for line in it if line.startswith("data: ")]
                assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "request_timeout"


def test_request_timeout_is_504(http):
    r = http.post("/generate", json=LONG)  # 480 tokens take seconds on CPU
    assert r.status_code == 504 and r.json()["error"]["code"] == "request_timeout"
    r = http.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200  # a short one is served


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "hello", "max_tokens": 4}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "messages"),
    ("/generate", {"text": "hello"}, "text"),
    ("/v1/completions", {"prompt": [5, 6], "stop": "x"}, "stop"),
    ("/tokenize", {"prompt": "hello"}, "prompt"),
    ("/detokenize", {"tokens": [5, 6]}, "tokens"),
])
def test_text_needs_tokenizer(http, path, body, param):
    r = http.post(path, json=body)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "no_tokenizer" and err["param"] == param and "token ids" in err["message"]


def test_token_ids_work_without_tokenizer(http):
    g = http.post("/generate", json={"input_ids": [5, 6, 7], "sampling_params": {
        "max_new_tokens": 5, "temperature": 0, "ignore_eos": True}}).json()
    assert len(g["output_ids"]) == 5 and g["text"] == ""
    c = http.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 5, "temperature": 0,
                                           "ignore_eos": True}).json()
    assert c["choices"][0]["token_ids"] == g["output_ids"]  # same greedy tokens on both APIs
    assert c["usage"] == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}


def test_sampling_seed_source():
    """Without --random-seed each start draws its own seed source; with one, starts agree."""
    draws = lambda seed: [Engine(None, None, None, seed).rng.randrange(2**31) for _ in range(2)]  # noqa: E731
    assert draws(None)[0] != draws(None)[0] or draws(None)[1] != draws(None)[1]
    assert draws(5) == draws(5) == [random.Random(5).randrange(2**31)] * 2
    with pytest.raises(ValueError, match="random-seed"):
        ServeOptions(random_seed=2**64)
    with pytest.raises(ValueError, match="max-queued-requests"):
        ServeOptions(max_queued_requests=0)
