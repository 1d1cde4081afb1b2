"""Lowering a Pallas kernel for CUDA on a CPU-only machine: an abstract mesh names the target GPU (an H200), and
`.lower(lowering_platforms=("cuda",))` runs the whole Pallas -> Triton / Mosaic GPU pipeline with nothing
allocated (arguments are ShapeDtypeStructs)."""
import jax
import pytest
from jax.sharding import AbstractDevice, AbstractMesh

S = jax.ShapeDtypeStruct
H200 = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(
    device_kind="NVIDIA H200", num_cores=132, platform="cuda"))


def lower_cuda(f, *args) -> str:
  """The StableHLO text of jit(f) lowered for CUDA at the abstract args."""
  with jax.sharding.use_abstract_mesh(H200):
    return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def compile_only_h200():
  """A compile-only H200 (the CUDA PJRT plugin's compiler, no driver: bench/census_offline.py), or skip."""
  try:
    from bench.census_offline import compile_only_devices
    return compile_only_devices("h200", 1)[0]
  except (ImportError, SystemExit, RuntimeError) as e:
    pytest.skip(f"no compile-only CUDA target (the CUDA PJRT plugin on PYTHONPATH: scripts/setup_census.sh): {e}")
