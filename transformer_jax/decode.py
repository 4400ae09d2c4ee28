"""Autoregressive decoding with a KV cache: the shared machinery, greedy search and beam search.

The encoder runs once per batch; the decoder then runs one token per step against a cache of
self-attention keys/values and of the encoder-decoder keys/values (projected once, on the first
step). Shapes: b batch, s source length, n max decode length, v vocabulary, k beam size.

Beam search (§6.1: beam 4, length penalty α = 0.6, maximum output length = input length + 50)
keeps, per sentence, two sets of k hypotheses as tensor2tensor and the Flax WMT example do:
"alive" (the k most probable unfinished ones, extended every step) and "finished" (the k best
that ended with EOS, ranked by the length-penalised score and never extended again). One rule is
fairseq's rather than tensor2tensor's: an EOS extension joins the finished set only if it ranks
among the k best extensions of its step (it would have taken a beam slot), not anywhere in the top
2k. With k = 1 the search then makes greedy's choices, so beam 1 is greedy search exactly for
α = 0; for α > 0 its single alive beam may still find a longer hypothesis that scores higher.
The loop stops once no alive hypothesis can beat the worst finished one, in every sentence.
`beam_search_with_step_fn` is the search over any `step_fn(tokens, cache, position)`, so it can be
tested against hand-made distributions; `beam_search` binds it to the Transformer.

What makes it fast on a CPU (each measured, see benchmarks/decode.py):
  * Nothing in the KV cache is ever reordered. The encoder-decoder keys/values are one copy per
    sentence that its k beams read as k queries (attention.py). The self-attention cache has one
    slot per beam: beam j writes its positions into slot j, and a small table [b, k, n] says
    which slot holds each position of each beam's prefix (`beam_search_with_step_fn`); after a
    step only that table follows the beams. Gathering the whole cache by parent every step was
    the largest cost of a step, above the attention itself.
  * The caches are laid out so that a step's attention is two plain batched matmuls over
    (sentence, head) (attention.py `cached_attention`): no transposition of the cache per step.
  * The self-attention cache grows in blocks of `DEFAULT_BLOCK` positions (one while_loop per
    block), so attention touches the positions written so far, rounded up to the block, not the
    maximum output length.
  * The top 2k of k*v extensions is a top_k over the 2k chunks of tokens (64 for beam 4 and an
    8k vocabulary) with the highest maxima: the same result as the flat top_k, ties included.
  * Finished sentences leave the batch (`Predictor`): once at most half of a batch is still
    decoding, the rest go on in a batch half the size. Sorted by source length, a batch's
    sentences still end many steps apart (with α > 0 a sentence is done only when no alive
    hypothesis can win, on Multi30k ~10 steps after its best one ends), and the batch would
    otherwise carry its finished sentences to the last one's end.
  * α is a traced argument (`Predictor`): trying several α compiles the search once.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from transformer_jax import distributed
from transformer_jax.data.tokenizer import BOS_ID, EOS_ID, PAD_ID
from transformer_jax.executables import ExecutableCache
from transformer_jax.model import Transformer
from transformer_jax.model_config import TransformerConfig

# Leaves of a layer's decoding cache that hold one copy per sentence (the encoder-decoder keys
# and values, attention.py): never tiled to the beams, never reordered.
SENTENCE_CACHE_KEYS = ("cross_key", "cross_value")
# Self-attention keys [b, h, d, n*k] and values [b, h, n*k, d] (attention.py): per leaf, the
# axis of the n positions x k beam slots, position-major (`expand_slots`, `grow_cache`).
COLUMN_AXIS = {"cached_key": 3, "cached_value": 2}


def split_cache(cache) -> tuple[dict, dict]:
  """cache -> (per-beam part, per-sentence part): the cross-attention keys/values go apart.

  The per-beam part (self-attention keys/values, one slot per beam, and the write index) is
  carried through a search's loop; the per-sentence part is read, never carried or changed.
  """
  flat = traverse_util.flatten_dict(cache)
  sentence = {k: v for k, v in flat.items() if k[-1] in SENTENCE_CACHE_KEYS}
  rows = {k: v for k, v in flat.items() if k[-1] not in SENTENCE_CACHE_KEYS}
  return traverse_util.unflatten_dict(rows), traverse_util.unflatten_dict(sentence)


def merge_cache(rows: dict, sentence: dict) -> dict:
  """The inverse of `split_cache`."""
  flat = traverse_util.flatten_dict(rows)
  flat.update(traverse_util.flatten_dict(sentence))
  return traverse_util.unflatten_dict(flat)


def grow_cache(rows: dict, length: int, beam_size: int = 1) -> dict:
  """Pads every self-attention key/value leaf with zeros to `length` positions (of `beam_size`
  slots each).

  The causal mask of a cached step follows the cache's length (attention.py), so the padded
  positions are masked until written.
  """
  flat = traverse_util.flatten_dict(rows)
  for key, x in flat.items():
    if key[-1] in COLUMN_AXIS:
      axis = COLUMN_AXIS[key[-1]]
      if x.shape[axis] > length * beam_size:
        raise ValueError(
            f"cannot shrink the cache {key} from {x.shape[axis] // beam_size} to {length}"
        )
      pad = [(0, 0)] * x.ndim
      pad[axis] = (0, length * beam_size - x.shape[axis])
      flat[key] = jnp.pad(x, pad)
  return traverse_util.unflatten_dict(flat)


def expand_slots(rows: dict, beam_size: int) -> dict:
  """The self-attention cache of the first step (one slot per sentence) -> `beam_size` slots.

  Every slot starts as a copy of the first step's (it holds BOS at position 0, which every beam
  shares); a beam search then writes row j's later positions into slot j.
  """
  flat = traverse_util.flatten_dict(rows)
  for key, x in flat.items():
    if key[-1] in COLUMN_AXIS:  # position-major: each position's column repeated per slot
      flat[key] = jnp.repeat(x, beam_size, axis=COLUMN_AXIS[key[-1]])
  return traverse_util.unflatten_dict(flat)


def cache_block_ends(max_decode_len: int, block: int | None) -> tuple[int, ...]:
  """The cache lengths a search decodes in: multiples of `block`, then `max_decode_len`.

  Steps p < ends[0] run with a cache of length ends[0], then up to ends[1] with one of ends[1],
  ...: attention reads at most `block - 1` unwritten positions,
  not the whole maximum length. Each block is one `while_loop` in the compiled search, entered
  only while some sentence is still being decoded. `block=None`: one block of the whole length.
  """
  if block is None or block >= max_decode_len:
    return (max_decode_len,)
  if block < 1:
    raise ValueError(f"block={block} must be >= 1")
  return tuple(range(block, max_decode_len, block)) + (max_decode_len,)


@dataclasses.dataclass(frozen=True)
class IncrementalDecoder:
  """Binds a model config to the functions cached (one token a step) decoding needs. Pure; jit
  the caller. (model.Decoder is the decoder stack; this runs the whole model step by step.)"""

  config: TransformerConfig

  @property
  def model(self) -> Transformer:
    return Transformer(self.config.replace(decode=True, deterministic=True))

  def encode(self, params, inputs: jax.Array) -> jax.Array:
    """inputs [b, s] -> encoded [b, s, e]."""
    return self.model.apply({"params": params}, inputs, method=Transformer.encode)

  def init_cache(self, inputs: jax.Array, max_decode_len: int):
    """Zeroed cache for a batch: per layer self-attention keys [b, h, d, n] and values
    [b, h, n, d] (one beam slot; `expand_slots`), cross-attention [b, h, d, s] and [b, h, s, d].

    Shapes come from tracing `init` (nothing is computed). `grow_cache` lengthens it.
    """
    batch = inputs.shape[0]
    shapes = jax.eval_shape(
        lambda: self.model.init(
            jax.random.PRNGKey(0), inputs, jnp.zeros((batch, max_decode_len), jnp.int32)
        )["cache"]
    )
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)

  def step(self, params, cache, encoded, inputs, tokens, position, slots=None):
    """One decoding step. tokens [r] (the previous output), position: int scalar.

    `encoded` is passed on the first step (it fills the cross-attention cache) and None after.
    `inputs` [b, s] (for the source padding mask) and the caches have one entry per sentence;
    `tokens` has r = b * k rows, k beams per sentence (sentence-major), which attend to their
    sentence's one copy of the encoder keys/values. With k > 1 the self-attention cache has k
    slots and `slots` [b, k, n] says which slot holds each position of each beam's prefix
    (`beam_search_with_step_fn`); row j writes `position` into slot j.
    Returns (log_probs [r, v] float32, new cache).
    """
    rows = tokens.shape[0]
    logits, variables = self.model.apply(
        {"params": params, "cache": cache},
        encoded,
        inputs,
        tokens[:, None],  # [r, 1]
        jnp.full((rows, 1), position, jnp.int32),  # targets_positions
        cache_slots=slots,
        method=Transformer.decode,
        mutable=["cache"],
    )
    return jax.nn.log_softmax(logits[:, 0], axis=-1), variables["cache"]

  def search_step(self, params, cache, encoded, inputs, tokens, position, slots=None):
    """`step` for a search: PAD and BOS are ruled out as outputs (-inf), since an emitted PAD
    would be read as padding and BOS only ever starts a sentence."""
    log_probs, cache = self.step(params, cache, encoded, inputs, tokens, position, slots)
    return log_probs.at[:, (PAD_ID, BOS_ID)].set(-jnp.inf), cache

  def start(self, params, inputs: jax.Array, cache_length: int):
    """Encodes and runs the first step (reading BOS) once per sentence.

    Returns (log_probs [b, v], self-attention cache (one slot, length `cache_length`),
    step_fn(tokens [r], cache, position, slots=None) -> (log_probs [r, v], cache)) where
    step_fn reads the per-sentence cross-attention cache, which it holds (never carried or
    reordered by a search).
    """
    log_probs, rows, sentence = self.first_step(params, inputs, cache_length)
    return log_probs, rows, self.step_fn(params, inputs, sentence)

  def first_step(self, params, inputs: jax.Array, cache_length: int):
    """`start` as data: (log_probs [b, v], self-attention cache, cross-attention cache)."""
    batch = inputs.shape[0]
    encoded = self.encode(params, inputs)  # [b, s, e]
    cache = self.init_cache(inputs, cache_length)
    bos = jnp.full((batch,), BOS_ID, jnp.int32)
    log_probs, cache = self.search_step(params, cache, encoded, inputs, bos, 0)  # [b, v]
    rows, sentence = split_cache(cache)
    return log_probs, rows, sentence

  def step_fn(self, params, inputs: jax.Array, sentence) -> Callable:
    """step_fn(tokens [r], cache, position, slots=None) -> (log_probs [r, v], cache) over the
    self-attention cache; it holds the cross-attention cache `sentence` (never carried)."""

    def step_fn(tokens, rows, position, slots=None):
      log_probs, cache = self.search_step(
          params, merge_cache(rows, sentence), None, inputs, tokens, position, slots
      )
      return log_probs, split_cache(cache)[0]

    return step_fn


def max_decode_length(inputs: jax.Array, extra: int, max_len: int) -> int:
  """§6.1: maximum output length = input length + 50, within the positional table's range."""
  return min(inputs.shape[1] + extra, max_len)


