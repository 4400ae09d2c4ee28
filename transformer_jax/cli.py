"""What the command-line tools that act on a training run's --workdir share."""

from __future__ import annotations

import logging

from absl import app, flags


def workdir_args(argv: list[str], required: str = "workdir") -> flags.FlagValues:
  """The parsed flags, after checking there are no stray arguments and --`required` is given."""
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  args = flags.FLAGS
  if not getattr(args, required):
    raise app.UsageError(f"--{required} is required")
  logging.getLogger().setLevel(logging.INFO)
  return args
