"""bench_serving's and eval_gsm8k's parts without a server: the random dataset drawn from real prompts, flags,
the peak-throughput window, GSM8K answer extraction and the few-shot prompt. Against the real server they run in
test_serve_api.py (its server has the tokenizer they need)."""

from __future__ import annotations

import os

from bench import bench_serving, eval_gsm8k
from ling_jax.tokenizer import load_tokenizer
from tests.serve_helpers import make_model_dir

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
SHAREGPT = os.path.join(DATA, "sharegpt_tiny.json")
GSM8K = os.path.join(DATA, "gsm8k_tiny.jsonl")


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
        assert any((p * 40).startswith(text) for p in prompts), text  # real text, repeated or cut
        assert abs(len(tok.encode(text)) - n_in) <= 2, (text, n_in)  # it re-encodes to about its length


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