# Cache lengths grow in blocks of this many positions (`cache_block_ends`): measured on the
# Multi30k model, see benchmarks/decode.py and docs.
DEFAULT_BLOCK = 16


def _run_in_blocks(ends, step_of, all_done, body, state, cache, grow):
  """`while_loop(body)` over (state, cache) until every sentence is done or the last block ends.

  Block j runs steps < ends[j] with a cache of length ends[j] (grown by `grow` on entry); a
  block that ends early (everything done) skips the rest (`lax.cond`). Returns the final state.
  """

  def run(j, state, cache):
    end = ends[j]
    if j > 0:
      cache = grow(cache, end)

    def cond(carry):
      return (step_of(carry[0]) < end) & ~all_done(carry[0])

    state, cache = jax.lax.while_loop(cond, body, (state, cache))
    if j + 1 == len(ends):
      return state
    return jax.lax.cond(
        step_of(state) < end,  # stopped early: every sentence is done
        lambda state, cache: state,
        lambda state, cache: run(j + 1, state, cache),
        state,
        cache,
    )

  return run(0, state, cache)


class GreedyState(NamedTuple):
  """Greedy search of a batch; `step` tokens have been chosen so far."""

  step: jax.Array  # int32 scalar
  token: jax.Array  # [b] int32: the token chosen last (PAD once finished)
  finished: jax.Array  # [b] bool: EOS chosen
  out: jax.Array  # [b, n] int32: the tokens chosen, EOS then PAD


