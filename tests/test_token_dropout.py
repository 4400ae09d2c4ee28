"""Token dropout of the translation task (translation.source_token_dropout and
target_token_dropout, off by default): pieces read as <unk> in training batches only."""

import functools

import jax
import numpy as np
import pytest

from transformer_jax import config as config_lib
from transformer_jax.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID
from transformer_jax.tasks import translation


def _batch(rows=64, length=64, vocab=500, seed=0):
  rng = np.random.default_rng(seed)
  inputs = rng.integers(4, vocab, (rows, length)).astype(np.int32)  # [b, L]
  targets = rng.integers(4, vocab, (rows, length)).astype(np.int32)  # [b, L]
  lengths = rng.integers(1, length, rows)  # [b]
  for row, n in enumerate(lengths):
    inputs[row, n - 1], inputs[row, n:] = EOS_ID, PAD_ID
    targets[row, n - 1], targets[row, n:] = EOS_ID, PAD_ID
  inputs[:, 0] = np.where(np.arange(rows) % 7 == 0, UNK_ID, inputs[:, 0])  # UNK in the data
  decoder_inputs = np.concatenate([np.full((rows, 1), BOS_ID), targets[:, :-1]], axis=1)
  decoder_inputs = np.where(targets == PAD_ID, PAD_ID, decoder_inputs).astype(np.int32)
  return {"inputs": inputs, "decoder_inputs": decoder_inputs, "targets": targets}


def test_each_piece_becomes_unk_with_its_sides_rate_and_reserved_ids_stay():
  batch = _batch()
  rates = {"inputs": 0.1, "decoder_inputs": 0.3}
  out = jax.jit(functools.partial(translation.drop_tokens, rates=rates))(
      batch, jax.random.PRNGKey(0)
  )
  out = {k: np.asarray(v) for k, v in out.items()}
  np.testing.assert_array_equal(out["targets"], batch["targets"])  # what the loss scores
  for key, rate in rates.items():
    before, after = batch[key], out[key]
    changed = before != after
    assert (after[changed] == UNK_ID).all()
    reserved = before <= UNK_ID  # PAD, EOS, BOS and UNK itself
    np.testing.assert_array_equal(after[reserved], before[reserved])
    candidates = int((~reserved).sum())
    fraction = changed.sum() / candidates
    # Binomial: within 5 standard deviations of the rate over ~2,000 pieces.
    assert abs(fraction - rate) < 5 * (rate * (1 - rate) / candidates) ** 0.5, (key, fraction)
  # Independent per occurrence and per side: the same id is dropped in one place, kept in another.
  dropped = set(batch["inputs"][batch["inputs"] != out["inputs"]].tolist())
  kept = set(batch["inputs"][batch["inputs"] == out["inputs"]].tolist())
  assert dropped & kept
  # The same key gives the same batch (an exact resume), another key another.
  again = translation.drop_tokens(batch, jax.random.PRNGKey(0), rates)
  np.testing.assert_array_equal(again["inputs"], out["inputs"])
  other = translation.drop_tokens(batch, jax.random.PRNGKey(1), rates)
  assert (np.asarray(other["inputs"]) != out["inputs"]).any()


def test_the_task_drops_only_the_sides_asked_for():
  config = config_lib.default_config()
  assert translation.TASK.batch_transform(config, None) is None  # the paper's: off
  config.translation.source_token_dropout = 0.2
  transform = translation.TASK.batch_transform(config, None)
  batch = _batch(seed=1)
  out = transform(batch, jax.random.PRNGKey(3))
  assert (np.asarray(out["inputs"]) != batch["inputs"]).any()
  np.testing.assert_array_equal(out["decoder_inputs"], batch["decoder_inputs"])
  source_only = out["inputs"]
  config.translation.source_token_dropout = 0.0
  config.translation.target_token_dropout = 0.2
  out = translation.TASK.batch_transform(config, None)(batch, jax.random.PRNGKey(3))
  np.testing.assert_array_equal(out["inputs"], batch["inputs"])
  assert (np.asarray(out["decoder_inputs"]) != batch["decoder_inputs"]).any()
  target_only = out["decoder_inputs"]
  # Each side's pieces are dropped alike whether or not the other side's are.
  config.translation.source_token_dropout = 0.2
  both = translation.TASK.batch_transform(config, None)(batch, jax.random.PRNGKey(3))
  np.testing.assert_array_equal(both["inputs"], source_only)
  np.testing.assert_array_equal(both["decoder_inputs"], target_only)


@pytest.mark.parametrize("key", ["source_token_dropout", "target_token_dropout"])
@pytest.mark.parametrize("rate", [1.0, -0.1])
def test_a_rate_outside_0_1_is_a_config_error_naming_the_key(key, rate):
  config = config_lib.default_config()
  config.translation[key] = rate
  with pytest.raises(config_lib.ConfigError, match=f"translation.{key}"):
    config_lib.validate(config)
