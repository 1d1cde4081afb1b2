"""NEXTN accept length of a trained checkpoint on held-out code, and the target's held-out loss.

For each --steps k: ling_jax.runner.Generator with SpecConfig("NEXTN", k) generates --new-tokens greedy tokens
(EOS ignored) from each of --prompts prompts of --prompt-len tokens cut from the corpus's held-out split. Reports
the mean accept length (accepted drafts + the bonus token, SGLang's avg_spec_accept_length), the per-position
acceptance rates, decode tok/s, and whether the output equals plain greedy decoding (lossless check).
Held-out loss: the target's next-token cross-entropy over the first --eval-windows non-overlapping --eval-seq windows of the
held-out split (the same windows the trainer evaluates; plus the NEXTN head's top-1 agreement with the target).

    python -m bench.eval_accept --model models/ling-demo --data .data/stdlib --steps 1-8
Writes bench/results/eval-accept-<device>-<date>.json and .png.
--quantization fp8: the same measurements for the checkpoint's weights and for them quantised to block fp8
(ling_jax.quant), plus the fp8 model's greedy agreement with the unquantised one (per prompt: tokens before the
first difference, and the fraction of equal positions); writes eval-fp8-<device>-<date>.json.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from ling_jax.config import load_config
from ling_jax.model import Numerics, RuntimeOptions
from ling_jax.runner import Generator
from ling_jax.spec import SpecConfig
from ling_jax.train import corpus, trainer
from ling_jax.train.data import fixed_windows
from ling_jax.train.data import prompt_windows as make_prompts  # also imported from here by other benches
from ling_jax.train.step import StepConfig, eval_step
from ling_jax.weights import load_params


def heldout_tokens(data: str, model: str) -> np.ndarray:
    """The held-out token stream; packs and tokenizes the corpus from this interpreter's stdlib if absent."""
    path = os.path.join(data, "tokens-heldout.npy")
    if os.path.exists(path + ".xz"):  # a carried corpus (ling_jax.train.corpus --compress)
        return corpus.load_tokens(data, "heldout")
    if not os.path.exists(path):
        from ling_jax.tokenizer import load_tokenizer

        if not os.path.exists(os.path.join(data, corpus.CORPUS_FILE)):
            corpus.build(data)
        tok = load_tokenizer(model)
        corpus.tokenize_splits(corpus.load(data), tok, data, tok.eos_ids[0])
    return np.load(path)


def repeated_ngram_share(ids: list[int], n: int = 4) -> float:
    """The share of the output's n-grams that already occurred earlier in the same output: 0 for text that never
    repeats itself, -> 1 for a loop of one line (what a user sees as a stuck model)."""
    grams = [tuple(ids[i : i + n]) for i in range(len(ids) - n + 1)]
    seen, repeats = set(), 0
    for g in grams:
        repeats += g in seen
        seen.add(g)
    return repeats / max(len(grams), 1)


def heldout_loss(cfg, params, tokens: np.ndarray, seq: int, windows: int, batch: int,
                 fp8_activations: str = "none") -> dict:
    """The trainer's held-out evaluation (every one of the first `windows` windows of `seq` tokens)."""
    sc = StepConfig(batch=batch, seq=seq, compute_dtype=str(params["embed"].dtype), fp8_activations=fp8_activations)
    ev = jax.jit(functools.partial(eval_step, cfg=cfg, sc=sc))
    w = fixed_windows(tokens, seq, windows)
    m = trainer.evaluate(ev, params, w, batch)
    return {**m, "heldout_ppl": math.exp(m["heldout_ce"]), "heldout_windows": len(w), "heldout_seq": seq,
            "heldout_eval_tokens": len(w) * seq}


