"""Input-pipeline cost and throughput: prepared corpus -> BatchIterator batches, no model.

Prints one JSON line. The first call with a corpus prepares it (vocabulary + tokenized arrays in
config.data.cache_dir, default ~/.cache/transformer_jax/prepared here, as without a workdir);
later calls reuse it, as every training start, resume and host does:

  python benchmarks/pipeline.py --config configs/base.py --config.data.source=text \
      --config.data.path=DIR [--config.data.cache_dir=DIR] --seconds=5

Fields: train_pairs; prepare_seconds (0 when the cache was reused); open_seconds;
first_batch_seconds (from process start to the first batch in hand, imports included);
peak_rss_bytes (of this process: the data path's peak, preparation included when it ran; it
counts the pages of the memory-mapped corpus that batches touched), and the resident memory at
the end split into rss_anon_bytes and rss_file_bytes (those mapped pages);
cache_bytes (the prepared training split on disk); then batches_per_s, tokens_per_s (non-PAD
source + target tokens) and padding_efficiency of the training iterator over --seconds.

--compare_packing measures bucketing and packing in the same run, interleaved (--rounds rounds,
medians): each mode's padding efficiency and iterator tokens/s, and with --train_steps=N also the
target tokens/s of N jitted training steps of config.model on the CPU (compilation excluded).
"""

import json
import os
import pathlib
import resource
import statistics
import sys
import time

_START = time.time()  # replaced by the process's own start time when psutil can tell it

from absl import flags  # noqa: E402 (after _START: their import time counts)
from ml_collections import config_flags  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # run from anywhere

_CONFIG = config_flags.DEFINE_config_file(
    "config", "configs/multi30k.py", "Experiment config file.", lock_config=True
)
_WORKDIR = flags.DEFINE_string("workdir", None, "Reuse or store the vocabulary here.")
_SECONDS = flags.DEFINE_float("seconds", 10.0, "Time to draw batches for.")
_MAX_BATCHES = flags.DEFINE_integer("max_batches", 0, "Stop after this many batches (0: none).")
_BATCH_MULTIPLE = flags.DEFINE_integer(
    "batch_multiple", 8, "Global rows are a multiple of this (the data-parallel device count)."
)
_COMPARE = flags.DEFINE_bool("compare_packing", False, "Bucketing and packing, interleaved.")
_ROUNDS = flags.DEFINE_integer("rounds", 3, "Rounds of --compare_packing (medians reported).")
_TRAIN_STEPS = flags.DEFINE_integer(
    "train_steps", 0, "With --compare_packing: training steps a round per mode (0: none)."
)


def process_start() -> float:
  try:
    import psutil

    return psutil.Process().create_time()
  except ImportError:
    return _START


def peak_rss_bytes() -> int:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def rss_now() -> dict:
  """Resident memory now, split as /proc reports it: anonymous (the process's own) and file
  pages (here mostly the memory-mapped corpus: page cache, shared and reclaimable)."""
  out = {}
  try:
    with open("/proc/self/status") as f:
      for line in f:
        if line.startswith(("RssAnon:", "RssFile:")):
          out[line.split(":")[0]] = int(line.split()[1]) * 1024
  except OSError:
    pass
  return {"rss_anon_bytes": out.get("RssAnon"), "rss_file_bytes": out.get("RssFile")}


def dir_bytes(path: str) -> int:
  return sum(f.stat().st_size for f in pathlib.Path(path).rglob("*") if f.is_file())


def draw(train_iter, seconds: float, max_batches: int = 0) -> dict:
  """Batches for `seconds`: rate, non-PAD tokens/s and padding efficiency."""
  import numpy as np

  from transformer_jax.data.tokenizer import PAD_ID

  batches = real = padded = 0
  shapes = set()
  start = time.perf_counter()
  while True:
    batch = next(train_iter)
    batches += 1
    real += np.count_nonzero(batch["inputs"] != PAD_ID) + np.count_nonzero(
        batch["targets"] != PAD_ID
    )
    padded += batch["inputs"].size + batch["targets"].size
    shapes.add(batch["inputs"].shape)
    elapsed = time.perf_counter() - start
    if elapsed >= seconds or batches == max_batches:
      break
  return {
      "batches": batches,
      "seconds": round(elapsed, 3),
      "batches_per_s": round(batches / elapsed, 1),
      "tokens_per_s": round(real / elapsed),
      "padding_efficiency": round(real / padded, 4),
      "batch_shapes": len(shapes),
  }


