"""NEXTN step in parts: draft / verify / commit / extend, each its own jitted program, and the fused spec_step,
at Ling-3.0-flash dims on a layer slice (or the full model over TP), context 8192, random bf16 weights.

  python3 -m bench.bench_spec --layers 12 --out $OUT
  (or as part of bench_step: python3 -m bench.bench_step --layers 12 --spec-parts --out $OUT)

Each part runs on a donated carry so chains of calls measure its device time; floors use the same byte model
as bench_step (distinct experts from the actual routing, KDA state, MLA cache reads, lm_head per pass).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from bench.bench_step import (SEED_NEXTN_US, byte_model, distinct_experts, floor_bytes, random_state, time_chain,
                              write)
from bench.ceiling import Ceiling
from compile.mesh import make_mesh
from compile.runner import constrain, sharded_params
from compile.sharding import ShardingRules, kernel_calls_for
from compile.stages import Program, slice_config
from ling_jax.config import get_preset
from ling_jax.model import RuntimeOptions, commit, forward, lm_logits
from ling_jax.sampling import greedy, greedy_verdict
from ling_jax.spec import draft, extend, spec_step


def parts(cfg, K, opts):
    """Four programs over (params, SpecState, extras) -> (SpecState, extras), each donating the carry."""

    def p_draft(params, s):
        drafts, _, cache = draft(params, s, cfg, steps=K, is_greedy=True, opts=opts)
        return s.replace(draft_cache=cache, seed=drafts[:, -1]), drafts

    def p_verify(params, s, drafts):
        rows = jnp.concatenate([s.bonus[:, None], drafts], axis=1)
        out = forward(params, rows, s.target, cfg, mode="verify", opts=opts)
        n, bonus = greedy_verdict(drafts, greedy(lm_logits(params, out.hidden)))
        return s.replace(target=out.state, bonus=bonus), (out.pending, n, out.hidden)

    def p_commit(params, s, pending, n):
        del params
        return s.replace(target=commit(s.target, pending, n + 1, opts))

    def p_extend(params, s, committed, hidden, n):
        seed, _, h, cache = extend(params, s, s.draft_cache, committed, hidden, n, s.history, cfg, is_greedy=True,
                                   opts=opts)
        return s.replace(seed=seed, draft_hidden=h, draft_cache=cache)

    return p_draft, p_verify, p_commit, p_extend


def run(cfg, mesh, rules, params, bw, ctx, reps, K=5, fused=None, routing=None):
    """fused / routing: bench_step's compiled NEXTN step and its routing census, reused (no recompile)."""
    opts = kernel_calls_for(RuntimeOptions(), mesh, rules)  # Pallas on GPU, under shard_map over TP
    prog = Program(cfg, mode="nextn", steps=K, max_len=ctx + 1024, opts=opts)
    c = lambda t: constrain(t, mesh, rules)
    p_draft, p_verify, p_commit, p_extend = parts(cfg, K, opts)
    state = random_state(prog, mesh, rules, ctx)
    if routing is None:  # draft K-1 calls, verify (MoE layers), extend 1
        routing = distinct_experts(prog, params, state)
    n_moe = sum(1 for i in range(cfg.num_hidden_layers) if cfg.is_moe(i))
    r_draft, r_verify, r_extend = routing[:K - 1], routing[K - 1:K - 1 + n_moe], routing[K - 1 + n_moe:]
    g, per_expert = byte_model(cfg, mesh, rules)
    tp = mesh.devices.size
    target = sum(v for k, v in g.items() if k.startswith("layer"))
    mtp = sum(v for k, v in g.items() if k.startswith("mtp"))
    kda = len(cfg.kda_layers) * cfg.num_attention_heads * cfg.head_dim ** 2 * 4 / tp
    mla = ctx * cfg.mla_cache_dim * 2
    floors = {
        "draft": (K - 1) * (mtp + g["lm_head"] + mla) + sum(r_draft) * per_expert,
        "verify": target + g["lm_head"] + kda + len(cfg.mla_layers) * mla + sum(r_verify) * per_expert,
        "commit": 2 * kda,
        "extend": mtp + g["lm_head"] + mla + sum(r_extend) * per_expert,
    }
    floors["fused"] = floor_bytes(cfg, mesh, rules, "nextn", K, routing, ctx)

    # inputs of the later parts, produced once by the earlier ones
    jd = jax.jit(lambda p, s: c(p_draft(p, s)), donate_argnums=(1,))
    state, drafts = jd(params, state)
    jv = jax.jit(lambda p, s, d: c(p_verify(p, s, d)), donate_argnums=(1,))
    state, (pending, n, hidden) = jv(params, state, drafts)
    committed = jnp.concatenate([drafts, drafts[:, :1]], axis=1)  # [B, K+1]
    programs = {
        "draft": lambda p, s: jd(p, s),
        "verify": lambda p, s: jv(p, s, drafts),
        "commit": lambda p, s, _j=jax.jit(lambda p, s: c(p_commit(p, s, pending, n)), donate_argnums=(1,)): (_j(p, s), None),
        "extend": lambda p, s, _j=jax.jit(lambda p, s: c(p_extend(p, s, committed, hidden, n)), donate_argnums=(1,)): (_j(p, s), None),
        "fused": fused or jax.jit(lambda p, s, _f=prog.fn(): c(_f(p, s)), donate_argnums=(1,)),
    }
    rows, total = [], 0.0
    for name, f in programs.items():
        t, state = time_chain(f, params, state, reps=reps)
        label = {"draft": f"draft ({K - 1} MTP forwards)", "verify": f"verify (target over {K + 1} rows + verdict)",
                 "commit": "commit (KDA replay, conv, lengths)", "extend": f"extend (MTP over {K + 1} rows)",
                 "fused": f"spec_step fused (steps={K})"}[name]
        if name != "fused":
            total += t
        floor_us = floors[name] / bw * 1e6
        r = {"name": label, "time_us": t * 1e6, "bytes": floors[name], "floor_us": floor_us,
             "fraction_of_floor": floor_us / (t * 1e6)}
        if name == "fused":  # measured in this run: the four parts as separate programs
            r.update(baseline="sum of the four parts, same run", baseline_time_us=total * 1e6,
                     reference="SGLang NEXTN step, 4xB200 (published)", reference_time_us=SEED_NEXTN_US)
        rows.append(r)
        print(f"{label:44s} {t * 1e6:9.1f} us  floor {floor_us:8.1f} us  {100 * r['fraction_of_floor']:5.1f} %", flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--tp", type=int, default=None)
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default="bench/results")
    a = ap.parse_args()
    tp = a.tp or len(jax.devices())
    cfg = slice_config(get_preset("ling3-flash"), a.layers)
    mesh, rules = make_mesh(tp), ShardingRules.tensor_parallel()
    bw = Ceiling.measure(jax.devices()[0]).bytes_per_s
    params = sharded_params(cfg, mesh, rules, seed=0, dtype=jnp.bfloat16)
    rows = run(cfg, mesh, rules, params, bw, a.ctx, a.reps)
    device = f"{jax.devices()[0].device_kind} x{tp}"
    print("wrote", write(a.out, "spec", rows, {"hbm_bw_bytes_per_s": bw, "model": cfg.name, "tp": tp, "ctx": a.ctx},
                         device))


if __name__ == "__main__":
    main()
