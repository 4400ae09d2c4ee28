"""The searches' decoding cache (`TransformerConfig.cache`; docs/changing_the_model.md, "The
searches' cache"): self-attention appends each step's keys and values to a `SelfKV`, cross-
attention keeps the encoder's, projected on the first step, in a `SourceKV`. Beam j writes into
slot j and following the parents gathers the slot table, never the keys; a ring (`row_start`)
lets a row take a new sentence in place. b sentences, k beams, r = b * k rows, n positions, s
source length, h heads, d head dim.
"""

from __future__ import annotations

from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from transformer_jax.model.attention import CachedKeys, Layout


class HeadsMajor(Layout):
  """query [b, q, h, d_k], keys [b, h, d_k, m], values [b, h, m, d_v] -> [b, q, h, d_v]."""

  def logits(self, query, key):
    # Batched matmuls over (b, h), the small query and output transposed around them: XLA:CPU
    # computed other orders transposed, without its fast matmul kernels.
    query = query.transpose(0, 2, 1, 3)  # [b, h, q, d_k]
    return jnp.einsum("bhqd,bhdm->bhqm", query, key, preferred_element_type=jnp.float32)

  def combine(self, weights, value):
    return jnp.einsum("bhqm,bhmd->bhqd", weights, value).transpose(0, 2, 1, 3)  # [b, q, h, d_v]


HEADS_MAJOR = HeadsMajor()


def _pad(x: jax.Array, axis: int, size: int) -> jax.Array:
  if x.shape[axis] > size:
    raise ValueError(f"cannot shrink a cache axis of {x.shape[axis]} to {size}")
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, size - x.shape[axis])
  return jnp.pad(x, widths)


