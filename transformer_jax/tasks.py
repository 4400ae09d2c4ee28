"""Which task a run trains, and which command decodes its outputs.

A run's task follows from its saved config: `data.source="ptb"` (Penn Treebank trees, §6.3) is
parsing, every other source translation. Each task has one command; a command given another
task's run refuses it in one line that names the right command, before anything is loaded.
Plain Python (no JAX), so a refusal costs no start-up.
"""

from __future__ import annotations

import json
import os

from transformer_jax.errors import UserError

COMMANDS = {"translation": "translate", "parsing": "parse"}  # task -> its decoding command


def task_of(config) -> str:
  """The task of a run's config (a ConfigDict or the dict read from its config.json)."""
  return "parsing" if config["data"]["source"] == "ptb" else "translation"


def check_command(workdir: str, command: str) -> None:
  """A UserError naming the right command unless `command` decodes the run in `workdir`. A
  workdir without a readable config.json passes: loading the run reports that."""
  try:
    with open(os.path.join(workdir, "config.json")) as f:
      config = json.load(f)
    source = config["data"]["source"]
  except (OSError, ValueError, KeyError, TypeError):
    return
  task = task_of(config)
  if COMMANDS[task] != command:
    wanted = next(t for t, c in COMMANDS.items() if c == command)
    raise UserError(
        f"--workdir={workdir} is a {task} run (data.source={source!r}), not a {wanted} run: "
        f"use python -m transformer_jax.{COMMANDS[task]} for it"
    )
