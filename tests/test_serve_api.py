"""The real server (subprocess, loopback) driven by the official `openai` client and raw HTTP: completions and
chat (stream and not), exact stop-string truncation, SGLang /generate, seeds, concurrency, disconnect-cancel,
/metrics and /get_server_info. Model: test-tiny random weights with a tiny trained BPE tokenizer + chat template.
"""

from __future__ import annotations

import json
import re
import threading
import time

import httpx
import openai  # a dev dependency: missing is a failure, not a skip
import pytest

from tests.serve_helpers import Server, make_model_dir

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("serve-api")
    srv = Server(make_model_dir(str(d / "model")), str(d / "server.log"), "--random-weights", "--seed", "3")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def greedy_text(client, model):
    """The greedy completion of PROMPT without stop strings (the reference for the stop tests)."""
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=40, temperature=0)
    return r.choices[0].text


def _stream_text(client, **kw) -> tuple[str, str | None]:
    text, reason = "", None
    for chunk in client.completions.create(stream=True, **kw):
        if chunk.choices:
            text += chunk.choices[0].text
            reason = chunk.choices[0].finish_reason or reason
    return text, reason


def test_health_models_and_warm_start(server, model):
    assert server.saw_503, "/health must answer 503 while the model loads"
    assert httpx.get(server.url + "/health").status_code == 200
    assert model.endswith("model")
    assert "cancelled" not in server.log()


def test_completion_nonstream_and_stream_agree(client, model, greedy_text):
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=40, temperature=0)
    assert r.choices[0].text == greedy_text  # greedy is deterministic
    assert r.usage.prompt_tokens > 0 and 1 <= r.usage.completion_tokens <= 40
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.choices[0].finish_reason in ("stop", "length")
    text, reason = _stream_text(client, model=model, prompt=PROMPT, max_tokens=40, temperature=0)
    assert text == greedy_text and reason == r.choices[0].finish_reason


def _pick_stop(text: str) -> str:
    """Two characters, not at the very start, that end inside the text: printable ASCII when the text has such a
    pair, else any pair without whitespace or U+FFFD. Never skips: a text with no pair at all fails."""
    pairs = [text[p : p + 2] for p in range(2, len(text) - 2)]
    ascii_pairs = [s for s in pairs if all(" " < c < "\x7f" for c in s)]
    other = [s for s in pairs if not any(c.isspace() or c == "\ufffd" for c in s)]
    assert ascii_pairs or other, f"the greedy text has no two characters to stop on: {text!r}"
    return (ascii_pairs or other)[0]


def test_stop_string_exact_truncation(client, model, greedy_text, server):
    stop = _pick_stop(greedy_text)
    want = greedy_text[: greedy_text.index(stop)]
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=40, temperature=0, stop=[stop, "\x00zz"])
    assert r.choices[0].text == want
    assert r.choices[0].finish_reason == "stop"
    text, reason = _stream_text(client, model=model, prompt=PROMPT, max_tokens=40, temperature=0, stop=stop)
    assert (text, reason) == (want, "stop")
    g = httpx.post(server.url + "/generate", json={"text": PROMPT, "sampling_params": {
        "max_new_tokens": 40, "temperature": 0, "stop": stop}}, timeout=60).json()
    assert g["text"] == want
    assert g["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert len(g["output_ids"]) == g["meta_info"]["completion_tokens"] < 40  # tokens after the stop dropped


def test_chat_uses_template(client, model, server):
    from ling_jax.tokenizer import load_tokenizer

    msgs = [{"role": "user", "content": "hi"}]
    r = client.chat.completions.create(model=model, messages=msgs, max_tokens=8, temperature=0)
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant" and isinstance(r.choices[0].message.content, str)
    info = httpx.get(server.url + "/get_server_info").json()
    tok = load_tokenizer(info["model_path"])
    assert r.usage.prompt_tokens == len(tok.encode(tok.apply_chat_template(msgs)))
    parts = [c.choices[0].delta.content or "" for c in
             client.chat.completions.create(model=model, messages=msgs, max_tokens=8, temperature=0, stream=True)
             if c.choices]
    assert "".join(parts) == r.choices[0].message.content


def test_generate_native_stream_and_meta(server):
    body = {"input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 12, "temperature": 0,
                                                          "ignore_eos": True}}
    g = httpx.post(server.url + "/generate", json=body, timeout=60).json()
    m = g["meta_info"]
    assert m["prompt_tokens"] == 4 and m["completion_tokens"] == 12 == len(g["output_ids"])
    assert m["finish_reason"] == {"type": "length", "length": 12}
    assert m["spec_verify_ct"] >= 1 and m["spec_accept_length"] >= 1.0
    chunks = []
    with httpx.stream("POST", server.url + "/generate", json={**body, "stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                chunks.append(line[6:])
    assert chunks[-1] == "[DONE]"
    last = json.loads(chunks[-2])
    assert last["output_ids"] == g["output_ids"] and last["meta_info"]["finish_reason"]["type"] == "length"


def test_sampling_seed_reproducible(client, model):
    kw = dict(model=model, prompt=PROMPT, max_tokens=16, temperature=1.0, top_p=0.9, seed=7)
    a, b = (client.completions.create(**kw).choices[0].text for _ in range(2))
    assert a == b


def test_concurrent_clients(client, model, greedy_text):
    results, errors = {}, []

    def work(i):
        try:
            r = client.completions.create(model=model, prompt=PROMPT, max_tokens=40, temperature=0)
            results[i] = r.choices[0].text
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and len(results) == 3
    assert all(t == greedy_text for t in results.values())


def _metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics").text
    m = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def test_disconnect_cancels_and_next_request_is_fine(server, client, model, greedy_text):
    aborted0 = _metric(server.url, "ling:num_aborted_requests_total")
    body = {"input_ids": [9, 10, 11], "stream": True,
            "sampling_params": {"max_new_tokens": 480, "temperature": 0, "ignore_eos": True}}
    with httpx.Client(timeout=60) as c, c.stream("POST", server.url + "/generate", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break  # one chunk read, then the connection closes
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=40, temperature=0)
    assert r.choices[0].text == greedy_text
    deadline = time.time() + 30
    while _metric(server.url, "ling:num_aborted_requests_total") <= aborted0 and time.time() < deadline:
        time.sleep(0.2)
    assert _metric(server.url, "ling:num_aborted_requests_total") == aborted0 + 1
    assert re.search(r"request \w+ cancelled: client disconnected", server.log())
    n = int(re.search(r"aborted after (\d+) tokens", server.log()).group(1))
    assert n < 480  # it stopped early


def test_metrics_and_server_info(server):
    r = httpx.get(server.url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    for name in ("ling:time_to_first_token_seconds_bucket", "ling:inter_token_latency_seconds_bucket",
                 "ling:time_per_output_token_seconds_bucket", "ling:spec_accept_length_bucket",
                 "ling:num_requests_total", "ling:prompt_tokens_total", "ling:generation_tokens_total"):
        assert name in r.text, name
    assert _metric(server.url, "ling:generation_tokens_total") > 0
    info = httpx.get(server.url + "/get_server_info").json()
    assert info["speculative_algorithm"] == "NEXTN" and info["context_length"] == 512
    st = info["internal_states"][0]
    assert st["avg_spec_accept_length"] >= 1.0 and st["spec_verify_ct_total"] > 0
    assert st["num_aborted_requests"] >= 1
