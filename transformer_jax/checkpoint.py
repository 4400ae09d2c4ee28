"""Orbax checkpoints of the whole run: train state plus the data iterator's position.

One checkpoint = `state` (step, params, optimizer state; sharded arrays written collectively by
every process) and `data` (a small JSON with the input pipeline's position), so a resumed run
sees exactly the batches an uninterrupted run would have seen. Orbax writes each step into a
temporary directory and renames it when complete, so an interrupted save is never restored.
"""

from __future__ import annotations

import os

import jax
import orbax.checkpoint as ocp


def make_manager(workdir: str, *, keep: int, save_every: int) -> ocp.CheckpointManager:
  options = ocp.CheckpointManagerOptions(
      max_to_keep=keep,
      save_interval_steps=save_every,
      create=True,
  )
  return ocp.CheckpointManager(
      os.path.abspath(os.path.join(workdir, "checkpoints")),
      options=options,
      item_names=("state", "data"),
  )


def save(manager: ocp.CheckpointManager, step: int, state, data_state: dict, *, force=False):
  """Saves if `step` is on the interval (or `force`); returns whether a save started."""
  return manager.save(
      step,
      args=ocp.args.Composite(
          state=ocp.args.StandardSave(state),
          data=ocp.args.JsonSave(data_state),
      ),
      force=force,
  )


def restore(manager: ocp.CheckpointManager, abstract_state, step: int | None = None):
  """Restores (state, data_state) at `step` (default: latest) into `abstract_state`'s shardings.

  `abstract_state` is a pytree of jax.ShapeDtypeStruct with `.sharding` set, so arrays come back
  already laid out on the current mesh (which may differ from the one that saved them).
  """
  step = manager.latest_step() if step is None else step
  if step is None:
    raise FileNotFoundError(f"no checkpoint in {manager.directory}")
  restored = manager.restore(
      step,
      args=ocp.args.Composite(
          state=ocp.args.StandardRestore(abstract_state),
          data=ocp.args.JsonRestore(),
      ),
  )
  return restored["state"], restored["data"]


def abstract_like(tree, shardings):
  """ShapeDtypeStructs carrying the target shardings, for `restore`."""
  return jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings
  )