def run_steps(cfg, params, prompts, k: int, new_tokens: int, max_len: int, target_rows=None, spec=None, draft=None,
              fp8_activations: str = "none"):
    """NEXTN with k steps (k = 0: plain greedy), or the given DSPARK spec with its draft (k = its block size)."""
    spec = spec or (SpecConfig("NEXTN", k) if k > 0 else SpecConfig("NONE"))
    numerics = Numerics(target_rows=target_rows, fp8_activations=fp8_activations)
    gen = Generator(cfg, params, spec=spec, max_len=max_len, dtype=params["embed"].dtype,
                    opts=RuntimeOptions(numerics=numerics), draft=draft)
    gen.generate(prompts[0], max_new_tokens=2 * spec.draft_tokens + 1, stop_token_ids=())  # compile
    outs, accepts, decode_s, decode_tokens = [], [], 0.0, 0
    for p in prompts:
        ids, st = gen.generate(p, max_new_tokens=new_tokens, stop_token_ids=())
        outs.append(ids)
        accepts += st.accept_lengths
        decode_s += st.total_s - st.ttft_s
        decode_tokens += st.completion_tokens - 1
    a = np.asarray(accepts) if accepts else np.zeros(1)
    row = {"steps": k, "algorithm": spec.algorithm, "decode_tokens_per_s": decode_tokens / max(decode_s, 1e-9)}
    if spec.is_dspark:
        row.update(dspark_verify=spec.dspark_verify, confidence_threshold=spec.confidence_threshold)
    if k > 0:
        row.update({"mean_accept_length": float(a.mean()), "verify_steps": int(a.size),
                    "acceptance_rate_per_position": [float(np.mean(a - 1 >= j)) for j in range(1, k + 1)],
                    "accept_histogram": np.bincount(a, minlength=k + 2)[1:].tolist()})
    return row, outs


def plot(rows, path, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    spec = [r for r in rows if r["steps"] > 0 and r["algorithm"] == "NEXTN"]
    a1.plot([r["steps"] for r in spec], [r["mean_accept_length"] for r in spec], "o-", label="NEXTN")
    for r in rows:
        if r.get("algorithm") == "DSPARK":
            a1.plot([r["steps"]], [r["mean_accept_length"]], "s",
                    label=f"DSPARK {os.path.basename(r.get('dspark_draft', ''))} {r['dspark_verify']}")
    a1.legend(fontsize=7)
    a1.set_xlabel("--speculative-num-steps")
    a1.set_ylabel("mean accept length (incl. bonus)")
    a1.grid(alpha=0.3)
    for r in spec + [r for r in rows if r.get("algorithm") == "DSPARK"]:
        name = (f"steps={r['steps']}" if r["algorithm"] == "NEXTN"
                else f"DSPARK {os.path.basename(r.get('dspark_draft', ''))} {r['dspark_verify']}")
        a2.plot(range(1, r["steps"] + 1), r["acceptance_rate_per_position"], "o-", label=name)
    a2.set_xlabel("draft position j")
    a2.set_ylabel("P(draft j accepted)")
    a2.grid(alpha=0.3)
    a2.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_steps(s: str) -> list[int]:
    if "-" in s:
        lo, hi = s.split("-")
        return list(range(int(lo), int(hi) + 1))
    return [int(x) for x in s.split(",")]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="models/ling-demo")
    p.add_argument("--data", default=".data/stdlib")
    p.add_argument("--steps", default="1-8")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--eval-seq", type=int, default=512)
    p.add_argument("--eval-windows", type=int, default=96)
    p.add_argument("--eval-batch", type=int, default=8)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="float32 makes the lossless check exact; in bf16 the 1-row decode and the multi-row verify "
                        "round differently, so near-tied greedy choices can differ")
    p.add_argument("--target-rows", type=int, default=None,
                   help="deterministic inference: every target pass runs this many rows (RuntimeOptions.target_rows; "
                        "8 covers steps <= 7), which makes the bf16 lossless check exact too")
    p.add_argument("--fp8-activations", choices=["none", "dynamic"], default="none",
                   help="with --quantization fp8: the fp8 run's Numerics.fp8_activations (dynamic: w8a8, each fp8 "
                        "GEMM's input quantised per token and 128 columns; the report is eval-fp8-dynamic-*)")
    p.add_argument("--quantization", choices=["fp8"], default=None,
                   help="fp8: also evaluate the weights quantised to block fp8 and compare with the unquantised run")
    p.add_argument("--dspark", default=None,
                   help="DSpark draft dir(s), comma-separated: also measure DSPARK with each (block = its block_size; "
                        "one run: the same prompts, plain greedy and NEXTN rows for all)")
    p.add_argument("--dspark-verify", default="static,confidence", help="DSpark verify modes to measure")
    p.add_argument("--dspark-threshold", type=float, default=0.5, help="survival threshold of the confidence mode")
    p.add_argument("--out", default="bench/results")
    a = p.parse_args(argv)
    if a.quantization:
        return compare_fp8(a, argv)
    cfg = load_config(a.model)
    params = load_params(cfg, a.model, dtype=jnp.dtype(a.dtype))  # bf16 weights, upcast exactly when float32
    command = "python -m bench.eval_accept " + " ".join(argv if argv is not None else sys.argv[1:])
    os.makedirs(a.out, exist_ok=True)

    def write(report, complete=False):
        report.update(command=command, complete=complete)
        with open(report_path(report) + ".json", "w") as f:
            json.dump({k: v for k, v in report.items() if k != "outputs"}, f, indent=1)

    report_path = lambda r: os.path.join(a.out, f"eval-accept-{r['device']}-{r['date']}")
    report = evaluate(a, cfg, params, on_row=write)
    write(report, complete=True)
    path = report_path(report)
    plot(report["rows"], path + ".png", f"{a.model}: NEXTN on {report['prompts']} held-out prompts, {report['device']}")
    print(f"wrote {path}.json")
    return report