def _greedy_emit(log_probs: jax.Array, finished: jax.Array) -> tuple[jax.Array, jax.Array]:
  token = jnp.argmax(log_probs, axis=-1).astype(jnp.int32)  # [b]
  return jnp.where(finished, PAD_ID, token), finished | (token == EOS_ID)


def _greedy_init(first_log_probs: jax.Array, max_decode_len: int) -> GreedyState:
  batch = first_log_probs.shape[0]
  token, finished = _greedy_emit(first_log_probs, jnp.zeros((batch,), bool))
  out = jnp.full((batch, max_decode_len), PAD_ID, jnp.int32).at[:, 0].set(token)
  return GreedyState(jnp.array(1, jnp.int32), token, finished, out)


def _greedy_body(step_fn: Callable, carry):
  state, cache = carry
  log_probs, cache = step_fn(state.token, cache, state.step)
  token, finished = _greedy_emit(log_probs, state.finished)
  out = state.out.at[:, state.step].set(token)
  return GreedyState(state.step + 1, token, finished, out), cache


def greedy_search(
    decoder: IncrementalDecoder,
    params,
    inputs: jax.Array,  # [b, s]
    max_decode_len: int,
    block: int | None = DEFAULT_BLOCK,
) -> tuple[jax.Array, jax.Array]:
  """Argmax decoding. Returns (tokens [b, n], steps): each row ends with EOS (if produced) then
  PAD; `steps` (int32) is the number of decoder steps run, the first one included."""
  ends = cache_block_ends(max_decode_len, block)
  log_probs, cache, step_fn = decoder.start(params, inputs, ends[0])
  state = _run_in_blocks(
      ends, lambda state: state.step, lambda state: jnp.all(state.finished),
      functools.partial(_greedy_body, step_fn), _greedy_init(log_probs, max_decode_len), cache,
      grow_cache,
  )  # fmt: skip
  return state.out, state.step


# ----------------------------------------------------------------------------- beam search


def length_penalty(length, alpha: float):
  """lp(Y) = ((5 + |Y|) / 6)^α — GNMT (Wu et al., 2016, Eq. 14), used with α = 0.6 in §6.1.

  |Y| counts the generated tokens including EOS. Works on Python numbers and on arrays.
  """
  return ((5.0 + length) / 6.0) ** alpha


