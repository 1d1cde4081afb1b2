"""Each Pallas kernel lowers for CUDA (H200) on a CPU-only machine at full Ling-3.0-flash shapes
(ShapeDtypeStruct inputs, nothing allocated). The abstract mesh names the target GPU."""
import jax.numpy as jnp
import pytest

from pallas_kernels.kda_verify import KdaRows, kda_commit, kda_verify
from pallas_kernels.moe import moe
from tests import cuda_lowering
from tests.cuda_lowering import S

BF, F32, I32 = jnp.bfloat16, jnp.float32, jnp.int32
D, E, I, A = 2560, 512, 768, 8
H, DK, W = 32, 128, 4
HD = H * DK


def lower_cuda(f, *args):
  text = cuda_lowering.lower_cuda(f, *args)
  assert "__gpu$xla.gpu.triton" in text
  return text


@pytest.mark.parametrize("t", [1, 6, 17])
def test_moe_lowers_for_cuda(t):
  args = (S((t, D), BF), S((t, A), I32), S((t, A), F32), S((E, I, D), BF), S((E, I, D), BF),
          S((E, D, I), BF))
  sh = (S((I, D), BF), S((I, D), BF), S((D, I), BF))
  text = lower_cuda(lambda *a: moe(*a[:6], limit=4.0, shared=a[6:], shared_limit=5.0),
                    *args, *sh)
  assert text.count("__gpu$xla.gpu.triton") == 2          # up and down kernels


@pytest.mark.parametrize("t", [1, 6, 17])
def test_kda_lowers_for_cuda(t):
  """Verify (the first layer's: rows allocated; a later one's: rows aliased in place) and the all-layer commit,
  on the model's stacked states (35 KDA layers)."""
  n_layers = 35
  args = (S((1, t, 5, HD), BF), S((1, t, H), BF), S((H,), F32), S((HD,), F32), S((3, HD, 1, W), BF),
          S((n_layers, 1, W - 1, 3, HD), BF), S((n_layers, 1, H, DK, DK), F32), S((), I32))
  rows = KdaRows(S((n_layers, 1, t, 3, HD), BF), S((n_layers, 1, t, H, DK), F32), S((n_layers, 1, t, H, DK), F32),
                 S((n_layers, 1, t, H, DK), F32), S((n_layers, 1, t, H), F32))
  lower_cuda(kda_verify, *args)
  lower_cuda(kda_verify, *args, rows)
  lower_cuda(kda_commit, args[6], args[5], rows, S((1,), I32))
