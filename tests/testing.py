"""Helpers shared by the model-level tests."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax.model.transformer import Transformer


def random_params(config, seed=0, model=Transformer):
  """Random parameters (LayerNorm scales near 1) on the tree `jax.eval_shape(init)` of
  `model(config)` describes.

  Larger than the real init so every path matters, and nothing is compiled for initialisation.
  Parameter shapes do not depend on the batch, so a [1, 4] dummy input describes the tree.
  """
  inputs = np.ones((1, 4), np.int32)  # [1, 4], source and decoder inputs alike
  shapes = nn.unbox(jax.eval_shape(model(config).init, jax.random.key(0), inputs, inputs))
  rng = np.random.default_rng(seed)

  def fill(path, shape):
    value = 0.2 * rng.standard_normal(shape.shape)
    if path[-1].key == "scale":
      value += 1.0
    return jnp.asarray(value, shape.dtype)

  return jax.tree_util.tree_map_with_path(fill, shapes["params"])


def tiny_train_config():
  """The quickstart smoke config shrunk for tests: 1 layer, d_model 32, 400 synthetic pairs and a
  single bucket of 24 tokens (one compiled shape per step function)."""
  from configs import quickstart

  config = quickstart.get_config("smoke")
  config.model.d_model = 32
  config.model.num_heads = 4
  config.model.num_layers = 1
  config.model.d_ff = 64
  config.model.max_len = 32
  config.data.max_len = 24
  config.data.num_buckets = 1
  config.data.tokens_per_batch = 512
  config.data.synthetic_train_size = 400
  config.data.synthetic_eval_size = 16
  config.eval.batch_size = 16
  config.eval.num_sentences = 16
  config.train.warmup_steps = 10
  return config


def tiny_overrides() -> dict:
  """tiny_train_config as dotted keys ("model.d_model": 32, ...) over the quickstart smoke
  config: for runs configured from outside (train.py flags, the notebook's OVERRIDES)."""
  tiny = tiny_train_config().to_dict()
  return {
      f"{section}.{key}": value
      for section in ("model", "data", "eval", "train")
      for key, value in tiny[section].items()
      if value is not None  # an unset optional field (a placeholder) stays unset
  }


# Two Penn Treebank trees as the treebank writes them: an outer bracket, function tags, indices,
# empty elements (tests of tasks/parsing).
PTB = """
( (S
    (NP-SBJ-1 (NNP Mr.) (NNP Vinken) )
    (VP (VBZ is)
      (VP (VBN expected)
        (S (NP-SBJ (-NONE- *-1) )
          (VP (TO to) (VP (VB retire) (PRT (RP early)))))))
    (. .) ))
( (FRAG (NP (NN Nothing)) (SBAR (-NONE- 0) (S (-NONE- *T*-2))) (. .)) )
"""
