"""Lowering a Pallas kernel for CUDA on a CPU-only machine: an abstract mesh names the target GPU (an H200), and
`.lower(lowering_platforms=("cuda",))` runs the whole Pallas -> Triton / Mosaic GPU pipeline with nothing
allocated (arguments are ShapeDtypeStructs)."""
import jax
from jax.sharding import AbstractDevice, AbstractMesh

S = jax.ShapeDtypeStruct
H200 = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(
    device_kind="NVIDIA H200", num_cores=132, platform="cuda"))


def lower_cuda(f, *args) -> str:
  """The StableHLO text of jit(f) lowered for CUDA at the abstract args."""
  with jax.sharding.use_abstract_mesh(H200):
    return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
