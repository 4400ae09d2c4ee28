"""Averages the last N checkpoints of a run (§6.1: 5 for base, 20 for big) into workdir/averaged.

  python -m transformer_jax.average --workdir DIR [--num 5]

`python -m transformer_jax.translate --workdir DIR --checkpoint avg` then translates with it.
"""

from __future__ import annotations

import logging

from absl import app, flags

from transformer_jax import cli, errors


def _define_flags():
  # Defined only when run as a program, so importing this module defines no flags.
  flags.DEFINE_string("workdir", None, "The training run's --workdir.")
  flags.DEFINE_integer("num", 5, "How many of the latest checkpoints to average.")


def average_workdir(workdir: str, num: int) -> list[int]:
  """Writes the average of the last `num` checkpoints to workdir/averaged; returns their steps.

  Reads the parameters of each checkpoint only (inference.restore_params), never the optimizer.
  """
  from transformer_jax import tasks
  from transformer_jax.data import pipeline
  from transformer_jax.parallel import sharding
  from transformer_jax.runs import checkpoint, inference, workdir_lock

  config = inference.load_config(workdir)
  try:
    tokenizer = pipeline.load_workdir_tokenizer(workdir)
  except (FileNotFoundError, ValueError) as e:
    raise errors.UserError(str(e)) from None
  model = tasks.get(config.task).build_model(config, tokenizer)  # the run's task's
  mesh = sharding.make_mesh(config.mesh)
  abstract = inference.abstract_params(model, sharding.replicated(mesh))
  # averaged/ is the run's own (its final evaluation writes it too), and a training run deletes
  # old checkpoints as it goes: averaging waits for no training on this workdir.
  with workdir_lock.hold(workdir, "average"):
    params, steps = inference.average_workdir_params(workdir, abstract, num)
    checkpoint.save_averaged(workdir, params, steps)
  return steps


def main(argv):
  args = cli.workdir_args(argv)
  if args.num < 1:
    raise app.UsageError(f"--num={args.num}: must be >= 1")
  steps = average_workdir(args.workdir, args.num)
  logging.info("averaged steps %s into %s/averaged", steps, args.workdir)
  return 0


if __name__ == "__main__":
  _define_flags()
  cli.run(main)
