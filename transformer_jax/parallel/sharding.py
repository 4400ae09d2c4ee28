"""Logical axis names, the device mesh, and the rules that map one onto the other.

Every parameter is annotated with logical axis names (declared once, here). A rules table maps
logical names to mesh axes; changing the rules (not the model) moves a run from pure data
parallelism to FSDP or tensor parallelism.

Mesh axes:
  data    pure data parallelism: the batch is split, parameters are replicated.
  fsdp    the batch is split too, and (with FSDP rules) parameters/optimizer state are sharded.
  tensor  tensor (model) parallelism over heads, the FFN hidden dimension and the vocabulary
          (Megatron-style: activations [batch, length, embed] stay whole on each tensor shard).

Rule sets (`config.sharding_rules`):
  data_parallel    parameters replicated; the batch over data x fsdp.
  fsdp             ZeRO-3 style: every parameter's embed dimension over fsdp (gathered for use,
                   gradients reduce-scattered by GSPMD), heads/mlp/vocab over tensor, so
                   `mesh={"fsdp": F, "tensor": T}` is 2-D FSDP x tensor parallelism.
  tensor_parallel  heads/mlp/vocab over tensor, embed replicated; the batch over data x fsdp.

Rules are applied in order and a mesh axis is used once per array, so an activation
[batch, length, embed] under FSDP rules gets (data+fsdp, -, -): the batch rule takes fsdp first.
A parameter dimension that does not divide by its mesh axes is replicated instead (see
`logical_to_shardings`), so e.g. an odd vocabulary still runs under tensor parallelism.

On several hosts the mesh is laid out from `jax.devices()` (ordered by process), so the outer
axes (data, then fsdp) span hosts and `tensor`, the innermost, stays within a host.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from transformer_jax import errors

# Logical axis names (parameters and activations).
BATCH = "batch"
LENGTH = "length"
EMBED = "embed"  # d_model
MLP = "mlp"  # d_ff
HEADS = "heads"
KV = "kv"  # d_k = d_v
VOCAB = "vocab"
LAYERS = "layers"  # the stacked-layer axis of `model.scan_layers` parameters

MESH_AXES = ("data", "fsdp", "tensor")

# Rules: logical name -> mesh axis (or tuple of axes, or None = replicated). Order matters: an
# earlier rule claims its mesh axis first (see the module docstring).
DATA_PARALLEL_RULES = (
    (BATCH, ("data", "fsdp")),
    (LENGTH, None),
    (EMBED, None),
    (MLP, None),
    (HEADS, None),
    (KV, None),
    (VOCAB, None),
    (LAYERS, None),
)
FSDP_RULES = (
    (BATCH, ("data", "fsdp")),
    (LENGTH, None),
    (EMBED, "fsdp"),
    (MLP, "tensor"),
    (HEADS, "tensor"),
    (KV, None),
    (VOCAB, "tensor"),
    (LAYERS, None),
)
TENSOR_PARALLEL_RULES = (
    (BATCH, ("data", "fsdp")),
    (LENGTH, None),
    (EMBED, None),
    (MLP, "tensor"),
    (HEADS, "tensor"),
    (KV, None),
    (VOCAB, "tensor"),
    (LAYERS, None),
)
RULES = {
    "data_parallel": DATA_PARALLEL_RULES,
    "fsdp": FSDP_RULES,
    "tensor_parallel": TENSOR_PARALLEL_RULES,
}


def make_mesh(mesh_shape: Mapping[str, int], devices: Sequence[jax.Device] | None = None) -> Mesh:
  """Builds a ('data', 'fsdp', 'tensor') mesh; one size may be -1 to take the remaining devices.

  A shape these devices cannot fill is the user's to fix (`--config.mesh.*`): a UserError.
  """
  devices = list(jax.devices() if devices is None else devices)
  unknown = set(mesh_shape) - set(MESH_AXES)
  if unknown:
    raise errors.UserError(f"config.mesh has unknown axes {sorted(unknown)}; expected {MESH_AXES}")
  sizes = [int(mesh_shape.get(axis, 1)) for axis in MESH_AXES]
  fill = [i for i, s in enumerate(sizes) if s == -1]
  if len(fill) > 1 or any(s == 0 or s < -1 for s in sizes):
    raise errors.UserError(
        f"config.mesh={dict(mesh_shape)}: sizes must be positive, at most one -1"
    )
  known = int(np.prod([s for s in sizes if s != -1]))
  if fill:
    if len(devices) % known:
      raise errors.UserError(
          f"config.mesh={dict(mesh_shape)}: {len(devices)} devices do not divide by {known}; "
          "set --config.mesh.* to sizes whose product divides the device count"
      )
    sizes[fill[0]] = len(devices) // known
  if int(np.prod(sizes)) != len(devices):
    raise errors.UserError(
        f"config.mesh={dict(mesh_shape)} needs {int(np.prod(sizes))} devices, "
        f"but {len(devices)} are available; set --config.mesh.* to fit them (-1 fills one axis)"
    )
  return Mesh(np.asarray(devices).reshape(sizes), MESH_AXES)


def get_rules(name: str):
  if name not in RULES:
    raise ValueError(f"config.sharding_rules={name!r}; expected one of {sorted(RULES)}")
  return RULES[name]


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Leading (batch) dimension split over data and fsdp; the rest replicated."""
  return NamedSharding(mesh, PartitionSpec(("data", "fsdp")))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, PartitionSpec())


def logical_to_shardings(abstract_tree, mesh: Mesh, rules):
  """Boxed (LogicallyPartitioned) abstract tree -> matching tree of NamedShardings.

  Leaves that carry no logical names (step counters, Adam's count) are replicated. A dimension
  whose size does not divide by the product of its mesh axes is replicated (jit cannot lay out
  uneven shards), with one log line per such parameter shape.
  """
  logical_specs = nn.get_partition_spec(abstract_tree)
  shapes = nn.unbox(abstract_tree)
  is_spec = lambda x: isinstance(x, PartitionSpec)  # noqa: E731

  def to_sharding(logical_spec, shape):
    spec = nn.logical_to_mesh_axes(tuple(logical_spec), rules) if logical_spec else PartitionSpec()
    return NamedSharding(mesh, fit_spec(spec, getattr(shape, "shape", ()), mesh))

  return jax.tree.map(to_sharding, logical_specs, shapes, is_leaf=is_spec)


def fit_spec(spec: PartitionSpec, shape: Sequence[int], mesh: Mesh) -> PartitionSpec:
  """Drops the mesh axes of every dimension of `shape` they do not divide evenly."""
  entries = list(spec) + [None] * (len(shape) - len(spec))
  fitted = []
  for size, axes in zip(shape, entries):
    names = (axes,) if isinstance(axes, str) else tuple(axes or ())
    shards = math.prod(mesh.shape[a] for a in names)
    if shards > 1 and size % shards:
      logging.info(
          "sharding: dimension %d of %s does not divide by %s=%d; replicated",
          size,
          tuple(shape),
          names,
          shards,
      )
      axes = None
    fitted.append(axes)
  return PartitionSpec(*fitted)
