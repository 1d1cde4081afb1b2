"""The one place that holds PartitionSpecs: logical axes -> mesh axis "tp", for params, states and kernels.

Tensor parallelism over one mesh axis (Megatron layout, two all-reduces per layer at most):
  * attention: KDA and MLA heads ("heads": q/k/v/f/g projections, conv channels, gates, recurrent state,
    the MLA q_proj/kv_b_proj/g_proj) are split; o_proj / dense contract over heads -> one all-reduce;
  * FFN: the intermediate dim of routed experts ("expert_mlp"), the shared expert and the dense MLP ("mlp")
    is split; the down projections contract over it -> one all-reduce (routed + shared summed first);
    expert parallelism ("expert" -> tp) is an option (then "expert_mlp" stays whole);
  * vocab-parallel lm_head ("vocab"; the embedding too unless `replicate_embedding`, the default); router, norms, kv_a_proj and the MLA latent cache
    are replicated ("embed" and None never split).
`shardings_for(cfg, mesh, rules)` returns the callable that `init_params` / `load_hf_checkpoint` /
`abstract_params` take; `state_shardings` maps any state pytree (DecodeState, SpecState, PlainState, step
outputs) by leaf path; `shard_kernel` runs a per-device kernel under `jax.shard_map` with specs from the rules;
`ShardedKernelCalls` / `kernel_calls_for` hand the model its Pallas calls wrapped that way.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ling_jax.config import ModelConfig
from ling_jax.kernel_calls import KernelCalls
from ling_jax.weights import ArrayInfo, array_spec
from pallas_kernels.kda_verify import KdaRows

TP = "tp"


@dataclass(frozen=True)
class ShardingRules:
    """Logical axis -> mesh axis (or None = replicated). Unknown logical axes are an error."""

    vocab: str | None = TP
    embed: str | None = None
    heads: str | None = TP
    mlp: str | None = TP
    expert: str | None = None
    expert_mlp: str | None = TP
    # The embedding is read T rows per lookup: a replicated table costs its size (805 MB at full size) of HBM
    # capacity per device and no bandwidth, and saves one all-reduce per lookup (6 per NEXTN step at K=5).
    replicate_embedding: bool = True

    @staticmethod
    def tensor_parallel(expert_parallel: bool = False, replicate_embedding: bool = True) -> "ShardingRules":
        if expert_parallel:
            return ShardingRules(expert=TP, expert_mlp=None, replicate_embedding=replicate_embedding)
        return ShardingRules(replicate_embedding=replicate_embedding)

    @staticmethod
    def replicated() -> "ShardingRules":
        return ShardingRules(vocab=None, heads=None, mlp=None, expert=None, expert_mlp=None)

    def mesh_axis(self, logical: str | None) -> str | None:
        if logical is None:
            return None
        if logical not in {f.name for f in dataclasses.fields(self)} - {"replicate_embedding"}:
            raise KeyError(f"no sharding rule for logical axis {logical!r}")
        return getattr(self, logical)

    def spec(self, axes: tuple[str | None, ...], name: str = "?") -> P:
        """PartitionSpec for an array with these logical axes; two axes on one mesh axis is an error."""
        out = tuple(self.mesh_axis(a) for a in axes)
        used = [m for m in out if m is not None]
        if len(used) != len(set(used)):
            raise ValueError(f"sharding rules map two axes of {name} {axes} onto one mesh axis: {out}")
        return P(*out)


def _check_divisible(name, shape, spec: P, mesh: Mesh):
    for dim, (n, ax) in enumerate(zip(shape, tuple(spec) + (None,) * len(shape))):
        if ax is not None and n % mesh.shape[ax]:
            raise ValueError(f"{name}: dim {dim} of size {n} is not divisible by mesh axis {ax!r} "
                             f"of size {mesh.shape[ax]} (shape {shape}, spec {spec})")


def param_specs(cfg: ModelConfig, rules: ShardingRules) -> dict[tuple, P]:
    """path -> PartitionSpec for every parameter (validates the rules against the whole spec)."""
    out = {}
    for a in array_spec(cfg):
        axes = a.axes
        if a.path == ("embed",) and rules.replicate_embedding and not cfg.tie_word_embeddings:
            axes = (None,) * len(axes)
        out[a.path] = rules.spec(axes, "/".join(map(str, a.path)))
    return out


def shardings_for(cfg: ModelConfig, mesh: Mesh, rules: ShardingRules = ShardingRules()) -> Callable:
    """The callable `ArrayInfo -> NamedSharding` that init_params / load_hf_checkpoint / abstract_params take."""
    specs = param_specs(cfg, rules)
    for a in array_spec(cfg):
        _check_divisible("/".join(map(str, a.path)), a.shape, specs[a.path], mesh)

    def sharding(info: ArrayInfo) -> NamedSharding:
        return NamedSharding(mesh, specs[info.path])

    return sharding


# ---- states ---------------------------------------------------------------------------------------------------

# DecodeState fields by name -> logical axes (leading dims first). The MLA latent cache and the MTP cache are
# shared by all heads (kv_a_proj is replicated), so they are replicated; lengths and the relay are tiny.
STATE_AXES: dict[str, tuple[str | None, ...]] = {
    "kda_recurrent": (None, None, "heads", None, None),  # [Lk, B, H, K, V]
    "kda_conv": (None, None, None, None, "heads"),  # [Lk, B, W-1, 3, C]
}


def _leaf_name(path) -> str | None:
    for k in reversed(path):
        name = getattr(k, "name", None) or getattr(k, "key", None)
        if isinstance(name, str):
            return name
    return None


def state_specs(tree, rules: ShardingRules = ShardingRules()):
    """PartitionSpec pytree for any pytree holding DecodeState fields (by field name); all else replicated."""

    def spec(path, leaf):
        name = _leaf_name(path)
        if name in STATE_AXES and getattr(leaf, "ndim", 0) == len(STATE_AXES[name]):
            return rules.spec(STATE_AXES[name], name)
        return P()

    return jax.tree_util.tree_map_with_path(spec, tree)


def state_shardings(tree, mesh: Mesh, rules: ShardingRules = ShardingRules()):
    """NamedSharding pytree matching `tree` (arrays or ShapeDtypeStructs)."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), state_specs(tree, rules),
                        is_leaf=lambda x: isinstance(x, P))


