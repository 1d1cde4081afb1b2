"""The model with its Pallas kernels (interpreter) equals the model with its jnp layers: the wiring is right."""

import jax
import jax.numpy as jnp
import pytest

from ling_jax.config import get_preset
from ling_jax.kernel_calls import KernelCalls
from ling_jax.model import RuntimeOptions, commit, forward, lm_logits
from ling_jax.state import init_state
from ling_jax.weights import init_params
from tests.conftest import rel_err


def test_verify_commit_decode_with_interpreted_kernels_match_jnp():
    cfg = get_preset("test-wide")  # D 256, experts of width 32, 4 heads of 64: tiles divide
    params = init_params(cfg, 0, jnp.float32)
    toks = jax.random.randint(jax.random.key(1), (1, 14), 0, cfg.vocab_size)
    base = forward(params, toks[:, :8], init_state(cfg, 1, 64, jnp.float32), cfg, mode="prefill").state
    results = {}
    choices = {"reference": "reference", "verify": KernelCalls(interpret=True)}
    for name, kernels in choices.items():
        o = RuntimeOptions(kernels=kernels)
        v = forward(params, toks[:, 8:], base, cfg, mode="verify", opts=o)
        c = commit(v.state, v.pending, jnp.array([4], jnp.int32), o)
        d = forward(params, toks[:, 8:9], base, cfg, mode="decode", opts=o)
        results[name] = (lm_logits(params, v.hidden), c.kda_recurrent, c.kda_conv, lm_logits(params, d.hidden),
                          d.state.kda_recurrent, d.state.kda_conv)
    for ref, got in zip(results["reference"], results["verify"]):
        assert rel_err(got, ref) <= 1e-5


def test_prefill_and_fused_decode_with_interpreted_kernels_match_jnp():
    """Prefill with the interpreted kernels (T not a chunk multiple, padded tail) and decode through the fused
    one-kernel KDA decode equal the jnp model."""
    cfg = get_preset("test-wide")
    params = init_params(cfg, 0, jnp.float32)
    toks = jax.random.randint(jax.random.key(2), (1, 12), 0, cfg.vocab_size)
    n = jnp.array([11], jnp.int32)
    out = {}
    for name, o in (("reference", RuntimeOptions(kernels="reference")),
                    ("interpret", RuntimeOptions(kernels=KernelCalls(interpret=True, kda_fused_decode=True)))):
        p = forward(params, toks, init_state(cfg, 1, 64, jnp.float32), cfg, mode="prefill", n_valid=n, opts=o)
        d = forward(params, toks[:, 11:12], p.state, cfg, mode="decode", opts=o)
        out[name] = (lm_logits(params, p.hidden[:, :11]), p.state.kda_recurrent, lm_logits(params, d.hidden),
                     d.state.kda_recurrent, d.state.kda_conv)
    for ref, got in zip(out["reference"], out["interpret"]):
        assert rel_err(got, ref) <= 1e-5


def test_kernel_choices_that_cannot_apply_are_rejected():
    """A choice the chosen path would ignore is an error, not a silent no-op."""
    import pytest

    with pytest.raises(ValueError, match="interpret=True"):
        KernelCalls(interpret=True, moe_impl="mosaic").moe_kernel(jnp.zeros((1, 8)), jnp.zeros((2, 4, 8)))



def _flat_eqns(jaxpr, env, out):
    """The equations of a jaxpr with nested jit calls inlined: [(primitive, params, in ids, out ids)], an id per
    variable (env: the ids of jaxpr's inputs; literals None). Returns the ids of its outputs."""
    ids = dict(env)
    vid = lambda v: None if isinstance(v, jax.extend.core.Literal) else ids.setdefault(v, ("var", len(ids), id(v)))
    for e in jaxpr.eqns:
        sub = e.params.get("jaxpr") if e.primitive.name in ("jit", "pjit") else None
        if sub is not None:
            sub = getattr(sub, "jaxpr", sub)
            for ov, r in zip(e.outvars, _flat_eqns(sub, {iv: vid(v) for iv, v in zip(sub.invars, e.invars)}, out)):
                ids[ov] = r
            continue
        out.append((e.primitive.name, e.params, [vid(v) for v in e.invars], [vid(v) for v in e.outvars]))
    return [vid(v) for v in jaxpr.outvars]


@pytest.mark.parametrize("mode", ["plain", "nextn"])
def test_demo_step_runs_the_kda_kernels_on_the_state_in_place(mode):
    """The shipped demo's plain step and NEXTN5 step (bench_step's programs, default kernels, traced only): its 6
    KDA layers run 6 kda_verify calls and ONE kda_commit; the kernels read conv_w and the stacked states as the
    step receives them (only free reshapes between), nothing slices, gathers, concatenates or scatters their
    operands or results, and the commit's results are the step's output states (updated in place)."""
    from compile.stages import Program
    from ling_jax.config import from_hf_config
    from ling_jax.weights import abstract_params
    from tests.test_fused_linear_wired import DEMO

    cfg = from_hf_config(DEMO)
    prog = Program(cfg, mode=mode, steps=5, max_len=1024, opts=RuntimeOptions(kernels=KernelCalls()))
    args = (abstract_params(cfg, jnp.bfloat16), prog.abstract_state())
    closed = jax.make_jaxpr(prog.fn())(*args)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(args)[0]]
    eqns = []
    outs = _flat_eqns(closed.jaxpr, {v: ("in", paths[i]) for i, v in enumerate(closed.jaxpr.invars)}, eqns)
    producer = {o: e for e in eqns for o in e[3]}
    consumers = {}
    for e in eqns:
        for v in e[2]:
            consumers.setdefault(v, []).append(e)
    free = ("reshape", "squeeze", "expand_dims")
    glue = ("slice", "dynamic_slice", "gather", "concatenate", "scatter", "dynamic_update_slice", "copy", "copy_p")

    def source(v):  # through free reshapes: ("in", path) of a step input, or the producing equation's primitive
        while v in producer and producer[v][0] in free:
            v = producer[v][2][0]
        return producer[v][0] if v in producer else v

    def sinks(v):  # the non-free uses of v (and "out" where it is a step output), through free reshapes
        got = ["out"] if v in outs else []
        for e in consumers.get(v, []):
            got += [s for o in e[3] for s in sinks(o)] if e[0] in free else [e[0]]
        return got

    kda = [(n, e) for e in eqns if e[0] == "pallas_call"
           for n in ("kda_verify", "kda_commit") if n in str(e[1].get("name", ""))]
    assert sorted(n for n, _ in kda) == ["kda_commit"] + ["kda_verify"] * 6
    for name, (_, _, ins, res) in kda:
        assert not [source(v) for v in ins if source(v) in glue], name
        assert not [s for v in res for s in sinks(v) if s in glue], name
        if name == "kda_verify":  # (layer, proj, b_raw, A_log, dt_bias, conv_w, conv_state, rec_state, [rows])
            conv_w, window, state = (source(v) for v in ins[5:8])
            assert "conv_w" in conv_w[1] and ".kda_conv" in window[1] and ".kda_recurrent" in state[1], ins
        else:                     # (n_accept, rec_state, conv_state, rows ...) -> (rec_state, conv_state)
            assert ".kda_recurrent" in source(ins[1])[1] and ".kda_conv" in source(ins[2])[1]
            assert all(sinks(v) == ["out"] for v in res)
