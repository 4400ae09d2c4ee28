"""Orbax checkpoints of the whole run: train state plus the data iterator's position.

One checkpoint = `state` (step, params, optimizer state; sharded arrays written collectively by
every process) and `data` (a small JSON with the input pipeline's position), so a resumed run
sees exactly the batches an uninterrupted run would have seen. Orbax writes each step into a
temporary directory and renames it when complete, so an interrupted save is never restored.

A checkpoint that is complete but cannot be read (damaged bytes, a file lost in a copy, a
half-synced bucket) is set aside, not deleted: resuming restores the newest readable step and
moves the unreadable newer ones to `workdir/checkpoints.unreadable/`, where they can be inspected
or moved back.

Orbax does not check the bytes of the array chunks it reads back, so each checkpoint also holds
`digest.json`: the size and CRC-32 of every file of `state/` and `data/` (runs/digest.py), written
in Orbax's background thread once the files are written and before the step is committed. Every
restore checks the files against it first, and a checkpoint whose files differ is reported as
damaged (and, when resuming, set aside like an unreadable one). The averaged parameters carry
theirs in `averaged/steps.json`. Checkpoints written without such a record (before it was kept)
restore unverified, with a note saying so.
"""

from __future__ import annotations

import json
import logging
import os

import jax
import orbax.checkpoint as ocp
from etils import epath

from transformer_jax import errors, files
from transformer_jax.parallel import distributed
from transformer_jax.runs import digest

UNREADABLE_DIR = "checkpoints.unreadable"


class CheckpointError(errors.UserError):
  """A checkpoint that exists but cannot be restored; the message names the step and directory."""


class Manager(ocp.CheckpointManager):
  """Orbax's manager, with the digest of each step's files written before the step commits.

  Orbax calls `post_finalization_callback` on the primary process once every process has written
  and finalized the step, in its background thread, and commits the step (renames the temporary
  directory) after it; an error there leaves the step uncommitted and is raised by the next save
  or wait."""

  def __init__(self, directory: str, options: ocp.CheckpointManagerOptions, **kwargs):
    self.digest_step: int | None = None  # the step whose save is in flight
    options.async_options = ocp.AsyncOptions(post_finalization_callback=self._write_digest)
    super().__init__(directory, options=options, **kwargs)

  def save(self, step: int, *args, **kwargs) -> bool:
    self.wait_until_finished()  # as Orbax's save does first: one save in flight at a time
    self.digest_step = step
    return super().save(step, *args, **kwargs)

  def _write_digest(self) -> None:
    final = epath.Path(self.directory) / str(self.digest_step)
    # Before the commit, the step is in Orbax's temporary directory beside the final one
    # (renamed at the commit); where Orbax commits by a marker file instead (cloud buckets), it
    # is the final directory itself.
    temporary = final.parent / f"{final.name}{ocp.path.atomicity.TMP_DIR_SUFFIX}"
    step_dir = temporary if temporary.is_dir() else final
    if not step_dir.is_dir():
      raise CheckpointError(f"checkpoint step {self.digest_step}: no directory to record in")
    digest.write(step_dir, digest.record_files(step_dir, subdirectories=True))


def make_manager(workdir: str, *, keep: int, save_every: int) -> Manager:
  options = ocp.CheckpointManagerOptions(
      max_to_keep=keep,
      save_interval_steps=save_every,
      create=True,
  )
  return Manager(
      os.path.abspath(os.path.join(workdir, "checkpoints")),
      options=options,
      item_names=("state", "data"),
  )


def save(manager: ocp.CheckpointManager, step: int, state, data_state: dict, *, force=False):
  """Saves if `step` is on the interval (or `force`); returns whether a save started."""
  if not (force or manager.should_save(step)):
    return False
  return manager.save(
      step,
      args=ocp.args.Composite(
          state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state)
      ),
      force=force,
  )


def read_record(path) -> dict | None:
  """The digest record at `path` (a `digest.json`), or None when there is none (a checkpoint
  written before records were kept). A record that cannot be read is a CheckpointError."""
  path = epath.Path(path)
  if not path.exists():
    return None
  try:
    record = json.loads(path.read_text())
    if not digest.is_record(record):
      raise ValueError(f"not a format-{digest.FORMAT} digest record")
  except (ValueError, UnicodeDecodeError) as e:
    raise CheckpointError(
        f"{path} is damaged or cut short ({_first_line(e)}): the checkpoint cannot be verified; "
        "use an older checkpoint (--checkpoint STEP) or restore the file from a copy"
    ) from None
  return record


