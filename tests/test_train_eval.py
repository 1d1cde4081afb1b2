"""The trainer's held-out evaluation covers every window, and --init starts from a matching checkpoint only."""

from collections import namedtuple

import jax.numpy as jnp
import numpy as np
import pytest

from ling_jax.config import get_preset
from ling_jax.train import trainer

Metrics = namedtuple("Metrics", "ce kl mtp_top1")


def fake_eval(params, windows):
    """Per-batch means of per-window values (what eval_step returns), here a function of each window's first id."""
    v = np.asarray(windows)[:, 0].astype(np.float64)
    return Metrics(ce=v.mean(), kl=(2 * v).mean(), mtp_top1=(v % 2).mean())


@pytest.mark.parametrize("n, batch", [(48, 32), (59, 4), (7, 8), (8, 8)])
def test_evaluate_weighs_every_window(n, batch):
    windows = np.arange(n, dtype=np.int32)[:, None] * np.ones((1, 5), np.int32)
    m = trainer.evaluate(fake_eval, None, windows, batch)
    ids = np.arange(n, dtype=np.float64)
    assert m["heldout_ce"] == pytest.approx(ids.mean())
    assert m["heldout_kl"] == pytest.approx(2 * ids.mean())
    assert m["heldout_mtp_top1"] == pytest.approx((ids % 2).mean())


def test_init_refuses_another_architecture():
    with pytest.raises(ValueError, match=r"hidden_size=320 \(preset 256\)"):
        trainer.initial_params(get_preset("ling-demo"), "models/ling-demo", 0)


def test_init_loads_the_checkpoint_as_fp32_master_weights():
    from ling_jax.config import load_config
    from ling_jax.weights import load_params

    cfg = get_preset("ling-demo-v2")
    params = trainer.initial_params(cfg, "models/ling-demo", 0)
    ref = load_params(load_config("models/ling-demo"), "models/ling-demo", dtype=jnp.float32)
    assert params["embed"].dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(params["embed"]), np.asarray(ref["embed"]))
    assert not np.allclose(np.asarray(params["embed"]), np.asarray(trainer.initial_params(cfg, None, 0)["embed"]))
