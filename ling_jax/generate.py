"""Generate from a preset (random weights) or an HF checkpoint dir, plain or with NEXTN speculation.

    python -m ling_jax.generate --model test-tiny --prompt-ids 1,2,3 --max-new-tokens 32 --json
    python -m ling_jax.generate --model models/ling-demo --prompt "def fib(n):" \
        --speculative-algorithm NEXTN --speculative-num-steps 5 --speculative-eagle-topk 1 \
        --speculative-num-draft-tokens 6

A checkpoint problem (config.json, a safetensors file, tokenizer.json) is reported as one line `error: ...` naming
the file or tensor, expected vs found, with exit status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp

from ling_jax.config import load_config
from ling_jax.errors import CheckpointError
from ling_jax.model import FP8_ACTIVATIONS, Numerics, RuntimeOptions
from ling_jax.spec import deterministic_rows
from ling_jax.runner import DEFAULT_CHUNKED_PREFILL_SIZE, Generator
from ling_jax.spec import spec_from_flags
from ling_jax.tokenizer import load_tokenizer
from ling_jax.weights import fp8_activations_note, load_params, validate_checkpoint

DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}


def add_speculative_flags(p: argparse.ArgumentParser) -> None:
    """SGLang's --speculative-* flags (shared with serve.launch_server); resolved by ling_jax.spec.spec_from_flags."""
    p.add_argument("--speculative-algorithm", choices=["NEXTN", "DSPARK", "NONE"], default="NONE")
    p.add_argument("--speculative-num-steps", type=int, default=None, help="NEXTN draft steps (default 3)")
    p.add_argument("--speculative-eagle-topk", type=int, default=None, help="NEXTN: 1 (chains only)")
    p.add_argument("--speculative-num-draft-tokens", type=int, default=None, help="NEXTN: num_steps + 1")
    p.add_argument("--speculative-draft-model-path", default=None, help="DSPARK: the draft checkpoint dir")
    p.add_argument("--speculative-dspark-verify", choices=["static", "confidence"], default="static",
                   help="DSPARK: verify the whole block (static, SGLang's deployed config) or the prefix whose "
                        "confidence survival stays above the threshold (same tokens, shorter accepts)")
    p.add_argument("--speculative-dspark-confidence-threshold", type=float, default=0.5)


def speculative_config(a: argparse.Namespace):
    """(SpecConfig, DSparkConfig | None) from the parsed flags."""
    return spec_from_flags(a.speculative_algorithm, a.speculative_num_steps, a.speculative_eagle_topk,
                           a.speculative_num_draft_tokens, a.speculative_draft_model_path,
                           a.speculative_dspark_verify, a.speculative_dspark_confidence_threshold)


