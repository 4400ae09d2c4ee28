"""Orbax checkpoints of the whole run: train state plus the data iterator's position.

One checkpoint = `state` (step, params, optimizer state; sharded arrays written collectively by
every process) and `data` (a small JSON with the input pipeline's position), so a resumed run
sees exactly the batches an uninterrupted run would have seen. Orbax writes each step into a
temporary directory and renames it when complete, so an interrupted save is never restored.
"""

from __future__ import annotations

import json
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


def average_params(manager: ocp.CheckpointManager, abstract_state, num: int):
  """§6.1: the mean of the parameters of the last `num` checkpoints (5 for base, 20 for big).

  Returns (params, steps). Only the parameters are averaged; one checkpoint is held at a time
  besides the running sum, so memory stays at about twice the parameters plus one state.
  """
  steps = sorted(manager.all_steps())[-num:]
  if len(steps) < num:
    raise ValueError(
        f"asked to average {num} checkpoints but {manager.directory} holds {len(steps)} "
        f"({steps}); raise train.keep_checkpoints to keep enough"
    )
  total = None
  for step in steps:
    state, _ = restore(manager, abstract_state, step)
    params = jax.tree.map(lambda x: x.astype(jax.numpy.float32), state.params)
    total = params if total is None else jax.tree.map(jax.numpy.add, total, params)
  return jax.tree.map(lambda x: x / len(steps), total), steps


AVERAGED_DIR = "averaged"


def save_averaged(workdir: str, params, steps: list[int]) -> str:
  """Writes averaged parameters to `workdir/averaged` (replacing an older average)."""
  path = os.path.abspath(os.path.join(workdir, AVERAGED_DIR))
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(os.path.join(path, "params"), params, force=True)
  if jax.process_index() == 0:
    with open(os.path.join(path, "steps.json"), "w") as f:
      json.dump({"steps": [int(s) for s in steps]}, f)
  return path


def load_averaged(workdir: str, abstract_params):
  path = os.path.abspath(os.path.join(workdir, AVERAGED_DIR))
  if not os.path.isdir(os.path.join(path, "params")):
    raise FileNotFoundError(
        f"no averaged checkpoint in {path}: run `python -m transformer_jax.average "
        f"--workdir {workdir}` or train with train.average_last > 0"
    )
  with ocp.StandardCheckpointer() as checkpointer:
    return checkpointer.restore(os.path.join(path, "params"), abstract_params)
