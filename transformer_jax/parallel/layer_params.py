"""How a stack of layers runs, not what it computes: unrolled (`layer_0`, `layer_1`, ...) or
under nn.scan (`model.scan_layers`: one `layers` tree, [n, ...]), rematerialised or not
(`model.remat_policy`); and the parameter trees of the two layouts, converted both ways (a
checkpoint of either serves the other: export, decoding; tests compare the two)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from transformer_jax.parallel import sharding

# What a rematerialised layer keeps from its forward pass, for each of model/config.py's
# REMAT_POLICIES but "none": "full" only its inputs, "dots" every matmul output, "dots_no_batch"
# the weight matmuls (projections, FFN) while the attention scores [b, h, q, k] are recomputed.
REMAT_SAVEABLE = {
    "full": None,
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def apply_stack(layer_cls, cfg, attention, num_layers: int, args: tuple):
  """`num_layers` layers (`layer_cls(cfg, attention)`) applied in turn to args[0], the others
  shared: unrolled, or one layer under nn.scan (a fresh dropout key per layer); rematerialised
  under `cfg.remat_policy` (never in decode mode: no backward pass there)."""
  if cfg.remat_policy != "none" and not cfg.decode:
    # prevent_cse stops XLA from merging the recomputation back into the forward pass; inside
    # nn.scan the loop boundary already does that, and the flag would only block optimisations.
    policy = REMAT_SAVEABLE[cfg.remat_policy]
    layer_cls = nn.remat(layer_cls, policy=policy, prevent_cse=not cfg.scan_layers)
  if cfg.scan_layers:
    if cfg.decode:
      raise ValueError("a scanned stack decodes unrolled (decoding/decoder.py unstacks it)")
    scanned = nn.scan(
        layer_cls,
        variable_axes={"params": 0},
        split_rngs={"params": True, "dropout": True},
        in_axes=(nn.broadcast,) * (len(args) - 1),
        length=num_layers,
        metadata_params={nn.PARTITION_NAME: sharding.LAYERS},
    )
    return scanned(cfg, attention, scanned=True, name="layers")(*args)[0]
  x = args[0]
  for i in range(num_layers):
    x = layer_cls(cfg, attention, name=f"layer_{i}")(x, *args[1:])
  return x


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
