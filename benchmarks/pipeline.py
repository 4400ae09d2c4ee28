"""Input-pipeline throughput alone: tokenized corpus -> BatchIterator batches, no model.

Prints one JSON line: the one-time cost of reading, training the vocabulary and tokenizing, then
batches/s and non-PAD tokens/s (source + target) of the training iterator, with its padding
efficiency. A training step that takes longer than 1 / batches_per_s is not input-bound.

  python benchmarks/pipeline.py --config configs/multi30k.py --config.data.path=DIR
  python benchmarks/pipeline.py --config configs/quickstart.py --seconds=5

Without --workdir the vocabulary is trained in a temporary directory (so its cost is included);
with one, an existing workdir/vocab.model is reused, as a resumed run would.
"""

import json
import pathlib
import sys
import time

from absl import app, flags
from ml_collections import config_flags

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # run from anywhere

_CONFIG = config_flags.DEFINE_config_file(
    "config", "configs/multi30k.py", "Experiment config file.", lock_config=True
)
_WORKDIR = flags.DEFINE_string("workdir", None, "Reuse or store the vocabulary here.")
_SECONDS = flags.DEFINE_float("seconds", 10.0, "Time to draw batches for.")
_MAX_BATCHES = flags.DEFINE_integer("max_batches", 0, "Stop after this many batches (0: none).")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  import numpy as np

  from transformer_jax import config as config_lib
  from transformer_jax.data import batching, pipeline
  from transformer_jax.data.tokenizer import PAD_ID

  config = _CONFIG.value
  config_lib.validate(config)
  start = time.perf_counter()
  dataset = pipeline.load_dataset(config, _WORKDIR.value)
  load_seconds = time.perf_counter() - start

  start = time.perf_counter()
  train_iter = batching.BatchIterator(
      dataset.splits["train"].examples,
      seed=config.seed,
      bucket_lengths=dataset.bucket_lengths(config.data),
      tokens_per_batch=config.data.tokens_per_batch,
  )
  iterator_seconds = time.perf_counter() - start

  batches = real = padded = 0
  shapes = set()
  start = time.perf_counter()
  while True:
    batch = next(train_iter)
    batches += 1
    real += np.count_nonzero(batch["inputs"] != PAD_ID)
    real += np.count_nonzero(batch["targets"] != PAD_ID)
    padded += batch["inputs"].size + batch["targets"].size
    shapes.add(batch["inputs"].shape)
    elapsed = time.perf_counter() - start
    if elapsed >= _SECONDS.value or batches == _MAX_BATCHES.value:
      break

  print(
      json.dumps({
          "benchmark": "input_pipeline",
          "source": config.data.source,
          "train_pairs": len(dataset.splits["train"].pairs),
          "vocab_size": dataset.tokenizer.vocab_size,
          "load_seconds": round(load_seconds, 3),
          "read_and_vocabulary_seconds": round(dataset.seconds["read_and_vocabulary"], 3),
          "tokenize_seconds": round(dataset.seconds["tokenize"], 3),
          "iterator_init_seconds": round(iterator_seconds, 3),
          "batches": batches,
          "epochs": round(batches / train_iter.batches_per_epoch, 2),
          "seconds": round(elapsed, 3),
          "batches_per_s": round(batches / elapsed, 1),
          "tokens_per_s": round(real / elapsed),
          "padding_efficiency": round(real / padded, 4),
          "batch_shapes": len(shapes),
          "tokens_per_batch": config.data.tokens_per_batch,
      })
  )


if __name__ == "__main__":
  app.run(main)
