"""Averages the last N checkpoints of a run (§6.1: 5 for base, 20 for big) into workdir/averaged.

  python -m transformer_jax.average --workdir DIR [--num 5]

`python -m transformer_jax.translate --workdir DIR --checkpoint avg` then translates with it.
"""

from __future__ import annotations

import logging
import sys

from absl import app, flags

from transformer_jax import checkpoint, cli, translate


def _define_flags():
  # Defined only when run as a program, so importing this module defines no flags.
  flags.DEFINE_string("workdir", None, "The training run's --workdir.")
  flags.DEFINE_integer("num", 5, "How many of the latest checkpoints to average.")


def average_workdir(workdir: str, num: int) -> list[int]:
  """Writes the average of the last `num` checkpoints to workdir/averaged; returns their steps."""
  _, _, trainer = translate.load_trainer(workdir)
  manager = checkpoint.make_manager(workdir, keep=max(num, 1), save_every=1)
  try:
    params, steps = checkpoint.average_params(manager, trainer.abstract_state(), num)
  finally:
    manager.close()
  checkpoint.save_averaged(workdir, params, steps)
  return steps


def main(argv):
  args = cli.workdir_args(argv)
  if args.num < 1:
    raise app.UsageError(f"--num={args.num}: must be >= 1")
  try:
    steps = average_workdir(args.workdir, args.num)
  except (FileNotFoundError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 1
  logging.info("averaged steps %s into %s/averaged", steps, args.workdir)
  return 0


if __name__ == "__main__":
  _define_flags()
  app.run(main)
