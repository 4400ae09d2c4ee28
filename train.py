"""Trains a Transformer: `python train.py --config configs/quickstart.py --workdir /tmp/qs`.

Any config leaf can be overridden: `--config.model.num_layers=2`. The workdir is the whole run:
config.json, vocabulary, checkpoints (resumed automatically), metrics.jsonl and results.json.
On SIGTERM (preemption) it saves a checkpoint at the next step and exits with status 143;
the same command resumes.
Multi-host: run the same command on every host with `--config.distributed.enabled=True`
(Cloud TPU VMs, SLURM and Open MPI detect the rest; elsewhere also pass
`--config.distributed.coordinator_address=HOST:PORT`, `--config.distributed.num_processes=N` and
`--config.distributed.process_id=I`); see transformer_jax/parallel/distributed.py.
"""

import logging
import sys

from absl import app, flags
from ml_collections import config_flags

from transformer_jax import cli

_CONFIG = config_flags.DEFINE_config_file(
    "config", "configs/quickstart.py", "Experiment config file.", lock_config=True
)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints, logs and results.")
flags.mark_flags_as_required(["workdir"])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  config = cli.config_value(_CONFIG)
  logging.getLogger().setLevel(logging.INFO)
  # Orbax logs every file it writes at INFO; keep the run's own log readable.
  logging.getLogger("absl").addFilter(
      lambda record: record.levelno >= logging.WARNING or "orbax" not in record.pathname
  )
  from transformer_jax.training import train  # after flag parsing: keeps --help fast
  from transformer_jax.training.preemption import EXIT_STATUS

  # A wrong config value, workdir or checkpoint is a UserError: cli.run reports it in one line.
  results = train.run(config, _WORKDIR.value)
  if results["stopped_by"] == "preemption":  # checkpointed; the same command resumes
    logging.warning("preempted at step %d; rerun the same command to resume", results["step"])
    sys.exit(EXIT_STATUS)


if __name__ == "__main__":
  cli.run(main)
