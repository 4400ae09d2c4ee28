"""Logical axis names, the device mesh, and the rules that map one onto the other.

Every parameter is annotated with logical axis names (declared once, here). A rules table maps
logical names to mesh axes; changing the rules (not the model) moves a run from pure data
parallelism to FSDP or tensor parallelism.

Mesh axes:
  data    pure data parallelism: the batch is split, parameters are replicated.
  fsdp    the batch is split too, and (with FSDP rules) parameters/optimizer state are sharded.
  tensor  tensor (model) parallelism over heads and the FFN hidden dimension.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

# Logical axis names (parameters and activations).
BATCH = "batch"
LENGTH = "length"
EMBED = "embed"  # d_model
MLP = "mlp"  # d_ff
HEADS = "heads"
KV = "kv"  # d_k = d_v
VOCAB = "vocab"

MESH_AXES = ("data", "fsdp", "tensor")

# Rules: logical name -> mesh axis (or tuple of axes, or None = replicated).
DATA_PARALLEL_RULES = (
    (BATCH, ("data", "fsdp")),
    (LENGTH, None),
    (EMBED, None),
    (MLP, None),
    (HEADS, None),
    (KV, None),
    (VOCAB, None),
)
FSDP_RULES = (
    (BATCH, ("data", "fsdp")),
    (LENGTH, None),
    (EMBED, "fsdp"),
    (MLP, "tensor"),
    (HEADS, "tensor"),
    (KV, None),
    (VOCAB, "tensor"),
)
RULES = {"data_parallel": DATA_PARALLEL_RULES, "fsdp": FSDP_RULES}


def make_mesh(mesh_shape: Mapping[str, int], devices: Sequence[jax.Device] | None = None) -> Mesh:
  """Builds a ('data', 'fsdp', 'tensor') mesh; one size may be -1 to take the remaining devices."""
  devices = list(jax.devices() if devices is None else devices)
  unknown = set(mesh_shape) - set(MESH_AXES)
  if unknown:
    raise ValueError(f"config.mesh has unknown axes {sorted(unknown)}; expected {MESH_AXES}")
  sizes = [int(mesh_shape.get(axis, 1)) for axis in MESH_AXES]
  fill = [i for i, s in enumerate(sizes) if s == -1]
  if len(fill) > 1 or any(s == 0 or s < -1 for s in sizes):
    raise ValueError(f"config.mesh={dict(mesh_shape)}: sizes must be positive, at most one -1")
  known = int(np.prod([s for s in sizes if s != -1]))
  if fill:
    if len(devices) % known:
      raise ValueError(
          f"config.mesh={dict(mesh_shape)}: {len(devices)} devices do not divide by {known}"
      )
    sizes[fill[0]] = len(devices) // known
  if int(np.prod(sizes)) != len(devices):
    raise ValueError(
        f"config.mesh={dict(mesh_shape)} needs {int(np.prod(sizes))} devices, "
        f"but {len(devices)} are available"
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

  Leaves that carry no logical names (step counters, Adam's count) are replicated.
  """
  specs = nn.get_partition_spec(abstract_tree)
  return nn.logical_to_mesh_sharding(specs, mesh, rules)