def verify(record: dict | None, directory, where: str) -> None:
  """Raises CheckpointError when the files under `directory` differ from `record` (written with
  them); `where` names the checkpoint in messages. `record` None: a one-line note, no check."""
  if record is None:
    logging.warning(
        "%s was written without a digest (by an older version): its values are not verified",
        where,
    )
    return
  bad = digest.damaged(directory, record["files"])
  if bad:
    listing = ", ".join(bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
    raise CheckpointError(
        f"{where} is damaged: {len(bad)} of its files differ from the digest written with them "
        f"({listing}). Use an older checkpoint (--checkpoint STEP) or restore the files from a "
        "copy"
    )


def verify_step(directory, step: int) -> None:
  """Checks the files of checkpoint `step` in the checkpoint directory `directory`."""
  step_dir = epath.Path(directory) / str(step)
  where = f"checkpoint step {step} in {directory}"
  verify(read_record(step_dir / digest.RECORD), step_dir, where)


def restore(manager: ocp.CheckpointManager, abstract_state, step: int | None = None):
  """Restores (state, data_state) at `step` (default: latest) into `abstract_state`'s shardings.

  `abstract_state` is a pytree of jax.ShapeDtypeStruct with `.sharding` set, so arrays come back
  already laid out on the current mesh (which may differ from the one that saved them).
  """
  step = manager.latest_step() if step is None else step
  if step is None:
    raise FileNotFoundError(f"no checkpoint in {manager.directory}")
  verify_step(manager.directory, step)  # before anything is read
  try:
    restored = manager.restore(
        step,
        args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()
        ),
    )
    data_state = restored["data"]
    if not isinstance(data_state, dict):
      raise ValueError(f"the data position is {type(data_state).__name__}, not a JSON object")
  # Orbax and TensorStore raise many types for bad bytes (ValueError, OSError, KeyError,
  # json.JSONDecodeError, ...): whatever it is, say which checkpoint it came from.
  except Exception as e:  # noqa: BLE001
    raise CheckpointError(
        f"checkpoint step {step} in {manager.directory} cannot be restored: "
        f"{type(e).__name__}: {_first_line(e)}"
    ) from e
  return restored["state"], data_state


def _first_line(error: Exception, limit: int = 300) -> str:
  text = str(error).strip().splitlines()
  return (text[0] if text else "")[:limit]


def restore_newest_readable(manager: ocp.CheckpointManager, abstract_state):
  """Resumes from the newest checkpoint that can be read; None when there is no checkpoint.

  Checkpoints newer than it that cannot be read are moved to `checkpoints.unreadable/<step>`
  beside the checkpoint directory, with a warning naming each one and its error, so that the
  manager neither lists them (averaging, `--checkpoint latest`) nor collides with them when
  training saves that step again. Nothing is moved unless an older checkpoint restores: when
  none does (a model that no longer matches them, say) the error lists every step and why, and
  the directory is left as it was. Every process takes the same decision.
  """
  failures: list[tuple[int, str]] = []
  for step in sorted(manager.all_steps(), reverse=True):
    try:
      restored, error = restore(manager, abstract_state, step), None
    except CheckpointError as e:
      restored, error = None, str(e)
    if distributed.any_process(error is not None) and error is None:
      error = f"checkpoint step {step} cannot be restored on another process"
    if error is None:
      if failures:
        _set_aside(manager, [s for s, _ in failures])
      return restored
    logging.error("%s", error)
    failures.append((step, error))
  if not failures:
    return None
  listing = "\n  ".join(error for _, error in failures)
  raise CheckpointError(
      f"none of the {len(failures)} checkpoints in {manager.directory} can be restored:\n  "
      f"{listing}\nNothing was moved or deleted. If the model or its vocabulary changed, "
      "use a new --workdir; otherwise the checkpoints are damaged."
  )


