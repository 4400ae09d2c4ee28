"""Helpers shared by the model-level tests."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax.model import Transformer


def random_params(config, seed=0):
  """Random parameters (LayerNorm scales near 1) on the tree `jax.eval_shape(init)` describes.

  Larger than the real init so every path matters, and nothing is compiled for initialisation.
  Parameter shapes do not depend on the batch, so a [1, 4] dummy input describes the tree.
  """
  dummy = np.ones((1, 4), np.int32)
  shapes = nn.unbox(jax.eval_shape(Transformer(config).init, jax.random.key(0), dummy, dummy))
  rng = np.random.default_rng(seed)

  def fill(path, shape):
    value = 0.2 * rng.standard_normal(shape.shape)
    if path[-1].key == "scale":
      value += 1.0
    return jnp.asarray(value, shape.dtype)

  return jax.tree_util.tree_map_with_path(fill, shapes["params"])
