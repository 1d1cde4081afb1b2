"""Pallas GPU kernels, each beside a pure-jnp reference of the same signature.

Model code calls `pallas_kernels.dispatch.{moe, route, kda_verify, kda_commit}`: Pallas on GPU,
the reference elsewhere. (`moe` and `kda_verify` are also submodule names, so the package does
not re-export those two functions: `pallas_kernels.moe` stays the module.)
"""
from pallas_kernels import dispatch
from pallas_kernels.dispatch import Backend, conv_window_commit, kda_commit, route
from pallas_kernels.kda_verify import (KdaCommitInputs, KdaConfig, kda_commit_reference,
                                       kda_verify_reference)
from pallas_kernels.moe import MoeConfig, moe_reference
from pallas_kernels.router import route_reference

__all__ = [
    "Backend", "KdaCommitInputs", "KdaConfig", "MoeConfig", "conv_window_commit", "dispatch",
    "kda_commit", "kda_commit_reference", "kda_verify_reference", "moe_reference", "route",
    "route_reference",
]
