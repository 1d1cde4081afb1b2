"""The real server (subprocess, loopback) driven by the official `openai` client and raw HTTP: completions and
chat (stream and not), exact stop-string truncation, SGLang /generate, seeds, concurrency, disconnect-cancel,
/metrics, every SGLang endpoint in SGLang's shapes (server/model info, tokenize, abort, flush, health), and the
bench clients (bench_serving's three backends and datasets, eval_gsm8k on a hand-written JSONL).
Model: random weights of test-tiny's first 3 layers (serve_helpers.MODEL_CFG), a tiny trained BPE tokenizer + chat
template; the server (tests/conftest.py batch1_server) is shared with test_serve_sampling.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time

import httpx
import openai  # a dev dependency: missing is a failure, not a skip
import pytest

from bench import bench_serving, eval_gsm8k

PROMPT = "The quick brown fox"
DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
SHAREGPT = os.path.join(DATA, "sharegpt_tiny.json")
GSM8K = os.path.join(DATA, "gsm8k_tiny.jsonl")


@pytest.fixture(scope="module")
def server(batch1_server):
    return batch1_server  # tests/conftest.py: shared with test_serve_sampling


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
    tok = load_tokenizer(server.model_path)
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


# ---- SGLang's endpoints, as its clients call them -------------------------------------------------------------


def test_server_info_both_names_redacted_without_auth(server):
    a, b = (httpx.get(server.url + p).json() for p in ("/server_info", "/get_server_info"))
    assert a.keys() == b.keys() and a["model_path"] == b["model_path"]
    st = a["internal_states"][0]  # what SGLang's bench_serving reads as the accept length
    assert isinstance(st["avg_spec_accept_length"], float)
    # no key configured: nobody is authenticated, so no absolute path, no coordinator address, no key field
    assert a["model_path"] == "model" and a["tokenizer_path"] == "model"
    assert "dist_init_addr" not in a and "api_key" not in a
    assert not any(isinstance(v, str) and v.startswith("/") for v in a.values())


def test_model_info_and_model_cards(server, model):
    for path in ("/model_info", "/get_model_info"):
        m = httpx.get(server.url + path).json()
        assert m["tokenizer_path"] == "model" and m["served_model_name"] == model == "model"
        assert m["is_generation"] is True and m["weight_version"] == "default"
    card = httpx.get(server.url + "/v1/models/model").json()
    assert card == {**httpx.get(server.url + "/v1/models").json()["data"][0]}
    assert card["id"] == card["root"] == "model" and card["max_model_len"] == 512
    r = httpx.get(server.url + "/v1/models/other")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_model_default_is_the_served_model(client, greedy_text):
    r = client.completions.create(model="default", prompt=PROMPT, max_tokens=40, temperature=0)
    assert r.choices[0].text == greedy_text and r.model == "model"


def test_flush_cache_and_health_generate(server):
    gen0 = _metric(server.url, "ling:generation_tokens_total")
    assert httpx.post(server.url + "/flush_cache", params={"timeout": 60}).status_code == 200  # SGLang's call
    assert httpx.get(server.url + "/flush_cache").status_code == 200
    r = httpx.post(server.url + "/flush_cache", params={"timeout": "soon"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "timeout"
    assert httpx.get(server.url + "/health_generate", timeout=60).status_code == 200
    assert _metric(server.url, "ling:generation_tokens_total") == gen0  # the probe is not a user request


def test_tokenize_detokenize(server):
    from tokenizers import Tokenizer

    hf = Tokenizer.from_file(f"{server.model_path}/tokenizer.json")  # the oracle: HF tokenizers directly
    post = lambda p, **b: httpx.post(server.url + p, json=b).json()  # noqa: E731
    want = hf.encode(PROMPT, add_special_tokens=False).ids
    assert post("/tokenize", prompt=PROMPT) == {"tokens": want, "count": len(want), "max_model_len": 512}
    two = post("/v1/tokenize", prompt=[PROMPT, "fox"], model="default")
    assert two["tokens"][0] == want and two["count"] == [len(want), len(two["tokens"][1])]
    assert post("/detokenize", tokens=want) == {"text": PROMPT}
    assert post("/v1/detokenize", tokens=[want, two["tokens"][1]]) == {"text": [PROMPT, "fox"]}
    special = hf.token_to_id("<|im_start|>")
    assert post("/detokenize", tokens=[special] + want)["text"] == PROMPT
    assert post("/detokenize", tokens=[special] + want, skip_special_tokens=False)["text"] == "<|im_start|>" + PROMPT
    chat = post("/tokenize", messages=[{"role": "user", "content": "hi"}])
    assert chat["tokens"][0] == special
    r = httpx.post(server.url + "/tokenize", json={"prompt": "x", "return_offsets": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "return_offsets"


def _sse_events(url: str, body: dict) -> list:
    with httpx.stream("POST", url + "/generate", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        return [line[6:] for line in r.iter_lines() if line.startswith("data: ")]


def test_abort_request_by_rid(server):
    body = {"input_ids": [9, 10, 11], "rid": "abort-me", "stream": True,
            "sampling_params": {"max_new_tokens": 480, "temperature": 0, "ignore_eos": True}}
    events = []
    with httpx.stream("POST", server.url + "/generate", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if len(events) == 1:
                    a = httpx.post(server.url + "/abort_request", json={"rid": "abort-me"})
                    assert a.status_code == 200
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])  # SGLang: a shortened reply, not an error
    assert last["meta_info"]["id"] == "abort-me" and last["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(last["output_ids"]) < 480
    r = httpx.post(server.url + "/abort_request", json={"rid": "gone-already"})
    assert r.status_code == 200
    r = httpx.post(server.url + "/abort_request", json={})
    assert r.status_code == 400 and r.json()["error"]["param"] == "rid"


def _greedy_ids(server, n: int) -> list[int]:
    g = httpx.post(server.url + "/generate", json={"text": PROMPT, "sampling_params": {
        "max_new_tokens": n, "temperature": 0, "ignore_eos": True}}, timeout=60).json()
    return g["output_ids"]


def test_first_token_stop_is_stop_and_streams_once(server, client, model):
    first = _greedy_ids(server, 1)[0]
    sp = {"max_new_tokens": 20, "temperature": 0, "stop_token_ids": [first]}
    g = httpx.post(server.url + "/generate", json={"text": PROMPT, "sampling_params": sp}, timeout=60).json()
    assert g["meta_info"]["finish_reason"] == {"type": "stop", "matched": first}
    assert g["output_ids"] == [first] and g["text"] == ""  # the stop token's text is dropped (SGLang)
    events = _sse_events(server.url, {"text": PROMPT, "sampling_params": sp})
    assert events[-1] == "[DONE]" and len(events) == 2  # one event: the final one, once
    e = json.loads(events[0])
    assert (e["text"], e["output_ids"]) == ("", [first])
    assert e["meta_info"]["finish_reason"] == g["meta_info"]["finish_reason"]
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=20, temperature=0,
                                  extra_body={"stop_token_ids": [first]})
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 1


def test_stop_token_text_dropped_and_final_event_once(server):
    from ling_jax.tokenizer import load_tokenizer

    tok = load_tokenizer(server.model_path)
    ids = _greedy_ids(server, 16)
    k = next(i for i in range(2, len(ids)) if ids[i] not in ids[:i] and tok.decode([ids[i]]))
    sp = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True, "stop_token_ids": [ids[k]]}
    g = httpx.post(server.url + "/generate", json={"text": PROMPT, "sampling_params": sp}, timeout=60).json()
    assert g["output_ids"] == ids[: k + 1]  # the matched id stays in the ids, as SGLang's
    assert g["text"] == tok.decode(ids[:k])
    events = [json.loads(e) for e in _sse_events(server.url, {"text": PROMPT, "sampling_params": sp})[:-1]]
    finals = [e for e in events if e["meta_info"]["finish_reason"] is not None]
    assert len(finals) == 1 and finals[0] is events[-1] and events[-1]["text"] == g["text"]
    assert all(a["output_ids"] != b["output_ids"] for a, b in zip(events, events[1:]))  # no event twice


# ---- the bench clients against this server (runs last: they add requests) ------------------------------


@pytest.mark.parametrize("backend,dataset", [("sglang", "random-ids"), ("sglang-oai", "random"),
                                             ("sglang-oai-chat", "sharegpt")])
def test_bench_serving(server, tmp_path, backend, dataset, capsys):
    out = tmp_path / f"bench-{backend}.json"
    data = (["--tokenizer-free"] if dataset == "random-ids" else ["--tokenizer", server.model_path,
                                                                  "--dataset-path", SHAREGPT])
    rc = bench_serving.main(["--base-url", server.url, "--backend", backend, "--random-input-len", "12",
                             "--random-output-len", "10", "--random-range-ratio", "0.5", "--num-prompts", "4",
                             "--max-concurrency", "2", "--seed", "1", "--output-file", str(out), *data,
                             "--dataset-name", "sharegpt" if dataset == "sharegpt" else "random",
                             "--sharegpt-output-len", "8"])
    assert rc == 0
    table = capsys.readouterr().out
    for line in ("Serving Benchmark Result", "Successful requests:", "Mean TPOT (ms):", "P99 ITL (ms):",
                 "Peak output token throughput (tok/s):", "Accept length:"):
        assert line in table
    d = json.loads(out.read_text())
    assert d["completed"] == 4 and d["failed"] == 0
    lo, hi = (8, 8) if dataset == "sharegpt" else (5, 10)
    assert len(d["output_lens"]) == 4 and all(lo <= n <= hi for n in d["output_lens"])  # ignore_eos: exact
    assert d["total_output_tokens"] == sum(d["output_lens"])
    for k in ("mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms",
              "mean_itl_ms", "p99_itl_ms", "mean_e2e_latency_ms", "output_throughput", "max_output_tokens_per_s"):
        assert isinstance(d[k], float) and d[k] > 0, k
    assert d["max_output_tokens_per_s"] <= d["total_output_tokens"]  # tokens in the best 1 s window
    assert d["accept_length"] >= 1.0
    assert "bench.bench_serving" in d["command"] and "--backend" in d["command"]
    assert d["server_info"]["speculative_algorithm"] == "NEXTN" and d["date"]
    assert (tmp_path / f"bench-{backend}.png").stat().st_size > 1000


def test_bench_needs_a_tokenizer_or_says_so(server, capsys):
    rc = bench_serving.main(["--base-url", server.url, "--backend", "sglang-oai-chat", "--num-prompts", "1"])
    assert rc == 2 and "--tokenizer" in capsys.readouterr().err  # the server shows no absolute path to find it


def test_eval_gsm8k_against_server(server, tmp_path, capsys):
    out = tmp_path / "gsm8k.json"
    rc = eval_gsm8k.main(["--base-url", server.url, "--data-path", GSM8K, "--num-shots", "0", "--num-questions",
                          "6", "--max-new-tokens", "8", "--parallel", "3", "--output-file", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    d = json.loads(out.read_text())
    assert [it["label"] for it in d["items"]] == [7, 60, 105, 24, 5, 950]
    preds = [eval_gsm8k.answer_value(it["output"]) for it in d["items"]]
    assert [it["pred"] for it in d["items"]] == preds
    assert d["accuracy"] == sum(p == it["label"] for p, it in zip(preds, d["items"])) / 6
    assert d["invalid"] == preds.count(eval_gsm8k.INVALID) / 6
    assert 1 <= d["completion_tokens"] <= 48 and d["latency"] > 0
    assert d["output_throughput"] == pytest.approx(d["completion_tokens"] / d["latency"])
    assert f"Accuracy: {d['accuracy']:.3f}" in printed and "Output throughput:" in printed