def _set_aside(manager: ocp.CheckpointManager, steps: list[int]):
  """Moves unreadable step directories out of the manager's view (process 0 moves them)."""
  directory = epath.Path(manager.directory)
  aside = directory.parent / UNREADABLE_DIR
  if distributed.is_chief():
    aside.mkdir(parents=True, exist_ok=True)
    for step in steps:
      target = aside / str(step)
      suffix = 1
      while target.exists():  # the same step may have been set aside before
        suffix += 1
        target = aside / f"{step}.{suffix}"
      (directory / str(step)).rename(target)
      logging.warning(
          "checkpoint step %d could not be read and was moved to %s; training resumes from "
          "an older step (move it back into %s to retry it)",
          step,
          target,
          directory,
      )
  distributed.sync("checkpoint.set_aside")
  manager.reload()


def abstract_like(tree, shardings):
  """ShapeDtypeStructs carrying the target shardings, for `restore`."""
  return jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings
  )


def average_manager_params(manager: ocp.CheckpointManager, abstract_state, num: int):
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
  return mean_params(steps, lambda step: restore(manager, abstract_state, step)[0].params), steps


def mean_params(steps: list[int], load_params):
  """The float32 mean of `load_params(step)` over `steps`, one checkpoint held at a time."""
  total = None
  for step in steps:
    params = jax.tree.map(lambda x: x.astype(jax.numpy.float32), load_params(step))
    total = params if total is None else jax.tree.map(jax.numpy.add, total, params)
  return jax.tree.map(lambda x: x / len(steps), total)


AVERAGED_DIR = "averaged"


def save_averaged(workdir: str, params, steps: list[int], selection: dict | None = None) -> str:
  """Writes averaged parameters to `workdir/averaged` (replacing an older average), and
  `steps.json`: the steps averaged, the digest of the parameters' files and, for an average
  chosen on validation (train.select_on_validation), `selection`: its metric, score and step."""
  path = os.path.abspath(os.path.join(workdir, AVERAGED_DIR))
  # An older average's record must not vouch for these parameters while they are written.
  stale = epath.Path(path) / "steps.json"
  if distributed.is_chief() and stale.exists():
    stale.unlink()
  distributed.sync("checkpoint.save_averaged")
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(os.path.join(path, "params"), params, force=True)
  if distributed.is_chief():
    record = {"steps": [int(s) for s in steps], "format": digest.FORMAT}
    if selection is not None:
      record["selection"] = selection
    record["files"] = digest.record_files(os.path.join(path, "params"))
    files.atomic_write(
        os.path.join(path, "steps.json"), lambda tmp: epath.Path(tmp).write_text(json.dumps(record))
    )
  return path


def load_averaged(workdir: str, abstract_params):
  """The averaged parameters, their files checked against the digest in `averaged/steps.json`."""
  path = os.path.abspath(os.path.join(workdir, AVERAGED_DIR))
  if not os.path.isdir(os.path.join(path, "params")):
    raise FileNotFoundError(
        f"no averaged checkpoint in {path}: run `python -m transformer_jax.average "
        f"--workdir {workdir}` or train with train.average_last > 0"
    )
  where = f"the averaged checkpoint {path}"
  record = averaged_record(workdir)
  verify(record if record and "files" in record else None, os.path.join(path, "params"), where)
  try:
    with ocp.StandardCheckpointer() as checkpointer:
      return checkpointer.restore(os.path.join(path, "params"), abstract_params)
  except Exception as e:  # noqa: BLE001 - as in `restore`: name the checkpoint, whatever it is
    raise CheckpointError(
        f"{where} cannot be restored: {type(e).__name__}: {_first_line(e)}"
    ) from e


def averaged_record(workdir: str) -> dict | None:
  """`averaged/steps.json` ({"steps": [...], and the digest}), or None when there is none.
  A record of an older format (no "files") has its steps and no digest."""
  path = os.path.join(os.path.abspath(workdir), AVERAGED_DIR, "steps.json")
  if not os.path.exists(path):
    return None
  try:
    record = json.loads(epath.Path(path).read_text())
    if not isinstance(record, dict) or not isinstance(record.get("steps"), list):
      raise ValueError("expected an object with a list of steps")
    if "files" in record and not digest.is_record(record):
      raise ValueError(f"its files are not a format-{digest.FORMAT} digest record")
  except (ValueError, UnicodeDecodeError) as e:
    raise CheckpointError(
        f"{path} is damaged or cut short ({_first_line(e)}): run `python -m "
        f"transformer_jax.average --workdir {workdir}` to average again"
    ) from None
  return record
