"""GPU check of the model's kernel wiring at Ling-3.0-flash dims (a layer slice, bf16 random weights): prefill
(Pallas chunked KDA), decode, verify + commit with the Pallas kernels (Mosaic/Triton MoE, KDA) against the
XLA-only model, on 1 device and, when there are more, under shard_map over TP. Prints one line per check.
--fused-linear adds, on 1 device, the same check with KernelCalls.fused_linear=True (the projections through
pallas_kernels/fused_linear.py; not sharded yet, so TP > 1 runs without it).

  python3 -m bench.check_gpu_wiring --layers 6 --tp 1,2 [--fused-linear]
(Ling-3.0-flash's layer groups are 6 layers: --layers 6 keeps the real layout, 5 KDA + 1 MLA; a slice of fewer
than 6 layers is all MLA and checks no KDA kernel.)
  python3 -m bench.check_gpu_wiring --preset test-tiny --layers 4 --prompt 16 --kernels interpret --fused-linear
                                                                      (CPU smoke test of this script)
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from compile.mesh import make_mesh
from compile.runner import sharded_params
from compile.sharding import ShardingRules, kernel_calls_for, state_shardings
from compile.stages import slice_config
from ling_jax.config import get_preset
from ling_jax.kernel_calls import kernel_calls
from ling_jax.model import RuntimeOptions, commit, forward, lm_logits
from ling_jax.state import init_state


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def run(cfg, params, mesh, rules, opts, tokens, drafts):
    st = init_state(cfg, 1, tokens.shape[1] + 64, jnp.bfloat16)
    st = jax.device_put(st, state_shardings(st, mesh, rules))

    @functools.partial(jax.jit, static_argnames="mode")
    def fwd(p, t, s, mode):
        out = forward(p, t, s, cfg, mode=mode, opts=opts)
        return lm_logits(p, out.hidden, opts), out

    lp, o = fwd(params, tokens, st, mode="prefill")
    ld, d = fwd(params, tokens[:, -1:], o.state, mode="decode")
    lv, v = fwd(params, drafts, o.state, mode="verify")
    c = jax.jit(lambda s, pe, n: commit(s, pe, n, opts))(v.state, v.pending, jnp.array([3], jnp.int32))
    return dict(prefill=lp, decode=ld, verify=lv, decode_state=d.state.kda_recurrent, commit_state=c.kda_recurrent)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tp", default="1,2")
    ap.add_argument("--prompt", type=int, default=200)
    ap.add_argument("--preset", default="ling3-flash")
    ap.add_argument("--kernels", default="pallas", choices=("pallas", "interpret"),
                    help="interpret: a CPU smoke test of this script")
    ap.add_argument("--fused-linear", action="store_true", help="also check KernelCalls.fused_linear=True (TP1)")
    a = ap.parse_args()
    cfg = slice_config(get_preset(a.preset), a.layers) if a.layers else get_preset(a.preset)
    rules = ShardingRules.tensor_parallel()
    key = jax.random.key(0)
    tokens = jax.random.randint(key, (1, a.prompt), 0, cfg.vocab_size)
    drafts = jax.random.randint(jax.random.fold_in(key, 1), (1, 6), 0, cfg.vocab_size)
    for tp in [int(t) for t in a.tp.split(",") if int(t) <= len(jax.devices())]:
        mesh = make_mesh(tp)
        params = sharded_params(cfg, mesh, rules, seed=0, dtype=jnp.bfloat16)
        t0 = time.perf_counter()
        ref = run(cfg, params, mesh, rules, RuntimeOptions(kernels="reference"), tokens, drafts)
        for fused in (False, True) if a.fused_linear and tp == 1 else (False,):
            calls = kernel_calls(a.kernels, fused_linear=fused)
            got = run(cfg, params, mesh, rules, kernel_calls_for(RuntimeOptions(kernels=calls), mesh, rules),
                      tokens, drafts)
            errs = {k: rel(got[k], ref[k]) for k in ref}
            agree = float(np.mean(np.argmax(np.asarray(got["verify"]), -1)
                                  == np.argmax(np.asarray(ref["verify"]), -1)))
            print(f"TP{tp} {cfg.name} ({len(cfg.kda_layers)} KDA + {len(cfg.mla_layers)} MLA layers)"
                  f"{' fused_linear' if fused else ''}: "
                  + " ".join(f"{k} {v:.1e}" for k, v in errs.items())
                  + f" | verify argmax agree {agree:.2f} | {time.perf_counter() - t0:.0f} s", flush=True)
        del params


if __name__ == "__main__":
    main()