def make_iterator(config, dataset, packing: bool):
  from transformer_jax.data import batching

  return batching.BatchIterator(
      dataset.splits["train"].examples,
      seed=config.seed,
      bucket_lengths=dataset.bucket_lengths(config.data),
      tokens_per_batch=config.data.tokens_per_batch,
      batch_multiple=_BATCH_MULTIPLE.value,
      packing=packing,
      packed_source_len=config.data.packed_source_len if packing else 0,
  )


def compare_packing(config, dataset) -> dict:
  """Bucketing vs packing, interleaved rounds: iterator figures and, optionally, train steps."""
  modes = {
      "bucketing": make_iterator(config, dataset, False),
      "packing": make_iterator(config, dataset, True),
  }
  trainer = state = rng = None
  if _TRAIN_STEPS.value:
    import jax

    from transformer_jax import config as config_lib
    from transformer_jax.training import train

    config.unlock()
    config.mesh = {"data": 1, "fsdp": 1, "tensor": 1}
    trainer = train.Trainer(
        config,
        config_lib.model_config(config, dataset.tokenizer.vocab_size),
        devices=jax.devices()[:1],
    )
    state, rng = trainer.init_state(config.seed), jax.random.PRNGKey(0)
    compiled = set()

  per_round = {name: [] for name in modes}
  for _ in range(_ROUNDS.value):
    for name, it in modes.items():
      figures = draw(it, _SECONDS.value, _MAX_BATCHES.value)
      if trainer is not None:
        batches = [next(it) for _ in range(_TRAIN_STEPS.value)]
        for batch in batches:  # compile every shape outside the timing
          key = (tuple(batch["inputs"].shape), "inputs_segmentation" in batch)
          if key not in compiled:
            state, _ = trainer.train_step(state, batch, rng)
            jax.block_until_ready(state)
            compiled.add(key)
        start = time.perf_counter()
        target_tokens = 0
        for batch in batches:
          state, _ = trainer.train_step(state, batch, rng)
          target_tokens += int((batch["targets"] != 0).sum())
        jax.block_until_ready(state)
        figures["train_target_tokens_per_s"] = round(target_tokens / (time.perf_counter() - start))
      per_round[name].append(figures)
  out = {}
  for name, rounds in per_round.items():
    keys = [k for k in rounds[0] if k not in ("batches", "seconds", "batch_shapes")]
    out[name] = {k: statistics.median(r[k] for r in rounds) for k in keys}
    out[name]["rows_per_bucket"] = {str(k): v for k, v in modes[name].rows_per_bucket.items()}
  return out


def main(argv):
  from absl import app

  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  from transformer_jax import config as config_lib
  from transformer_jax.data import pipeline

  config = _CONFIG.value
  config_lib.validate(config)
  workdir = _WORKDIR.value
  if config.data.source != "synthetic" and not config.data.cache_dir:
    config.unlock()
    config.data.cache_dir = pipeline.default_cache_dir(workdir)
  start = time.perf_counter()
  dataset = pipeline.load_dataset(config, workdir, splits=("train",))
  load_seconds = time.perf_counter() - start

  init_start = time.perf_counter()
  train_iter = make_iterator(config, dataset, config.data.get("packing", False))
  iterator_seconds = time.perf_counter() - init_start
  first = next(train_iter)
  first_batch_seconds = time.time() - process_start()
  del first
  figures = draw(train_iter, _SECONDS.value, _MAX_BATCHES.value)
  split_dir = None
  if dataset.cache_dir:
    split_dir = os.path.dirname(dataset.splits["train"].examples.source.tokens.filename)
  record = {
      "benchmark": "input_pipeline",
      "source": config.data.source,
      "packing": bool(config.data.get("packing", False)),
      "train_pairs": len(dataset.splits["train"].examples),
      "vocab_size": dataset.tokenizer.vocab_size,
      "prepare_seconds": round(dataset.seconds["prepare"], 3),
      "open_seconds": round(dataset.seconds["open"], 3),
      "load_seconds": round(load_seconds, 3),
      "iterator_init_seconds": round(iterator_seconds, 3),
      "first_batch_seconds": round(first_batch_seconds, 3),
      "peak_rss_bytes": peak_rss_bytes(),
      **rss_now(),
      "cache_bytes": dir_bytes(split_dir) if split_dir else 0,
      **figures,
      "epochs": round(figures["batches"] / train_iter.batches_per_epoch, 3),
      "rows_per_bucket": {str(k): v for k, v in train_iter.rows_per_bucket.items()},
      "tokens_per_batch": config.data.tokens_per_batch,
  }
  if _COMPARE.value:
    record["compare"] = compare_packing(config, dataset)
  print(json.dumps(record))


if __name__ == "__main__":
  from transformer_jax import cli

  cli.run(main)