def agreement(outs, base_outs) -> dict:
    """Greedy agreement of two runs on the same prompts: tokens before the first difference, equal positions."""
    prefix = [next((j for j, (x, y) in enumerate(zip(o, b)) if x != y), min(len(o), len(b))) for o, b in
              zip(outs, base_outs)]
    equal = [float(np.mean(np.asarray(o) == np.asarray(b))) for o, b in zip(outs, base_outs)]
    return {"identical_prompts": sum(o == b for o, b in zip(outs, base_outs)), "first_difference_at": prefix,
            "mean_first_difference_at": float(np.mean(prefix)), "equal_position_fraction": float(np.mean(equal))}


def compare_fp8(a, argv):
    """The checkpoint's weights vs the same weights quantised to block fp8 (what --quantization fp8 loads)."""
    cfg = load_config(a.model)
    runs = {}
    for name, q, act in (("unquantised", None, "none"), ("fp8", "fp8", a.fp8_activations)):
        params = load_params(cfg, a.model, dtype=jnp.dtype(a.dtype), quantization=q)
        print(f"== {name} (fp8 activations {act})", flush=True)
        runs[name] = evaluate(a, cfg, params, fp8_activations=act)
    ref, fp8 = runs["unquantised"], runs["fp8"]
    plain = agreement(fp8["outputs"][0], ref["outputs"][0])
    delta = {"heldout_ppl_unquantised": ref["heldout_ppl"], "heldout_ppl_fp8": fp8["heldout_ppl"],
             "heldout_ppl_ratio": fp8["heldout_ppl"] / ref["heldout_ppl"],
             "plain_greedy_agreement": plain,
             "accept_length": {r["steps"]: {"unquantised": r["mean_accept_length"], "fp8": f["mean_accept_length"]}
                               for r, f in zip(ref["rows"], fp8["rows"]) if r["steps"] > 0}}
    print(json.dumps(delta), flush=True)
    report = {"command": "python -m bench.eval_accept " + " ".join(argv if argv is not None else sys.argv[1:]),
              "device": ref["device"], "date": ref["date"], "git_commit": ref["git_commit"], "model": a.model,
              "dtype": a.dtype, "quantization": "fp8 (128x128 blocks, e4m3, ling_jax.quant.fp8_policy)",
              "fp8_activations": a.fp8_activations,
              "fp8_vs_unquantised": delta,
              **{name: {k: v for k, v in r.items() if k != "outputs"} for name, r in runs.items()}}
    os.makedirs(a.out, exist_ok=True)
    kind = "eval-fp8" + ("" if a.fp8_activations == "none" else f"-{a.fp8_activations}")
    path = os.path.join(a.out, f"{kind}-{ref['device']}-{ref['date']}.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {path}")
    return report


