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
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from transformer_jax.data.tokenizer import BOS_ID, EOS_ID, PAD_ID
from transformer_jax.model import Transformer, TransformerConfig


@dataclasses.dataclass(frozen=True)
class Decoder:
  """Binds a model config to the three functions decoding needs. Pure; jit the caller."""

  config: TransformerConfig

  @property
  def model(self) -> Transformer:
    return Transformer(self.config.replace(decode=True, deterministic=True))

  def encode(self, params, inputs: jax.Array) -> jax.Array:
    """inputs [b, s] -> encoded [b, s, e]."""
    return self.model.apply({"params": params}, inputs, method=Transformer.encode)

  def init_cache(self, inputs: jax.Array, max_decode_len: int):
    """Zeroed cache for a batch: self-attention [b, n, h, d] per layer,
    cross-attention [b, s, h, d].

    Shapes come from tracing `init` (nothing is computed).
    """
    batch = inputs.shape[0]
    shapes = jax.eval_shape(
        lambda: self.model.init(
            jax.random.PRNGKey(0), inputs, jnp.zeros((batch, max_decode_len), jnp.int32)
        )["cache"]
    )
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)

  def step(self, params, cache, encoded, inputs, tokens, position):
    """One decoding step. tokens [b] (the previous output), position: int scalar.

    `encoded` is passed on the first step (it fills the cross-attention cache) and None after.
    Returns (log_probs [b, v] float32, new cache).
    """
    batch = tokens.shape[0]
    logits, variables = self.model.apply(
        {"params": params, "cache": cache},
        encoded,
        inputs,
        tokens[:, None],  # [b, 1]
        jnp.full((batch, 1), position, jnp.int32),  # targets_positions
        method=Transformer.decode,
        mutable=["cache"],
    )
    return jax.nn.log_softmax(logits[:, 0], axis=-1), variables["cache"]

  def search_step(self, params, cache, encoded, inputs, tokens, position):
    """`step` for a search: PAD and BOS are ruled out as outputs (-inf), since an emitted PAD
    would be read as padding and BOS only ever starts a sentence."""
    log_probs, cache = self.step(params, cache, encoded, inputs, tokens, position)
    return log_probs.at[:, (PAD_ID, BOS_ID)].set(-jnp.inf), cache


def max_decode_length(inputs: jax.Array, extra: int, max_len: int) -> int:
  """§6.1: maximum output length = input length + 50, within the positional table's range."""
  return min(inputs.shape[1] + extra, max_len)


