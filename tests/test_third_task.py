"""A third task added without editing a library file: reversing a sequence of symbols, scored by
exact match, defined here, registered by name and trained and evaluated through the same entry
as train.py (`training.train.run`), in a short run that learns it."""

import json
import os

import jax
import ml_collections
import numpy as np
import pytest

from transformer_jax import config as config_lib
from transformer_jax import tasks
from transformer_jax.data import pipeline
from transformer_jax.data.tokenizer import WordTokenizer
from transformer_jax.tasks import base
from transformer_jax.training import train


class ReversalTask(base.Task):
  """Source: 2-6 symbols; target: the same symbols in reverse order."""

  name = "reversal"
  sources = ("generated",)
  metric = "exact_match"

  def config_section(self):
    return ml_collections.ConfigDict({"symbols": 8, "seed": 0, "train_size": 3000, "eval_size": 64})

  def validate(self, config, check):
    check(2 <= config.reversal.symbols <= 26, "reversal.symbols", "must be in [2, 26]")

  def load_dataset(self, config, workdir, splits):
    r = config.reversal
    symbols = [chr(ord("a") + i) for i in range(r.symbols)]
    tokenizer = pipeline.word_tokenizer(WordTokenizer(symbols), workdir)  # kept in the workdir
    rng = np.random.default_rng(r.seed)
    sizes = {"test": r.eval_size, "eval": r.eval_size, "train": r.train_size}  # fixed order
    out = {}
    for key, size in sizes.items():
      sources = [" ".join(rng.choice(symbols, rng.integers(2, 7))) for _ in range(size)]
      pairs = [(s, " ".join(reversed(s.split()))) for s in sources]
      if key in splits:
        examples = [(tokenizer.encode(s), tokenizer.encode(t)) for s, t in pairs]
        out[key] = pipeline.Split(pairs, examples)
    return pipeline.Dataset(tokenizer, out)

  def scores(self, config, hypotheses, pairs):
    return {"exact_match": float(np.mean([h == t for h, (_, t) in zip(hypotheses, pairs)]))}

  def test_results(self, config, hypotheses, pairs, workdir):
    if workdir is not None:
      with open(os.path.join(workdir, "test_reversed.txt"), "w") as f:
        f.writelines(h + "\n" for h in hypotheses)
    return {f"test_{k}": v for k, v in self.scores(config, hypotheses, pairs).items()}


@pytest.fixture
def reversal():
  task = tasks.register(ReversalTask())
  yield task
  tasks.unregister(task.name)


def _config():
  config = config_lib.default_config("reversal")
  config.data.source = "generated"
  config.model.update(d_model=64, num_heads=4, num_layers=2, d_ff=128, max_len=16)
  config.model.dropout_rate = 0.0
  config.data.update(max_len=8, num_buckets=1, tokens_per_batch=1024, vocab_size=16)
  config.train.update(num_steps=300, warmup_steps=60, lr_multiplier=0.5, log_every=100)
  config.train.update(checkpoint_every=300, keep_checkpoints=1)
  config.eval.update(beam_size=1, batch_size=64, num_sentences=64)
  return config


@pytest.mark.slow  # ~30 s on 2 cores: .ci/run runs it after the default suite
def test_a_task_defined_outside_the_package_trains_and_scores_through_the_same_entry(
    reversal, tmp_path
):
  config = _config()
  config.reversal.symbols = 1
  with pytest.raises(config_lib.ConfigError, match=r"config.reversal.symbols=1: must be in"):
    config_lib.validate(config)  # the task's own checks run with every config's
  config.reversal.symbols = 8
  results = train.run(config, str(tmp_path), devices=jax.devices()[:1])
  assert results["step"] == 300 and results["test_sentences"] == 64
  assert results["test_exact_match"] >= 0.9, results  # it learned to reverse
  written = (tmp_path / "test_reversed.txt").read_text().splitlines()
  assert len(written) == 64
  saved = json.loads((tmp_path / "config.json").read_text())
  assert saved["task"] == "reversal" and saved["reversal"]["symbols"] == 8
  # The built-in commands refuse its run, in one line.
  with pytest.raises(tasks.UserError, match="is a reversal run .* no command decodes it"):
    tasks.check_command(str(tmp_path), "translate")
