"""The training step: target cross-entropy + NEXTN distillation, AdamW on fp32 masters, noaux_tc bias update.

Shape legend: B windows, T positions, D hidden, V vocab, M MoE layers (target, then the MTP layer), E experts.

Target (the SAME `ling_jax.model.forward`, prefill mode, chunked KDA, from a fresh zero state per window):
    h = forward(tokens[:, :T]).hidden;  ce = mean_t -log softmax(lm_head h_t)[tok_{t+1}]
NEXTN head (distillation; the target is frozen for it: h, the teacher logits, the embedding and lm_head are
stop_gradient, so only params["mtp"] learns from it). Row t = 0..T-2 feeds (tok_{t+1}, h_t) and predicts tok_{t+2}:
    h' = mtp_forward(tok[:, 1:T], h[:, :T-1], cache of T-1 rows, start 0, absorbed=False)
    kl = mean_t KL(softmax(z_{t+1}) || softmax(lm_head h'_t)),   z = the target's logits
Optional chained passes (mtp_chain > 1), as drafting chains the head: pass k feeds (tok_{t+1+k}, h'^(k-1)_t)
(stop_gradient) and distils z_{t+1+k}; kl = kl_0 + mtp_chain_weight * sum_k>0 kl_k. Each pass attends over its
own rows (RoPE is relative, so starting its cache at slot 0 is exact for the shifted positions).
loss = ce + mtp_weight * kl. The optional final distillation phase (mtp_only) freezes the target (stop_gradient on
its hidden, zero updates and no bias update outside params["mtp"]) and trains the head alone on loss = kl.
Router balance (DeepSeek-V3 noaux_tc, no auxiliary loss): after each step, for every MoE layer,
    expert_bias += u * sign(mean_e load - load_e)
with load_e the (token, slot) pairs routed to expert e in this step's forward. The bias only selects experts,
so it has no gradient; it is excluded from AdamW and weight decay.
Mixed precision: masters are fp32; the forward runs on a copy cast to `compute_dtype` (arrays that the spec
keeps in fp32, e.g. A_log, dt_bias, expert_bias, stay fp32).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from ling_jax.config import ModelConfig
from ling_jax.model import Numerics, RuntimeOptions, forward, lm_logits
from ling_jax.nextn import mtp_forward
from ling_jax.state import init_state
from ling_jax.train.data import random_windows
from ling_jax.weights import array_spec, unflatten
from ling_jax.quant import Fp8Weight


@dataclass(frozen=True)
class StepConfig:
    """Static options of the compiled step."""

    batch: int = 32
    seq: int = 512
    compute_dtype: str = "bfloat16"
    mtp_weight: float = 1.0
    mtp_chain: int = 1  # MTP passes per window: pass k > 0 is fed pass k-1's output hidden (chained drafting)
    mtp_chain_weight: float = 0.5  # weight of the chained passes' KL
    bias_update: float = 1e-3  # u of the noaux_tc update
    weight_decay: float = 0.1
    clip_norm: float = 1.0
    b1: float = 0.9
    b2: float = 0.95
    mtp_only: bool = False  # the distillation phase: the target is frozen (no update, no bias update), loss = kl
    fp8_activations: str = "none"  # Numerics.fp8_activations of the forward (fp8 weights: the held-out eval of w8a8)


class Metrics(NamedTuple):
    loss: jax.Array  # ce + w * kl
    ce: jax.Array  # target next-token cross-entropy (nats)
    kl: jax.Array  # NEXTN distillation KL (nats)
    mtp_top1: jax.Array  # fraction of rows where argmax MTP == argmax target (greedy draft acceptance proxy)
    grad_norm: jax.Array
    max_load: jax.Array  # max over MoE layers of max_e load_e / mean_e load_e (1 = balanced)


def training_options(sc: StepConfig | None = None) -> RuntimeOptions:
    """The differentiable pure-jnp path (chunked KDA, plain MLA, jnp MoE): never a Pallas kernel, which has no VJP.
    sc: its fp8_activations (default "none")."""
    return RuntimeOptions(numerics=Numerics(fp8_activations=sc.fp8_activations if sc else "none"), kernels="reference")


def fp32_mask(cfg: ModelConfig) -> dict:
    """True for the arrays the spec keeps in fp32 whatever the model dtype."""
    spec = array_spec(cfg)
    return unflatten(spec, [a.dtype == "float32" for a in spec])


def bias_mask(cfg: ModelConfig) -> dict:
    spec = array_spec(cfg)
    return unflatten(spec, [a.path[-1] == "expert_bias" for a in spec])


def cast_params(params, cfg: ModelConfig, dtype):
    """Arrays to dtype except the fp32 ones; block-fp8 weights (quant.Fp8Weight) stay fp8 (layers dequantise)."""
    cast = lambda keep, p: p if keep or isinstance(p, Fp8Weight) else p.astype(dtype)
    return jax.tree.map(cast, fp32_mask(cfg), params)


def moe_layer_paths(cfg: ModelConfig) -> list[tuple]:
    """Pytree paths of the MoE blocks in the order forward (then mtp_forward) reports their loads."""
    paths = [("layers", i) for i in range(cfg.num_hidden_layers) if cfg.is_moe(i)]
    return paths + [("mtp", j) for j, i in enumerate(cfg.mtp_layers) if cfg.is_moe(i)]


def kl_rows(teacher_logits, student_logits):
    """KL(softmax(teacher) || softmax(student)) per row, f32. [..., V] -> [...]."""
    lt = jax.nn.log_softmax(teacher_logits.astype(jnp.float32), axis=-1)
    ls = jax.nn.log_softmax(student_logits.astype(jnp.float32), axis=-1)
    return jnp.sum(jnp.exp(lt) * (lt - ls), axis=-1)


def losses(params, windows, cfg: ModelConfig, sc: StepConfig, with_mtp: bool = True):
    """windows int32[B, T+1] -> (loss, (Metrics without grad_norm/max_load, loads int32[M, E] or None))."""
    p = cast_params(params, cfg, jnp.dtype(sc.compute_dtype))
    inp, labels = windows[:, :-1], windows[:, 1:]
    B, T = inp.shape
    opts = training_options(sc)
    out = forward(p, inp, init_state(cfg, B, T, p["embed"].dtype), cfg, mode="prefill", expert_load=True, opts=opts)
    if sc.mtp_only:  # frozen target: no backward pass through it
        out = out._replace(hidden=jax.lax.stop_gradient(out.hidden))
    logits = lm_logits(p, out.hidden, opts)  # [B, T, V] f32
    ce = jnp.mean(jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, labels[..., None], -1)[..., 0])
    loads = [out.expert_load] if out.expert_load is not None else []
    kl = top1 = jnp.float32(0.0)
    if with_mtp and cfg.mtp_layers:
        sg = jax.lax.stop_gradient
        pm = {"embed": sg(p["embed"]), "lm_head": sg(p.get("lm_head", p["embed"])), "mtp": p["mtp"]}
        h_in, kls = sg(out.hidden[:, :-1]), []
        for k in range(sc.mtp_chain):  # pass k: rows r = 0..T-2-k, (tok_{r+1+k}, h^(k-1)_r) -> tok_{r+2+k}
            n = T - 1 - k
            cache = jnp.zeros((B, n, cfg.mla_cache_dim), p["embed"].dtype)
            hm, _, mload = mtp_forward(pm, inp[:, 1 + k :], h_in[:, :n], cache, jnp.zeros((B,), jnp.int32), cfg,
                                       absorbed=False, expert_load=True, opts=opts)
            student = lm_logits(pm, hm, opts)  # [B, n, V]
            teacher = sg(logits[:, 1 + k :])
            kls.append(jnp.mean(kl_rows(teacher, student)))
            if k == 0:
                top1 = jnp.mean((jnp.argmax(student, -1) == jnp.argmax(teacher, -1)).astype(jnp.float32))
                if mload is not None:
                    loads.append(mload[None])
            h_in = sg(hm)  # chained drafting feeds the head's own output hidden back in
        kl = kls[0] + sc.mtp_chain_weight * sum(kls[1:])
    loss = sc.mtp_weight * kl if sc.mtp_only else ce + sc.mtp_weight * kl
    load = jnp.concatenate(loads) if loads else None
    return loss, (Metrics(loss, ce, kl, top1, jnp.float32(0), jnp.float32(0)), load)


def make_optimizer(sc: StepConfig) -> optax.GradientTransformation:
    """clip -> Adam moments -> decoupled weight decay on matrices only. The learning rate is applied by the step
    (a traced argument), so any schedule can be driven from the host without recompiling."""
    decay = lambda params: jax.tree.map(lambda a: a.ndim >= 2, params)
    return optax.chain(optax.clip_by_global_norm(sc.clip_norm), optax.scale_by_adam(sc.b1, sc.b2),
                       optax.add_decayed_weights(sc.weight_decay, decay))


def update_bias(params, loads, cfg: ModelConfig, u: float, mtp_only: bool = False):
    """expert_bias += u * sign(mean_e load - load_e) for every MoE layer (loads int32[M, E]); mtp_only: only the
    MTP layers' (the target's routing stays as trained)."""
    for j, path in enumerate(moe_layer_paths(cfg)):
        if mtp_only and path[0] != "mtp":
            continue
        node = params[path[0]][path[1]]["mlp"]
        load = loads[j].astype(jnp.float32)
        node["expert_bias"] = node["expert_bias"] + u * jnp.sign(jnp.mean(load) - load)
    return params


def train_step(params, opt_state, key, lr, tokens, cfg: ModelConfig, sc: StepConfig, tx):
    """One step over a fresh batch of random windows. params are fp32 masters (donated)."""
    windows = random_windows(tokens, key, sc.batch, sc.seq)
    (_, (m, loads)), grads = jax.value_and_grad(losses, has_aux=True)(params, windows, cfg, sc)
    grads = jax.tree.map(lambda g, b: jnp.zeros_like(g) if b else g, grads, bias_mask(cfg))
    updates, opt_state = tx.update(grads, opt_state, params)
    if sc.mtp_only:  # Adam momentum and weight decay would still move the target: zero its updates
        updates = {k: (v if k == "mtp" else jax.tree.map(jnp.zeros_like, v)) for k, v in updates.items()}
    params = jax.tree.map(lambda p, u: p - lr * u, params, updates)
    # copy the containers so the bias update never touches the caller's (donated) pytree structure
    params = jax.tree.map(lambda a: a, params)
    params = update_bias(params, loads, cfg, sc.bias_update, sc.mtp_only)
    loads_f = loads.astype(jnp.float32)
    imbalance = jnp.max(jnp.max(loads_f, -1) / jnp.maximum(jnp.mean(loads_f, -1), 1e-9))
    m = m._replace(grad_norm=optax.tree.norm(grads), max_load=imbalance)
    return params, opt_state, m


def eval_step(params, windows, cfg: ModelConfig, sc: StepConfig):
    _, (m, _) = losses(params, windows, cfg, sc)
    return m


def compiled(cfg: ModelConfig, sc: StepConfig, tx):
    step = jax.jit(functools.partial(train_step, cfg=cfg, sc=sc, tx=tx), donate_argnums=(0, 1))
    ev = jax.jit(functools.partial(eval_step, cfg=cfg, sc=sc))
    return step, ev