def greedy_search(
    decoder: Decoder,
    params,
    inputs: jax.Array,  # [b, s]
    max_decode_len: int,
) -> jax.Array:
  """Argmax decoding. Returns tokens [b, n]: each row ends with EOS (if produced) then PAD."""
  batch = inputs.shape[0]
  encoded = decoder.encode(params, inputs)
  cache = decoder.init_cache(inputs, max_decode_len)
  bos = jnp.full((batch,), BOS_ID, jnp.int32)
  log_probs, cache = decoder.search_step(params, cache, encoded, inputs, bos, 0)

  def emit(log_probs, finished):
    token = jnp.argmax(log_probs, axis=-1).astype(jnp.int32)  # [b]
    return jnp.where(finished, PAD_ID, token), finished | (token == EOS_ID)

  token, finished = emit(log_probs, jnp.zeros((batch,), bool))
  out = jnp.full((batch, max_decode_len), PAD_ID, jnp.int32).at[:, 0].set(token)

  def cond(carry):
    t, _, _, finished, _ = carry
    return (t < max_decode_len) & ~jnp.all(finished)

  def body(carry):
    t, token, cache, finished, out = carry
    log_probs, cache = decoder.search_step(params, cache, None, inputs, token, t)
    token, finished = emit(log_probs, finished)
    return t + 1, token, cache, finished, out.at[:, t].set(token)

  *_, out = jax.lax.while_loop(cond, body, (1, token, cache, finished, out))
  return out


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

  Scalars (the self-attention `cache_index`, shared by all rows) are left alone.
  """
  return jax.tree.map(lambda x: x if x.ndim == 0 else jnp.repeat(x, beam_size, axis=0), tree)


def _gather_beams(tree: Any, parents: jax.Array) -> Any:
  """Every leaf [b*k, ...] -> the rows of the parent beams (parents [b, k], within a sentence)."""
  batch, beam = parents.shape

  def gather(x):
    if x.ndim == 0:  # cache_index: one write position for every row
      return x
    x = x.reshape((batch, beam) + x.shape[1:])  # [b, k, ...]
    return _take_beams(x, parents).reshape((batch * beam,) + x.shape[2:])  # [b*k, ...]

  return jax.tree.map(gather, tree)


def _grow(state: BeamState, log_probs: jax.Array, alpha: float) -> tuple[BeamState, jax.Array]:
  """Extends every alive hypothesis by every token. log_probs [b, k, v] -> (state, parents [b, k]).

  The beam of this step is the top k of all k*v extensions. Those ending in EOS move to the
  finished set (so with k = 1 this is exactly greedy's choice); the alive set is refilled with the
  k best extensions that do not end in EOS, so it always holds k candidates. Taking the top 2k
  first suffices: at most k of them (one per parent) end in EOS.
  """
  batch, beam, vocab = log_probs.shape
  i = state.step
  candidates = state.alive_log_probs[:, :, None] + log_probs  # [b, k, v]
  top_log_probs, top_index = jax.lax.top_k(candidates.reshape(batch, beam * vocab), 2 * beam)
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


def _search_done(state: BeamState, max_decode_len: int, alpha: float) -> jax.Array:
  """[b] bool: no alive hypothesis can still beat the worst finished one.

  Log-probs only decrease as a hypothesis grows, so an alive one ends with a score of at most
  alive_log_prob / max lp over the lengths it can still reach: lp(max_decode_len) for α >= 0
  (lp grows with length), lp(step + 1) for α < 0. While fewer than k hypotheses have finished the
  worst finished score is -inf and the sentence is not done.
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
    alpha: float = 0.6,
) -> tuple[jax.Array, jax.Array]:
  """Beam search over `step_fn(tokens [b*k], cache, position) -> (log_probs [b*k, v], cache)`.

  `first_log_probs` is the distribution of the first token (the step that read BOS, run once per
  sentence) and `cache` the state after it, with batch b: it is tiled to b*k rows here, once, and
  after every step the rows of the surviving parent beams are gathered (every leaf with a batch
  axis; scalar leaves are shared by all rows and kept). At `position` p, `tokens` are the tokens
  chosen at p - 1. Beam rows are sentence-major: row r is sentence r // k, beam r % k.

  Returns (tokens [b, k, n], scores [b, k]), best first, score = log P(Y) / lp(Y). Tokens end with
  EOS then PAD. A sentence with no finished hypothesis after `max_decode_len` tokens returns its
  alive ones instead (no EOS, scored with |Y| = n); slots left empty have score -inf, all PAD.
  The loop stops early once, for every sentence, no alive hypothesis can beat the worst finished.
  """
  batch, vocab = first_log_probs.shape
  if beam_size < 1:
    raise ValueError(f"beam_size={beam_size} must be >= 1")
  if max_decode_len < 1:
    raise ValueError(f"max_decode_len={max_decode_len} must be >= 1")
  if vocab < 2:
    raise ValueError(f"the vocabulary must have at least 2 tokens, got {vocab}")
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
  state, _ = _grow(state, first, alpha)  # every row of a sentence is the same: no gather needed
  cache = _tile_beams(cache, k)  # [b, ...] -> [b*k, ...], once

  def cond(carry):
    state, _ = carry
    return (state.step < n) & ~jnp.all(_search_done(state, n, alpha))

  def body(carry):
    state, cache = carry
    tokens = state.alive_seqs[:, :, state.step - 1].reshape(batch * k)  # [b*k]
    log_probs, cache = step_fn(tokens, cache, state.step)  # [b*k, v]
    state, parents = _grow(state, log_probs.astype(jnp.float32).reshape(batch, k, vocab), alpha)
    return state, _gather_beams(cache, parents)

  state, _ = jax.lax.while_loop(cond, body, (state, cache))

  any_finished = state.finished_scores[:, 0] > -jnp.inf  # [b]
  alive_scores = state.alive_log_probs / length_penalty(state.step, alpha)  # [b, k], |Y| = step
  scores = jnp.where(any_finished[:, None], state.finished_scores, alive_scores)  # [b, k]
  tokens = jnp.where(any_finished[:, None, None], state.finished_seqs, state.alive_seqs)
  tokens = jnp.where((scores > -jnp.inf)[:, :, None], tokens, PAD_ID)  # [b, k, n]
  return tokens, scores


def beam_search(
    decoder: Decoder,
    params,
    inputs: jax.Array,  # [b, s]
    max_decode_len: int,
    beam_size: int = 4,
    alpha: float = 0.6,
) -> tuple[jax.Array, jax.Array]:
  """§6.1 beam search. Returns (tokens [b, k, n], scores [b, k]), best first.

  The encoder and the first decoder step (which projects the encoder-decoder keys/values into the
  cache) run once per sentence; only then is the cache tiled to b*k rows.
  """
  batch = inputs.shape[0]
  encoded = decoder.encode(params, inputs)  # [b, s, e]
  cache = decoder.init_cache(inputs, max_decode_len)
  bos = jnp.full((batch,), BOS_ID, jnp.int32)
  first_log_probs, cache = decoder.search_step(params, cache, encoded, inputs, bos, 0)  # [b, v]
  beam_inputs = jnp.repeat(inputs, beam_size, axis=0)  # [b*k, s], for the cross-attention mask

  def step_fn(tokens, cache, position):
    return decoder.search_step(params, cache, None, beam_inputs, tokens, position)

  return beam_search_with_step_fn(
      step_fn, first_log_probs, cache, max_decode_len, beam_size, alpha
  )


def make_predict_fn(
    config: TransformerConfig,
    max_decode_extra: int,
    beam_size: int = 1,
    alpha: float = 0.6,
) -> Callable:
  """(params, inputs [b, s]) -> tokens [b, n], EOS then PAD; jit compiles once per input shape.

  beam_size 1 is greedy search; otherwise beam search (§6.1: beam 4, α = 0.6) and its best
  hypothesis.
  """
  if beam_size < 1:
    raise ValueError(f"beam_size={beam_size} must be >= 1 (1 = greedy search)")
  decoder = Decoder(config)

  @jax.jit
  def predict(params, inputs):
    n = max_decode_length(inputs, max_decode_extra, config.max_len)
    if beam_size == 1:
      return greedy_search(decoder, params, inputs, n)
    tokens, _ = beam_search(decoder, params, inputs, n, beam_size, alpha)
    return tokens[:, 0]  # [b, n], the best hypothesis

  return predict
