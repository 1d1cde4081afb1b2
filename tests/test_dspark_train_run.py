"""Run control of the DSpark trainer: the greedy texts of one compiled program equal plain greedy decoding across
padded chunks, the whole-run budget plan, the signal counter, and `timeout -s INT` keeping the work (a subprocess
interrupted after its first logged step leaves a loadable draft dir whose metrics say so)."""

import json
import math
import os
import signal
import subprocess
import sys
import time

import jax.numpy as jnp
import numpy as np
import pytest

from ling_jax import dspark
from ling_jax.train import dspark as train
from ling_jax.train.run_control import Deadline, GracefulStop, steps_in_budget
from ling_jax.weights import save_hf_checkpoint
from tests.test_dspark import generator, model, write_xz_tokens

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_greedy_program_equals_generator_greedy_over_padded_chunks():
    """3 prompts through one program of 2 rows (the second chunk padded with a repeat): each row is the prompt
    then exactly the Generator's 40 greedy tokens (fp32, EOS ignored)."""
    cfg, params = model()
    prompts = np.asarray([[3, 7, 1, 9, 4], [11, 2, 2, 5, 8], [6, 10, 4, 4, 2]], np.int32)
    rows = train.program_rows(len(prompts), 2)
    gen = train.greedy_program(params, rows, 5, 45, cfg).compile()
    got = train.continue_prompts(gen, params, prompts, rows)
    assert rows == 2 and got.shape == (3, 45)
    for i, p in enumerate(prompts.tolist()):
        want = generator(0).generate(p, max_new_tokens=40, stop_token_ids=())[0]
        assert got[i].tolist() == p + want, i


def test_program_rows_spread_evenly():
    assert [train.program_rows(n, b) for n, b in [(4128, 512), (4096, 512), (32, 512), (3, 2), (1, 1)]] == \
        [459, 512, 32, 2, 1]
    with pytest.raises(ValueError, match="--distill-batch 0"):
        train.program_rows(5, 0)


def test_steps_in_budget():
    # 100 s left, 10 s reserve, 0.125 s steps: 720 more steps; capped by max_steps; never fewer than done
    assert steps_in_budget(11, 0.125, 100.0, 10.0, 10_000) == 731
    assert steps_in_budget(11, 0.125, 100.0, 10.0, 500) == 500
    assert steps_in_budget(11, 0.125, 5.0, 10.0, 500) == 11
    assert steps_in_budget(11, 0.125, float("inf"), 10.0, 500) == 500
    assert Deadline(None).left() == float("inf") and 9.0 < Deadline(10.0).left() <= 10.0
    with pytest.raises(ValueError, match="--time-budget -1"):
        Deadline(-1)


def test_graceful_stop_counts_signals_and_restores_the_handler():
    before = signal.getsignal(signal.SIGINT)
    with GracefulStop() as stop:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.01)  # the handler runs at the next bytecode boundary of the main thread
        assert stop.requested and not stop.urgent
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)
        assert stop.urgent
        with pytest.raises(KeyboardInterrupt, match="third SIGINT"):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.01)
    assert signal.getsignal(signal.SIGINT) is before


def tiny_run(tmp_path):
    """A saved 3-layer target, an xz corpus and the trainer's arguments for a tiny draft."""
    cfg, params = model()
    target, data, out = tmp_path / "target", tmp_path / "data", tmp_path / "draft"
    save_hf_checkpoint(cfg, params, str(target))
    data.mkdir()
    period = np.random.default_rng(0).integers(0, 12, 24)
    write_xz_tokens(data, "train", np.tile(period, 20))
    write_xz_tokens(data, "heldout", np.tile(period, 3))
    return cfg, out, ["--target", str(target), "--data", str(data), "--out", str(out), "--batch", "2", "--seq", "16",
                      "--anchors", "4", "--block-size", "4", "--layers", "1", "--context-layers", "2",
                      "--markov-rank", "8", "--warmup", "1", "--compute-dtype", "float32", "--eval-windows", "2",
                      "--distill-seqs", "3", "--distill-prompt", "6", "--distill-batch", "2"]


