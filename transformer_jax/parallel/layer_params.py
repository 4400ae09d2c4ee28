"""Parameter trees of a scanned stack (`model.scan_layers`: `layers`, [n, ...]) and of the same
stack unrolled (`layer_0`, `layer_1`, ...), converted both ways: a checkpoint of either layout
serves the other (export, decoding), and tests compare the two."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from transformer_jax.parallel import sharding


def _is_boxed(x) -> bool:
  return isinstance(x, nn.LogicallyPartitioned)


def _stack(*xs):
  """Stacks layer values on a new leading axis; boxed values get the logical name "layers"."""
  if _is_boxed(xs[0]):
    return xs[0].replace(
        value=jnp.stack([x.value for x in xs]), names=(sharding.LAYERS, *xs[0].names)
    )
  return jnp.stack(xs)


def _index(x, i: int):
  if _is_boxed(x):
    return x.replace(value=x.value[i], names=x.names[1:])
  return x[i]


def stack_layer_params(params):
  """Unrolled parameters (`layer_0`, `layer_1`, ... under a stack) -> scanned (`layers`, [n, ...]).

  Works on any (sub)tree: every dict holding `layer_0` is converted; other entries are kept.
  """
  if not isinstance(params, dict) and not hasattr(params, "items"):
    return params
  params = dict(params)
  if "layer_0" in params:
    n = sum(1 for k in params if k.startswith("layer_"))
    layers = [params.pop(f"layer_{i}") for i in range(n)]
    params["layers"] = jax.tree.map(_stack, *layers, is_leaf=_is_boxed)  # [n, ...]
  return {k: stack_layer_params(v) for k, v in params.items()}


def unstack_layer_params(params):
  """Scanned parameters (`layers`, [n, ...]) -> unrolled (`layer_0`, ...); inverse of the above."""
  if not isinstance(params, dict) and not hasattr(params, "items"):
    return params
  params = dict(params)
  if "layers" in params:
    stacked = params.pop("layers")
    n = jax.tree.leaves(stacked)[0].shape[0]
    for i in range(n):
      params[f"layer_{i}"] = jax.tree.map(lambda x, i=i: _index(x, i), stacked, is_leaf=_is_boxed)
  return {k: unstack_layer_params(v) for k, v in params.items()}
