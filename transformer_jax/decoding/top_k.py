"""The top `count` of a beam search's k*v extensions, in two stages (exactly the flat top_k).

A beam search ranks every extension of every alive hypothesis each step: a top_k over k*v
candidates per sentence (32k for beam 4 and an 8k vocabulary), a visible share of a decoding
step on XLA:CPU (docs/experiments.md). `top_extensions` first takes the maximum of each chunk
of C consecutive tokens, keeps the `count` chunks ranked first, and takes the top_k of their
elements only. Greedy search's
`argmax` is likewise jnp.argmax's result by a faster route.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

MIN_CHUNK = 8  # below this the chunk maxima cost more than they save


def chunk_size(beam: int, vocab: int, count: int) -> int:
  """The chunk size C for `top_extensions` (0: take the flat top_k, chunks do not pay).

  ~sqrt(k*v / count), a power of two, balances its two small top_k's (over the k*v/C chunk
  maxima and over the count*C elements of the kept chunks): 64 for beam 4 and an 8k vocabulary.
  """
  chunk = 2 ** round(math.log2(math.sqrt(beam * vocab / count)))
  if chunk < MIN_CHUNK or chunk > vocab or beam * -(-vocab // chunk) < count:
    return 0
  return chunk


def chunk_maxima(candidates: jax.Array, chunk: int) -> jax.Array:
  """candidates [b, k, v] -> the max of each chunk of `chunk` tokens [b, k*ceil(v/C)], in flat
  order (beam, then chunk); a beam's last chunk is shorter when C does not divide v."""
  batch, beam, vocab = candidates.shape
  chunks = -(-vocab // chunk)  # per beam
  window, padding = (1, 1, chunk), ((0, 0), (0, 0), (0, chunks * chunk - vocab))
  maxima = jax.lax.reduce_window(candidates, -jnp.inf, jax.lax.max, window, window, padding)
  return maxima.reshape(batch, beam * chunks)  # [b, k*chunks]


def top_of_chunks(
    candidates: jax.Array, maxima: jax.Array, count: int, chunk: int
) -> tuple[jax.Array, jax.Array]:
  """The flat top_k of candidates [b, k, v] among the elements of the `count` chunks whose
  maxima [b, k*chunks] top_k ranks first (see `top_extensions` for why it is exact)."""
  batch, beam, vocab = candidates.shape
  chunks = maxima.shape[1] // beam
  _, ids = jax.lax.top_k(maxima, count)  # [b, count]
  ids = jnp.sort(ids, axis=1)  # ascending: the gathered elements keep the flat order
  token = (ids % chunks)[:, :, None] * chunk + jnp.arange(chunk)  # [b, count, C]
  index = (ids // chunks)[:, :, None] * vocab + jnp.minimum(token, vocab - 1)  # [b, count, C]
  index = index.reshape(batch, count * chunk)
  gathered = jnp.take_along_axis(candidates.reshape(batch, beam * vocab), index, axis=1)
  if vocab % chunk:  # past the end of a beam: -NaN, last in top_k's order
    lowest = jax.lax.bitcast_convert_type(jnp.int32(-1), jnp.float32)
    gathered = jnp.where(token.reshape(batch, count * chunk) < vocab, gathered, lowest)
  values, position = jax.lax.top_k(gathered, count)  # [b, count]
  return values, jnp.take_along_axis(index, position, axis=1)


def top_extensions(candidates: jax.Array, count: int) -> tuple[jax.Array, jax.Array]:
  """The top `count` of candidates [b, k, v] over k*v: (values [b, count], flat index = beam*v +
  token), exactly `top_k(candidates.reshape(b, k*v), count)`, ties included.

  On XLA:CPU a flat top_k over k*v (32k for beam 4 and an 8k vocabulary) is ~10% of a step,
  while the max of every chunk of C consecutive tokens costs about one read. So: keep the
  `count` chunks that top_k ranks first by maximum, and take the top_k of their elements only
  (~3x faster at b = 128 or 256, k = 4, v = 8000).

  Exact, ties included: top_k orders by value, then lower index first, and chunks are contiguous
  runs of the flat index. If an element e of chunk j is in the top `count` but j is not kept,
  `count` kept chunks rank ahead of j, and the first maximal element of each ranks ahead of e
  (a higher value, or equal with a lower index): a contradiction. The kept chunks are gathered in
  flat order, so the last top_k breaks ties as the flat one. Positions past a beam's end read as
  -NaN, below everything. This needs each chunk's maximum in top_k's total order (-NaN < -inf <
  ... < -0.0 < +0.0 < ... < NaN); a float max gives it except for signed zeros and NaN (XLA:CPU's
  vectorised max skips it), so a batch with a zero maximum or a NaN takes the flat top_k.
  """
  batch, beam, vocab = candidates.shape
  chunk = chunk_size(beam, vocab, count)
  if not chunk:
    return jax.lax.top_k(candidates.reshape(batch, beam * vocab), count)
  maxima = chunk_maxima(candidates, chunk)  # [b, k*chunks]
  exact = jnp.all(maxima != 0) & ~jnp.isnan(jnp.sum(candidates))
  return jax.lax.cond(
      exact,
      lambda: top_of_chunks(candidates, maxima, count, chunk),
      lambda: tuple(jax.lax.top_k(candidates.reshape(batch, beam * vocab), count)),
  )


ARGMAX_CHUNKS = (64, 32, 16, 8)  # `argmax`'s chunk: the first of these that divides the vocabulary


def argmax(log_probs: jax.Array, branch: bool | None = None) -> jax.Array:
  """[..., v] -> [...] int32: exactly `jnp.argmax(log_probs, axis=-1)` (the first maximum; in a
  row holding NaN, its first NaN), in a fraction of its time on XLA:CPU, where argmax is a
  reduction over (value, index) pairs that does not vectorise.

  One read of the row: the maximum of each chunk of C consecutive tokens (C in ARGMAX_CHUNKS
  dividing v; else `_first_max`, two reads). The first maximum is in the first chunk whose
  maximum equals the row's, at the first position there that equals it: found among the v/C
  chunk maxima and the C elements of that chunk. Equality is float ==, as argmax's order
  (-0.0 == +0.0: the first of them). A max may skip NaN (XLA:CPU's vectorised one does), so NaN
  is answered apart, in one of two ways:
  - `branch` (the default on the CPU backend): a batch whose sum is NaN (a NaN, or +inf beside
    -inf) takes jnp.argmax under a `lax.cond`, whose predicate costs one more reduction;
  - else (other backends, where a branch in the search's loop may wait on the device): each
    chunk also says whether it holds a NaN, and a NaN row's answer is its first chunk holding
    one, at the first NaN there. On the CPU 4-8% slower than `branch` in the refilled
    greedy search (docs/experiments.md, 2026-11-29).
  """
  shape, vocab = log_probs.shape[:-1], log_probs.shape[-1]
  chunk = argmax_chunk(vocab)
  if not chunk:
    return _first_max(log_probs)
  if branch is None:
    branch = jax.default_backend() == "cpu"
  chunks = log_probs.reshape(-1, vocab // chunk, chunk)  # [r, n, C]
  maxima = jnp.max(chunks, axis=-1)  # [r, n]
  top = jnp.max(maxima, axis=-1, keepdims=True)  # [r, 1]
  first = jnp.argmax(maxima == top, axis=-1)  # [r]: the first chunk holding the maximum
  if branch:
    total = jnp.sum(jnp.sum(chunks, axis=-1))  # NaN if any element is (a sibling of the max)
    at = jnp.argmax(_chunk(chunks, first) == top, axis=-1)
    token = (first * chunk + at).astype(jnp.int32).reshape(shape)
    exact = lambda: jnp.argmax(log_probs, axis=-1).astype(jnp.int32)  # noqa: E731
    return jax.lax.cond(jnp.isnan(total), exact, lambda: token)
  nans = jnp.any(jnp.isnan(chunks), axis=-1)  # [r, n]: in the same pass
  nan_row = jnp.any(nans, axis=-1)  # [r]
  first = jnp.where(nan_row, jnp.argmax(nans, axis=-1), first)
  elements = _chunk(chunks, first)  # [r, C]
  at = jnp.where(
      nan_row, jnp.argmax(jnp.isnan(elements), axis=-1), jnp.argmax(elements == top, axis=-1)
  )
  return (first * chunk + at).astype(jnp.int32).reshape(shape)


def _chunk(chunks: jax.Array, index: jax.Array) -> jax.Array:
  """chunks [r, n, C], index [r] -> each row's chunk `index` [r, C]."""
  return jnp.take_along_axis(chunks, index[:, None, None], axis=1)[:, 0]


def argmax_chunk(vocab: int) -> int:
  """`argmax`'s chunk for a vocabulary of `vocab` tokens (0: none divides it)."""
  return next((c for c in ARGMAX_CHUNKS if vocab % c == 0 and vocab > c), 0)


def _first_max(log_probs: jax.Array) -> jax.Array:
  """`argmax` for a vocabulary no chunk divides: a max, then the least index holding it."""
  vocab = log_probs.shape[-1]
  token = jnp.arange(vocab, dtype=jnp.int32)
  nan = jnp.isnan(log_probs)
  first_nan = jnp.min(jnp.where(nan, token, vocab), axis=-1)  # v: none
  top = jnp.max(jnp.where(nan, -jnp.inf, log_probs), axis=-1, keepdims=True)
  first_max = jnp.min(jnp.where(log_probs == top, token, vocab), axis=-1)
  return jnp.where(first_nan < vocab, first_nan, first_max)
