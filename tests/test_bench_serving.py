"""bench_serving against the real server (test-tiny random weights + the tiny BPE tokenizer): the three SGLang
backends over the random (token ids from real prompts, or random ids without a tokenizer) and ShareGPT datasets,
JSON fields, PNG; eval_gsm8k on a hand-written GSM8K JSONL."""

from __future__ import annotations

import json
import os

import pytest

from bench import bench_serving, eval_gsm8k
from ling_jax.tokenizer import load_tokenizer
from tests.serve_helpers import Server, make_model_dir

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
SHAREGPT = os.path.join(DATA, "sharegpt_tiny.json")
GSM8K = os.path.join(DATA, "gsm8k_tiny.jsonl")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("serve-bench")
    srv = Server(make_model_dir(str(d / "model")), str(d / "server.log"), "--random-weights")
    yield srv
    srv.stop()


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


def test_random_dataset_samples_real_prompts(tmp_path):
    tok = load_tokenizer(make_model_dir(str(tmp_path / "model")))
    a = bench_serving.build_parser().parse_args(["--tokenizer", "unused", "--dataset-path", SHAREGPT,
                                                 "--random-input-len", "40", "--random-range-ratio", "0.25",
                                                 "--num-prompts", "6", "--random-output-len", "4"])
    assert a.tokenizer == "unused" and not a.tokenizer_free  # --tokenizer is its own flag, not --tokenizer-free
    prompts = [q for q, _ in bench_serving.sharegpt_prompts(SHAREGPT)]
    assert len(prompts) == 6  # the one-turn conversation is skipped
    for text, n_in, n_out in bench_serving.make_prompts(a, 512, tok):
        assert 10 <= n_in <= 40 and 1 <= n_out <= 4
        src = next(p for p in prompts if (p * 40).startswith(text))  # real text, repeated or cut
        assert abs(len(tok.encode(text)) - n_in) <= 2, (text, n_in)  # it re-encodes to about its length
        assert src


def test_bench_needs_a_tokenizer_or_says_so(server, capsys):
    rc = bench_serving.main(["--base-url", server.url, "--backend", "sglang-oai-chat", "--num-prompts", "1"])
    assert rc == 2 and "--tokenizer" in capsys.readouterr().err  # the server shows no absolute path to find it


def test_peak_throughput_window():
    R = bench_serving.Result
    rs = [R(prompt_len=1, chunks=[(0.0, 3), (0.5, 2), (1.2, 4)]), R(prompt_len=1, chunks=[(0.9, 1), (2.5, 7)])]
    assert bench_serving.peak_throughput(rs) == 7.0  # (0.5, 2) + (0.9, 1) + (1.2, 4), or (2.5, 7)
    rs[1].chunks[1] = (2.5, 5)
    assert bench_serving.peak_throughput(rs) == 7.0
    rs[0].chunks[2] = (1.2, 9)
    assert bench_serving.peak_throughput(rs) == 12.0  # 2 + 1 + 9 within [0.5, 1.2]


def test_gsm8k_answer_extraction():
    assert eval_gsm8k.answer_value("so 1,200 - 250 = 950 stamps.\n#### 950") == 950
    assert eval_gsm8k.answer_value("The answer is 42.") == 42
    assert eval_gsm8k.answer_value("no digits here") == eval_gsm8k.INVALID
    items = eval_gsm8k.read_jsonl(GSM8K)
    assert eval_gsm8k.few_shot_prefix(items, 2) == (f"Question: {items[0]['question']}\nAnswer: {items[0]['answer']}"
                                                    f"\n\nQuestion: {items[1]['question']}\nAnswer: "
                                                    f"{items[1]['answer']}\n\n")


def test_eval_gsm8k_against_server(server, tmp_path, capsys):
    out = tmp_path / "gsm8k.json"
    rc = eval_gsm8k.main(["--base-url", server.url, "--data-path", GSM8K, "--num-shots", "1", "--num-questions",
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
