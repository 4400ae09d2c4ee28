"""Greedy and beam search (§6.1) over a model's steps, read top to bottom.

A search sees the model only as a `Stepper`: `step(tokens, cache, position) -> (log_probs,
cache)` and `follow(cache, parents)`, how a beam's cache continues its parent's prefix
(decoder.py gives both for any decodable model). `Greedy` and `Beam` are each an init / step /
done / result over a small state; `run_steps` is the loop that steps them; `greedy_search`,
`beam_search` and `beam_search_with_step_fn` are the reference, one loop over the whole output
length. decode.py's `Predictor` runs the same searches fast, in blocks of steps.

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
CTranslate2 and fairseq: fewer steps, and a translation may differ (docs/translation.md). The
top 2k extensions come from the 2k chunks of the vocabulary with the highest maxima
(`top_k.top_extensions`, the flat top_k's result).

A constraint (`constrain(log_probs [..., v], prefixes [..., n], limit [b]) -> log_probs`, a
task's: tasks/base.py) may reshape each step's distribution given each hypothesis' tokens
so far and its sentence's output limit. Where few tokens can ever follow, it may answer with
`Candidates` (the log-probs of m token ids each, m << v) instead: the searches then choose among
those m, not the vocabulary, and their results are the same.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from transformer_jax.data.tokenizer import EOS_ID, PAD_ID
from transformer_jax.decoding import top_k
from transformer_jax.decoding.batch_shapes import STOPS


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


class Stepper(NamedTuple):
  """The model as a search steps it: `step(tokens [r], cache, position) -> (log_probs [r, v],
  cache)`, and `follow(cache, parents [b, k]) -> cache`: beam j of sentence i continues the prefix
  of beam parents[i, j] (rows are sentence-major: row i*k + j). The default follows a cache whose
  every leaf has one row per beam, by gathering them; a model's own cache follows itself
  (decoder.py)."""

  step: Callable
  follow: Callable = None  # type: ignore[assignment]  # None: follow_rows

  def follow_beams(self, cache, parents):
    return (self.follow or follow_rows)(cache, parents)


def follow_rows(cache: Any, parents: jax.Array) -> Any:
  """Every leaf [b*k, ...] of `cache` takes its rows from the parents [b, k] (scalars stay)."""
  batch, beams = parents.shape
  rows = (jnp.arange(batch)[:, None] * beams + parents).reshape(-1)  # [b*k]
  return jax.tree.map(lambda x: x if x.ndim == 0 else x[rows], cache)


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

  def step(self, model: Stepper, state: GreedyState, cache, alpha):
    log_probs, cache = model.step(state.token, cache, state.step)  # [b, v]
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
  limit: jax.Array  # [b] int32: the sentence's maximum output length


@dataclasses.dataclass(frozen=True)
class Beam:
  """§6.1 beam search with the GNMT length penalty."""

  beam_size: int = 4
  constrain: Callable | None = None  # (log_probs [b, k, v], alive_seqs [b, k, n], limit [b])
  best_only: bool = False  # only the best is wanted: done once no alive one can beat it
  stop: str = "proven"  # or "k_finished": also done once k hypotheses have finished (`done`)

  def __post_init__(self):
    check_stop(self.stop)

  def init(self, first_log_probs, limit, max_decode_len: int, alpha) -> BeamState:
    """The state after the first step ([b, v], the distribution after BOS). Only beam 0 is real
    at first."""
    batch, vocab = first_log_probs.shape
    k, n = self.beam_size, max_decode_len
    empty = jnp.full((batch, k, n), PAD_ID, jnp.int32)
    state = BeamState(
        step=jnp.array(0, jnp.int32),
        alive_seqs=empty,
        alive_log_probs=jnp.full((batch, k), -jnp.inf).at[:, 0].set(0.0),
        finished_seqs=empty,
        finished_scores=jnp.full((batch, k), -jnp.inf),
        limit=limit,
    )
    first = jnp.broadcast_to(first_log_probs.astype(jnp.float32)[:, None], (batch, k, vocab))
    return self._extend(state, first, alpha)[0]  # every beam is the same: parent 0

  def step(self, model: Stepper, state: BeamState, cache, alpha):
    """Extends every alive hypothesis of the sentences not done; the others stay as they are
    (their rows go on being computed, and are never read)."""
    batch, k = state.alive_log_probs.shape
    tokens = state.alive_seqs[:, :, state.step - 1].reshape(batch * k)  # [r]
    log_probs, cache = model.step(tokens, cache, state.step)  # [r, v]
    grown, parents = self._extend(state, log_probs.reshape(batch, k, -1), alpha)
    cache = model.follow_beams(cache, parents)  # the beams' prefixes are their parents'
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


def run_steps(search, model: Stepper, state, cache, alpha, end: int, exit_at: jax.Array | int = 0):
  """Steps `search` over `model` while step < `end` and more than `exit_at` sentences are not
  done."""

  def running(carry):
    state, _ = carry
    return (state.step < end) & (jnp.sum(~search.done(state, alpha)) > exit_at)

  def step(carry):
    return search.step(model, *carry, alpha)

  return jax.lax.while_loop(running, step, (state, cache))


def _tile_rows(tree: Any, beam_size: int) -> Any:
  """Every leaf [b, ...] -> [b*k, ...] (each row repeated k times); scalars are left alone."""
  return jax.tree.map(lambda x: x if x.ndim == 0 else jnp.repeat(x, beam_size, axis=0), tree)


def _reference(search, model: Stepper, first_log_probs, cache, n, alpha, limit, widen):
  """Runs `search` over the whole output length `n` in one loop; returns its final state."""
  if limit is None:
    limit = jnp.full(first_log_probs.shape[:1], n, jnp.int32)
  state = search.init(first_log_probs, limit, n, alpha)
  cache = widen(cache, search.beam_size) if search.beam_size > 1 else cache
  return run_steps(search, model, state, cache, alpha, n)[0]


def beam_search_with_step_fn(
    step_fn: Callable, first_log_probs: jax.Array, cache: Any, max_decode_len: int,
    beam_size: int = 4, alpha: float | jax.Array = 0.6, *, limit: jax.Array | None = None,
    widen: Callable = _tile_rows, follow: Callable | None = None,
    constrain: Callable | None = None, best_only: bool = False, stop: str = "proven",
) -> tuple[jax.Array, jax.Array, jax.Array]:  # fmt: skip
  """Beam search over `step_fn(tokens [r], cache, position) -> (log_probs [r, v], cache)`.

  `first_log_probs` is the distribution after BOS and `cache` the state after that step, batch
  b; `widen(cache, k)` gives it k beams (default: repeat every leaf's rows), and `follow(cache,
  parents)` makes each beam continue its parent's prefix (`Stepper`; default: gather the rows).
  `limit` [b]: each sentence's maximum output length (default: `max_decode_len`); `constrain`,
  `best_only` and `stop` as `Beam`'s.

  Returns (tokens [b, k, n], scores [b, k], steps) as `Beam.result` (with `best_only`, only
  tokens[:, 0] is the k-best search's); steps counts the calls of `step_fn` plus the first step.
  """
  check_beam_size(beam_size)
  if max_decode_len < 1:
    raise ValueError(f"max_decode_len={max_decode_len} must be >= 1")
  if first_log_probs.shape[1] < 2:
    raise ValueError(f"the vocabulary must have at least 2 tokens, got {first_log_probs.shape[1]}")
  search = Beam(beam_size, constrain, best_only, stop)
  model = Stepper(step_fn, follow)
  state = _reference(search, model, first_log_probs, cache, max_decode_len, alpha, limit, widen)
  return *search.result(state, alpha), state.step


def beam_search(
    decoder, params, inputs, max_decode_len, beam_size=4, alpha=0.6, limit=None, constraint=None,
    best_only=False, stop="proven",
):  # fmt: skip
  """§6.1 beam search of a batch [b, s] -> (tokens [b, k, n], scores [b, k], steps).
  `constraint(log_probs, prefixes, limit, inputs)`: see `Predictor`; `best_only`, `stop`:
  `Beam`'s."""
  first_log_probs, cache, invariant = decoder.start(params, inputs, max_decode_len)
  return beam_search_with_step_fn(
      decoder.step_fn(params, inputs, invariant), first_log_probs, cache, max_decode_len,
      beam_size, alpha, limit=limit, widen=decoder.widen, follow=decoder.follow,
      constrain=make_search(beam_size, constraint, inputs).constrain, best_only=best_only,
      stop=stop,
  )  # fmt: skip


def greedy_search(decoder, params, inputs, max_decode_len, limit=None, constraint=None):
  """Argmax decoding of a batch [b, s] -> (tokens [b, n], EOS then PAD; steps)."""
  first_log_probs, cache, invariant = decoder.start(params, inputs, max_decode_len)
  model = Stepper(decoder.step_fn(params, inputs, invariant))
  search = make_search(1, constraint, inputs)
  state = _reference(search, model, first_log_probs, cache, max_decode_len, 0.0, limit, None)
  return state.out, state.step


def make_search(
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


def check_stop(stop: str):
  if stop not in STOPS:
    raise ValueError(f"stop={stop!r}: expected one of {STOPS}")


def check_beam_size(beam_size: int):
  if beam_size < 1:
    raise ValueError(f"beam_size={beam_size} must be >= 1 (1 = greedy search)")
