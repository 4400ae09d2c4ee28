"""What the tests decode besides the paper's model and the searches' own cache, written here
without touching model/ or decoding/ (docs/changing_the_model.md):

- `AlibiAttention`, a variant of the Transformer's attention: decoder self-attention adds to each
  head's logits -m_h (q - k), the key's distance behind the query scaled by a learned slope per
  head (ALiBi, Press et al. 2022), its slopes started away from zero. It depends on positions, so
  every decoding path must hand it the right ones: beam slots, refilled rows' rings, blocks.
- `NaiveCache`, a decoding cache in the plainest layout: every row's full keys and values, the
  rows gathered by parent when beams follow them (flax examples/wmt's way). No slot table, no
  ring: it offers no refilled rows, so greedy search runs it in batches.
"""

from __future__ import annotations

from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

from transformer_jax.model.attention import SEQUENCE, CachedKeys, MultiHeadAttention
from transformer_jax.model.transformer import Transformer


class AlibiAttention(MultiHeadAttention):
  """The Transformer's attention, with ALiBi-style slopes in decoder self-attention."""

  def bias(self, query_positions, key_positions):
    if self.kind != "causal":
      return super().bias(query_positions, key_positions)
    heads = self.config.num_heads
    slopes = self.param(
        "alibi_slopes", lambda _, n: 2.0 ** (-4.0 * jnp.arange(1, n + 1) / n), heads
    )  # [h]: 0.5 ... 1/16, not 0
    distance = query_positions[:, :, None] - key_positions[:, None, :]  # [b | 1, q, k]
    return -slopes[None, :, None, None] * distance[:, None].astype(jnp.float32)  # [b | 1, h, q, k]


def alibi_transformer(config) -> Transformer:
  """The Transformer with `AlibiAttention` everywhere (it changes decoder self-attention only)."""
  return Transformer(config, attention=AlibiAttention)


MODELS = {"stock": Transformer, "alibi": alibi_transformer}  # config -> model
# MODELS' names as test parameters: the paper's model in the default suite, the variant in
# .ci/run's slow stage (where the default suite's time is spent on checks that are slow).
SLOW_VARIANTS = [n if n == "stock" else pytest.param(n, marks=pytest.mark.slow) for n in MODELS]


class RowsKV(NamedTuple):
  """Keys and values of every row: [b, k, n, h, d], written at `index`."""

  key: jax.Array
  value: jax.Array
  index: jax.Array
  invariant = False

  def widen(self, beams):
    return self._replace(key=jnp.repeat(self.key, beams, 1), value=jnp.repeat(self.value, beams, 1))

  def follow(self, parents):  # parents [b, k]: gather the keys and values themselves
    take = lambda x: jnp.take_along_axis(x, parents[:, :, None, None, None], axis=1)  # noqa: E731
    return self._replace(key=take(self.key), value=take(self.value))

  def grow(self, length):
    pad = lambda x: jnp.pad(x, [(0, 0), (0, 0), (0, length - x.shape[2]), (0, 0), (0, 0)])  # noqa: E731
    return self._replace(key=pad(self.key), value=pad(self.value))

  def rows(self):  # [b * k, n, h, d]
    return (x.reshape((-1,) + x.shape[2:]) for x in (self.key, self.value))


class RowsSource(RowsKV):
  """The encoder's keys and values of every row: [b, k, s, h, d]; they never grow."""

  def grow(self, length):
    del length
    return self


class NaiveCache(nn.Module):
  """A decoding cache (`TransformerConfig.cache`) of full keys and values per row."""

  kind: str

  @nn.compact
  def __call__(self, key, value, key_valid=None):
    created = self.has_variable("cache", "state")
    if self.kind == "cross":  # the encoder's keys, one copy per row: tiled and gathered too
      if key is not None:
        self.put_variable("cache", "state", RowsSource(key[:, None], value[:, None], jnp.int32(0)))
      if not created:
        return None
      state = self.get_variable("cache", "state")
      beams = state.key.shape[1]
      keys, values = state.rows()
      mask = jnp.repeat(key_valid, beams, axis=0)[:, None, None, :]  # [r, 1, 1, s]
      return CachedKeys(keys, values, mask, None, SEQUENCE)
    if not created:  # model init: key [b, n, h, d] sets the length
      zeros = jnp.zeros_like(key)[:, None]
      self.put_variable(
          "cache", "state", RowsKV(zeros, jnp.zeros_like(value)[:, None], jnp.int32(0))
      )
      return None
    state = self.get_variable("cache", "state")
    batch, beams, length = state.key.shape[:3]
    write = lambda cached, new: jax.lax.dynamic_update_slice_in_dim(  # noqa: E731
        cached, new.reshape((batch, beams) + new.shape[1:]), state.index, axis=2
    )
    state = RowsKV(write(state.key, key), write(state.value, value), state.index + 1)
    self.put_variable("cache", "state", state)
    keys, values = state.rows()
    positions = jnp.arange(length)
    mask = jnp.broadcast_to(positions <= state.index - 1, (batch * beams, 1, 1, length))
    return CachedKeys(keys, values, mask, positions[None], SEQUENCE)
