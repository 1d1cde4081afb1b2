"""The draft vocabulary (ling_jax/draft_vocab.py) on a trained checkpoint: build it from the target's own greedy
outputs on training-split prompts, store it beside the checkpoint, then measure NEXTN accept length and decode
speed on held-out prompts with the full draft vocabulary and with the reduced one, and check losslessness (the
NEXTN output with the reduced draft vocabulary equals plain greedy decoding).

    python -m bench.draft_vocab_eval --model models/ling-demo --data .data/stdlib --n 854
Ling-3.0-flash's N = 32768 of 157184 tokens (20.8 %); the demo's proportional N is 854 of 4096.
Writes <model>/draft_vocab.safetensors and bench/results/draft-vocab-<device>-<date>.json.
"""

from __future__ import annotations

import argparse
import os

import jax
import jax.numpy as jnp
import numpy as np

from bench.bench_step import write
from bench.eval_accept import heldout_tokens, make_prompts, run_steps
from ling_jax import draft_vocab
from ling_jax.config import load_config
from ling_jax.runner import Generator
from ling_jax.weights import load_params


def output_counts(cfg, params, prompts, new_tokens: int, max_len: int) -> np.ndarray:
    """int64[V]: how often plain greedy decoding emitted each token over the prompts."""
    gen = Generator(cfg, params, max_len=max_len, dtype=params["embed"].dtype)
    counts = np.zeros(cfg.vocab_size, np.int64)
    for p in prompts:
        ids, _ = gen.generate(p, max_new_tokens=new_tokens, stop_token_ids=())
        np.add.at(counts, np.asarray(ids), 1)
    return counts


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="models/ling-demo")
    ap.add_argument("--data", default=".data/stdlib")
    ap.add_argument("--n", type=int, default=854, help="draft vocabulary size")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--count-prompts", type=int, default=32, help="training-split prompts whose outputs are counted")
    ap.add_argument("--count-tokens", type=int, default=96)
    ap.add_argument("--prompts", type=int, default=8, help="held-out prompts measured")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                    help="float32: the lossless check is exact (see bench/eval_accept.py)")
    ap.add_argument("--vocab-out", default=None, help="default: <model>/draft_vocab.safetensors")
    ap.add_argument("--out", default="bench/results")
    a = ap.parse_args(argv)
    cfg = load_config(a.model)
    params = load_params(cfg, a.model, dtype=jnp.dtype(a.dtype))
    eos = cfg.eos_token_id
    max_len = a.prompt_len + max(a.new_tokens, a.count_tokens) + 2 * (a.steps + 1) + 8
    heldout = heldout_tokens(a.data, a.model)
    train = np.load(os.path.join(a.data, "tokens-train.npy"))
    counts = output_counts(cfg, params, make_prompts(train, a.count_prompts, a.prompt_len, eos), a.count_tokens,
                           max_len)
    ids = draft_vocab.hot_tokens(counts, a.n)
    path = a.vocab_out or os.path.join(a.model, draft_vocab.FILE)
    draft_vocab.save(path, ids, cfg.vocab_size, source=f"plain greedy outputs of {a.model} on {a.count_prompts} "
                     f"training-split prompts of {a.data}, {a.count_tokens} tokens each", tokens_counted=int(counts.sum()))
    ids = draft_vocab.load(path, cfg.vocab_size)  # measure what the file holds
    prompts = make_prompts(heldout, a.prompts, a.prompt_len, eos)
    plain, plain_out = run_steps(cfg, params, prompts, 0, a.new_tokens, max_len)
    full, full_out = run_steps(cfg, params, prompts, a.steps, a.new_tokens, max_len)
    reduced, reduced_out = run_steps(cfg, draft_vocab.with_draft_vocab(params, ids), prompts, a.steps, a.new_tokens,
                                     max_len)
    emitted = np.concatenate([np.asarray(o) for o in plain_out])
    res = {"model": a.model, "dtype": a.dtype, "steps": a.steps, "vocab_size": cfg.vocab_size, "draft_vocab": a.n,
           "draft_vocab_file": path, "tokens_counted": int(counts.sum()),
           "heldout_output_coverage": float(np.isin(emitted, ids).mean()),
           "plain": plain, "full_draft_vocab": full, "reduced_draft_vocab": reduced,
           "lossless_full": [list(x) for x in full_out] == [list(x) for x in plain_out],
           "lossless_reduced": [list(x) for x in reduced_out] == [list(x) for x in plain_out]}
    for name in ("full_draft_vocab", "reduced_draft_vocab"):
        r = res[name]
        print(f"{name:20s} accept {r['mean_accept_length']:.3f}  decode {r['decode_tokens_per_s']:.1f} tok/s")
    print(f"coverage of held-out greedy outputs by the {a.n} hot tokens: {res['heldout_output_coverage']:.3f}; "
          f"lossless: full {res['lossless_full']}, reduced {res['lossless_reduced']}")
    print("wrote", write(a.out, "draft-vocab", [], res, jax.devices()[0].platform,
                         command="python -m bench.draft_vocab_eval " + " ".join(argv or os.sys.argv[1:])))
    if not res["lossless_reduced"]:
        raise SystemExit("the reduced draft vocabulary changed the output")


if __name__ == "__main__":
    main()