def lr_fraction(step: int, total: int, warmup: int = 1, min_frac: float = 0.1) -> float:
    """The schedule written out (warmup then cosine to min_frac), independent of trainer.lr_at."""
    return min_frac + (1 - min_frac) * 0.5 * (1 + math.cos(math.pi * (step - warmup) / (total - warmup)))


def test_learning_rate_follows_the_planned_steps(monkeypatch):
    """Once the budget has planned the run (40 steps here, of --steps 1000), the cosine runs over those 40 steps:
    the last step's rate is ~10 % of --lr (a schedule over --steps would still be at ~100 %)."""
    import argparse
    import types

    monkeypatch.setattr(train, "steps_in_budget", lambda i, step_s, left, reserve, max_steps: 40)
    seen = []

    def step(dp, opt_state, params, tokens, pool, key, lr):
        seen.append(float(lr))
        return dp, opt_state, {k: jnp.float32(0) for k in ("loss", "ce", "l1", "expected_accept", "greedy_accept")}

    a = argparse.Namespace(seed=0, steps=1000, time_budget=10.0, log_every=1000, lr=1e-3, warmup=5)
    clock, stop = types.SimpleNamespace(left=lambda: 10.0), types.SimpleNamespace(requested=False)
    _, _, _, steps, _, _ = train.train_loop(step, jnp.zeros(2), (), None, None, None, a, clock, 0.0, stop)
    assert steps == 40 and len(seen) == 40
    assert seen[:5] == pytest.approx([1e-3 * (i + 1) / 5 for i in range(5)])  # warmup, before any plan
    assert seen[11:] == pytest.approx([1e-3 * lr_fraction(i, 40, warmup=5) for i in range(11, 40)], rel=1e-6)
    assert seen[-1] < 0.11e-3


def test_budget_spent_before_training_leaves_the_measuring_steps(tmp_path):
    """A 0.5 s whole-run budget is gone after the three compiles: training stops at the 11 steps that measure the
    step time (the old training-only budget ran on), and the run still evaluates and saves (no pool: the greedy
    program serves the held-out prompts alone, the training step takes no pool)."""
    _, out, args = tiny_run(tmp_path)
    report = train.main(args + ["--steps", "1000", "--time-budget", "0.5", "--log-every", "5", "--distill-seqs", "0"])
    assert report["steps"] == 11 and not report["interrupted"] and report["run_s"] > 0.5
    assert set(report["compile_s"]) == {"greedy", "train_step", "eval"} and report["reserve_s"] >= train.SAVE_RESERVE_S
    assert 1.0 <= report["final"]["heldout_greedy_expected_accept"] <= 5.0
    assert sorted(os.listdir(out)) == ["config.json", "metrics.json", "model.safetensors"]


def test_sigint_after_the_first_step_keeps_the_work(tmp_path):
    """`timeout -s INT`: the trainer (a subprocess, 100000 steps asked) gets SIGINT once it logged a step; it stops
    at a step boundary, evaluates, and writes a dir that loads as a draft of the target, metrics saying so."""
    cfg, out, args = tiny_run(tmp_path)
    proc = subprocess.Popen([sys.executable, "-m", "ling_jax.train.dspark", *args, "--steps", "100000",
                             "--log-every", "1"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("step 1/"):
                proc.send_signal(signal.SIGINT)
                break
        rest, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    log = "".join(lines) + rest
    assert proc.returncode == 0, log
    assert "SIGINT: stopping at the next step" in log and "interrupted" in log, log
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["interrupted"] and not metrics["final_eval_skipped"], metrics
    assert 1 <= metrics["steps"] < 100000 and metrics["rows"][-1]["step"] == metrics["steps"]
    assert 1.0 <= metrics["final"]["heldout_expected_accept"] <= 5.0
    dcfg = dspark.load_config(str(out))
    dcfg.check_target(cfg)
    dp = dspark.load_params(dcfg, str(out), jnp.float32)
    assert dp["fc"]["weight"].shape[1] == 2 * cfg.hidden_size
