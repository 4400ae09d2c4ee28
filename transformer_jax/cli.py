"""What the command-line programs share: one way to report a user's mistake, and workdir flags.

Every program's `if __name__ == "__main__":` calls `cli.run(main)` instead of `absl.app.run`.
A `errors.UserError` (ConfigError, CheckpointError and CorpusError are ones) raised anywhere
below `main` then ends the program with one line on stderr, `error: <message>`, and status 1;
a wrong flag stays absl's `app.UsageError` (usage text, status 1).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable

from absl import app, flags

from transformer_jax.errors import UserError


def run(main: Callable[[list[str]], object]) -> None:
  """`absl.app.run(main)`, with a UserError reported as `error: ...` and exit status 1."""

  def guarded(argv):
    try:
      return main(argv)
    except UserError as e:
      sys.exit(f"error: {e}")

  app.run(guarded)


def workdir_args(argv: list[str], required: str = "workdir") -> flags.FlagValues:
  """The parsed flags, after checking there are no stray arguments and --`required` is given."""
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  args = flags.FLAGS
  if not getattr(args, required):
    raise app.UsageError(f"--{required} is required")
  logging.getLogger().setLevel(logging.INFO)
  return args
