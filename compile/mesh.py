"""The device mesh: one axis "tp" over the local GPUs, or over every process's GPUs on several hosts.

    mesh = make_mesh(2)                                   # one host, 2 devices
    mesh = make_mesh(16, multi_host=True, coordinator="10.0.0.1:1234", num_processes=2, process_id=0)
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh

from compile.sharding import TP

def init_distributed(coordinator: str | None = None, num_processes: int | None = None,
                     process_id: int | None = None, local_device_ids=None) -> None:
    """`jax.distributed.initialize` once per process (before any other JAX call touches a device). Arguments
    left None are discovered from the environment (SLURM, Open MPI, or JAX_COORDINATOR_ADDRESS etc.)."""
    if jax.distributed.is_initialized():
        return
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                               process_id=process_id, local_device_ids=local_device_ids)


def barrier(name: str, timeout_s: float = 1800.0) -> None:
    """Wait until every process reaches `name` (the coordination service's barrier, not a device collective).
    Used before the first collective of a phase: gloo's CPU context gives a late peer only 30 s."""
    if jax.process_count() == 1:
        return
    from jax._src import distributed  # the public API has no barrier on the coordination service

    distributed.global_state.client.wait_at_barrier(name, int(timeout_s * 1000))


def make_mesh(tp_size: int, multi_host: bool = False, coordinator: str | None = None,
              num_processes: int | None = None, process_id: int | None = None, devices=None) -> Mesh:
    """A 1-D mesh ("tp",) of tp_size devices. multi_host: initialise jax.distributed first and span all
    processes' devices (tp_size must equal the global device count; the order keeps each host's devices
    adjacent, so the ring crosses hosts as rarely as possible)."""
    if multi_host:
        init_distributed(coordinator, num_processes, process_id)
    devs = list(devices) if devices is not None else jax.devices()
    if tp_size < 1 or tp_size > len(devs):
        raise ValueError(f"tp_size={tp_size} but {len(devs)} device(s) are visible "
                         f"({'all processes' if multi_host else 'this process'})")
    if multi_host and tp_size != len(devs):
        raise ValueError(f"multi-host meshes span every device: tp_size={tp_size} != {len(devs)}")
    devs = sorted(devs[:tp_size], key=lambda d: (d.process_index, d.id))
    return Mesh(np.array(devs), (TP,))
