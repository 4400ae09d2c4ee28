"""Digests of a checkpoint's values: what was saved is what is restored, or the restore says so.

Orbax and TensorStore check the structure of a checkpoint (its metadata, its shard indices) but
not the bytes of the arrays: a flipped byte in a data file restores as a different number,
silently. So every checkpoint carries, committed with it, a digest of each array's values, and
each restore recomputes it and compares.

A digest is two 32-bit sums over the array's elements taken as unsigned words, each word
weighted by its position (row-major index i): Σ wᵢ·(2i+1) and Σ fmix32(wᵢ ⊕ i·φ) (fmix32 is
MurmurHash3's finalizer, φ the golden-ratio constant). Integer addition modulo 2³² is associative
and commutative, so the value is exact and the same on any backend, mesh, sharding or reduction
order: a run resumed elastically on other devices checks against the digest of the run that
saved it. The first sum changes with any single changed word (its weights are odd, so invertible
modulo 2³²); the second, nonlinear in the word, makes a cancellation between several changes as
unlikely as a 64-bit collision. It detects damage, not tampering (it is not cryptographic).

Each shard of an array is reduced on its own device, by one small jitted program per shard shape
and dtype, and the sums are added up on the host (across processes in a multi-host run): no
array is gathered, and the arrays of a model share a handful of programs.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

_PHI = 0x9E3779B9
_MIX1, _MIX2 = 0x85EBCA6B, 0xC2B2AE35


def path_name(path) -> str:
  """A leaf's key path as "params/encoder/layer_0/kernel": from the keys' public fields, so the
  name does not change with how JAX prints a path."""
  parts = []
  for key in path:
    for field in ("key", "name", "idx"):  # DictKey/FlattenedIndexKey, GetAttrKey, SequenceKey
      if hasattr(key, field):
        parts.append(str(getattr(key, field)))
        break
    else:
      parts.append(str(key))
  return "/".join(parts)


def _words(x: jax.Array) -> jax.Array:
  """The array's elements as uint32 words (narrower types widened; 64-bit ones as two words on a
  new last axis)."""
  if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  if x.dtype == jnp.bool_:
    return x.astype(jnp.uint32)
  size = jnp.dtype(x.dtype).itemsize
  if size in (4, 8):
    return jax.lax.bitcast_convert_type(x, jnp.uint32)  # 8 bytes: [..., 2]
  unsigned = {1: jnp.uint8, 2: jnp.uint16}[size]
  return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)


def _fmix32(h: jax.Array) -> jax.Array:
  h = h ^ (h >> 16)
  h = h * jnp.uint32(_MIX1)
  h = h ^ (h >> 13)
  h = h * jnp.uint32(_MIX2)
  return h ^ (h >> 16)


@jax.jit
def _shard_sums(x: jax.Array, starts: jax.Array, strides: jax.Array) -> jax.Array:
  """[2] uint32: the two sums of the module docstring over one shard of an array, whose first
  element is at `starts` of the whole (its words' shape: `strides` are the whole's)."""
  words = _words(x)
  # Row-major index in the whole array of every element of the shard, built per axis (no
  # reshape, so any shard shape compiles alike).
  index = jnp.zeros(words.shape, jnp.uint32)
  for axis in range(words.ndim):
    position = jax.lax.broadcasted_iota(jnp.uint32, words.shape, axis) + starts[axis]
    index = index + position * strides[axis]
  weighted = jnp.sum(words * (index * jnp.uint32(2) + jnp.uint32(1)), dtype=jnp.uint32)
  mixed = jnp.sum(_fmix32(words ^ (index * jnp.uint32(_PHI))), dtype=jnp.uint32)
  return jnp.stack([weighted, mixed])


def _partial_sums(x: jax.Array) -> list[jax.Array]:
  """The sums of this process's shards of `x`, one replica of each (not yet added up).

  Each shard is reduced on its own device by a single-device program: nothing is gathered,
  and no program depends on how the array is sharded, only on its shards' shapes."""
  shape = list(x.shape) + ([2] if jnp.dtype(x.dtype).itemsize == 8 else [])
  strides, stride = [0] * len(shape), 1
  for axis in reversed(range(len(shape))):
    strides[axis] = stride % 2**32
    stride *= shape[axis]
  strides = np.asarray(strides, np.uint32)
  sums = []
  for shard in x.addressable_shards:
    if shard.replica_id != 0:
      continue
    starts = [s.start or 0 for s in shard.index] + [0] * (len(shape) - x.ndim)
    sums.append(_shard_sums(shard.data, np.asarray(starts, np.uint32), strides))
  return sums


def _describe(x) -> str:
  return f"{jnp.dtype(x.dtype).name}{list(np.shape(x))}"


def tree_digest(tree: Any) -> dict[str, str]:
  """{leaf path: "dtype[shape]:hex"} for every array of `tree` (e.g. a train state)."""
  leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
  arrays = [x if isinstance(x, jax.Array) else jnp.asarray(x) for _, x in leaves]
  partial = [_partial_sums(x) for x in arrays]  # dispatched on every device before any wait
  mask = 2**32 - 1
  totals = np.zeros((len(arrays), 2), np.uint64)
  for i, sums in enumerate(partial):
    for s in sums:
      totals[i] += np.asarray(s, np.uint64)
  totals &= mask
  if jax.process_count() > 1:  # each process holds some shards: add up every process's sums
    from jax.experimental import multihost_utils

    gathered = multihost_utils.process_allgather(totals.astype(np.uint32))  # [processes, n, 2]
    totals = np.asarray(gathered, np.uint64).sum(axis=0) & mask
  return {
      path_name(path): f"{_describe(x)}:{int(t[0]):08x}{int(t[1]):08x}"
      for (path, _), x, t in zip(leaves, arrays, totals)
  }


def json_digest(value: Any) -> str:
  """SHA-256 of `value` as canonical JSON (the data position a checkpoint saves beside the
  state)."""
  text = json.dumps(value, sort_keys=True, separators=(",", ":"))
  return hashlib.sha256(text.encode()).hexdigest()


def mismatches(saved: dict[str, str], restored: Any, prefix: str = "") -> tuple[list[str], int]:
  """(the leaves of `restored` whose digest differs from `saved`, the number not in `saved`).

  `prefix` is prepended to `restored`'s paths (a partial restore of the `params` subtree)."""
  computed = tree_digest(restored)
  bad, unknown = [], 0
  for name, value in computed.items():
    expected = saved.get(prefix + name)
    if expected is None:
      unknown += 1
    elif expected != value:
      bad.append(prefix + name)
  return bad, unknown
