"""Chunked prefill: time to first token by --chunked-prefill-size and prompt length, at Ling-3.0-flash dims on a
layer slice (random bf16 weights, NEXTN 3), with the compile count of the timed requests (must be 0).

  python3 -m bench.bench_prefill --layers 12 --ctx 16384 --chunks 512,2048 --prompts 64,1024,8192 --out $OUT
  python3 -m bench.bench_prefill --preset test-tiny --ctx 512 --chunks 16,64 --prompts 8,300   (CPU smoke test)

Check first: every chunk size's first token and its logprob against one unchunked forward over the whole prompt
(the model's own prefill), then time. Rows: TTFT ms (median of --reps), prompt tokens / s, padded positions.
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench.bench_step import write
from compile.stages import slice_config
from ling_jax.config import get_preset
from ling_jax.model import forward, lm_logits
from ling_jax.runner import Generator, count_compiles
from ling_jax.sampling import SamplingOptions
from ling_jax.spec import SpecConfig
from ling_jax.state import init_state
from ling_jax.weights import init_params


def reference_first(cfg, params, prompt, dtype):
    """(argmax token, its log-softmax) of one unchunked prefill over the whole prompt."""
    tokens = jnp.asarray([prompt], jnp.int32)

    @jax.jit
    def f(params, tokens):
        out = forward(params, tokens, init_state(cfg, 1, tokens.shape[1], dtype), cfg, mode="prefill")
        return jax.nn.log_softmax(lm_logits(params, out.hidden[:, -1]), axis=-1)[0]

    logp = np.asarray(f(params, tokens))
    return int(np.argmax(logp)), float(np.max(logp))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="ling3-flash")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--ctx", type=int, default=16384)
    ap.add_argument("--chunks", default="512,2048")
    ap.add_argument("--prompts", default="64,1024,8192")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default="bench/results")
    a = ap.parse_args()
    cfg = get_preset(a.preset)
    if a.preset.startswith("ling3"):
        cfg = slice_config(cfg, a.layers)
    dtype = jnp.bfloat16
    params = init_params(cfg, 0, dtype)
    rng = np.random.default_rng(0)
    prompts = {n: rng.integers(2, cfg.vocab_size, n).tolist() for n in map(int, a.prompts.split(","))}
    refs = {n: reference_first(cfg, params, p, dtype) for n, p in prompts.items()}
    sp, key = SamplingOptions().device(cfg.vocab_size), jax.random.key(0)
    rows, device = [], f"{jax.device_count()}x {jax.devices()[0].device_kind}"
    for chunk in map(int, a.chunks.split(",")):
        gen = Generator(cfg, params, spec=SpecConfig("NEXTN", 3), max_len=a.ctx, chunked_prefill_size=chunk,
                        dtype=dtype)
        gen.generate([2, 3, 4, 5], max_new_tokens=2, stop_token_ids=())  # compiles the one prefill program
        for n, prompt in prompts.items():
            with count_compiles() as compiled:
                ts = []
                for _ in range(a.reps):
                    t0 = time.perf_counter()
                    _, first, lp = gen.prefill(prompt, sp, key, True)
                    first, chosen = jax.device_get((first, lp.chosen))
                    ts.append(time.perf_counter() - t0)
            ref_tok, ref_lp = refs[n]
            t = float(np.median(ts))
            r = {"name": f"prefill chunk {chunk}, prompt {n}", "chunk": chunk, "prompt_tokens": n,
                 "ttft_ms": t * 1e3, "prompt_tokens_per_s": n / t, "padded_positions": -(-n // chunk) * chunk - n,
                 "compiles_in_timed_requests": len(compiled), "first_token_matches_unchunked": int(first[0]) == ref_tok,
                 "first_logprob_abs_diff": abs(float(chosen[0]) - ref_lp) if int(first[0]) == ref_tok else None}
            rows.append(r)
            diff = "" if r["first_logprob_abs_diff"] is None else f" (|dlogprob| {r['first_logprob_abs_diff']:.1e})"
            print(f"chunk {chunk:5d} prompt {n:6d}: TTFT {t * 1e3:9.1f} ms  {n / t:9.0f} tok/s  compiles "
                  f"{len(compiled)}  first token {'=' if r['first_token_matches_unchunked'] else '!='} unchunked{diff}",
                  flush=True)
    print("wrote", write(a.out, "prefill", rows, {"model": cfg.name, "ctx": a.ctx}, device,
                         command="python3 -m bench.bench_prefill " + " ".join(sys.argv[1:])))


if __name__ == "__main__":
    main()
