"""The real DSpark step's accept lengths vs the trainer's teacher-forced estimate at the same anchors.

For each held-out prompt: Generator (DSPARK static) generates --new-tokens greedy tokens and records each verify
step's accept length; the anchors it verified from are the prompt end and then the running sum of those lengths.
The trainer's block (ling_jax.train.dspark.block_logits) over the final token sequence at those anchors gives the
teacher-forced greedy accept (1 + the leading slots whose argmax equals the target's). Equal per step means the
trainer's greedy-accept metric predicts inference exactly at those anchors (no train/inference mismatch); a gap
between the trainer's held-out figure and the real step is then a difference of anchors (where in the text), not of
computation.

    python -m bench.dspark_teacher_forced --draft models/ling-demo-dspark --prompts 3 --new-tokens 200
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from bench.bench_step import write
from bench.eval_accept import heldout_tokens, make_prompts
from ling_jax import dspark as ds
from ling_jax.config import load_config
from ling_jax.runner import Generator
from ling_jax.spec import spec_from_flags
from ling_jax.train.dspark import block_logits
from ling_jax.weights import load_params


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="models/ling-demo")
    p.add_argument("--draft", default="models/ling-demo-dspark")
    p.add_argument("--data", default=".data/v2-heldout")
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=200)
    p.add_argument("--out", default=None, help="write dspark-teacher-forced-<device>-<date>.json here")
    a = p.parse_args(argv)
    cfg = load_config(a.model)
    params = load_params(cfg, a.model, dtype=jnp.float32)
    spec, dcfg = spec_from_flags("DSPARK", None, None, None, a.draft, "static", 0.5)
    dp = ds.load_params(dcfg, a.draft, jnp.float32)
    prompts = make_prompts(heldout_tokens(a.data, a.model), 16, 64, cfg.eos_token_id)[: a.prompts]
    gen = Generator(cfg, params, spec=spec, max_len=64 + a.new_tokens + 64, dtype=jnp.float32, draft=(dcfg, dp))
    G, per_prompt = dcfg.block_size, []
    for prompt in prompts:
        ids, st = gen.generate(prompt, max_new_tokens=a.new_tokens, stop_token_ids=())
        tokens = np.asarray(prompt + ids, np.int32)
        anchors = len(prompt) + np.concatenate([[0], np.cumsum(st.accept_lengths)[:-1]])
        keep = anchors + G < len(tokens)  # the trainer's block needs every slot's label inside the text
        logits, _, _, z = block_logits(dp, params, jnp.asarray(tokens)[None], jnp.asarray(anchors[keep])[None],
                                       cfg, dcfg)
        match = np.asarray(jnp.argmax(logits, -1) == jnp.argmax(z, -1))[0]
        forced = 1 + np.cumprod(match, axis=-1).sum(axis=-1)
        real = np.asarray(st.accept_lengths)[keep]
        per_prompt.append({"real": real.tolist(), "teacher_forced": forced.tolist(),
                           "equal_steps": int(np.sum(real == forced)), "steps": int(real.size)})
        print(f"prompt {len(per_prompt)}: real {real.mean():.3f}, teacher-forced {forced.mean():.3f}, equal at "
              f"{per_prompt[-1]['equal_steps']}/{real.size} steps", flush=True)
    real = np.concatenate([r["real"] for r in per_prompt])
    forced = np.concatenate([r["teacher_forced"] for r in per_prompt])
    report = {"model": a.model, "draft": a.draft, "mean_real": float(real.mean()),
              "mean_teacher_forced": float(forced.mean()), "equal_steps": int(np.sum(real == forced)),
              "steps": int(real.size)}
    print(f"all: real {report['mean_real']:.3f}, teacher-forced {report['mean_teacher_forced']:.3f}, equal at "
          f"{report['equal_steps']}/{report['steps']} steps")
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        print("wrote", write(a.out, "dspark-teacher-forced", per_prompt, report,
                             jax.devices()[0].device_kind.replace(" ", "-"),
                             "python -m bench.dspark_teacher_forced " + " ".join(argv or sys.argv[1:])))
    return report


if __name__ == "__main__":
    main()
