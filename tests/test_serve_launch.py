"""serve.launch_server without starting a server: SGLang flag names, --tp-size checks, bad flags exit 2,
--num-continuous-decode-steps' checks, DSPARK's --max-running-requests and its memory budget."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from ling_jax import dspark, memory
from ling_jax.config import get_preset
from ling_jax.dspark_step import dspark_init
from ling_jax.sampling import SamplingParams
from ling_jax.spec import SpecConfig
from serve import launch_server


def test_sglang_flag_names_parse():
    a = launch_server.build_parser().parse_args([
        "--model-path", "test-tiny", "--tp-size", "1", "--speculative-algorithm", "NEXTN",
        "--speculative-num-steps", "3", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4",
        "--context-length", "512", "--host", "127.0.0.1", "--port", "30000", "--random-weights", "--seed", "1",
        "--dtype", "float32", "--enable-deterministic-inference", "--dist-init-addr", "10.0.0.1:5000", "--nnodes", "2",
        "--node-rank", "1"])
    assert (a.speculative_algorithm, a.speculative_num_draft_tokens, a.context_length) == ("NEXTN", 4, 512)
    assert a.enable_deterministic_inference and (a.dist_init_addr, a.nnodes, a.node_rank) == ("10.0.0.1:5000", 2, 1)


def test_tp_size_checks():
    cfg = get_preset("test-tiny")
    assert launch_server.tensor_parallel(cfg, 1) == (None, None)
    with pytest.raises(ValueError, match="tp-size must be >= 1"):
        launch_server.tensor_parallel(cfg, 0)
    with pytest.raises(ValueError, match="device"):
        launch_server.tensor_parallel(cfg, jax.device_count() + 1)


@pytest.mark.parametrize("argv", [
    ["--model-path", "no-such-model"],
    ["--model-path", "test-tiny", "--speculative-algorithm", "NEXTN", "--speculative-eagle-topk", "2"],
    ["--model-path", "test-tiny", "--speculative-algorithm", "NEXTN", "--speculative-num-steps", "3",
     "--speculative-num-draft-tokens", "7"],
    ["--model-path", "test-tiny", "--context-length", "4"],
    ["--model-path", "test-tiny", "--nnodes", "2", "--node-rank", "2", "--dist-init-addr", "127.0.0.1:1"],
    ["--model-path", "test-tiny", "--nnodes", "2", "--node-rank", "1"],
    ["--model-path", "test-tiny", "--max-queued-requests", "0"],
    ["--model-path", "test-tiny", "--request-timeout", "0"],
    ["--model-path", "test-tiny", "--body-timeout", "-1"],
    ["--model-path", "test-tiny", "--api-key", ""],
    ["--model-path", "test-tiny", "--random-seed", str(2**64)],
    ["--model-path", "test-tiny", "--num-continuous-decode-steps", "0"],
    ["--model-path", "test-tiny", "--num-continuous-decode-steps", "4", "--context-length", "12"],
])
def test_bad_flags_exit_2(argv, capsys):
    assert launch_server.main(argv) == 2
    assert capsys.readouterr().err.startswith("error: ")


def test_operations_flags_and_model_id():
    a = launch_server.build_parser().parse_args([
        "--model-path", "/data/ckpt/Ling-flash/", "--api-key", "k", "--random-seed", "7", "--max-queued-requests", "4",
        "--request-timeout", "30", "--body-timeout", "5"])
    assert (a.api_key, a.random_seed, a.max_queued_requests, a.request_timeout, a.body_timeout) == ("k", 7, 4, 30.0, 5.0)
    assert launch_server.served_name(a) == "Ling-flash"  # a clean id, not the path
    a.served_model_name = "ling"
    assert launch_server.served_name(a) == "ling"


def test_continuous_decode_steps_flag(capsys):
    """--num-continuous-decode-steps: an integer >= 1, with or without continuous batching (the default
    --max-running-requests does not depend on it)."""
    parse = lambda *argv: launch_server.build_parser().parse_args(["--model-path", "test-tiny", *argv])
    assert launch_server.decode_steps(parse()) == 1  # SGLang's default
    assert launch_server.max_running(parse()) == launch_server.DEFAULT_MAX_RUNNING
    assert launch_server.max_running(parse("--num-continuous-decode-steps", "4")) == launch_server.DEFAULT_MAX_RUNNING
    assert launch_server.max_running(parse("--num-continuous-decode-steps", "4", "--max-running-requests", "1")) == 1
    assert launch_server.max_running(parse("--num-continuous-decode-steps", "4", "--max-running-requests", "8")) == 8
    with pytest.raises(ValueError, match="must be >= 1"):  # checked with --max-running-requests too
        launch_server.max_running(parse("--num-continuous-decode-steps", "0", "--max-running-requests", "8"))
    for bad in ("0", "-2"):
        assert launch_server.main(["--model-path", "test-tiny", "--num-continuous-decode-steps", bad]) == 2
        assert capsys.readouterr().err.strip() == f"error: --num-continuous-decode-steps must be >= 1, got {bad}"
    with pytest.raises(SystemExit) as e:  # argparse: not an integer
        parse("--num-continuous-decode-steps", "2.5")
    assert e.value.code == 2 and "--num-continuous-decode-steps: invalid int value: '2.5'" in capsys.readouterr().err
    # the context must hold the warm-up's two dispatches of N steps: 2 * 4 * 4 rows + 5 for NEXTN 3 steps
    assert launch_server.main(["--model-path", "test-tiny", "--num-continuous-decode-steps", "4", "--context-length",
                               "36", "--speculative-algorithm", "NEXTN", "--speculative-num-steps", "3"]) == 2
    assert capsys.readouterr().err.strip() == "error: --context-length 36 is too small (at least 37)"


def _dspark_draft(cfg, block: int = 4):
    return dspark.DSparkConfig(hidden_size=cfg.hidden_size, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=32, intermediate_size=64, vocab_size=cfg.vocab_size,
                               block_size=block, target_layer_ids=(0, cfg.num_hidden_layers - 1),
                               num_target_layers=cfg.num_hidden_layers)


def test_dspark_batches_on_one_device():
    """DSPARK rows batch as NEXTN rows do: --max-running-requests > 1 is accepted and defaults to
    DEFAULT_MAX_RUNNING on one host with --tp-size 1; only --tp-size / --nnodes > 1 still refuse it."""
    parse = lambda *argv: launch_server.build_parser().parse_args(
        ["--model-path", "test-tiny", "--speculative-algorithm", "DSPARK", "--speculative-draft-model-path", "d",
         *argv])
    assert launch_server.max_running(parse()) == launch_server.DEFAULT_MAX_RUNNING
    assert launch_server.max_running(parse("--max-running-requests", "4")) == 4
    assert launch_server.request_rows(parse("--max-running-requests", "4")) == 4 + 2 + 1
    assert launch_server.max_running(parse("--max-running-requests", "1")) == 1
    assert launch_server.max_running(parse("--tp-size", "2")) == 1
    with pytest.raises(ValueError, match="continuous batching needs --nnodes 1 and --tp-size 1"):
        launch_server.max_running(parse("--max-running-requests", "4", "--tp-size", "2"))


def test_dspark_memory_budget_counts_the_draft_context_per_row(monkeypatch):
    """The budget of DSPARK rows = the plain rows' + per row the draft context K/V over the context (the bytes of
    a real DSparkState's ctx_k / ctx_v) + the draft's weights (a real draft's leaves); a device that holds the
    plain rows but not the DSpark ones is refused."""
    cfg = get_preset("test-tiny")
    dcfg, context = _dspark_draft(cfg), 512
    parse = lambda *argv: launch_server.build_parser().parse_args(
        ["--model-path", "test-tiny", "--max-running-requests", "4", "--dtype", "bfloat16", *argv])
    plain_args, dspark_args = parse(), parse("--speculative-algorithm", "DSPARK")
    plain = launch_server.memory_budget(plain_args, cfg, SpecConfig("NONE"), context)
    budget = launch_server.memory_budget(dspark_args, cfg, SpecConfig("DSPARK", 4), context, dcfg)
    state = jax.eval_shape(lambda: dspark_init(SamplingParams.shapes(cfg.vocab_size), jax.random.key(0), cfg, dcfg,
                                               batch=1, slots=context, dtype=jnp.bfloat16))
    ctx = state.ctx_k.size * state.ctx_k.dtype.itemsize + state.ctx_v.size * state.ctx_v.dtype.itemsize
    draft = jax.eval_shape(lambda: dspark.init_params(dcfg, 0, jnp.bfloat16))
    weights = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(draft))
    assert budget["rows"] == plain["rows"] == 7 and ctx > 0 and weights > 0
    assert budget["per_request_bytes"] - plain["per_request_bytes"] == ctx
    assert budget["total_bytes"] - plain["total_bytes"] == 7 * ctx + weights
    assert budget["weights_bytes"] - plain["weights_bytes"] == weights
    between = int((plain["total_bytes"] + 3 * ctx) / 0.85) + 1  # holds the plain rows, not the DSpark rows
    monkeypatch.setattr(memory, "device_memory_bytes", lambda device=None: between)
    launch_server.memory_budget(plain_args, cfg, SpecConfig("NONE"), context)
    with pytest.raises(ValueError, match="7 request state rows x --context-length 512 do not fit"):
        launch_server.memory_budget(dspark_args, cfg, SpecConfig("DSPARK", 4), context, dcfg)
