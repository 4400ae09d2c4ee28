"""Tasks: what differs between translation, parsing (§6.3) and any task added to them.

A task (`base.Task`) supplies through one small interface what the generic code leaves open:
its config section and checks, reading its data and vocabulary, a transform of training
batches, a variant of the loss, the search's constraint, how outputs are scored and which test
outputs are written, and the command that decodes its runs. `config.task` names it; the model,
the training loop, decoding, checkpointing and batching name no task.

  task = tasks.get(config.task)   # "translation", "parsing", or one registered:
  tasks.register(MyTask())        # a task defined outside the package (a fork, a test)

Built-in tasks are imported when first asked for, so translating imports no parsing code, and
this module imports nothing heavy: a command refuses another task's run before JAX starts.
"""

from __future__ import annotations

import importlib
import json
import os
from typing import Any

from transformer_jax import files
from transformer_jax.errors import UserError

Task = Any  # a tasks.base.Task (not imported here: the base imports the modules that import this)

# name -> (module defining TASK, the command that decodes its runs)
BUILTIN = {
    "translation": ("transformer_jax.tasks.translation", "translate"),
    "parsing": ("transformer_jax.tasks.parsing.task", "parse"),
}
_registered: dict[str, Task] = {}


def register(task: Task) -> Task:
  """Makes `task` available as `config.task = task.name` (replacing one of the same name)."""
  if not task.name:
    raise ValueError(f"{type(task).__name__} has no name")
  _registered[task.name] = task
  return task


def unregister(name: str) -> None:
  """Forgets a task registered with `register` (a built-in one is imported again when asked)."""
  _registered.pop(name, None)


def names() -> list[str]:
  return sorted(set(BUILTIN) | set(_registered))


def get(name: str) -> Task:
  """The task called `name`; a UserError naming the known ones for any other."""
  if name not in _registered:
    if name not in BUILTIN:
      raise UserError(f"config.task={name!r}: expected one of {names()}")
    _registered[name] = importlib.import_module(BUILTIN[name][0]).TASK
  return _registered[name]


def command_of(name: str) -> str | None:
  """The command that decodes runs of task `name` (None: none has one)."""
  if name in BUILTIN:
    return BUILTIN[name][1]
  return _registered[name].command if name in _registered else None


def saved_task(saved: dict) -> str:
  """The task of a run's saved config (a dict): its `task`, or for a config.json written before
  configs named their task, parsing for the ptb source and translation for any other."""
  if saved.get("task"):
    return saved["task"]
  return "parsing" if saved.get("data", {}).get("source") == "ptb" else "translation"


# Keys of a parsing run that lived in the generic sections before the parsing task had its own
# section: (section, key) then -> (task section, key) now.
LEGACY_KEYS = {
    ("data", "tree_closing"): ("parsing", "tree_closing"),
    ("data", "tree_words"): ("parsing", "tree_words"),
    ("data", "tree_order"): ("parsing", "tree_order"),
    ("data", "word_dropout"): ("parsing", "word_dropout"),
    ("train", "word_loss"): ("parsing", "word_loss"),
    ("eval", "tree_constraints"): ("parsing", "tree_constraints"),
}


def saved_layout(saved: dict) -> dict:
  """A copy of a run's saved config (a dict) in today's layout: its `task` named (`saved_task`),
  and each key an older layout kept in a generic section (LEGACY_KEYS) moved to its task's
  section, or dropped from a run of another task (which saved it at its default)."""
  saved = json.loads(json.dumps(saved))  # a deep copy, to move keys in
  saved["task"] = task = saved_task(saved)
  for (section, key), (new_section, new_key) in LEGACY_KEYS.items():
    if key in saved.get(section, {}):
      value = saved[section].pop(key)
      if task == new_section:
        saved.setdefault(new_section, {})[new_key] = value
  return saved


def check_command(workdir: str, command: str) -> None:
  """A UserError naming the right command unless `command` decodes the run in `workdir`. A
  workdir without a readable config.json passes: loading the run reports that."""
  try:
    saved = files.read_json(os.path.join(workdir, "config.json"))
    task, source = saved_task(saved), saved["data"]["source"]
  except (UserError, KeyError, TypeError, AttributeError):
    return
  if command_of(task) != command:
    wanted = next((t for t, (_, c) in BUILTIN.items() if c == command), command)
    right = command_of(task)
    use = f"use python -m transformer_jax.{right} for it" if right else "no command decodes it"
    raise UserError(
        f"--workdir={workdir} is a {task} run (data.source={source!r}), not a {wanted} run: {use}"
    )
