"""The staged compiler on 4 simulated CPU devices: lowering checks (one program, no host callbacks, donated
state aliased) at TP 1 and 4, collectives (none at TP 1, two per layer pass at TP 4), serialize/load, the CLI."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from compile.mesh import make_mesh
from compile.report import format_report, report_dict
from compile.sharding import ShardingRules, shardings_for, state_shardings
from compile.stages import (Program, build, deserialize, enable_persistent_cache, serialize, slice_config)
from ling_jax.config import get_preset
from ling_jax.weights import init_params

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _concrete_state(abstract, mesh, seed=0):
    keys = iter(jax.random.split(jax.random.key(seed), len(jax.tree.leaves(abstract))))

    def make(a):
        k = next(keys)
        if jnp.issubdtype(a.dtype, jax.dtypes.prng_key):
            return jax.random.key(seed)
        if jnp.issubdtype(a.dtype, jnp.integer):
            return jnp.full(a.shape, 3, a.dtype)
        return (0.1 * jax.random.normal(k, a.shape, jnp.float32)).astype(a.dtype)

    state = jax.tree.map(make, abstract)
    return jax.device_put(state, state_shardings(state, mesh))


@pytest.fixture(autouse=True, scope="module")
def _no_suite_cache():
    """This module compiles without the suite's persistent cache (tests/conftest.py): an XLA:CPU executable loaded
    from that cache, serialized again and deserialized, can lack its fusions ("NOT_FOUND: Function
    multiply_power_fusion not found", seen in CI), and serialize / load is what this module tests."""
    from jax.experimental.compilation_cache import compilation_cache as cc

    saved = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", None)
    cc.reset_cache()
    yield
    jax.config.update("jax_compilation_cache_dir", saved)
    cc.reset_cache()


@pytest.fixture(scope="module")
def built_tp():
    cfg = get_preset("test-tiny")
    out = {}
    for tp in (1, 4):
        mesh = make_mesh(tp)
        out[tp] = (build(Program(cfg, mode="nextn", steps=3, max_len=32, dtype="float32"), mesh), mesh)
    return out


@pytest.mark.parametrize("tp", [1, 4])
def test_lowering_checks(built_tp, tp):
    b, mesh = built_tp[tp]
    assert b.checks.programs == 1
    assert b.checks.host_callbacks == []
    # SpecState leaves: target 4, bonus, draft cache, seed, draft hidden, key, accept_hist, sampling 8, history 2
    assert b.checks.aliased_outputs == b.checks.donated_leaves == 20
    assert "input_output_alias" in b.compiled.as_text()
    rep = report_dict(b, mesh, ShardingRules())
    text = format_report(rep)
    assert "programs per step        1" in text
    if tp == 1:
        assert rep["collectives_total"] == 0
        assert rep["param_bytes_per_device"] == rep["param_bytes_total"]
    else:
        # Megatron layout: one all-reduce after attention, one after the FFN (routed + shared combined)
        assert rep["collectives_per_layer_pass"] == pytest.approx(2.0)
        assert rep["collectives_per_step"].get("all-gather", 0) <= 4 * 3  # argmaxes over vocab shards only
        assert rep["param_bytes_per_device"] < rep["param_bytes_total"] / 2


def test_serialized_executable_runs_the_same(built_tp):
    b, mesh = built_tp[4]
    cfg = b.prog.cfg
    params = init_params(cfg, 0, jnp.float32, shardings_for(cfg, mesh))
    loaded = deserialize(serialize(b.compiled))
    outs = []
    for exe in (b.compiled, loaded):
        state = _concrete_state(b.prog.abstract_state(), mesh)
        new, step_out = exe(params, state)
        outs.append((new.target.kda_recurrent, new.draft_cache, step_out.tokens))
    for x, y in zip(*outs):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_persistent_cache_and_plain_program(tmp_path):
    from jax.experimental.compilation_cache import compilation_cache as cc

    saved = {k: getattr(jax.config, k) for k in ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
                                                  "jax_persistent_cache_min_entry_size_bytes")}
    enable_persistent_cache(str(tmp_path / "xla"))
    try:
        b = build(Program(get_preset("test-tiny"), mode="plain", max_len=32, dtype="float32"), make_mesh(2))
    finally:
        # Put everything back, the cache object included: once used, jax keeps writing every later test's
        # executables into it (seen: an abort serializing one of them).
        for k, v in saved.items():
            jax.config.update(k, v)
        cc.reset_cache()
    assert b.checks.ok and b.checks.donated_leaves == 16  # PlainState: target 4, bonus, key, sampling 8, history 2
    assert os.listdir(tmp_path / "xla")


def test_slice_config_keeps_layout_and_clamps():
    cfg = get_preset("ling3-flash")
    s = slice_config(cfg, 12)
    assert s.num_hidden_layers == 12 and s.mla_layers == (5, 11) and s.mtp_layers == (12,)
    assert len(s.routed_swiglu_limits) == 13
    assert s.routed_limit(12) == cfg.routed_limit(42) and s.shared_limit(11) == cfg.shared_limit(11)
    with pytest.raises(ValueError):
        slice_config(cfg, 2)


def test_cli_report():
    env = dict(os.environ, XLA_FLAGS="", JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-m", "compile", "--model", "test-tiny", "--tp-size", "2", "--spec", "none",
                        "--max-len", "32", "--dtype", "float32", "--report"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "programs per step        1" in r.stdout and "TP 2 on cpu" in r.stdout


def test_program_leaves_out_logprobs_unless_asked():
    """A step program computes logprobs (log_softmax + a vocabulary top-k, a sort on the GPU) only with
    with_logprobs=True, like the runner for a request that asks for them; the default is the request without."""
    cfg = get_preset("test-tiny")
    mesh = make_mesh(1)
    from compile.stages import abstract_inputs

    texts = {}
    for mode in ("plain", "nextn"):
        for want in (False, True):
            prog = Program(cfg, mode=mode, steps=2, max_len=32, dtype="float32", with_logprobs=want)
            params, state = abstract_inputs(prog, mesh)
            _, out = jax.eval_shape(prog.fn(), params, state)
            assert (out.logprobs is not None) == want, (mode, want)
            texts[mode, want] = jax.jit(prog.fn()).lower(params, state).as_text()
    vocab_topk = f"x{cfg.vocab_size}xf32> -> ("  # a top_k over the vocabulary (the router's are over experts)
    for mode in ("plain", "nextn"):
        n = {w: sum(vocab_topk in line for line in texts[mode, w].splitlines() if "top_k" in line) for w in (0, 1)}
        assert n[0] == 0 and n[1] >= 1, (mode, n)
