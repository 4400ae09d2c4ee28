"""Packed batches train like the same pairs one per row: equal loss sums with a real model."""

import functools

import numpy as np
import pytest
from testing import random_params, tiny_train_config

from transformer_jax import config as config_lib
from transformer_jax.data import batching, pipeline
from transformer_jax.model.transformer import Transformer
from transformer_jax.training import losses, train


@pytest.mark.slow  # 10-60 s on 2 cores: .ci/run runs it after the default suite
@pytest.mark.parametrize("source_len", [0, 16])  # 16: source rows shorter than target rows
def test_packed_batch_has_the_loss_of_its_pairs_unpacked(source_len):
  config = tiny_train_config()
  config.model.dropout_rate = 0.0
  dataset = pipeline.load_dataset(config)
  examples = dataset.splits["train"].examples[:200]
  length = config.data.max_len
  packed_iter = batching.BatchIterator(
      examples,
      seed=0,
      bucket_lengths=(length,),
      batch_size=8,
      packing=True,
      packed_source_len=source_len,
  )
  packed = next(packed_iter)
  assert packed["inputs"].shape == (8, source_len or length)
  # The pairs of the packed batch, one per row, in the same padded length.
  sources = packed["inputs"][packed["inputs_segmentation"] > 0]
  assert np.count_nonzero(sources == 1) > 8  # more pairs than rows: several a row
  pairs = []
  for r in range(8):
    for s in range(1, packed["inputs_segmentation"][r].max() + 1):
      src = packed["inputs"][r][packed["inputs_segmentation"][r] == s][:-1]
      tgt = packed["targets"][r][packed["targets_segmentation"][r] == s][:-1]
      pairs.append((src.tolist(), tgt.tolist()))
  alone = next(iter(batching.eval_batches(pairs, len(pairs), (length,))))
  alone.pop("index")

  model_config = config_lib.model_config(config, dataset.tokenizer.vocab_size)
  model = Transformer(model_config.replace(deterministic=True))
  params = random_params(model_config)
  loss = functools.partial(losses.sequence_loss, label_smoothing=0.1)  # the paper's (§5.4)
  packed_loss, packed_metrics = train.loss_and_metrics(params, packed, model=model, loss=loss)
  alone_loss, alone_metrics = train.loss_and_metrics(params, alone, model=model, loss=loss)
  assert packed_metrics["weight_sum"] == alone_metrics["weight_sum"]
  np.testing.assert_allclose(packed_loss, alone_loss, rtol=1e-5)
