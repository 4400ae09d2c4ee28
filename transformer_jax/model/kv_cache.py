"""The decoding cache of the attention layers: keys and values kept from step to step.

A search decodes one token per step. Each decoder layer's self-attention appends that step's
key and value to a `SelfAttentionCache`, so a step costs O(length) instead of re-running the
prefix; each encoder-decoder attention projects the encoder output once, on the first step, into
a `CrossAttentionCache` that later steps read. Letters: b sentences, k beams per sentence,
r = b * k rows of a step, n positions, s source length, h heads, d head dim.

Layouts (chosen so a step's attention is two plain batched matmuls over (b, h), see
attention.py `cached_attention`; other layouts made XLA:CPU transpose the cache every step):
  self-attention keys [b, h, d_k, n*k] and values [b, h, n*k, d_v], position-major: column
    p*k + j holds position p of beam slot j;
  cross-attention keys [b, h, d_k, s] and values [b, h, s, d_v], one copy per sentence, read by
    the k beams of the sentence as k queries (never tiled, never reordered).

Beam slots. Beam j of a sentence always writes into slot j, so a beam search never moves the
cache; it passes a slot table `slots` [b, k, n] int32 instead: slots[i, j, p] is the slot that
holds position p of beam j's prefix. When a beam continues another beam's prefix, only the table
follows (decode.py); gathering the whole cache by parent every step cost more than attention.

Rows that start anew (decoding/refill.py). A cache may also hold `row_start` [b] int32 beside its
write index (`set_row_starts`, one slot only): then its n columns are a ring, step t writes column
t % n, and row i attends to the columns written at steps row_start[i]..t, so a row whose sentence
has finished takes a new one without the cache moving or the other rows noticing.

The functions at the end act on a whole model's cache (the "cache" collection): split off the
per-sentence cross-attention part, add beam slots, grow the length between blocks of steps, and
(refill.py) give rows their starts and a new sentence's padded source.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import traverse_util

# Leaves that hold one copy per sentence (never tiled to the beams, never carried by a search).
SENTENCE_KEYS = ("cross_key", "cross_value")
# Self-attention leaves: the axis of the n positions x k beam slots (position-major).
COLUMN_AXIS = {"cached_key": 3, "cached_value": 2}
# Cross-attention leaves: the axis of the s source positions.
SOURCE_AXIS = {"cross_key": 3, "cross_value": 2}


def slot_mask(
    index: jax.Array, slots: jax.Array | None, batch: int, beams: int, length: int,
    row_start: jax.Array | None = None,
):  # fmt: skip
  """[b, k, n*k] bool: the columns row (i, j) attends to at write position `index`.

  Without `slots` (k = 1): every position <= index (causal, §3.2.3); with `row_start` [b], the
  ring's columns written at steps row_start[i]..index (module docstring). With `slots` [b, k, >= n]:
  (position p, slot slots[i, j, p]) for p < index, and its own slot j at p = index.
  """
  positions = jnp.arange(length)  # [n]
  if slots is None:
    if beams != 1:
      raise ValueError(f"a cache with {beams} beam slots needs a slot table (decode.py)")
    if row_start is None:
      return jnp.broadcast_to(positions <= index, (batch, 1, length))  # [b, 1, n]
    written = index - (index - positions) % length  # [n]: the last step that wrote it (< 0: none)
    return (written >= row_start[:, None])[:, None, :]  # [b, 1, n]
  if row_start is not None:
    raise ValueError("a cache with row starts has one slot: no slot table")
  beam = jnp.arange(beams)
  holder = jnp.where(positions == index, beam[:, None], slots[:, :, :length])  # [b, k, n]
  mask = (holder[..., None] == beam) & (positions <= index)[:, None]  # [b, k, n, k(slot)]
  return mask.reshape(batch, beams, length * beams)


class SelfAttentionCache(nn.Module):
  """Decoder self-attention's keys and values, one slot per beam, and the write index."""

  @nn.compact
  def __call__(self, key: jax.Array, value: jax.Array, slots: jax.Array | None = None):
    """Writes this step's key [r, 1, h, d_k] and value [r, 1, h, d_v] at the write index.

    Returns (key_t [b, h, d_k, n*k], value [b, h, n*k, d_v], mask [b, k, n*k]); None on the
    call that creates the cache (model init: key [b, n, h, d] fixes n, one slot).
    """
    created = self.has_variable("cache", "cached_key")
    rows, length, heads, key_dim = key.shape
    value_dim = value.shape[-1]
    cached_key = self.variable(
        "cache", "cached_key", jnp.zeros, (rows, heads, key_dim, length), key.dtype
    )
    cached_value = self.variable(
        "cache", "cached_value", jnp.zeros, (rows, heads, length, value_dim), value.dtype
    )
    index = self.variable("cache", "cache_index", lambda: jnp.array(0, jnp.int32))
    if not created:
      return None
    if length != 1:
      raise ValueError(f"cached decoding takes one token per step, got length {length}")
    batch, columns = cached_key.value.shape[0], cached_key.value.shape[-1]
    beams, rest = divmod(rows, batch)
    if rest:
      raise ValueError(f"a cache of {batch} sentences cannot take {rows} rows of keys")
    step = i = index.value  # i: the column written
    row_start = None
    if self.has_variable("cache", "row_start"):  # a ring (module docstring)
      row_start = self.get_variable("cache", "row_start")  # [b]
      i = step % (columns // beams)
    new_key = key.reshape(batch, beams, heads, key_dim).transpose(0, 2, 3, 1)  # [b, h, d_k, k]
    new_value = value.reshape(batch, beams, heads, value_dim).transpose(0, 2, 1, 3)  # [b,h,k,d_v]
    cached_key.value = jax.lax.dynamic_update_slice(cached_key.value, new_key, (0, 0, 0, i * beams))
    cached_value.value = jax.lax.dynamic_update_slice(
        cached_value.value, new_value, (0, 0, i * beams, 0)
    )
    index.value = step + 1
    mask = slot_mask(step, slots, batch, beams, columns // beams, row_start)
    return cached_key.value, cached_value.value, mask


class CrossAttentionCache(nn.Module):
  """Encoder-decoder keys and values, projected once per sentence and then only read."""

  @nn.compact
  def __call__(self, key: jax.Array | None = None, value: jax.Array | None = None):
    """key [b, s, h, d_k], value [b, s, h, d_v] (the first step) or None (later steps: read).

    Returns key_t [b, h, d_k, s] and value [b, h, s, d_v]."""
    if key is not None:
      key_t, value = key.transpose(0, 2, 3, 1), value.transpose(0, 2, 1, 3)
      self.put_variable("cache", "cross_key", key_t)
      self.put_variable("cache", "cross_value", value)
      return key_t, value
    if not self.has_variable("cache", "cross_key"):
      raise ValueError("cross-attention cache is empty: the first decoding step must pass encoded")
    return self.get_variable("cache", "cross_key"), self.get_variable("cache", "cross_value")


# ----------------------------------------------------------------------------- a model's cache


def set_row_starts(cache: dict, row_start: jax.Array) -> dict:
  """The self-attention cache with `row_start` [b] int32 beside each layer's write index: its
  columns become a ring whose rows start anew (module docstring)."""
  flat = traverse_util.flatten_dict(cache)
  for key in [k for k in flat if k[-1] == "cache_index"]:
    flat[key[:-1] + ("row_start",)] = row_start
  return traverse_util.unflatten_dict(flat)


def pad_source(sentence: dict, length: int) -> dict:
  """The cross-attention cache padded with zeros to `length` source positions (masked: the
  source's PAD)."""

  def pad(x, axis):
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, length - x.shape[axis])
    return jnp.pad(x, widths)

  flat = traverse_util.flatten_dict(sentence)
  return traverse_util.unflatten_dict({k: pad(x, SOURCE_AXIS[k[-1]]) for k, x in flat.items()})


def split(cache) -> tuple[dict, dict]:
  """cache -> (per-beam part, per-sentence part): the cross-attention keys/values go apart.

  A search carries the per-beam part (self-attention, write index) through its loop; the
  per-sentence part is only read."""
  flat = traverse_util.flatten_dict(cache)
  sentence = {k: v for k, v in flat.items() if k[-1] in SENTENCE_KEYS}
  beams = {k: v for k, v in flat.items() if k[-1] not in SENTENCE_KEYS}
  return traverse_util.unflatten_dict(beams), traverse_util.unflatten_dict(sentence)


def merge(beams: dict, sentence: dict) -> dict:
  """The inverse of `split`."""
  flat = traverse_util.flatten_dict(beams)
  flat.update(traverse_util.flatten_dict(sentence))
  return traverse_util.unflatten_dict(flat)


def _map_columns(fn, cache: dict) -> dict:
  flat = traverse_util.flatten_dict(cache)
  for key, x in flat.items():
    if key[-1] in COLUMN_AXIS:
      flat[key] = fn(x, COLUMN_AXIS[key[-1]])
  return traverse_util.unflatten_dict(flat)


def add_beam_slots(cache: dict, beam_size: int) -> dict:
  """One slot (the first step's cache) -> `beam_size` copies: position 0 (BOS) is every beam's."""
  return _map_columns(lambda x, axis: jnp.repeat(x, beam_size, axis=axis), cache)


def grow(cache: dict, length: int, beam_size: int = 1) -> dict:
  """Pads the self-attention keys/values with zeros to `length` positions of `beam_size` slots;
  the padded positions are masked (`slot_mask` follows the cache's length) until written."""

  def pad(x, axis):
    if x.shape[axis] > length * beam_size:
      raise ValueError(f"cannot shrink a cache of {x.shape[axis] // beam_size} to {length}")
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, length * beam_size - x.shape[axis])
    return jnp.pad(x, widths)

  return _map_columns(pad, cache)