def evaluate(a, cfg, params, on_row=None, fp8_activations: str = "none") -> dict:
    """Held-out loss, plain greedy, and NEXTN at each --steps on these params; outputs[k] the token lists.
    on_row(report so far) runs after every row, so a run cut short still leaves what it measured.
    fp8_activations: the Numerics.fp8_activations of every forward (fp8 params)."""
    dev = jax.devices()[0]
    device = "cpu" if dev.platform == "cpu" else dev.device_kind.replace(" ", "-")
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = "unknown"
    rows, all_outs, loss = [], [], {}

    def snapshot() -> dict:
        return {"device": device, "jax_version": jax.__version__, "date": time.strftime("%Y-%m-%d"),
                "git_commit": commit, "model": a.model, "prompts": len(prompts), "prompt_len": a.prompt_len,
                "new_tokens": a.new_tokens, "greedy": True, "dtype": a.dtype, "target_rows": a.target_rows,
                "fp8_activations": fp8_activations, **loss,
                "wall_s": time.perf_counter() - t0, "rows": rows,
                "sample": {"prompt": prompts[0], "plain_output": all_outs[0][0] if all_outs else None},
                "outputs": all_outs}

    def add(row, outs):
        rows.append(row)
        all_outs.append(outs)
        if on_row:
            on_row(snapshot())

    held = heldout_tokens(a.data, a.model)
    prompts = make_prompts(held, a.prompts, a.prompt_len, cfg.eos_token_id)
    max_len = a.prompt_len + a.new_tokens + 64
    t0 = time.perf_counter()
    loss.update(heldout_loss(cfg, params, held, a.eval_seq, a.eval_windows, a.eval_batch, fp8_activations))
    print(json.dumps(loss), flush=True)
    base, base_outs = run_steps(cfg, params, prompts, 0, a.new_tokens, max_len, a.target_rows,
                                fp8_activations=fp8_activations)
    add(base, base_outs)
    base["repeated_4gram_share"] = float(np.mean([repeated_ngram_share(o) for o in base_outs]))
    print(f"plain greedy: {base['decode_tokens_per_s']:.1f} tok/s, repeated 4-grams {base['repeated_4gram_share']:.3f}",
          flush=True)
    for k in parse_steps(a.steps):
        row, outs = run_steps(cfg, params, prompts, k, a.new_tokens, max_len, a.target_rows,
                              fp8_activations=fp8_activations)
        row["lossless_prompts"] = sum(o == b for o, b in zip(outs, base_outs))
        row["speedup_vs_plain"] = row["decode_tokens_per_s"] / base["decode_tokens_per_s"]
        add(row, outs)
        print(f"steps={k}: accept {row['mean_accept_length']:.3f}, per-position "
              f"{[round(x, 3) for x in row['acceptance_rate_per_position']]}, {row['decode_tokens_per_s']:.1f} tok/s, "
              f"lossless {row['lossless_prompts']}/{len(prompts)}", flush=True)
    if a.dspark:
        from ling_jax import dspark as ds
        from ling_jax.spec import spec_from_flags

        for path, mode in [(d, m) for d in a.dspark.split(",") for m in a.dspark_verify.split(",")]:
            spec, dcfg = spec_from_flags("DSPARK", None, None, None, path, mode, a.dspark_threshold)
            draft = (dcfg, ds.load_params(dcfg, path, params["embed"].dtype))
            row, outs = run_steps(cfg, params, prompts, spec.num_steps, a.new_tokens, max_len, a.target_rows, spec,
                                  draft, fp8_activations)
            row["dspark_draft"] = path
            row["lossless_prompts"] = sum(o == b for o, b in zip(outs, base_outs))
            row["speedup_vs_plain"] = row["decode_tokens_per_s"] / base["decode_tokens_per_s"]
            add(row, outs)
            print(f"DSPARK {path} block {spec.num_steps} {mode}: accept {row['mean_accept_length']:.3f}, per-position "
                  f"{[round(x, 3) for x in row['acceptance_rate_per_position']]}, {row['decode_tokens_per_s']:.1f} "
                  f"tok/s, lossless {row['lossless_prompts']}/{len(prompts)}", flush=True)
    return snapshot()

if __name__ == "__main__":
    main()
