"""The Triton router's shared memory at the shapes the server's step programs give it.

Bug (H200, 2026-12): the v2 demo model's server failed its first request with XLA's `RESOURCE_EXHAUSTED: Shared
memory size limit exceeded: requested 270336, available: 232448`: router_scores at the 512-token prefill chunk
pipelines its [T' = 512, BK = 64] x tile 4 stages deep, 4 x (512 + 16) x 64 x 2 B = 270336 B > 227 KiB.

Oracle: the Triton module Pallas emits for the kernel (lowered for CUDA on this CPU machine) compiled by the Triton
package for sm_90 (`metadata.shared`, the count XLA compares with the device's limit); the config's formula
(RouterConfig.scores_smem) is checked against it, then the chooser (KernelCalls._router_config) is walked over
every row count the server's programs route (decode / verify 1..4 rows at B = 1 and 8, prefill chunks 32 / 128 /
512, a 2048-token prompt) for the v2 demo and Ling-3.0-flash.
"""
import jax.numpy as jnp
import pytest
import triton
from jax._src.pallas.triton import pallas_call_registration
from triton.backends.compiler import GPUTarget

from ling_jax.config import get_preset
from ling_jax.kernel_calls import KernelCalls
from pallas_kernels import router
from tests.cuda_lowering import S, lower_cuda

LIMIT = 232448                          # the H200's shared memory per block, as XLA reported it
V2, FLASH = get_preset("ling-demo-v2"), get_preset("ling3-flash")
SERVER_ROWS = sorted({b * r for b in (1, 8) for r in (1, 2, 3, 4)} | {32, 128, 512, 2048})


def _route(cfg, rc):
  return lambda x, g, b: router.route(x, g, b, n_group=cfg.n_group, topk_group=cfg.topk_group,
                                      top_k=cfg.num_experts_per_tok, routed_scaling_factor=2.5, config=rc)


def triton_smem(monkeypatch, tmp_path, cfg, t, rc) -> int:
  """Shared memory of the router_scores kernel as Triton allocates it for sm_90 (the first Triton module)."""
  modules = []
  lower = pallas_call_registration.lowering.lower_jaxpr_to_triton_module

  def capture(*a, **k):
    out = lower(*a, **k)
    modules.append(out.module.operation.get_asm())
    return out

  monkeypatch.setattr(pallas_call_registration.lowering, "lower_jaxpr_to_triton_module", capture)
  d, e = cfg.hidden_size, cfg.num_experts
  lower_cuda(_route(cfg, rc), S((t, d), jnp.bfloat16), S((e, d), jnp.bfloat16), S((e,), jnp.float32))
  assert "router_scores" in modules[0], modules[0][:300]
  path = tmp_path / f"router_scores_{t}.ttir"
  path.write_text(modules[0])
  kernel = triton.compile(str(path), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": rc.num_warps, "num_stages": rc.num_stages})
  return kernel.metadata.shared


SEGMENTS = "scatter"  # KernelCalls' default router_segments program since 2026-12-03 (moe_router_scatter=True)


def chosen(cfg, t):
  return KernelCalls()._router_config(S((t, cfg.hidden_size), jnp.bfloat16), cfg.num_experts, cfg)


def test_the_failing_config_is_the_one_triton_counts(monkeypatch, tmp_path):
  """The regression: the old choice at the v2 demo's 512-row chunk is 270336 B, by Triton and by the formula, and
  the config's check now names it before any GPU compiles it."""
  old = router.RouterConfig(block_e=16, block_k=64)              # what the chooser gave for D = 320 before
  with pytest.raises(ValueError, match="270336 B of shared memory"):    # route() refuses it when tracing
    lower_cuda(_route(V2, old), S((512, 320), jnp.bfloat16), S((16, 320), jnp.bfloat16), S((16,), jnp.float32))
  with monkeypatch.context() as m:                                      # lift the check to let Triton count it
    m.setattr(router, "SMEM_BYTES", 1 << 30)
    assert triton_smem(m, tmp_path, V2, 512, old) == 270336
  assert old.scores_smem(512, V2.hidden_size) == 270336
  with pytest.raises(ValueError, match=r"router_scores at T=512 .*D=320, E=16.*270336 B .* > 232448 B"):
    old.check(V2.hidden_size, V2.num_experts, V2.n_group, V2.topk_group, V2.num_experts_per_tok, t=512)


@pytest.mark.parametrize("cfg,t", [(V2, 512), (FLASH, 128)], ids=["v2-512", "flash-128"])
def test_chosen_config_fits_by_triton_count(monkeypatch, tmp_path, cfg, t):
  rc = chosen(cfg, t)
  smem = triton_smem(monkeypatch, tmp_path, cfg, t, rc)
  assert smem == rc.scores_smem(t, cfg.hidden_size) and smem <= LIMIT, (rc, smem)


@pytest.mark.parametrize("cfg", [V2, FLASH], ids=["v2", "flash"])
def test_every_server_row_count_fits(cfg):
  d, e = cfg.hidden_size, cfg.num_experts
  for t in SERVER_ROWS:
    rc = chosen(cfg, t)
    assert rc is not None and rc.scores_smem(t, d) <= LIMIT, (t, rc)
    rc.check(d, e, cfg.n_group, cfg.topk_group, cfg.num_experts_per_tok, t=t)


def test_choice_unchanged_where_the_defaults_fit():
  """Ling-size decode / verify (the measured kernels) and the v2 demo's small calls keep block_k up to 256 and
  4 stages; only the calls past the limit change."""
  for cfg, fitting, bk in ((FLASH, (1, 4, 8, 32, 64), 256), (V2, (1, 4, 32, 128, 256), 64)):
    for t in fitting:
      assert chosen(cfg, t) == router.RouterConfig(block_e=16, block_k=bk, segments=SEGMENTS), (cfg.name, t)
  assert chosen(V2, 512) == router.RouterConfig(block_e=16, block_k=64, num_stages=3, segments=SEGMENTS)
  assert chosen(FLASH, 128) == router.RouterConfig(block_e=16, block_k=256, num_stages=3, segments=SEGMENTS)


def test_no_fitting_tiling_routes_in_jnp():
  """T' = 8192 at D = 2560: even 2 stages of 16 columns are (8192 + 16) x 16 x 2 x 2 = 525 KB: no kernel."""
  assert chosen(FLASH, 8192) is None
