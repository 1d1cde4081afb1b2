"""bench_serving against the real tokenizer-free server (test-tiny preset): both backends, JSON fields, PNG.
Also what a server without a tokenizer answers: text endpoints 400, token ids work."""

from __future__ import annotations

import json

import httpx
import pytest

from bench import bench_serving
from tests.serve_helpers import Server


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("serve-bench")
    srv = Server("test-tiny", str(d / "server.log"))
    yield srv
    srv.stop()


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "hello", "max_tokens": 4}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "messages"),
    ("/generate", {"text": "hello"}, "text"),
    ("/v1/completions", {"prompt": [5, 6], "stop": "x"}, "stop"),
])
def test_text_needs_tokenizer(server, path, body, param):
    r = httpx.post(server.url + path, json=body, timeout=30)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "no_tokenizer" and err["param"] == param and "token ids" in err["message"]


def test_token_ids_work_without_tokenizer(server):
    g = httpx.post(server.url + "/generate", json={"input_ids": [5, 6, 7], "sampling_params": {
        "max_new_tokens": 5, "temperature": 0, "ignore_eos": True}}, timeout=60).json()
    assert len(g["output_ids"]) == 5 and g["text"] == ""
    c = httpx.post(server.url + "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 5, "temperature": 0,
                                                         "ignore_eos": True}, timeout=60).json()
    assert c["choices"][0]["token_ids"] == g["output_ids"]  # same greedy tokens on both APIs
    assert c["usage"] == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}


@pytest.mark.parametrize("backend", ["sglang", "openai"])
def test_bench_serving(server, tmp_path, backend, capsys):
    out = tmp_path / f"bench-{backend}.json"
    rc = bench_serving.main(["--base-url", server.url, "--backend", backend, "--dataset-name", "random",
                             "--random-input-len", "12", "--random-output-len", "10", "--random-range-ratio", "0.5",
                             "--num-prompts", "4", "--max-concurrency", "2", "--seed", "1", "--tokenizer-free",
                             "--output-file", str(out)])
    assert rc == 0
    table = capsys.readouterr().out
    for line in ("Serving Benchmark Result", "Successful requests:", "Mean TPOT (ms):", "P99 ITL (ms):",
                 "Peak output token throughput (tok/s):", "Accept length:"):
        assert line in table
    d = json.loads(out.read_text())
    assert d["completed"] == 4 and d["failed"] == 0
    assert len(d["output_lens"]) == 4 and all(5 <= n <= 10 for n in d["output_lens"])  # ignore_eos: exact lengths
    assert d["total_output_tokens"] == sum(d["output_lens"])
    for k in ("mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms",
              "mean_itl_ms", "p99_itl_ms", "mean_e2e_latency_ms", "output_throughput", "max_output_tokens_per_s"):
        assert isinstance(d[k], float) and d[k] > 0, k
    assert d["max_output_tokens_per_s"] <= d["total_output_tokens"]  # tokens in the best 1 s window
    if d["duration"] < 1:
        assert d["max_output_tokens_per_s"] == d["total_output_tokens"]
    assert d["accept_length"] >= 1.0
    assert "bench.bench_serving" in d["command"] and "--backend" in d["command"]
    assert d["server_info"]["speculative_algorithm"] == "NEXTN" and d["date"]
    assert (tmp_path / f"bench-{backend}.png").stat().st_size > 1000


def test_peak_throughput_window():
    R = bench_serving.Result
    rs = [R(prompt_len=1, chunks=[(0.0, 3), (0.5, 2), (1.2, 4)]), R(prompt_len=1, chunks=[(0.9, 1), (2.5, 7)])]
    assert bench_serving.peak_throughput(rs) == 7.0  # (0.5, 2) + (0.9, 1) + (1.2, 4), or (2.5, 7)
    rs[1].chunks[1] = (2.5, 5)
    assert bench_serving.peak_throughput(rs) == 7.0
    rs[0].chunks[2] = (1.2, 9)
    assert bench_serving.peak_throughput(rs) == 12.0  # 2 + 1 + 9 within [0.5, 1.2]