def with_shardings(abstract_tree, shardings_tree):
    """ShapeDtypeStructs carrying the given shardings (stage-1 inputs: no device memory)."""
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract_tree,
                        shardings_tree)


def bytes_per_device(abstract_tree, shardings_tree) -> int:
    """Bytes one device holds for this pytree under these shardings (shard shape x itemsize)."""
    total = 0
    for a, s in zip(jax.tree.leaves(abstract_tree), jax.tree.leaves(shardings_tree)):
        dt = a.dtype
        size = dt.itemsize if hasattr(dt, "itemsize") else 8  # PRNG key arrays: 2 x uint32
        total += int(np.prod(s.shard_shape(a.shape))) * size
    return total


# ---- kernels under shard_map ------------------------------------------------------------------------------------


def shard_kernel(fn: Callable, mesh: Mesh, in_axes, out_axes, rules: ShardingRules = ShardingRules(),
                 reduce_out: bool = False) -> Callable:
    """Run a per-device kernel under `jax.shard_map` with specs derived from logical axes.

    in_axes / out_axes: pytrees (prefixes of the arguments / outputs) of logical-axes tuples, or None for a
    replicated argument. reduce_out: the kernel returns partial sums over the sharded contraction (e.g. the
    MoE down projection over expert_mlp); they are summed with one psum over "tp".
    """
    is_axes = lambda x: x is None or (isinstance(x, tuple) and all(a is None or isinstance(a, str) for a in x))
    to_spec = lambda ax: P() if ax is None else rules.spec(ax)
    in_specs = jax.tree.map(to_spec, in_axes, is_leaf=is_axes)
    out_specs = jax.tree.map(to_spec, out_axes, is_leaf=is_axes)

    def body(*args):
        out = fn(*args)
        return jax.lax.psum(out, TP) if reduce_out else out

    return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)


# The stacked KDA states and verify rows [Lk, B, ...] as the kernels see them, split by heads (each stream's
# channels C = H*K by heads, as the state's kda_conv rule).
KDA_STATE, KDA_WINDOW = (None, None, "heads", None, None), (None, None, None, None, "heads")
_KDA_BTHK = (None, None, None, "heads", None)
KDA_ROWS = KdaRows((None, None, None, None, "heads"), _KDA_BTHK, _KDA_BTHK, _KDA_BTHK, (None, None, None, "heads"))


