"""Few-shot GSM8K against the server, with the semantics of SGLang's harness (sglang.test.few_shot_gsm8k), so the
numbers compare with SGLang's on the same model and data:

    python -m bench.eval_gsm8k --data-path gsm8k_test.jsonl --num-questions 200 --num-shots 5 --port 30000

Data: GSM8K's JSONL, one {"question": ..., "answer": "... #### 42"} per line (the user's file: nothing is
downloaded). Prompt: the first --num-shots items with their answers ("Question: q\nAnswer: a" blocks, blank line
between), then "Question: q\nAnswer:"; the questions are the first --num-questions items (as in SGLang's script,
the shots are among them). Each prompt goes to /generate, greedy by default, stopped at "Question",
"Assistant:" or "<|separator|>", --parallel requests at a time. Answer: the last integer in the text, commas
removed (SGLang's get_answer_value); none is invalid. Reported: accuracy, invalid rate, latency (wall seconds for
all questions) and output throughput (completion tokens / latency); JSON with every prediction to --output-file.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

INVALID = -9999999  # SGLang's marker for "no number in the answer"
STOP = ["Question", "Assistant:", "<|separator|>"]


def read_jsonl(path: str) -> list[dict]:
    items = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            d = json.loads(line)
            if not (isinstance(d.get("question"), str) and isinstance(d.get("answer"), str)):
                raise ValueError(f"{path}:{n}: a GSM8K line needs string 'question' and 'answer' fields")
            items.append(d)
    return items


def example(item: dict, with_answer: bool) -> str:
    return "Question: " + item["question"] + "\nAnswer:" + (" " + item["answer"] if with_answer else "")


def few_shot_prefix(items: list[dict], k: int) -> str:
    return "".join(example(items[i], True) + "\n\n" for i in range(k))


def answer_value(text: str) -> int:
    """The last run of digits, commas removed (so '1,200' is 1200 and '-3' is 3, as in SGLang)."""
    numbers = re.findall(r"\d+", text.replace(",", ""))
    return int(numbers[-1]) if numbers else INVALID


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--data-path", required=True, help="GSM8K-format JSONL")
    p.add_argument("--num-shots", type=int, default=5)
    p.add_argument("--num-questions", type=int, default=200)
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--parallel", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--base-url", default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--output-file", default=None, help="JSON path (default bench/results/gsm8k-<date>.json)")
    return p


def ask(client: httpx.Client, prompt: str, a) -> dict:
    body = {"text": prompt, "sampling_params": {"max_new_tokens": a.max_new_tokens, "temperature": a.temperature,
                                                "stop": STOP}}
    r = client.post("/generate", json=body)
    if r.status_code != 200:
        raise RuntimeError(f"/generate answered {r.status_code}: {r.text[:300]}")
    return r.json()


def run_eval(a) -> dict:
    items = read_jsonl(a.data_path)
    if len(items) < a.num_shots:
        raise ValueError(f"{a.data_path} has {len(items)} items, fewer than --num-shots {a.num_shots}")
    prefix = few_shot_prefix(items, a.num_shots)
    questions = items[: a.num_questions]
    labels = [answer_value(q["answer"]) for q in questions]
    if INVALID in labels:
        raise ValueError(f"{a.data_path}: item {labels.index(INVALID)}'s answer has no number")
    key = os.environ.get("OPENAI_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    with httpx.Client(base_url=a.base_url, timeout=None, headers=headers,
                      limits=httpx.Limits(max_connections=a.parallel)) as client, \
            ThreadPoolExecutor(a.parallel) as pool:
        tic = time.perf_counter()
        replies = list(pool.map(lambda q: ask(client, prefix + example(q, False), a), questions))
        latency = time.perf_counter() - tic
    preds = [answer_value(r["text"]) for r in replies]
    n_out = sum(r["meta_info"]["completion_tokens"] for r in replies)
    n = len(questions)
    return {"accuracy": sum(p == y for p, y in zip(preds, labels)) / n, "invalid": preds.count(INVALID) / n,
            "latency": latency, "output_throughput": n_out / latency, "num_questions": n,
            "num_shots": a.num_shots, "completion_tokens": n_out,
            "items": [{"question": q["question"], "label": y, "pred": p, "output": r["text"]}
                      for q, y, p, r in zip(questions, labels, preds, replies)]}


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    a.base_url = (a.base_url or f"http://{a.host}:{a.port}").rstrip("/")
    try:
        m = run_eval(a)
    except (ValueError, OSError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"Accuracy: {m['accuracy']:.3f}")
    print(f"Invalid: {m['invalid']:.3f}")
    print(f"Latency: {m['latency']:.3f} s")
    print(f"Output throughput: {m['output_throughput']:.3f} token/s")
    date = time.strftime("%Y-%m-%d-%H%M%S")
    out = a.output_file or os.path.join("bench", "results", f"gsm8k-{date}.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump({"command": " ".join([sys.executable, "-m", "bench.eval_gsm8k", *(argv or sys.argv[1:])]),
                   "date": date, "args": vars(a), **m}, f, indent=1)
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
