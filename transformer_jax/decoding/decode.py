"""Greedy and beam search (§6.1), and the Transformer decoded with them.

The model side is incremental.py's `IncrementalDecoder`: `start` (encode, then the first step,
which reads BOS) and `step_fn(tokens, cache, position, slots) -> (log_probs, cache)`. Here:
  * The searches, over any such `step_fn`, knowing nothing of Flax: `Greedy` and `Beam`, each
    an init / step / done / result over a small state, and `run_steps`, the loop that steps
    them. `greedy_search`, `beam_search` and `beam_search_with_step_fn` are the reference: one
    loop over the whole output length.
  * `Predictor`, the fast run of the same searches: blocks of steps driven from the host, so that
    finished sentences leave the batch. Tests compare it with the reference.

Shapes: b sentences, s source length, n output length, v vocabulary, k beams, r = b * k rows.

Each sentence's output limit is its own: source tokens (EOS included) + `max_decode_extra`
(§6.1: input length + 50; fairseq's max_len_a * src + max_len_b with a = 1), within the
positional table. A translation therefore does not depend on the sentences batched with it.

Beam search keeps per sentence, as tensor2tensor and the Flax WMT example do, k "alive"
hypotheses (extended every step) and k "finished" ones (ended with EOS, ranked by the length-
penalised score, never extended); an EOS extension joins the finished set only if it ranks among
the k best extensions of its step (fairseq's rule), so with k = 1 it makes greedy's choices for
α = 0. A sentence is done at its limit or once no alive hypothesis can beat its worst finished
one (its best, with `best_only`: the same best, sooner); from then on its state stays as it is.
That stop is proven: the result is the search's to the output limit. `stop="k_finished"` (an
option, off by default) also stops a sentence once k hypotheses have finished, the rule of
CTranslate2 and fairseq: fewer steps, and a translation may differ (docs/translation.md).

What makes it fast on a CPU (each measured, see benchmarks/decode.py): the KV cache is never
reordered (one cross-attention copy per sentence, a slot table for the beams: kv_cache.py); it
grows in blocks of positions (batch_shapes.py); the top 2k extensions come from the 2k chunks of
the vocabulary with the highest maxima (`top_k.top_extensions`, the flat top_k's result); finished
sentences leave the batch (`Predictor`); α is traced, so trying several α compiles once.

A constraint (`constrain(log_probs [..., v], prefixes [..., n], limit [b]) -> log_probs`, a
task's: tasks/base.py) may reshape each step's distribution given each hypothesis' tokens
so far and its sentence's output limit. Where few tokens can ever follow, it may answer with
`Candidates` (the log-probs of m token ids each, m << v) instead: the searches then choose among
those m, not the vocabulary, and their results are the same. A constraint whose answer is the same
for any per-row shift of its input (it renormalizes; `takes_logits = True`) is given the model's
logits by `Predictor`, not their log-softmax.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax.data.tokenizer import EOS_ID, PAD_ID
from transformer_jax.decoding import batch_shapes, top_k
from transformer_jax.decoding import refill as refill_lib
from transformer_jax.decoding.batch_shapes import STOPS, Shapes
from transformer_jax.model.config import TransformerConfig
from transformer_jax.model.incremental import IncrementalDecoder
from transformer_jax.parallel import distributed


def output_limits(inputs: jax.Array, extra: int, max_decode_len: int) -> jax.Array:
  """[b] int32: each sentence's maximum output length, its source length (EOS included) + extra
  (§6.1), within `max_decode_len`. `inputs` [b, s]."""
  lengths = jnp.sum(inputs != PAD_ID, axis=1, dtype=jnp.int32)
  return jnp.minimum(lengths + extra, max_decode_len)


class Candidates(NamedTuple):
  """A constrained step's distribution over a few tokens: `log_probs` [..., m] of the token ids
  `ids` [..., m] (-inf: not allowed); every token not among them has probability 0. An id may
  be given twice only if at most one of its entries is finite (a beam would hold it twice)."""

  log_probs: jax.Array  # [..., m] float32
  ids: jax.Array  # [..., m] int32


def dense(candidates: Candidates, vocab: int) -> jax.Array:
  """Candidates [..., m] as the log-probs [..., v] they stand for (-inf elsewhere; an id given
  twice keeps its highest value). For tests and inspection: the searches never build it."""
  ids = candidates.ids.reshape(-1, candidates.ids.shape[-1])  # [rows, m]
  rows = jnp.arange(ids.shape[0])[:, None]
  out = jnp.full((ids.shape[0], vocab), -jnp.inf, jnp.float32)
  out = out.at[rows, ids].max(candidates.log_probs.reshape(ids.shape))  # [rows, v]
  return out.reshape(candidates.ids.shape[:-1] + (vocab,))


# ----------------------------------------------------------------------------- greedy search


class GreedyState(NamedTuple):
  step: jax.Array  # int32 scalar: tokens chosen so far
  token: jax.Array  # [b] int32: the token chosen last (PAD once finished)
  finished: jax.Array  # [b] bool: EOS chosen, or the limit reached
  out: jax.Array  # [b, n] int32: the tokens chosen, then PAD
  limit: jax.Array  # [b] int32: the sentence's maximum output length


@dataclasses.dataclass(frozen=True)
class Greedy:
  """Argmax decoding: the most probable token each step."""

  beam_size: int = 1
  constrain: Callable | None = None  # (log_probs [b, v], out [b, n], limit [b]) -> log_probs

  def init(self, first_log_probs, limit, max_decode_len: int, alpha) -> GreedyState:
    batch = first_log_probs.shape[0]
    out = jnp.full((batch, max_decode_len), PAD_ID, jnp.int32)
    state = GreedyState(jnp.array(0, jnp.int32), out[:, 0], jnp.zeros(batch, bool), out, limit)
    return self._emit(state, first_log_probs)

  def step(self, step_fn, state: GreedyState, cache, alpha):
    log_probs, cache = step_fn(state.token, cache, state.step)  # [b, v]
    return self._emit(state, log_probs), cache

  def _emit(self, state: GreedyState, log_probs) -> GreedyState:
    if self.constrain is not None:
      log_probs = self.constrain(log_probs, state.out, state.limit)
    if isinstance(log_probs, Candidates):  # the best of a few [b, m]
      best = top_k.argmax(log_probs.log_probs)  # [b]
      token = jnp.take_along_axis(log_probs.ids, best[:, None], axis=-1)[:, 0]
    else:
      token = top_k.argmax(log_probs)  # [b]: the first maximum, as jnp.argmax
    token = jnp.where(state.finished, PAD_ID, token)
    finished = state.finished | (token == EOS_ID) | (state.step + 1 >= state.limit)
    out = state.out.at[:, state.step].set(token)
    return GreedyState(state.step + 1, token, finished, out, state.limit)

  def done(self, state: GreedyState, alpha) -> jax.Array:
    return state.finished

  def best(self, state: GreedyState, alpha) -> jax.Array:
    return state.out  # [b, n]


# ----------------------------------------------------------------------------- beam search


def length_penalty(length, alpha: float):
  """lp(Y) = ((5 + |Y|) / 6)^α — GNMT (Wu et al., 2016, Eq. 14), α = 0.6 in §6.1; |Y| counts
  the generated tokens including EOS. Works on Python numbers and on arrays."""
  return ((5.0 + length) / 6.0) ** alpha


class BeamState(NamedTuple):
  step: jax.Array  # int32 scalar: tokens chosen so far (the alive length)
  alive_seqs: jax.Array  # [b, k, n] int32, PAD after the chosen tokens
  alive_log_probs: jax.Array  # [b, k] float32 log P(prefix), best first; -inf = empty
  finished_seqs: jax.Array  # [b, k, n] int32, EOS then PAD
  finished_scores: jax.Array  # [b, k] float32 log P(Y) / lp(Y), best first; -inf = empty
  slots: jax.Array  # [b, k, n] int32: the cache slot of each position of each beam's prefix
  limit: jax.Array  # [b] int32: the sentence's maximum output length


@dataclasses.dataclass(frozen=True)
class Beam:
  """§6.1 beam search with the GNMT length penalty."""

  beam_size: int = 4
  constrain: Callable | None = None  # (log_probs [b, k, v], alive_seqs [b, k, n], limit [b])
  best_only: bool = False  # only the best is wanted: done once no alive one can beat it
  stop: str = "proven"  # or "k_finished": also done once k hypotheses have finished (`done`)

  def __post_init__(self):
    _check_stop(self.stop)

  def init(self, first_log_probs, limit, max_decode_len: int, alpha) -> BeamState:
    """The state after the first step ([b, v], the distribution after BOS). Only beam 0 is real
    at first; position 0 (the step that read BOS) is in slot 0 for every beam."""
    batch, vocab = first_log_probs.shape
    k, n = self.beam_size, max_decode_len
    empty = jnp.full((batch, k, n), PAD_ID, jnp.int32)
    state = BeamState(
        step=jnp.array(0, jnp.int32),
        alive_seqs=empty,
        alive_log_probs=jnp.full((batch, k), -jnp.inf).at[:, 0].set(0.0),
        finished_seqs=empty,
        finished_scores=jnp.full((batch, k), -jnp.inf),
        slots=jnp.zeros((batch, k, n), jnp.int32),
        limit=limit,
    )
    first = jnp.broadcast_to(first_log_probs.astype(jnp.float32)[:, None], (batch, k, vocab))
    return self._extend(state, first, alpha)[0]  # every beam is the same: parent 0

  def step(self, step_fn, state: BeamState, cache, alpha):
    """Extends every alive hypothesis of the sentences not done; the others stay as they are."""
    batch, k = state.alive_log_probs.shape
    tokens = state.alive_seqs[:, :, state.step - 1].reshape(batch * k)  # [r]
    log_probs, cache = step_fn(tokens, cache, state.step, state.slots)  # [r, v]
    grown, parents = self._extend(state, log_probs.reshape(batch, k, -1), alpha)
    slots = _take_beams(state.slots, parents).at[:, :, state.step].set(parents)  # [b, k, n]
    grown = grown._replace(slots=slots)
    done = self.done(state, alpha)  # [b]
    return jax.tree.map(lambda new, old: _where_sentence(done, old, new), grown, state), cache

  def _extend(self, state: BeamState, log_probs, alpha) -> tuple[BeamState, jax.Array]:
    log_probs = log_probs.astype(jnp.float32)
    if self.constrain is not None:
      log_probs = self.constrain(log_probs, state.alive_seqs, state.limit)
    if not isinstance(log_probs, Candidates):  # every token of the vocabulary a candidate
      return _grow(state, log_probs, None, alpha)
    return _grow(state, log_probs.log_probs, log_probs.ids, alpha)

  def done(self, state: BeamState, alpha) -> jax.Array:
    """[b] bool: at the limit, or no alive hypothesis can beat the worst finished one (with
    `best_only`, the best: the same best hypothesis, found in fewer steps).

    Log-probs only decrease as a hypothesis grows, so an alive one ends with a score of at most
    alive_log_prob / max lp over the lengths it can still reach: lp(limit) for α >= 0 (lp grows
    with length), lp(step + 1) for α < 0. Once done, a sentence's finished set (its best) cannot
    change.

    With `stop="k_finished"`, a sentence is also done once k hypotheses have finished (an EOS
    extension ranked among the k best of its step, as CTranslate2 and fairseq count them): the
    best of those k, which an alive hypothesis might still have beaten.
    """
    best_alive = self.best_scores(state, alpha)[:, 0]  # [b]
    finished = state.finished_scores[:, 0 if self.best_only else -1]
    done = (state.step >= state.limit) | (finished >= best_alive)
    if self.stop == "k_finished":  # the finished set keeps the k best: full once k finished
      done |= state.finished_scores[:, -1] > -jnp.inf
    return done

  @staticmethod
  def best_scores(state: BeamState, alpha) -> jax.Array:
    """[b, k]: the best score each alive hypothesis can still end with (`done`'s bound)."""
    longest = jnp.where(alpha >= 0, state.limit, state.step + 1)  # [b]; alpha may be traced
    return state.alive_log_probs / length_penalty(longest, alpha)[:, None]

  def result(self, state: BeamState, alpha) -> tuple[jax.Array, jax.Array]:
    """(tokens [b, k, n], scores [b, k]), best first: the finished hypotheses, or the alive ones
    (no EOS, |Y| = their length) of a sentence where none finished; empty slots -inf, all PAD."""
    any_finished = state.finished_scores[:, :1] > -jnp.inf  # [b, 1]
    length = jnp.minimum(state.step, state.limit)[:, None]  # [b, 1]
    alive_scores = state.alive_log_probs / length_penalty(length, alpha)  # [b, k]
    scores = jnp.where(any_finished, state.finished_scores, alive_scores)  # [b, k]
    tokens = jnp.where(any_finished[:, :, None], state.finished_seqs, state.alive_seqs)
    return jnp.where((scores > -jnp.inf)[:, :, None], tokens, PAD_ID), scores

  def best(self, state: BeamState, alpha) -> jax.Array:
    return self.result(state, alpha)[0][:, 0]  # [b, n]


def _where_sentence(mask: jax.Array, x: jax.Array, y: jax.Array) -> jax.Array:
  """x where mask [b] else y, for leaves [b, ...]; a scalar leaf comes from y."""
  return y if x.ndim == 0 else jnp.where(mask.reshape(mask.shape + (1,) * (x.ndim - 1)), x, y)


def _take_beams(x: jax.Array, index: jax.Array) -> jax.Array:
  """x [b, m, ...], index [b, j] -> [b, j, ...]: the rows `index` of each sentence."""
  return x[jnp.arange(x.shape[0])[:, None], index]


def _grow(state: BeamState, log_probs: jax.Array, ids, alpha) -> tuple[BeamState, jax.Array]:
  """Extends every alive hypothesis by every token. log_probs [b, k, v] -> (state, parents [b, k]);
  with `ids` [b, k, m], log_probs [b, k, m] are those tokens' (`Candidates`), the rest excluded.

  The beam of this step is the top k of all k*v extensions. Those ending in EOS move to the
  finished set (so with k = 1 this is exactly greedy's choice); the alive set is refilled with the
  k best extensions that do not end in EOS. Taking the top 2k first suffices: at most k of them
  (one per parent) end in EOS.
  """
  _, beam, vocab = log_probs.shape
  i = state.step
  candidates = state.alive_log_probs[:, :, None] + log_probs  # [b, k, v]
  top_log_probs, top_index = top_k.top_extensions(candidates, 2 * beam)  # [b, 2k]
  parents = top_index // vocab  # [b, 2k]
  if ids is None:
    tokens = (top_index % vocab).astype(jnp.int32)  # [b, 2k]
  else:  # vocab is m here: the candidates' own ids
    tokens = jnp.take_along_axis(ids.reshape(ids.shape[0], -1), top_index, axis=1)  # [b, 2k]
  seqs = _take_beams(state.alive_seqs, parents).at[:, :, i].set(tokens)  # [b, 2k, n]
  is_eos = tokens == EOS_ID
  # Alive: the k best that continue (an EOS candidate never stays alive, so is never extended).
  alive_log_probs, keep = jax.lax.top_k(jnp.where(is_eos, -jnp.inf, top_log_probs), beam)  # [b, k]
  # Finished: EOS candidates within this step's beam (rank < k), scored with |Y| = i + 1. The
  # old finished come first, so a tie keeps the earlier (shorter) hypothesis.
  in_beam = is_eos & (jnp.arange(2 * beam) < beam)[None, :]  # [b, 2k]
  new_scores = jnp.where(in_beam, top_log_probs / length_penalty(i + 1, alpha), -jnp.inf)
  scores = jnp.concatenate([state.finished_scores, new_scores], axis=1)  # [b, 3k]
  finished_scores, best = jax.lax.top_k(scores, beam)  # [b, k]
  finished_seqs = _take_beams(jnp.concatenate([state.finished_seqs, seqs], axis=1), best)
  new_state = state._replace(
      step=i + 1,
      alive_seqs=_take_beams(seqs, keep),  # [b, k, n]
      alive_log_probs=alive_log_probs,
      finished_seqs=finished_seqs,
      finished_scores=finished_scores,
  )
  return new_state, _take_beams(parents, keep)  # [b, k]


# ----------------------------------------------------------------------------- the reference


def run_steps(search, step_fn, state, cache, alpha, end: int, exit_at: jax.Array | int = 0):
  """Steps `search` while step < `end` and more than `exit_at` sentences are not done."""

  def running(carry):
    state, _ = carry
    return (state.step < end) & (jnp.sum(~search.done(state, alpha)) > exit_at)

  def step(carry):
    return search.step(step_fn, *carry, alpha)

  return jax.lax.while_loop(running, step, (state, cache))


def _tile_rows(tree: Any, beam_size: int) -> Any:
  """Every leaf [b, ...] -> [b*k, ...] (each row repeated k times); scalars are left alone."""
  return jax.tree.map(lambda x: x if x.ndim == 0 else jnp.repeat(x, beam_size, axis=0), tree)


def _reference(search, step_fn, first_log_probs, cache, n, alpha, limit, tile):
  """Runs `search` over the whole output length `n` in one loop; returns its final state."""
  if limit is None:
    limit = jnp.full(first_log_probs.shape[:1], n, jnp.int32)
  state = search.init(first_log_probs, limit, n, alpha)
  cache = tile(cache, search.beam_size) if search.beam_size > 1 else cache
  return run_steps(search, step_fn, state, cache, alpha, n)[0]


def beam_search_with_step_fn(
    step_fn: Callable, first_log_probs: jax.Array, cache: Any, max_decode_len: int,
    beam_size: int = 4, alpha: float | jax.Array = 0.6, *, limit: jax.Array | None = None,
    tile: Callable = _tile_rows, constrain: Callable | None = None, best_only: bool = False,
    stop: str = "proven",
) -> tuple[jax.Array, jax.Array, jax.Array]:  # fmt: skip
  """Beam search over `step_fn(tokens [r], cache, position, slots) -> (log_probs [r, v], cache)`.

  `first_log_probs` is the distribution after BOS and `cache` the state after that step, batch
  b; `tile(cache, k)` gives it room for k beams (default: repeat every leaf's rows). Row j of
  sentence i (row i*k + j) writes position p into slot j and reads its prefix's positions q < p
  from slots[i, j, q]; the search never reorders the cache. `limit` [b]: each sentence's maximum
  output length (default: `max_decode_len`); `constrain`, `best_only` and `stop` as `Beam`'s.

  Returns (tokens [b, k, n], scores [b, k], steps) as `Beam.result` (with `best_only`, only
  tokens[:, 0] is the k-best search's); steps counts the calls of `step_fn` plus the first step.
  """
  _check_beam_size(beam_size)
  if max_decode_len < 1:
    raise ValueError(f"max_decode_len={max_decode_len} must be >= 1")
  if first_log_probs.shape[1] < 2:
    raise ValueError(f"the vocabulary must have at least 2 tokens, got {first_log_probs.shape[1]}")
  search = Beam(beam_size, constrain, best_only, stop)
  state = _reference(search, step_fn, first_log_probs, cache, max_decode_len, alpha, limit, tile)
  return *search.result(state, alpha), state.step


def beam_search(
    decoder, params, inputs, max_decode_len, beam_size=4, alpha=0.6, limit=None, constraint=None,
    best_only=False, stop="proven",
):  # fmt: skip
  """§6.1 beam search of a batch [b, s] -> (tokens [b, k, n], scores [b, k], steps).
  `constraint(log_probs, prefixes, limit, inputs)`: see `Predictor`; `best_only`, `stop`:
  `Beam`'s."""
  first_log_probs, cache, sentence = decoder.start(params, inputs, max_decode_len)
  return beam_search_with_step_fn(
      decoder.step_fn(params, inputs, sentence), first_log_probs, cache, max_decode_len,
      beam_size, alpha, limit=limit, tile=decoder.add_beams,
      constrain=_search(beam_size, constraint, inputs).constrain, best_only=best_only, stop=stop,
  )  # fmt: skip


def greedy_search(decoder, params, inputs, max_decode_len, limit=None, constraint=None):
  """Argmax decoding of a batch [b, s] -> (tokens [b, n], EOS then PAD; steps)."""
  first_log_probs, cache, sentence = decoder.start(params, inputs, max_decode_len)
  step_fn = decoder.step_fn(params, inputs, sentence)
  search = _search(1, constraint, inputs)
  state = _reference(search, step_fn, first_log_probs, cache, max_decode_len, 0.0, limit, None)
  return state.out, state.step


# ----------------------------------------------------------------------------- the fast run


class SearchCarry(NamedTuple):
  """A batch between two blocks: every leaf but scalars has the sentences on axis 0, so
  dropping finished sentences is one gather per leaf."""

  inputs: jax.Array  # [b, s]
  sentence: Any  # the cross-attention cache, one copy per sentence
  beams: Any  # the self-attention cache (k beam slots per sentence)
  state: Any  # GreedyState or BeamState


@dataclasses.dataclass
class _Batch:
  """The host's view of a batch being searched (`Predictor.search`)."""

  where: np.ndarray  # [rows]: the batch row of each row of `carry`
  shapes: Shapes
  carry: SearchCarry | None = None  # on the devices; None before the first block
  keep: np.ndarray | None = None  # the rows of `carry` the next block goes on with
  block: int = 0  # index of the cache length being decoded in
  steps: int = 0  # decoder steps run
  row_steps: int = 0  # sentences decoded at each step, summed over the steps


class Predictor:
  """(params, inputs [b, s]) -> tokens [b, n], EOS then PAD: the best translation of each row.

  beam_size 1 is greedy search, otherwise beam search: the best hypothesis of `greedy_search` or
  `beam_search` (`Beam.best_only`), run as jitted blocks of steps driven from the host, one
  program per cache length (`cache_block_ends`), the first with the encoder and first step.
  Between blocks the host reads which sentences are done; once few enough are still decoding
  (and `compact`), they go on in a smaller batch (`Shapes.smaller`). `shapes` is a `Shapes`
  or a name of batch_shapes.NAMES (`shapes_for`); it decides only which programs are compiled. A
  done sentence's hypotheses never change, so this changes no translation, and the last blocks of
  a batch do not carry its finished sentences along. α is traced, the beam size static.
  With `refill`, a greedy call on one CPU device is searched whole by `refiller` instead
  (refill.py, `refills`; `inference.decode_sources`), with the same translations.
  `constraint(log_probs, prefixes, limit, inputs [b, s])` constrains every step (module docstring);
  `stop` is the beam's (`Beam.done`).
  """

  def __init__(
      self, config: TransformerConfig, max_decode_extra: int, beam_size: int = 1,
      alpha: float = 0.6, shapes: Shapes | str = "fast", compact: bool = True,
      constraint: Callable | None = None, stop: str = "proven", refill: bool = False,
  ):  # fmt: skip
    _check_beam_size(beam_size)
    _check_stop(stop)  # here too: before any program is traced
    if not isinstance(shapes, Shapes) and shapes not in batch_shapes.NAMES:
      raise ValueError(f"shapes={shapes!r}: expected a Shapes or one of {batch_shapes.NAMES}")
    self.config, self.max_decode_extra = config, max_decode_extra
    self.beam_size, self.alpha, self.shapes, self.compact = beam_size, alpha, shapes, compact
    self.auto_fast = False  # "auto" has decoded a call of AUTO_FEW_BELOW sentences or more
    self.constraint, self.stop = constraint, stop
    # A constraint that renormalizes over the tokens it allows answers the same for the logits
    # as for their log-softmax: it is given the logits, sparing a pass over the vocabulary.
    self.decoder = IncrementalDecoder(
        config, normalize=not getattr(constraint, "takes_logits", False)
    )
    # Greedy without a constraint takes each row's first maximum, which the log-softmax (a shift
    # of the row) leaves where it is: it is given the logits too.
    self.greedy_decoder = (
        self.decoder if constraint else dataclasses.replace(self.decoder, normalize=False)
    )
    # Greedy search of a whole call in rows that finished sentences leave (refill.py).
    self.refiller = None
    if refill:
      self.refiller = refill_lib.RefillGreedy(self.greedy_decoder, max_decode_extra)
    self._start = jax.jit(self._start_impl, static_argnames=("beam_size", "n", "end"))
    self._block = jax.jit(self._block_impl, static_argnames=("beam_size", "end"))
    self.signatures: set[tuple] = set()  # the programs called: (name, shapes, statics)
    self.saved = None  # saved_programs.SavedPrograms: run the programs exported (commands)

  def _start_impl(self, params, inputs, alpha, exit_at, beam_size, n, end):
    """Encodes, runs the first step and the first block (`_block_impl`) of a batch."""
    decoder = self.greedy_decoder if beam_size == 1 else self.decoder
    log_probs, beams, sentence = decoder.start(params, inputs, end)
    limit = output_limits(inputs, self.max_decode_extra, n)
    search = _search(beam_size, self.constraint, inputs, True, end, self.stop)
    state = search.init(log_probs, limit, n, alpha)
    if beam_size > 1:
      beams = decoder.add_beams(beams, beam_size)
    carry = SearchCarry(inputs, sentence, beams, state)
    return self._block_impl(params, carry, alpha, exit_at, None, beam_size, end)

  def _block_impl(self, params, carry, alpha, exit_at, keep, beam_size, end):
    """Keeps the sentences `keep` [b'] of `carry` (None: all), then steps until position `end`
    (the cache grown to it) or until at most `exit_at` sentences are not done. Returns (carry,
    done [b], steps run so far, the best tokens so far [b, n])."""
    if keep is not None:
      carry = jax.tree.map(lambda x: x if x.ndim == 0 else x[keep], carry)
    search = _search(beam_size, self.constraint, carry.inputs, True, end, self.stop)
    decoder = self.greedy_decoder if beam_size == 1 else self.decoder
    step_fn = decoder.step_fn(params, carry.inputs, carry.sentence)
    beams = decoder.grow(carry.beams, end, beam_size)
    state, beams = run_steps(search, step_fn, carry.state, beams, alpha, end, exit_at)
    carry = carry._replace(beams=beams, state=state)
    return carry, search.done(state, alpha), state.step, search.best(state, alpha)

  def shapes_for(self, sentences: int) -> Shapes:
    """The shapes of a call that translates `sentences` sentences (batch_shapes.SHAPES); with
    "auto", a call of AUTO_FEW_BELOW or more is remembered (`auto_fast`)."""
    if isinstance(self.shapes, Shapes):
      return self.shapes
    if self.shapes != "auto":
      return batch_shapes.SHAPES[self.shapes]
    # From the first large call on, "fast": its programs are compiled by then.
    self.auto_fast = self.auto_fast or sentences >= batch_shapes.AUTO_FEW_BELOW
    return batch_shapes.SHAPES["fast" if self.auto_fast else "few"]

  def search(self, params, inputs, alpha=None, beam_size=None, stats=None, sentences=None):
    """(tokens [b, n] on every host, decoder steps run). `sentences`: how many the whole call
    translates (`shapes_for`; default b). `stats`, if given, gains "row_steps": the sentences
    decoded at each step, summed, the cost dropping finished sentences cuts."""
    beam_size = self.beam_size if beam_size is None else beam_size
    _check_beam_size(beam_size)
    alpha = jnp.float32(self.alpha if alpha is None else alpha)
    shapes = self.shapes_for(inputs.shape[0] if sentences is None else sentences)
    n = min(inputs.shape[1] + self.max_decode_extra, self.config.max_len)  # the longest limit
    ends = batch_shapes.cache_block_ends(n, shapes.block)
    sharding = getattr(inputs, "sharding", None)  # numpy inputs: one device
    shards = inputs.shape[0] // sharding.shard_shape(inputs.shape)[0] if sharding else 1
    out = np.full((inputs.shape[0], n), PAD_ID, np.int32)
    batch = _Batch(where=np.arange(inputs.shape[0]), shapes=shapes)
    while True:
      done, tokens = self._run_block(batch, params, inputs, alpha, beam_size, n, ends, shards)
      if batch.block == len(ends) or done.all():
        break
      rows = len(batch.where)
      size = batch.shapes.smaller(rows, int((~done).sum()), shards) if self.compact else rows
      if size < rows:
        out[batch.where] = distributed.gather(tokens)  # the finished sentences' translations
        batch.keep = np.concatenate([np.flatnonzero(~done), np.flatnonzero(done)])[:size]
        batch.where = batch.where[batch.keep]
    out[batch.where] = distributed.gather(tokens)
    if stats is not None:
      stats["row_steps"] = stats.get("row_steps", 0) + batch.row_steps
    return out, batch.steps

  def _run_block(self, batch: _Batch, params, inputs, alpha, beam_size, n, ends, shards):
    """Runs `batch`'s next block; returns (done [rows] on the host, best tokens [rows, n])."""
    rows, end = len(batch.where), ends[batch.block]
    # Leave the block as soon as the batch could shrink (by `shrink`), not at its end.
    shapes = batch.shapes
    smaller = shapes.smaller(rows, -(-rows // shapes.shrink), shards) if self.compact else rows
    exit_at = np.int32(smaller if smaller < rows else 0)
    if batch.carry is None:
      self.signatures.add(("start", inputs.shape, beam_size, end))
      outputs = self._program("start", beam_size=beam_size, n=n, end=end)(
          params, inputs, alpha, exit_at
      )
    else:
      keep = None if batch.keep is None else len(batch.keep)
      self.signatures.add(("block", inputs.shape, beam_size, end, len(batch.where), keep))
      outputs = self._program("block", beam_size=beam_size, end=end)(
          params, batch.carry, alpha, exit_at, batch.keep
      )
    batch.carry, done, steps, tokens = outputs
    done, steps = distributed.gather(done), int(distributed.gather(steps))  # waits for it
    batch.row_steps += rows * (steps - batch.steps)
    batch.steps, batch.keep = steps, None
    if steps >= end:
      batch.block += 1
    return done, tokens

  def _program(self, name: str, **static) -> Callable:
    """The jitted `start` or `block` bound to its static arguments, or its exported form."""
    if self.saved is None:
      return functools.partial(self._start if name == "start" else self._block, **static)
    impl = self._start_impl if name == "start" else self._block_impl
    return self.saved.program(name, impl, static)

  def __call__(self, params, inputs, alpha=None, beam_size=None) -> np.ndarray:
    return self.search(params, inputs, alpha, beam_size)[0]

  def searches(self) -> int:
    """The distinct searches started: one per input shape and beam size (α is traced)."""
    return len({s[1:3] for s in self.signatures if s[0] == "start"})

  def programs(self) -> int:
    """The distinct programs called: starts and blocks (per rows, cache length and gather),
    and the refill search's."""
    return len(self.signatures) + (self.refiller.programs() if self.refiller else 0)

  def refills(self, beam_size: int, mesh: jax.sharding.Mesh) -> bool:
    """Whether a call of `beam_size` on `mesh` is searched by `refiller` (`refill`, greedy, no
    constraint, one CPU device, one process): measured only there (docs/experiments.md)."""
    one_cpu = mesh.size == 1 and mesh.devices.flat[0].platform == "cpu"
    return (
        bool(self.refiller)
        and beam_size == 1
        and self.constraint is None
        and one_cpu
        and (jax.process_count() == 1)
    )


def _search(
    beam_size: int,
    constraint=None,
    inputs=None,
    best_only=False,
    window: int | None = None,
    stop: str = "proven",
) -> Greedy | Beam:
  """The search for `beam_size` (a beam's `stop` rule), constrained by `constraint` bound to the
  batch's `inputs`.
  `window`: the constraint reads only the first `window` positions of each prefix (a block of
  `Predictor` steps below its cache length `end`, whose later positions are all PAD)."""
  if constraint is None:
    constrain = None
  else:

    def constrain(log_probs, prefixes, limit):
      return constraint(log_probs, prefixes[..., :window], limit, inputs=inputs)

  if beam_size == 1:
    return Greedy(constrain=constrain)
  return Beam(beam_size, constrain, best_only, stop)


def _check_stop(stop: str):
  if stop not in STOPS:
    raise ValueError(f"stop={stop!r}: expected one of {STOPS}")


def _check_beam_size(beam_size: int):
  if beam_size < 1:
    raise ValueError(f"beam_size={beam_size} must be >= 1 (1 = greedy search)")
