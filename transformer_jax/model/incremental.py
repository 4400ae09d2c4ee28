"""The Transformer as a search steps it: encode once, then one token per step against its cache.

`IncrementalDecoder` is the boundary between the model and the searches of decode.py: a search
sees only `start` (the first step's distribution and cache) and `step_fn(tokens, cache, position,
slots) -> (log_probs, cache)`, and grows or widens the cache through `grow` and `add_beams`;
the cache's layout and its beam slots are kv_cache.py's. Shapes: b sentences, s source length,
n output length, v vocabulary, k beams, r = b * k rows of a step, e model dim.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from transformer_jax.model import kv_cache
from transformer_jax.model.config import BOS_ID, PAD_ID, TransformerConfig
from transformer_jax.model.transformer import Transformer


@dataclasses.dataclass(frozen=True)
class IncrementalDecoder:
  """The Transformer run one token a step against its cache. Pure functions; jit the caller."""

  config: TransformerConfig
  # False: `step` and `start` give the logits, not their log-softmax, for a search whose
  # constraint renormalizes whatever it is given (decode.Predictor, `takes_logits`): one pass
  # over [r, v] less a step.
  normalize: bool = True

  @property
  def model(self) -> Transformer:
    return Transformer(self.config.replace(decode=True, deterministic=True))

  def encode(self, params, inputs: jax.Array) -> jax.Array:
    """inputs [b, s] -> encoded [b, s, e]."""
    return self.model.apply({"params": params}, inputs, method=Transformer.encode)

  def init_cache(self, inputs: jax.Array, max_decode_len: int):
    """A zeroed cache for a batch, one beam slot, `max_decode_len` positions (kv_cache.py); the
    shapes come from tracing `init`, nothing is computed."""
    batch = inputs.shape[0]
    shapes = jax.eval_shape(
        lambda: self.model.init(
            jax.random.PRNGKey(0), inputs, jnp.zeros((batch, max_decode_len), jnp.int32)
        )["cache"]
    )
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)

  def step(self, params, cache, encoded, inputs, tokens, position, slots=None):
    """One step: tokens [r] (the previous output) at `position` (a scalar, or [r] int32: each
    row's own) -> (log_probs [r, v], cache) (the logits, with `normalize` False).

    `encoded` [b, s, e] on the first step (it fills the cross-attention cache), None after;
    `inputs` [b, s] for the source padding mask. With k = r / b beams per sentence, `slots`
    [b, k, n] is the search's slot table (kv_cache.py).
    """
    positions = jnp.reshape(jnp.asarray(position, jnp.int32), (-1, 1))  # [1 or r, 1]
    logits, variables = self.model.apply(
        {"params": params, "cache": cache},
        encoded,
        inputs,
        tokens[:, None],  # [r, 1]
        jnp.broadcast_to(positions, (tokens.shape[0], 1)),  # targets_positions [r, 1]
        cache_slots=slots,
        method=Transformer.decode,
        mutable=["cache"],
    )
    logits = logits[:, 0]  # [r, v]
    return (jax.nn.log_softmax(logits, axis=-1) if self.normalize else logits), variables["cache"]

  def start(self, params, inputs: jax.Array, cache_length: int):
    """Encodes and runs the first step (reading BOS) once per sentence.

    Returns (log_probs [b, v], the self-attention cache (one slot, `cache_length` positions),
    the cross-attention cache (per sentence; pass it to `step_fn`)).
    """
    encoded = self.encode(params, inputs)  # [b, s, e]
    cache = self.init_cache(inputs, cache_length)
    bos = jnp.full((inputs.shape[0],), BOS_ID, jnp.int32)
    log_probs, cache = self.step(params, cache, encoded, inputs, bos, 0)  # [b, v]
    beams, sentence = kv_cache.split(cache)
    return _no_pad_or_bos(log_probs), beams, sentence

  def cross_cache(self, params, inputs: jax.Array):
    """The cross-attention cache of `inputs` [b, s] (per sentence; pass it to `step_fn`), for a
    search that runs the BOS step itself (decoding/refill.py). The cache is filled by the first
    decoder call (kv_cache.CrossAttentionCache), so that call is traced here; under jit, XLA
    drops the rest of it (the step's logits and self-attention keys), whose results are unused.
    """
    encoded = self.encode(params, inputs)  # [b, s, e]
    bos = jnp.full((inputs.shape[0],), BOS_ID, jnp.int32)
    _, cache = self.step(params, self.init_cache(inputs, 1), encoded, inputs, bos, 0)
    return kv_cache.split(cache)[1]

  def step_fn(self, params, inputs: jax.Array, sentence) -> Callable:
    """step_fn(tokens [r], cache, position, slots) -> (log_probs [r, v], cache) over the
    self-attention cache; it holds the cross-attention cache `sentence`, never carried."""

    def step_fn(tokens, beams, position, slots=None):
      cache = kv_cache.merge(beams, sentence)
      log_probs, cache = self.step(params, cache, None, inputs, tokens, position, slots)
      return _no_pad_or_bos(log_probs), kv_cache.split(cache)[0]

    return step_fn

  def add_beams(self, beams, beam_size: int):
    """The self-attention cache of the first step (one slot) -> `beam_size` slots."""
    return kv_cache.add_beam_slots(beams, beam_size)

  def grow(self, beams, length: int, beam_size: int = 1):
    """The self-attention cache padded to `length` positions (masked until written)."""
    return kv_cache.grow(beams, length, beam_size)


def _no_pad_or_bos(log_probs: jax.Array) -> jax.Array:
  """An emitted PAD would read as padding, and BOS only starts a sentence: never outputs."""
  return log_probs.at[:, (PAD_ID, BOS_ID)].set(-jnp.inf)
