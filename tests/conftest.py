"""Shared fixtures: small configs, torch-written checkpoints, and jitted JAX entry points (compiled once)."""

import functools
import os

# 4 simulated devices for the sharding tests; no excess precision, so the bf16 roundings the model spells out
# (to mirror the reference) are not simplified away under jit.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4 --xla_allow_excess_precision=false")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.serve_helpers import CACHE_DIR

# One persistent compilation cache for the suite, shared by both xdist workers and the server subprocesses
# (tests/serve_helpers.py): test modules rebuild the same programs (each module's executables are dropped after
# it, _release_executables), and a program built once is then loaded, not compiled again. count_compiles counts
# a load like a compile, so the no-compile tests keep their meaning.
jax.config.update("jax_compilation_cache_dir", CACHE_DIR)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)

from ling_jax.config import TEST_PRESETS, get_preset, to_hf_dict
from ling_jax.model import RuntimeOptions, commit, forward, lm_logits

# Three small configs (every layer kind) and a seed each.
PARITY_CASES = [(name, seed) for name, seed in zip(TEST_PRESETS, (0, 1, 2))]


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@functools.lru_cache(maxsize=None)
def jitted_forward(cfg, mode: str, opts: RuntimeOptions = RuntimeOptions()):
    def f(params, tokens, state, n_valid):
        out = forward(params, tokens, state, cfg, mode=mode, n_valid=n_valid, opts=opts)
        return lm_logits(params, out.hidden, opts), out

    return jax.jit(f)


@functools.lru_cache(maxsize=None)
def jitted_commit():
    return jax.jit(commit)


@pytest.fixture(scope="session")
def torch_checkpoints(tmp_path_factory):
    """(preset, dtype) -> (checkpoint dir, reference model), written by the torch side."""
    torch = pytest.importorskip("torch")
    from tests.reference.checkpoint import write_random_checkpoint

    out = {}
    for name, seed in PARITY_CASES:
        for dt_name, dt in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
            d = tmp_path_factory.mktemp(f"{name}-{dt_name}")
            model = write_random_checkpoint(to_hf_dict(get_preset(name)), d, seed=seed, dtype=dt,
                                            shards=2 if name == "test-qlora" else 1,
                                            expert_bias_std=0.5 if dt_name == "float32" else 2.0)
            out[(name, dt_name)] = (str(d), model)
    return out


@pytest.fixture(autouse=True, scope="module")
def _release_executables():
    """After each test module, drop compiled executables (jit caches and this file's cached entry points). The whole
    suite compiles thousands of CPU executables in one process; their JIT-ed code mappings pile up toward the
    kernel's per-process map limit (65530), and two late-suite runs died inside XLA (an abort in an executable
    write, a segfault in a compile) once the new tests were added."""
    yield
    import gc

    jitted_forward.cache_clear()
    jitted_commit.cache_clear()
    jax.clear_caches()
    gc.collect()


@pytest.fixture(scope="session")
def batch1_server(tmp_path_factory):
    """One real batch-1 server (tests/serve_helpers.py: random weights, seed 3, a tokenizer) shared by the modules
    that need no flag of their own (test_serve_api, test_serve_sampling): a start costs seconds of tracing and cache
    loads even when the persistent compilation cache holds every program. --dist-init-addr: test_serve_api checks
    that server info redacts it."""
    from tests.serve_helpers import Server, make_model_dir

    d = tmp_path_factory.mktemp("serve-batch1")
    srv = Server(make_model_dir(str(d / "model")), str(d / "server.log"), "--random-weights", "--seed", "3",
                 "--dist-init-addr", "10.1.2.3:5000")
    yield srv
    srv.stop()


def greedy_emissions(cfg, params, prompt, opts: RuntimeOptions, runs, *, max_len: int, chunk: int, dtype):
    """{steps: [first token, then the tokens the device loop emitted]} for each (steps, n_steps) of `runs` (0:
    plain decode, else NEXTN with that many steps): the prompt through the jnp prefill (one state per relay), then
    n_steps device steps with `opts`. The lossless tests compare emissions[0] with emissions[steps]."""
    from ling_jax.runner import Generator, generate_on_device
    from ling_jax.sampling import SamplingOptions
    from ling_jax.spec import SpecConfig

    emitted = {}
    for steps, n_steps in runs:
        spec = SpecConfig("NEXTN", steps) if steps else SpecConfig("NONE")
        gen = Generator(cfg, params, spec=spec, max_len=max_len, chunked_prefill_size=chunk, dtype=dtype,
                        opts=opts.replace(kernels=None))
        state, first, _ = gen.prefill(prompt, SamplingOptions().device(cfg.vocab_size), jax.random.key(0), True)
        state = jax.block_until_ready(state)
        _, buf, count = jax.block_until_ready(generate_on_device(cfg, spec, n_steps, opts=opts)(params, state))
        emitted[steps] = [int(first[0])] + [int(t) for t in np.asarray(buf[0, : int(count[0])])]
    return emitted