class BeamState(NamedTuple):
  """The search state of a batch; `step` tokens have been chosen so far (the alive length)."""

  step: jax.Array  # int32 scalar
  alive_seqs: jax.Array  # [b, k, n] int32, PAD after the chosen tokens
  alive_log_probs: jax.Array  # [b, k] float32 log P(prefix), sorted best first; -inf = empty
  finished_seqs: jax.Array  # [b, k, n] int32, EOS then PAD
  finished_scores: jax.Array  # [b, k] float32 log P(Y) / lp(Y), sorted best first; -inf = empty


def _take_beams(x: jax.Array, index: jax.Array) -> jax.Array:
  """x [b, m, ...], index [b, j] -> [b, j, ...]: the rows `index` of each sentence."""
  return x[jnp.arange(x.shape[0])[:, None], index]


def _tile_beams(tree: Any, beam_size: int) -> Any:
  """Every leaf [b, ...] -> [b*k, ...] (each sentence's row repeated k times, sentence-major).

  Scalars are left alone. The default way `beam_search_with_step_fn` gives a step_fn's state
  one entry per beam; the Transformer's cache instead adds beam slots (`expand_slots`).
  """
  return jax.tree.map(lambda x: x if x.ndim == 0 else jnp.repeat(x, beam_size, axis=0), tree)


_MIN_TOP_K_CHUNK = 8  # below this the chunk maxima cost more than they save


