"""Prepares a corpus ahead of training, on any CPU machine: vocabulary and tokenized splits.

  python -m transformer_jax.prepare_data --config configs/base.py \
      [--config.data.cache_dir=/shared/prepared] [--workdir /shared/runs/base]

Writes what `train.py` with the same config would otherwise prepare at its first start (see
data/prepared.py): with --workdir, into `prepared/` beside it (the default of
config.data.cache_dir) and the vocabulary into the workdir; without one, into config.data.cache_dir
or ~/.cache/transformer_jax/prepared. A prepared corpus is reused, so rerunning is cheap, and a
killed preparation is finished by the next one. Prints one JSON line: the directory, per split its
pairs and tokens, and the seconds spent.
"""

from __future__ import annotations

import json
import logging
import time

from absl import flags
from ml_collections import config_flags

from transformer_jax import cli

_CONFIG = config_flags.DEFINE_config_file(
    "config", "configs/base.py", "Experiment config file.", lock_config=True
)
_WORKDIR = flags.DEFINE_string(
    "workdir", None, "The run's workdir: gets the vocabulary; the cache defaults beside it."
)


def main(argv):
  from absl import app

  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  logging.getLogger().setLevel(logging.INFO)
  from transformer_jax import config as config_lib
  from transformer_jax.data import pipeline, prepared

  config = cli.config_value(_CONFIG)
  config_lib.validate(config)
  if config.data.source == "synthetic":
    raise config_lib.ConfigError(
        "config.data.source='synthetic' is generated in memory at every start; there is nothing "
        "to prepare. Use a config with the 'text' or 'tfds' source."
    )
  workdir = _WORKDIR.value
  if workdir is not None:
    cli.make_directory(workdir)
  cache_dir = config.data.cache_dir or pipeline.default_cache_dir(workdir)
  cli.make_directory(cache_dir, "config.data.cache_dir")
  start = time.perf_counter()
  sources = pipeline.split_sources(config)
  vocab_directory, missing = pipeline.prepare(config, workdir, cache_dir, sources=sources)
  splits = {}
  for key, source in sources.items():
    split = prepared.open_split(
        prepared.split_dir(vocab_directory, key, source), source, vocab_directory
    )
    splits[key] = {
        "pairs": split.manifest["num_pairs"],
        "tokens": split.manifest["num_tokens"],
        "directory": split.directory,
    }
  print(
      json.dumps(
          {
              "prepared": vocab_directory,
              "reused": not missing,
              "seconds": round(time.perf_counter() - start, 1),
              "splits": splits,
          }
      )
  )


if __name__ == "__main__":
  cli.run(main)
