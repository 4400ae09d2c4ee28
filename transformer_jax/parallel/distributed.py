"""Joining a multi-process JAX job (`config.distributed`), before any other JAX call.

Every process runs the same command. After `jax.distributed.initialize`, `jax.devices()` lists
the devices of all processes, one jitted step runs across all of them, and each process feeds
only its own rows of the global batch (`BatchIterator(process_index=..., process_count=...)` and
`jax.make_array_from_process_local_data`). Process 0 alone writes logs, metrics and results;
Orbax checkpoints are written by all processes together, so `workdir` must be a filesystem every
process sees (NFS, GCS).

Where the job's layout comes from, per field left unset in the config:
  * Cloud TPU VMs, SLURM, Open MPI (mpirun), GKE: JAX detects all three fields itself;
  * `JAX_COORDINATOR_ADDRESS` in the environment stands for `coordinator_address`;
  * otherwise pass them, e.g. on two GPU hosts:
      python train.py ... --config.distributed.enabled=True \\
        --config.distributed.coordinator_address=host0:1234 \\
        --config.distributed.num_processes=2 --config.distributed.process_id=$RANK
"""

from __future__ import annotations

import logging

import jax
import ml_collections
import numpy as np


def initialize(config: ml_collections.ConfigDict) -> bool:
  """Calls `jax.distributed.initialize` as `config.distributed` says; True if this is (now) a
  multi-process job. A no-op when `distributed.enabled` is False or JAX is already initialized.
  """
  dist = config.distributed
  if not dist.enabled:
    return False
  if jax.distributed.is_initialized():
    return True
  kwargs = {}
  if dist.coordinator_address:
    kwargs["coordinator_address"] = dist.coordinator_address
  if dist.num_processes > 0:
    kwargs["num_processes"] = dist.num_processes
  if dist.process_id >= 0:
    kwargs["process_id"] = dist.process_id
  # CPU devices of different processes need a collectives library to all-reduce across processes
  # (the default, none, fails at the first cross-process step). Accelerators ignore this.
  jax.config.update("jax_cpu_collectives_implementation", dist.cpu_collectives)
  jax.distributed.initialize(**kwargs)
  logging.info(
      "distributed: process %d of %d, %d local / %d global devices",
      jax.process_index(),
      jax.process_count(),
      jax.local_device_count(),
      jax.device_count(),
  )
  return True


# ----------------------------------------------------------------------------- multi-host helpers
# Each is the single-process answer when there is one process, so callers need no branch.


def is_chief() -> bool:
  """Whether this is process 0, the one that writes logs, metrics, results and shared files."""
  return jax.process_index() == 0


def sync(tag: str) -> None:
  """Waits until every process reaches this point (e.g. after process 0 has written a file)."""
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices(tag)


def wait_for_chief(tag: str) -> None:
  """The other processes wait here for process 0 (which wrote what they are about to read)."""
  sync(tag)


def any_process(flag: bool) -> bool:
  """True on every process if `flag` is True on any of them."""
  if jax.process_count() == 1:
    return flag
  from jax.experimental import multihost_utils

  return bool(np.any(multihost_utils.process_allgather(np.asarray(flag))))


def chief_decides(flag: bool) -> bool:
  """Process 0's `flag` on every process: decisions from host clocks, which differ between hosts,
  must be the same everywhere or the next collective hangs."""
  if jax.process_count() == 1:
    return flag
  from jax.experimental import multihost_utils

  return bool(multihost_utils.broadcast_one_to_all(np.asarray(flag)))


def gather(x) -> np.ndarray:
  """A global jax.Array, or this process's rows of one, -> the whole array on every host."""
  if jax.process_count() == 1:
    return np.asarray(jax.device_get(x))
  from jax.experimental import multihost_utils

  return np.asarray(multihost_utils.process_allgather(x, tiled=True))