def load_draft(dcfg, spec, dtype):
    """The DSpark draft (DSparkConfig, params) for Generator(draft=...), None for other algorithms."""
    if dcfg is None:
        return None
    from ling_jax import dspark

    return dcfg, dspark.load_params(dcfg, spec.draft_model_path, dtype)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Ling-3.0 (BailingMoeV3) generation in JAX")
    p.add_argument("--model", required=True, help="preset name (random weights) or HF checkpoint directory")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--prompt-ids", help="comma-separated token ids")
    g.add_argument("--prompt", help="text (needs tokenizer.json in the model dir)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--enable-deterministic-inference", action="store_true",
                   help="every target pass runs a fixed row count (RuntimeOptions.target_rows), so greedy output is "
                        "the same with or without speculation (NEXTN steps <= 7), also in bf16")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1, help="-1: every token")
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)
    p.add_argument("--chunked-prefill-size", type=int, default=DEFAULT_CHUNKED_PREFILL_SIZE,
                   help="prompt positions per prefill chunk (one compiled prefill program for every prompt length)")
    p.add_argument("--num-continuous-decode-steps", type=int, default=1,
                   help="decode steps per dispatch (SGLang's flag): N > 1 runs N steps in one program, so the host's "
                        "per-dispatch cost is paid once per N steps (outputs arrive N steps at a time)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (and random-init seed for presets)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--quantization", choices=["fp8"], default=None,
                   help="fp8: block-fp8 linear weights (DeepSeek-V3 layout), quantising a bf16 checkpoint while it loads")
    p.add_argument("--fp8-activations", choices=FP8_ACTIVATIONS, default=Numerics.fp8_activations,
                   help="fp8 weights' GEMM inputs (Numerics.fp8_activations): none keeps them bf16 (weight-only fp8, "
                        "the default, also for a checkpoint whose activation_scheme is 'dynamic'); dynamic quantises "
                        "them per token and 128 columns to e4m3 (w8a8, as SGLang / vLLM serve the format)")
    p.add_argument("--context-length", type=int, default=None, help="KV cache slots (default: prompt+new+slack)")
    p.add_argument("--ignore-eos", action="store_true")
    add_speculative_flags(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--check-weights", action="store_true",
                   help="before loading, read every tensor of the checkpoint once and reject inf/nan (names the "
                        "tensor; off by default: it reads the whole checkpoint an extra time)")
    return p


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    try:
        if a.num_continuous_decode_steps < 1:
            raise ValueError(f"--num-continuous-decode-steps must be >= 1, got {a.num_continuous_decode_steps}")
        spec, dcfg = speculative_config(a)
        cfg = load_config(a.model)
        if dcfg is not None:
            dcfg.check_target(cfg)
        if a.check_weights and not os.path.isdir(a.model):
            raise ValueError(f"--check-weights checks a checkpoint directory; {a.model} is a preset (random weights)")
        if os.path.isdir(a.model):  # names, shapes, dtypes (and with --check-weights the values) before any compile
            validate_checkpoint(cfg, a.model, check_finite=a.check_weights)
        tok = load_tokenizer(a.model) if os.path.isdir(a.model) else None
        if a.prompt is not None:
            if tok is None:
                raise ValueError(f"--prompt needs a tokenizer.json in the model dir; {a.model} has none: use --prompt-ids")
            prompt = tok.encode(a.prompt)
        else:
            prompt = [int(x) for x in a.prompt_ids.split(",") if x.strip()]
    except (ValueError, KeyError, FileNotFoundError) as e:  # CheckpointError is a ValueError: one line, exit 2
        print(f"error: {e}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    try:
        params = load_params(cfg, a.model, dtype=DTYPES[a.dtype], seed=a.seed, quantization=a.quantization)
        draft = load_draft(dcfg, spec, DTYPES[a.dtype])
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    jax.block_until_ready((params, draft))
    load_s = time.perf_counter() - t0
    print(fp8_activations_note(a.model, a.quantization, a.fp8_activations), file=sys.stderr)
    max_len = a.context_length or max(256, len(prompt) + a.max_new_tokens
                                      + 4 * a.num_continuous_decode_steps * spec.draft_tokens)
    gen = Generator(cfg, params, spec=spec, max_len=max_len, dtype=DTYPES[a.dtype], opts=RuntimeOptions(
        numerics=Numerics(target_rows=deterministic_rows(spec.draft_tokens) if a.enable_deterministic_inference
                          else None, fp8_activations=a.fp8_activations)),
        chunked_prefill_size=a.chunked_prefill_size, draft=draft, decode_steps=a.num_continuous_decode_steps)
    sampling = dict(temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, min_p=a.min_p,
                    repetition_penalty=a.repetition_penalty, presence_penalty=a.presence_penalty,
                    frequency_penalty=a.frequency_penalty)
    stops = () if a.ignore_eos else ((tok.eos_ids if tok else None) or (cfg.eos_token_id,))
    try:
        # a first short request compiles the programs, so the timings below are warm
        t1 = time.perf_counter()
        gen.generate(prompt, max_new_tokens=min(a.max_new_tokens, 2 * spec.draft_tokens + 1), seed=a.seed,
                     stop_token_ids=stops, **sampling)
        compile_s = time.perf_counter() - t1
        ids, stats = gen.generate(prompt, max_new_tokens=a.max_new_tokens, seed=a.seed, stop_token_ids=stops,
                                  **sampling)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    result = {"model": a.model, "prompt_ids": prompt, "output_ids": ids, **stats.as_dict(),
              "load_s": load_s, "compile_s": compile_s, "speculative_algorithm": spec.algorithm,
              "speculative_num_steps": spec.num_steps if spec.enabled else 0, "backend": jax.default_backend()}
    if spec.is_dspark:
        result |= {"speculative_draft_model_path": spec.draft_model_path, "dspark_verify": spec.dspark_verify,
                   "dspark_block_size": spec.num_steps}
    if spec.enabled:  # verify steps that emitted 1..K+1 tokens
        result["accept_histogram"] = [stats.accept_lengths.count(j) for j in range(1, spec.num_steps + 2)]
    if tok is not None:
        result["text"] = tok.decode(ids)
    if a.json:
        print(json.dumps(result))
    else:
        if tok is not None:
            print((a.prompt or "") + result["text"])
        else:
            print("output ids:", ids)
        line = f"{stats.completion_tokens} tokens, {result['decode_tokens_per_s']:.1f} tok/s decode, TTFT {stats.ttft_s * 1e3:.0f} ms"
        if spec.enabled:
            line += f", accept length {stats.mean_accept_length:.2f} over {stats.verify_steps} verify steps"
        print(line, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