class SelfKV(NamedTuple):
  """Decoder self-attention's keys and values, k beam slots, and the write index."""

  key: jax.Array  # [b, h, d_k, n*k]
  value: jax.Array  # [b, h, n*k, d_v]
  index: jax.Array  # int32 scalar: the position (ring: the step) written next
  slots: jax.Array | None = None  # [b, k, n] int32, once widened to k > 1 beams
  row_start: jax.Array | None = None  # [b] int32: a ring (one slot)
  invariant = False  # written every step: carried through a search's loop

  @property
  def beams(self) -> int:
    return 1 if self.slots is None else self.slots.shape[1]

  def widen(self, beams: int) -> SelfKV:
    """One slot (the first step's cache) -> `beams`: position 0 (BOS) is every beam's."""
    batch, length = self.key.shape[0], self.key.shape[-1]
    return self._replace(
        key=jnp.repeat(self.key, beams, axis=3),
        value=jnp.repeat(self.value, beams, axis=2),
        slots=jnp.zeros((batch, beams, length), jnp.int32),
    )

  def follow(self, parents: jax.Array) -> SelfKV:
    """Beam j of sentence i continues the prefix of beam parents[i, j] [b, k]: its slot table."""
    if self.slots is None:
      return self
    return self._replace(slots=jnp.take_along_axis(self.slots, parents[:, :, None], axis=1))

  def grow(self, length: int) -> SelfKV:
    """Room for `length` positions (zeros, masked until written)."""
    k = self.beams
    slots = None if self.slots is None else _pad(self.slots, 2, length)
    key, value = _pad(self.key, 3, length * k), _pad(self.value, 2, length * k)
    return self._replace(key=key, value=value, slots=slots)

  def restart(self, row_start: jax.Array) -> SelfKV:
    """A ring whose row i holds the sentence that started at step row_start[i] [b]."""
    if self.slots is not None:
      raise ValueError("a cache with beam slots cannot be a ring")
    return self._replace(row_start=row_start)

  def write(self, key: jax.Array, value: jax.Array) -> tuple[SelfKV, CachedKeys]:
    """Writes a step's key [r, 1, h, d_k] and value [r, 1, h, d_v]; returns the new cache and
    what the step attends to."""
    rows, _, heads, key_dim = key.shape
    batch, columns = self.key.shape[0], self.key.shape[-1]
    beams = self.beams
    if rows != batch * beams or key.shape[1] != 1:
      raise ValueError(f"a cache of {batch} x {beams} rows cannot take keys {key.shape[:2]}")
    length = columns // beams
    step = column = self.index
    if self.row_start is not None:
      column = step % length
    new_key = key.reshape(batch, beams, heads, key_dim).transpose(0, 2, 3, 1)  # [b, h, d_k, k]
    new_value = value.reshape(batch, beams, heads, -1).transpose(0, 2, 1, 3)  # [b, h, k, d_v]
    keys = jax.lax.dynamic_update_slice(self.key, new_key, (0, 0, 0, column * beams))
    values = jax.lax.dynamic_update_slice(self.value, new_value, (0, 0, column * beams, 0))
    positions = jnp.arange(length)  # [n]
    slots = self.slots
    if slots is not None:  # (position p, slot slots[i, j, p]) for p < step, its own at step
      beam = jnp.arange(beams)
      slots = jnp.where(positions == step, beam[:, None], slots)  # [b, k, n]
      mask = (slots[..., None] == beam) & (positions <= step)[:, None]  # [b, k, n, k(slot)]
      mask = mask.reshape(batch, beams, length * beams)
      key_positions = (jnp.arange(columns) // beams)[None]  # [1, n*k]
    elif self.row_start is None:  # §3.2.3: every position <= step
      mask = jnp.broadcast_to(positions <= step, (batch, 1, length))  # [b, 1, n]
      key_positions = positions[None]  # [1, n]
    else:  # the columns written at steps row_start[i]..step (< 0: never)
      written = step - (step - positions) % length  # [n]: the last step that wrote each
      mask = (written >= self.row_start[:, None])[:, None, :]  # [b, 1, n]
      key_positions = written[None] - self.row_start[:, None]  # [b, n]
    cache = self._replace(key=keys, value=values, index=step + 1, slots=slots)
    return cache, CachedKeys(keys, values, mask[:, None], key_positions, HEADS_MAJOR)


class SourceKV(NamedTuple):
  """Encoder-decoder keys and values, projected once per sentence and then only read."""

  key: jax.Array  # [b, h, d_k, s]
  value: jax.Array  # [b, h, s, d_v]
  invariant = True  # written on the first step only: never carried through a search's loop

  # One copy per sentence, read by its beams: nothing to widen, follow or grow.
  widen = follow = grow = lambda self, _: self

  def pad_source(self, length: int) -> SourceKV:
    """Padded with zeros to `length` source positions (masked: the source's PAD)."""
    return SourceKV(_pad(self.key, 3, length), _pad(self.value, 2, length))


class SlotCache(nn.Module):
  """The searches' cache of one decoder attention layer (`kind` "causal" or "cross"): keeps a
  `SelfKV` or a `SourceKV` as the "cache" collection's variable "state"."""

  kind: str

  @nn.compact
  def __call__(self, key, value, key_valid=None) -> CachedKeys | None:
    """key, value [rows, length, h, d] (cross-attention after the first step: None), the
    source's padding `key_valid` [b, s] (cross-attention). None on the call that creates the
    cache: model init, whose key [b, n, h, d] sets n positions (one slot) or s."""
    created = self.has_variable("cache", "state")
    if self.kind == "cross":
      if key is not None:  # the first step (or init): the encoder's keys, laid out once
        state = SourceKV(key.transpose(0, 2, 3, 1), value.transpose(0, 2, 1, 3))
        self.put_variable("cache", "state", state)
      elif not created:
        raise ValueError("cross-attention cache is empty: the first decoding step passes encoded")
      state = self.get_variable("cache", "state")
      mask = None if key_valid is None else key_valid[:, None, None, :]  # [b, 1, 1, s]
      return CachedKeys(state.key, state.value, mask, None, HEADS_MAJOR) if created else None
    if not created:  # one slot of n positions, zeros
      key, value = key.transpose(0, 2, 3, 1), value.transpose(0, 2, 1, 3)
      state = SelfKV(jnp.zeros_like(key), jnp.zeros_like(value), jnp.array(0, jnp.int32))
      self.put_variable("cache", "state", state)
      return None
    state, keys = self.get_variable("cache", "state").write(key, value)
    self.put_variable("cache", "state", state)
    return keys