@dataclass(frozen=True)
class ShardedKernelCalls(KernelCalls):
    """The model's Pallas kernel calls, each run per device under `jax.shard_map` with specs from the rules
    (a Pallas custom call cannot be auto-partitioned). Pass as RuntimeOptions(kernels=...).

    moe: TP splits the expert width ("expert_mlp"/"mlp"): SwiGLU is elementwise in it, so each device's slice is
      exact; the down projections give fp32 partial sums, summed with ONE psum (routed + shared together).
      EP ("expert" -> tp) gives each device E/N experts: pairs routed elsewhere get weight 0 on local expert 0
      (read once per device when any pair is remote: up to one expert's bytes wasted), and the same one psum
      combines the devices.
    moe_residual_norm (p2p_allreduce, `fuses_layer_boundary`): the same partial sums, reduced by
      `allreduce_residual_norm` together with the residual add and the next layer's RMSNorm (one Mosaic kernel
      in place of the psum and two XLA fusions); the model then feeds that normed input to the next block.
    kda_verify / kda_commit: every head-indexed operand split over "tp"; heads are independent, no collective.
    fused_linear: not sharded yet (the output projections would need their partial sums reduced before the
      residual add): the sharded calls run the model's jnp projections, and fused_linear=True (or
      fused_linear_fp8=True, norm_linear_triton=True, linear_residual_triton=True, mtp_input_triton=True) is an
      error.
    moe_residual_epilogue: an error too. Under TP each device's MoE kernel gives a partial sum that is all-reduced
      before the residual add (the add of one device's epilogue would be summed N times), and routed_moe does not
      run under shard_map; the model adds after the psum (or in allreduce_residual_norm).
    lm_head_argmax: not sharded (the lm_head is split over the vocabulary: each device's (max, index) would need a
      cross-device argmax): the model's logits path, and lm_head_argmax=True is an error.
    """

    mesh: Mesh | None = None
    rules: ShardingRules = ShardingRules()
    fused_linear: bool = False
    fused_linear_fp8: bool = False
    norm_linear_triton: bool = False
    linear_residual_triton: bool = False
    moe_residual_epilogue: bool = False
    mtp_input_triton: bool = False
    lm_head_argmax: bool = False

    def __post_init__(self):
        if self.mesh is None:
            raise ValueError("ShardedKernelCalls needs a mesh")
        if self.moe_residual_epilogue:
            raise ValueError("ShardedKernelCalls(moe_residual_epilogue=True): the MoE's partial sums are all-reduced "
                             "before the residual add, so the add cannot ride in one device's kernel; use False")
        for name in ("fused_linear", "fused_linear_fp8", "norm_linear_triton", "linear_residual_triton",
                     "mtp_input_triton"):
            if getattr(self, name):
                raise ValueError(f"ShardedKernelCalls({name}=True): the fused projections are not run under "
                                 f"shard_map yet; use {name}=False (the jnp projections, sharded by XLA)")
        if self.lm_head_argmax:
            raise ValueError("ShardedKernelCalls(lm_head_argmax=True): the vocabulary-sharded lm_head's argmax is not "
                             "run under shard_map; use lm_head_argmax=False (the logits, sharded by XLA)")
        super().__post_init__()

    def _moe_partial(self, n_experts: int, *, limit: float, shared_limit: float, fp8_activations: bool = False):
        """(this device's MoE kernel -> fp32 partial sums [T, D], the logical axes of its arguments)."""
        rules, base = self.rules, super()
        if rules.mlp is None or (rules.expert is None and rules.expert_mlp is None):
            raise ValueError("sharded MoE needs the shared expert's width (mlp) and either the experts (expert) "
                             f"or their width (expert_mlp) on tp; got {rules}")
        ep = rules.expert is not None
        n_local = n_experts // self.mesh.shape[TP] if ep else n_experts

        def kernel(x, ids, w, wg, wu, wd, sg, su, sd):
            if ep:  # global expert ids -> this device's; pairs of other devices' experts contribute 0
                local = ids - jax.lax.axis_index(TP) * n_local
                mine = (local >= 0) & (local < n_local)
                ids, w = jnp.where(mine, local, 0), jnp.where(mine, w, 0.0)
            # The shared expert is split by its width ("mlp") in both layouts: each device adds its partial.
            # fp8_activations: x is replicated, and a device's slice of I holds whole 128-column groups of h
            # wherever its fp8 weights' 128-blocks shard whole, so it quantises the unsharded model's groups
            return base.moe(x, ids, w, wg, wu, wd, limit=limit, shared=(sg, su, sd), shared_limit=shared_limit,
                            fp8_activations=fp8_activations)

        ex_in, ex_out = ("expert", "expert_mlp", "embed"), ("expert", "embed", "expert_mlp")
        in_axes = (None, None, None, ex_in, ex_in, ex_out, ("mlp", "embed"), ("mlp", "embed"), ("embed", "mlp"))
        return kernel, in_axes

    def moe(self, x, ids, weights, w_gate, w_up, w_down, *, limit: float, shared, shared_limit: float,
            fp8_activations: bool = False):
        kernel, in_axes = self._moe_partial(w_gate.shape[0], limit=limit, shared_limit=shared_limit,
                                            fp8_activations=fp8_activations)
        f = shard_kernel(kernel, self.mesh, in_axes, None, self.rules, reduce_out=True)
        return f(x, ids, weights, w_gate, w_up, w_down, *shared)

    @property
    def fuses_layer_boundary(self) -> bool:
        return self.p2p_allreduce

    def moe_residual_norm(self, x, ids, weights, w_gate, w_up, w_down, *, limit: float, shared, shared_limit: float,
                          residual, norm_weight, eps: float, fp8_activations: bool = False):
        """The MoE's partial sums, their all-reduce, the residual add and the next RMSNorm in one shard_map: the
        all-reduce is `allreduce_residual_norm` (the peer-to-peer kernel with p2p_allreduce where it takes the
        shapes: D a multiple of 128, T <= its max_rows; else psum and the model's add and norm, per device).
        residual [T, D] and norm_weight [D] replicated; both outputs replicated."""
        kernel, in_axes = self._moe_partial(w_gate.shape[0], limit=limit, shared_limit=shared_limit,
                                            fp8_activations=fp8_activations)
        base = super()

        def boundary(*a):
            *moe_args, res, w = a
            return base.allreduce_residual_norm(kernel(*moe_args), res, w, eps=eps, axis=TP)

        f = shard_kernel(boundary, self.mesh, in_axes + (None, None), (None, None), self.rules)
        return f(x, ids, weights, w_gate, w_up, w_down, *shared, residual, norm_weight)

    def kda_verify(self, proj, b_raw, A_log, dt_bias, conv_w, conv_window, rec_state, layer, pending=None, *,
                   lower_bound: float, o_norm=None, eps: float = 1e-6):
        """o_norm (the folded epilogue): replicated, the V norm is per head; o [B, T, H*V] split by heads."""
        base = super()
        folded = o_norm is not None

        def kernel(*a):
            if folded:
                o_norm_, *a = a
                return base.kda_verify(*a, lower_bound=lower_bound, o_norm=o_norm_, eps=eps)
            return base.kda_verify(*a, lower_bound=lower_bound)

        in_axes = ((None, None, None, "heads"), (None, None, "heads"), ("heads",), ("heads",),
                   (None, "heads", None, None), KDA_WINDOW, KDA_STATE, None)
        args = (proj, b_raw, A_log, dt_bias, conv_w, conv_window, rec_state, jnp.asarray(layer, jnp.int32))
        if pending is not None:
            in_axes, args = in_axes + (KDA_ROWS,), args + (KdaRows(*pending),)
        if folded:
            in_axes, args = ((None,),) + in_axes, (o_norm,) + args
        o_axes = (None, None, "heads") if folded else (None, None, "heads", None)
        f = shard_kernel(kernel, self.mesh, in_axes, (o_axes, KDA_ROWS), self.rules)
        return f(*args)

    def kda_commit(self, rec_state, conv_window, pending, n_accept):
        base = super()
        in_axes = (KDA_STATE, KDA_WINDOW, KDA_ROWS, None)
        f = shard_kernel(lambda s, c, r, n: base.kda_commit(s, c, r, n), self.mesh, in_axes,
                         (KDA_STATE, KDA_WINDOW), self.rules)
        return f(rec_state, conv_window, KdaRows(*pending), n_accept)

    def routed_moe(self, x, gate_w, expert_bias, cfg, experts, shared, **kw):
        """Not under shard_map yet: each device's alignment tables would have to cover its own experts only, so the
        sharded model routes and calls `moe` as before (the layer falls back on None)."""
        return None

    def route(self, x, gate_w, expert_bias, cfg):
        base = super()
        if self._router_config(x, gate_w.shape[0], cfg) is None:
            return None
        # The router and its input are replicated: every device routes every token (no collective).
        rep = P()  # (None, None, None) would read as one argument's logical axes
        f = shard_kernel(lambda *a: base.route(*a, cfg), self.mesh, (rep, rep, rep), (rep, rep), self.rules)
        return f(x, gate_w, expert_bias)

    def kda_decode(self, q_raw, k_raw, v_raw, f_raw, b_raw, A_log, dt_bias, q_conv_w, k_conv_w, v_conv_w,
                   conv_window, rec_state, *, lower_bound: float):
        base = super()

        def kernel(*a):
            return base.kda_decode(*a, lower_bound=lower_bound)

        ch, w, state = (None, None, "heads"), ("heads", None, None), (None, "heads", None, None)
        window = (None, None, None, "heads")
        in_axes = (ch, ch, ch, ch, ch, ("heads",), ("heads",), w, w, w, window, state)
        f = shard_kernel(kernel, self.mesh, in_axes, ((None, None, "heads", None), state, window), self.rules)
        return f(q_raw, k_raw, v_raw, f_raw, b_raw, A_log, dt_bias, q_conv_w, k_conv_w, v_conv_w, conv_window,
                 rec_state)

    def mla_attention(self, q_lat, q_rope, cache, positions, kv_b, *, v_head_dim: int, scale: float,
                      layer: int | None = None, q_heads=None, rope_theta: float | None = None, gate=None,
                      out_dtype=None):
        """Heads split over "tp" (the queries, kv_b_proj's [H, P + Vh, Lr], the head gate and the output), the
        latent cache and positions replicated: each device attends its heads and applies their W_uv (and gate);
        no collective. The W_uk absorption choice is the base's, on the device's heads."""
        base = super()
        if self._mla_triton_config(q_lat, q_rope, cache, kv_b) is None:
            return None
        q_axes, rep = (None, None, "heads", None), P()

        def kernel(a, b, c, d, w, heads, g):
            return base.mla_attention(a, b, c, d, w, v_head_dim=v_head_dim, scale=scale, layer=layer,
                                      q_heads=heads, rope_theta=rope_theta, gate=g, out_dtype=out_dtype)

        in_axes = (q_axes, q_axes, rep, rep, ("heads", None, None), None if q_heads is None else q_axes,
                   None if gate is None else (None, None, "heads"))
        f = shard_kernel(kernel, self.mesh, in_axes, q_axes, self.rules)
        return f(q_lat, q_rope, cache, positions, kv_b, q_heads, gate)

    def mla_context(self, q_lat, q_rope, cache, positions, *, scale: float, layer: int | None = None):
        """Heads split over "tp" (the queries), the latent cache replicated: each device attends its heads."""
        base = super()
        if self._mla_config(q_lat, q_rope, cache) is None:
            return None
        q_axes = (None, None, "heads", None)
        rep = P()
        f = shard_kernel(lambda a, b, c, d: base.mla_context(a, b, c, d, scale=scale, layer=layer), self.mesh,
                         (q_axes, q_axes, rep, rep), q_axes, self.rules)
        return f(q_lat, q_rope, cache, positions)


def kernel_calls_for(opts, mesh: Mesh, rules: ShardingRules = ShardingRules()):
    """RuntimeOptions whose Pallas calls run under shard_map on `mesh` (unchanged for 1 device or the jnp path).
    The per-kernel choices of the options' KernelCalls carry over to the sharded one, except fused_linear,
    fused_linear_fp8, norm_linear_triton, linear_residual_triton, mtp_input_triton and lm_head_argmax (not sharded
    yet: see ShardedKernelCalls) and moe_residual_epilogue (the MoE is all-reduced before its add), which are off on
    more than one device."""
    calls = opts.calls
    if mesh.size == 1 or calls is None or isinstance(calls, ShardedKernelCalls):
        return opts
    fields = {f.name: getattr(calls, f.name) for f in dataclasses.fields(KernelCalls)}
    fields["fused_linear"] = fields["fused_linear_fp8"] = fields["norm_linear_triton"] = False
    fields["linear_residual_triton"] = fields["moe_residual_epilogue"] = fields["mtp_input_triton"] = False
    fields["lm_head_argmax"] = False
    return opts.replace(kernels=ShardedKernelCalls(**fields, mesh=mesh, rules=rules))
