"""Greedy agreement of a checkpoint in bf16 and in block fp8 (--quantization fp8) on held-out prompts, two ways:

  free-running    both models decode --new-tokens greedy tokens from each prompt on their own: tokens before the
                  first difference and the fraction of equal positions (bench/eval_accept.agreement). One early
                  near-tie sends the two continuations apart, so this understates how often they agree.
  teacher-forced  both models read the same sequence (prompt + the bf16 model's continuation) in one prefill
                  forward; the fraction of continuation positions where their argmax agrees, and where the fp8
                  model's argmax is the bf16 model's next token (the bf16 continuation is its own argmax).

    python -m bench.eval_fp8_agreement --model models/ling-demo --data .data/stdlib
Writes bench/results/eval-fp8-agreement-<device>-<date>.json (held-out ppl and NEXTN accept of the same pair:
bench/results/eval-fp8-*.json from bench/eval_accept.py --quantization fp8).
"""

from __future__ import annotations

import argparse
import os

import jax
import jax.numpy as jnp
import numpy as np

from bench.bench_step import write
from bench.eval_accept import agreement, heldout_tokens, make_prompts, run_steps
from ling_jax.config import load_config
from ling_jax.model import Numerics, RuntimeOptions, forward, lm_logits
from ling_jax.state import init_state
from ling_jax.weights import load_params


def argmax_rows(cfg, params, seqs: np.ndarray, fp8_activations: str = "none") -> np.ndarray:
    """seqs int32[B, T] -> int32[B, T]: the model's greedy next token at every position (one prefill forward)."""
    opts = RuntimeOptions(numerics=Numerics(fp8_activations=fp8_activations))

    @jax.jit
    def f(params, tokens):
        out = forward(params, tokens, init_state(cfg, tokens.shape[0], tokens.shape[1], params["embed"].dtype), cfg,
                      mode="prefill", opts=opts)
        return jnp.argmax(lm_logits(params, out.hidden), axis=-1)

    return np.asarray(f(params, jnp.asarray(seqs, jnp.int32)))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="models/ling-demo")
    ap.add_argument("--data", default=".data/stdlib")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--fp8-activations", choices=["none", "dynamic"], default="none",
                    help="the fp8 model's Numerics.fp8_activations (dynamic: w8a8; the report is "
                         "eval-fp8-dynamic-agreement-*)")
    ap.add_argument("--out", default="bench/results")
    a = ap.parse_args(argv)
    act = {None: "none", "fp8": a.fp8_activations}
    cfg = load_config(a.model)
    prompts = make_prompts(heldout_tokens(a.data, a.model), a.prompts, a.prompt_len, cfg.eos_token_id)
    max_len = a.prompt_len + a.new_tokens + 16
    params = {q: load_params(cfg, a.model, dtype=jnp.bfloat16, quantization=q) for q in (None, "fp8")}
    outs = {q: run_steps(cfg, p, prompts, 0, a.new_tokens, max_len, fp8_activations=act[q])[1]
            for q, p in params.items()}
    free = agreement(outs["fp8"], outs[None])
    seqs = np.array([p + o for p, o in zip(prompts, outs[None])], np.int32)  # prompt + the bf16 continuation
    P = a.prompt_len
    cont = slice(P - 1, P - 1 + a.new_tokens)  # rows whose next token is a continuation token
    ref = argmax_rows(cfg, params[None], seqs)[:, cont]
    q8 = argmax_rows(cfg, params["fp8"], seqs, a.fp8_activations)[:, cont]
    forced = {"argmax_agreement": float(np.mean(ref == q8)),
              "fp8_argmax_is_bf16_next_token": float(np.mean(q8 == seqs[:, P:P + a.new_tokens])),
              "bf16_argmax_is_its_own_continuation": float(np.mean(ref == seqs[:, P:P + a.new_tokens])),
              "per_prompt_argmax_agreement": [float(x) for x in np.mean(ref == q8, axis=1)]}
    res = {"model": a.model, "dtype": "bfloat16", "quantization": "fp8 (ling_jax.quant.fp8_policy)",
           "fp8_activations": a.fp8_activations,
           "prompts": len(prompts), "prompt_len": P, "new_tokens": a.new_tokens,
           "free_running_greedy_agreement": free, "teacher_forced": forced}
    print(f"free-running: identical {free['identical_prompts']}/{len(prompts)}, mean first difference at "
          f"{free['mean_first_difference_at']:.1f}, equal positions {free['equal_position_fraction']:.3f}")
    print(f"teacher-forced: argmax agreement {forced['argmax_agreement']:.4f} (bf16 self-consistency "
          f"{forced['bf16_argmax_is_its_own_continuation']:.4f})")
    kind = "eval-fp8" + ("" if a.fp8_activations == "none" else f"-{a.fp8_activations}") + "-agreement"
    print("wrote", write(a.out, kind, [], res, jax.devices()[0].platform,
                         command="python -m bench.eval_fp8_agreement " + " ".join(argv or os.sys.argv[1:])))


if __name__ == "__main__":
    main()