def _top_k_chunk(beam: int, vocab: int, count: int) -> int:
  """The chunk size C for `_top_extensions` (0: take the flat top_k, chunks do not pay).

  ~sqrt(k*v / count), a power of two, balances its two small top_k's (over the k*v/C chunk
  maxima and over the count*C elements of the kept chunks): 64 for beam 4 and an 8k vocabulary.
  """
  chunk = 2 ** round(math.log2(math.sqrt(beam * vocab / count)))
  if chunk < _MIN_TOP_K_CHUNK or chunk > vocab or beam * -(-vocab // chunk) < count:
    return 0
  return chunk


def _chunk_maxima(candidates: jax.Array, chunk: int) -> jax.Array:
  """candidates [b, k, v] -> the max of each chunk of `chunk` tokens [b, k*ceil(v/C)], in flat
  order (beam, then chunk); a beam's last chunk is shorter when C does not divide v."""
  batch, beam, vocab = candidates.shape
  chunks = -(-vocab // chunk)  # per beam
  window, padding = (1, 1, chunk), ((0, 0), (0, 0), (0, chunks * chunk - vocab))
  maxima = jax.lax.reduce_window(candidates, -jnp.inf, jax.lax.max, window, window, padding)
  return maxima.reshape(batch, beam * chunks)  # [b, k*chunks]


def _top_of_chunks(
    candidates: jax.Array, maxima: jax.Array, count: int, chunk: int
) -> tuple[jax.Array, jax.Array]:
  """The flat top_k of candidates [b, k, v] among the elements of the `count` chunks whose
  maxima [b, k*chunks] top_k ranks first; exact when every maximum is its chunk's maximum in
  top_k's order (see `_top_extensions`)."""
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


def _top_extensions(candidates: jax.Array, count: int) -> tuple[jax.Array, jax.Array]:
  """The top `count` of candidates [b, k, v] over k*v: (values [b, count], flat index = beam*v +
  token), exactly `top_k(candidates.reshape(b, k*v), count)`, ties included.

  On XLA:CPU a top_k over b rows of k*v (32k for beam 4 and an 8k vocabulary) is ~10% of a
  decoding step, while the vectorised max of every chunk of C consecutive tokens costs about one
  read of the candidates. So: split each beam's v tokens into chunks of C (`_top_k_chunk`), take
  every chunk's maximum, keep the `count` chunks that top_k ranks first by maximum, and take the
  top_k of their count*C elements only (~3x faster than one flat top_k, or than a top_k per beam
  and then across beams, at b = 128 or 256, k = 4, v = 8000).

  Why it is exact, ties included. top_k orders by value, then lower index first; the chunks are
  contiguous runs of the flat index, numbered in flat order (beam, then token). If an element e
  of chunk j is in the top `count` but chunk j is not kept, `count` kept chunks j' rank ahead of
  j, and the first maximal element of each ranks ahead of e: its value is above e's, or equal with
  a lower index (j' < j). That is `count` elements ahead of e, a contradiction. The kept chunks
  are sorted by id before they are gathered, so the order of the gathered elements is their flat
  order and the last top_k breaks ties as the flat one does. Positions past the end of a beam
  read as -NaN, below any other value, so they are never chosen.
  This needs each chunk's maximum in top_k's order, a total order (-NaN < -inf < ... < -0.0 <
  +0.0 < ... < +inf < NaN). A float max gives it except for signed zeros (either zero may come
  back) and NaN (XLA:CPU's vectorised max skips it). So a batch with a chunk whose maximum is 0,
  or with a NaN anywhere (its sum is NaN), takes the flat top_k instead; log-probabilities are
  exactly 0 only where a softmax saturates. So do shapes too small for chunks to pay.
  """
  batch, beam, vocab = candidates.shape
  chunk = _top_k_chunk(beam, vocab, count)
  if not chunk:
    return jax.lax.top_k(candidates.reshape(batch, beam * vocab), count)
  maxima = _chunk_maxima(candidates, chunk)  # [b, k*chunks]
  exact = jnp.all(maxima != 0) & ~jnp.isnan(jnp.sum(candidates))
  return jax.lax.cond(
      exact,
      lambda: _top_of_chunks(candidates, maxima, count, chunk),
      lambda: tuple(jax.lax.top_k(candidates.reshape(batch, beam * vocab), count)),
  )


def _grow(state: BeamState, log_probs: jax.Array, alpha) -> tuple[BeamState, jax.Array]:
  """Extends every alive hypothesis by every token. log_probs [b, k, v] -> (state, parents [b, k]).

  The beam of this step is the top k of all k*v extensions. Those ending in EOS move to the
  finished set (so with k = 1 this is exactly greedy's choice); the alive set is refilled with the
  k best extensions that do not end in EOS, so it always holds k candidates. Taking the top 2k
  first suffices: at most k of them (one per parent) end in EOS.
  """
  _, beam, vocab = log_probs.shape
  i = state.step
  candidates = state.alive_log_probs[:, :, None] + log_probs  # [b, k, v]
  top_log_probs, top_index = _top_extensions(candidates, 2 * beam)  # [b, 2k]
  parents = top_index // vocab  # [b, 2k]
  tokens = (top_index % vocab).astype(jnp.int32)  # [b, 2k]
  seqs = _take_beams(state.alive_seqs, parents).at[:, :, i].set(tokens)  # [b, 2k, n]
  is_eos = tokens == EOS_ID

  # Alive: the k best that continue. An EOS candidate is never kept alive, so a finished
  # hypothesis is never extended.
  alive_log_probs, keep = jax.lax.top_k(jnp.where(is_eos, -jnp.inf, top_log_probs), beam)  # [b, k]
  alive_seqs = _take_beams(seqs, keep)  # [b, k, n]
  alive_parents = _take_beams(parents, keep)  # [b, k]

  # Finished: EOS candidates within this step's beam (rank < k), scored with |Y| = i + 1.
  in_beam = is_eos & (jnp.arange(2 * beam) < beam)[None, :]  # [b, 2k]
  new_scores = jnp.where(in_beam, top_log_probs / length_penalty(i + 1, alpha), -jnp.inf)
  # The old finished come first, so a tie keeps the earlier (shorter) hypothesis.
  scores = jnp.concatenate([state.finished_scores, new_scores], axis=1)  # [b, 3k]
  finished_scores, best = jax.lax.top_k(scores, beam)  # [b, k]
  finished_seqs = _take_beams(jnp.concatenate([state.finished_seqs, seqs], axis=1), best)

  new_state = BeamState(i + 1, alive_seqs, alive_log_probs, finished_seqs, finished_scores)
  return new_state, alive_parents


def _search_done(state: BeamState, max_decode_len: int, alpha) -> jax.Array:
  """[b] bool: no alive hypothesis can still beat the worst finished one.

  Log-probs only decrease as a hypothesis grows, so an alive one ends with a score of at most
  alive_log_prob / max lp over the lengths it can still reach: lp(max_decode_len) for α >= 0
  (lp grows with length), lp(step + 1) for α < 0. While fewer than k hypotheses have finished the
  worst finished score is -inf and the sentence is not done. Once done, a sentence stays done
  and its finished set no longer changes (a later hypothesis scores at most that bound).
  """
  longest = jnp.where(alpha >= 0, max_decode_len, state.step + 1)  # alpha may be traced
  best_alive = state.alive_log_probs[:, 0] / length_penalty(longest, alpha)  # [b]
  return state.finished_scores[:, -1] >= best_alive


def beam_search_with_step_fn(
    step_fn: Callable,
    first_log_probs: jax.Array,  # [b, v]
    cache: Any,
    max_decode_len: int,
    beam_size: int = 4,
    alpha: float | jax.Array = 0.6,
    *,
    cache_ends: tuple[int, ...] | None = None,
    grow: Callable | None = None,
    tile: Callable = _tile_beams,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Beam search over `step_fn(tokens [b*k], cache, position, slots) -> (log_probs [b*k, v],
  cache)`.

  `first_log_probs` is the distribution of the first token (the step that read BOS, run once per
  sentence) and `cache` the state after it, with batch b; `tile(cache, k)` (once) gives it room
  for k beams (default: repeat every leaf's rows). The search never reorders the cache. Each
  beam j of a sentence owns a slot j: at `position` p, row j (row r is sentence r // k, beam
  r % k) reads `tokens` (its token chosen at p - 1) and writes its state for position p into
  slot j; its prefix's earlier positions q < p are in slots[i, j, q] ([b, k, n] int32). After a
  step only that small table follows the beams: a beam continuing parent j' takes row j' of the
  table, plus slot j' at p. This replaces gathering the whole cache by parent every step (the
  Transformer's self-attention cache, b*k*n*h*d per layer), which cost more than the attention
  itself on a CPU. State that is the same for every beam of a sentence (the encoder-decoder
  keys/values) belongs in `step_fn`'s closure, not here.

  `cache_ends` (default: one block, `(max_decode_len,)`) with `grow(cache, length)`: decode in
  blocks of cache length (`cache_block_ends`); `cache` comes in at length cache_ends[0].

  Returns (tokens [b, k, n], scores [b, k], steps), best first, score = log P(Y) / lp(Y); steps
  (int32) counts the calls of `step_fn` plus the first step. Tokens end with EOS then PAD. A
  sentence with no finished hypothesis after `max_decode_len` tokens returns its alive ones
  instead (no EOS, scored with |Y| = n); slots left empty have score -inf, all PAD. The loop
  stops early once, for every sentence, no alive hypothesis can beat the worst finished.
  """
  batch, vocab = first_log_probs.shape
  if beam_size < 1:
    raise ValueError(f"beam_size={beam_size} must be >= 1")
  if max_decode_len < 1:
    raise ValueError(f"max_decode_len={max_decode_len} must be >= 1")
  if vocab < 2:
    raise ValueError(f"the vocabulary must have at least 2 tokens, got {vocab}")
  cache_ends = cache_ends or (max_decode_len,)
  if cache_ends[-1] != max_decode_len or (len(cache_ends) > 1 and grow is None):
    raise ValueError(f"cache_ends={cache_ends} must end at {max_decode_len}, with a grow function")
  state = _beam_init(first_log_probs, max_decode_len, beam_size, alpha)
  state = _run_in_blocks(
      cache_ends, lambda carry: carry[0].step,
      lambda carry: jnp.all(_search_done(carry[0], max_decode_len, alpha)),
      functools.partial(_beam_body, step_fn, alpha=alpha), state, tile(cache, beam_size), grow,
  )  # fmt: skip
  tokens, scores = _beam_result(state[0], alpha)
  return tokens, scores, state[0].step


def _beam_init(first_log_probs, max_decode_len: int, beam_size: int, alpha):
  """The search state after the first step ([b, v], the distribution after BOS), and the slot
  table [b, k, n]: position 0 (the step that read BOS) is in slot 0 for every beam."""
  batch, vocab = first_log_probs.shape
  k, n = beam_size, max_decode_len
  empty_seqs = jnp.full((batch, k, n), PAD_ID, jnp.int32)
  state = BeamState(
      step=jnp.array(0, jnp.int32),
      alive_seqs=empty_seqs,
      # Only beam 0 is real at the start; the others are empty until the first step fills them.
      alive_log_probs=jnp.full((batch, k), -jnp.inf).at[:, 0].set(0.0),
      finished_seqs=empty_seqs,
      finished_scores=jnp.full((batch, k), -jnp.inf),
  )
  first = jnp.broadcast_to(first_log_probs.astype(jnp.float32)[:, None, :], (batch, k, vocab))
  state, _ = _grow(state, first, alpha)  # every row of a sentence is the same: one parent
  return state, jnp.zeros((batch, k, n), jnp.int32)


def _beam_body(step_fn: Callable, carry, alpha):
  """One step of every beam: ((state, slots), cache) -> the same after the step."""
  (state, slots), cache = carry
  batch, k = state.alive_log_probs.shape
  tokens = state.alive_seqs[:, :, state.step - 1].reshape(batch * k)  # [b*k]
  log_probs, cache = step_fn(tokens, cache, state.step, slots)  # [b*k, v]
  position = state.step
  log_probs = log_probs.astype(jnp.float32).reshape(batch, k, -1)
  state, parents = _grow(state, log_probs, alpha)
  slots = _take_beams(slots, parents).at[:, :, position].set(parents)  # [b, k, n]
  return (state, slots), cache


def _beam_result(state: BeamState, alpha) -> tuple[jax.Array, jax.Array]:
  """(tokens [b, k, n], scores [b, k]) of a search's state: the finished hypotheses, or the
  alive ones of a sentence where none finished."""
  any_finished = state.finished_scores[:, 0] > -jnp.inf  # [b]
  alive_scores = state.alive_log_probs / length_penalty(state.step, alpha)  # [b, k], |Y| = step
  scores = jnp.where(any_finished[:, None], state.finished_scores, alive_scores)  # [b, k]
  tokens = jnp.where(any_finished[:, None, None], state.finished_seqs, state.alive_seqs)
  tokens = jnp.where((scores > -jnp.inf)[:, :, None], tokens, PAD_ID)  # [b, k, n]
  return tokens, scores


def beam_search(
    decoder: IncrementalDecoder,
    params,
    inputs: jax.Array,  # [b, s]
    max_decode_len: int,
    beam_size: int = 4,
    alpha: float | jax.Array = 0.6,
    block: int | None = DEFAULT_BLOCK,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """§6.1 beam search. Returns (tokens [b, k, n], scores [b, k], steps), best first.

  The encoder and the first decoder step (which projects the encoder-decoder keys/values into the
  cache) run once per sentence. The self-attention cache then gets one slot per beam, which the
  search never reorders (it passes the slot table, attention.py); the encoder-decoder
  keys/values stay one copy per sentence, which the k beams of a sentence read.
  """
  ends = cache_block_ends(max_decode_len, block)
  first_log_probs, rows, step_fn = decoder.start(params, inputs, ends[0])  # [b, v]
  return beam_search_with_step_fn(
      step_fn, first_log_probs, rows, max_decode_len, beam_size, alpha,
      cache_ends=ends, grow=functools.partial(grow_cache, beam_size=beam_size), tile=expand_slots,
  )  # fmt: skip


class SearchCarry(NamedTuple):
  """A batch in the middle of a search (`Predictor`); every leaf but scalars has the sentences
  on axis 0, so dropping finished sentences is one gather per leaf."""

  inputs: jax.Array  # [b, s]
  sentence: Any  # the cross-attention cache, one copy per sentence
  rows: Any  # the self-attention cache (k beam slots per sentence)
  state: Any  # GreedyState, or (BeamState, slots [b, k, n])


def _record(out: np.ndarray, where: np.ndarray, tokens: jax.Array):
  """Writes a carry's `tokens` [rows, n] into the batch's result `out` [b, n] at rows `where`."""
  out[where] = distributed.gather(tokens)


def _take_sentences(carry: SearchCarry, keep: jax.Array) -> SearchCarry:
  """The sentences `keep` [b'] of a carry (scalars, shared by all, are kept)."""
  return jax.tree.map(lambda x: x if x.ndim == 0 else x[keep], carry)


class Predictor:
  """(params, inputs [b, s]) -> tokens [b, n], EOS then PAD: the best translation of each row.

  beam_size 1 is greedy search; otherwise beam search (§6.1: beam 4, α = 0.6) and its best
  hypothesis: the same hypotheses as `greedy_search` / `beam_search`, run as a sequence of
  jitted programs from the host so that finished sentences leave the batch.

  The search runs in blocks of `block` cache positions (`cache_block_ends`), one compiled
  program per block (the first one with the start, and any gather that drops sentences with
  the block that follows it: fewer programs to compile or load). Between blocks the host reads
  which sentences are done; once at most half the batch is still decoding (and `compact`), the
  rest continue in a batch half the size or smaller (at least `min_rows`), and the finished ones
  keep their result. A batch of sentences sorted by source length still spreads over many
  output lengths, and a beam search with α > 0 runs until its last sentence can no longer
  improve, so without this most rows of a batch's last blocks are finished sentences carried
  along. A done sentence's hypotheses never change (`_search_done`), so dropping it changes no
  translation.

  α is a traced argument and the beam size static: each program compiles once per (input
  shape, beam size, block, rows), whatever α (tune_decoding tries several without
  recompiling). `traces` counts the searches traced: one per input shape and beam size.
  With `executables` (an `executables.ExecutableCache` on disk), the programs are kept there
  and a later process loads them without tracing.
  """

  def __init__(
      self,
      config: TransformerConfig,
      max_decode_extra: int,
      beam_size: int = 1,
      alpha: float = 0.6,
      block: int | None = DEFAULT_BLOCK,
      compact: bool = True,
      min_rows: int = 8,
      shrink: int = 2,
      executables: ExecutableCache | None = None,
  ):
    _check_beam_size(beam_size)
    self.config, self.max_decode_extra = config, max_decode_extra
    self.beam_size, self.alpha, self.block = beam_size, alpha, block
    self.compact, self.min_rows, self.shrink = compact, min_rows, shrink
    self.decoder = IncrementalDecoder(config)
    self.traces = 0
    static = ("beam_size", "max_decode_len", "end", "exit_at")
    self._start = jax.jit(self._start_impl, static_argnames=static)
    self._block = jax.jit(self._block_impl, static_argnames=static)
    self.executables = executables
    self._programs_name = f"Predictor {config!r}"  # the closures hold the model config

  def _run(self, name: str, jitted, *args, **static):
    if self.executables is None:
      return jitted(*args, **static)
    return self.executables(self._name(name, static["beam_size"]), jitted, *args, **static)

  def _name(self, name: str, beam_size: int) -> str:
    """The programs' name in `executables` (what is prefetched together)."""
    return f"{self._programs_name} beam {beam_size}: {name}"

  def _start_impl(self, params, inputs, alpha, beam_size, max_decode_len, end, exit_at):
    """Encodes, runs the first step, sets up the search of a batch with a cache of length `end`
    and runs its first block (`_block_impl`): one program, as a batch always starts so."""
    self.traces += 1
    log_probs, rows, sentence = self.decoder.first_step(params, inputs, end)
    if beam_size == 1:
      state = _greedy_init(log_probs, max_decode_len)
    else:
      state = _beam_init(log_probs, max_decode_len, beam_size, alpha)
      rows = expand_slots(rows, beam_size)
    carry = SearchCarry(inputs, sentence, rows, state)
    return self._block_impl(params, carry, alpha, None, beam_size, max_decode_len, end, exit_at)

  def _block_impl(self, params, carry, alpha, keep, beam_size, max_decode_len, end, exit_at):
    """Steps until position `end` (the cache grown to it), or until at most `exit_at` sentences
    are still decoding (0: until every sentence is done), first keeping only the sentences
    `keep` [b'] of `carry` unless it is None (the take and the block are one program, as a
    smaller batch always goes on so). Returns (carry, done [b], steps run so far, the best
    tokens so far [b, n])."""
    if keep is not None:
      carry = _take_sentences(carry, keep)
    step_fn = self.decoder.step_fn(params, carry.inputs, carry.sentence)
    rows = grow_cache(carry.rows, end, beam_size)
    if beam_size == 1:
      body = functools.partial(_greedy_body, step_fn)

      def step_and_done(state):
        return state.step, state.finished

    else:
      body = functools.partial(_beam_body, step_fn, alpha=alpha)

      def step_and_done(state):
        return state[0].step, _search_done(state[0], max_decode_len, alpha)

    def cond(loop_carry):
      step, done = step_and_done(loop_carry[0])
      return (step < end) & (jnp.sum(~done) > exit_at)

    state, rows = jax.lax.while_loop(cond, body, (carry.state, rows))
    step, done = step_and_done(state)
    if beam_size == 1:
      tokens = state.out
    else:
      tokens = _beam_result(state[0], alpha)[0][:, 0]  # the best hypothesis
    return carry._replace(rows=rows, state=state), done, step, tokens

  def _smaller_batch(self, rows: int, active: int, multiple: int) -> int:
    """The rows to go on with: rows / 2^j for the largest j that keeps the `active` sentences,
    at least `min_rows`, rounded up to a multiple of `multiple` (the devices the batch is split
    over); `rows` itself while more than half are active. Halving keeps the shapes, and so the
    programs compiled, few."""
    best = rows
    for j in range(1, 32):
      size = -(-rows // self.shrink**j)
      size = -(-size // multiple) * multiple
      if size < max(active, self.min_rows) or size >= best:
        break
      best = size
    return best

  def search(
      self, params, inputs, alpha=None, beam_size=None, stats: dict | None = None
  ) -> tuple[np.ndarray, int]:
    """(tokens [b, n], steps): the translations, on every host, and the number of decoder
    steps run. `stats`, if given, gains "row_steps": the sentences decoded at each step, summed
    over the steps (the first one included), the cost that dropping finished sentences cuts."""
    beam_size = self.beam_size if beam_size is None else beam_size
    _check_beam_size(beam_size)
    alpha = jnp.float32(self.alpha if alpha is None else alpha)
    n = max_decode_length(inputs, self.max_decode_extra, self.config.max_len)
    ends = cache_block_ends(n, self.block)
    static = {"beam_size": beam_size, "max_decode_len": n}
    if self.executables is not None:  # start loading what the last searches needed
      for name in ("start", "block"):
        self.executables.prefetch(self._name(name, beam_size))
    rows = inputs.shape[0]
    sharding = getattr(inputs, "sharding", None)  # numpy inputs: one device
    shards = rows // sharding.shard_shape(inputs.shape)[0] if sharding else 1  # along the batch
    out = np.full((rows, n), PAD_ID, np.int32)  # written as sentences leave and at the end
    where = np.arange(rows)  # the batch row of each row of `carry`
    row_steps, last, j, keep, carry = 0, 0, 0, None, None
    while True:
      # Leave the block as soon as the batch could shrink (by half), not at its end.
      smaller = self._smaller_batch(rows, -(-rows // self.shrink), shards) if self.compact else rows
      static["end"], static["exit_at"] = ends[j], smaller if smaller < rows else 0
      if carry is None:
        carry, done, steps, tokens = self._run(
            "start", self._start, params, inputs, alpha, **static
        )
      else:
        carry, done, steps, tokens = self._run(
            "block", self._block, params, carry, alpha, keep, **static
        )
      done, steps = distributed.gather(done), int(distributed.gather(steps))  # waits for it
      row_steps, last, keep = row_steps + rows * (steps - last), steps, None
      if steps >= ends[j]:
        j += 1
      if j == len(ends) or done.all():
        break
      size = self._smaller_batch(rows, int((~done).sum()), shards) if self.compact else rows
      if size == rows:
        continue
      keep = np.concatenate([np.flatnonzero(~done), np.flatnonzero(done)])[:size]
      _record(out, where, tokens)  # the finished sentences' translations
      rows, where = size, where[keep]
    if stats is not None:
      stats["row_steps"] = stats.get("row_steps", 0) + row_steps
    _record(out, where, tokens)
    return out, steps

  def __call__(self, params, inputs, alpha=None, beam_size=None) -> np.ndarray:
    return self.search(params, inputs, alpha, beam_size)[0]

  def _cache_size(self) -> int:
    """Searches compiled and held (one per input shape and beam size)."""
    return self._start._cache_size()

  def programs(self) -> int:
    """Every program compiled and held: starts (each with its first block) and blocks (per
    rows and cache length, with or without the gather that drops finished sentences)."""
    jitted = (self._start, self._block)
    held = len(self.executables) if self.executables is not None else 0
    return sum(f._cache_size() for f in jitted) + held


def _check_beam_size(beam_size: int):
  if beam_size < 1:
    raise ValueError(f"beam_size={beam_size} must be >= 1 (1 = greedy search)")


def make_predict_fn(
    config: TransformerConfig,
    max_decode_extra: int,
    beam_size: int = 1,
    alpha: float = 0.6,
) -> Predictor:
  """A `Predictor`: (params, inputs [b, s]) -> tokens [b, n] (a host array)."""
  return Predictor(config, max_decode_extra, beam_size, alpha)
