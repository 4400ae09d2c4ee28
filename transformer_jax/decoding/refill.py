"""Greedy and beam search of many sentences in rows that a finished sentence leaves and the next
one takes.

`decode.Predictor` searches a batch of sentences until the last is done: the batch halves now and
then (`Shapes.smaller`), but between halvings its finished rows are computed for nothing, and the
last steps of every batch carry few rows, where a step costs the weights' read all the same (on a
2-core CPU a greedy step costs ~140 µs a row at 16 rows, ~85 at 128). `Refill` searches a whole
call's sentences in R sentence rows instead: once `chunk` sentences are done, their translations
are read and the next sentences take their rows, each starting at its own position while the
others go on. The tail of the call (no sentence left) halves the rows as `Predictor` does.

How a row starts anew (kv_cache.py, "rows that start anew"): the self-attention cache is a ring of
W = the longest output limit positions, step t writes position t % W, and `row_start` [R] tells
each sentence which positions are its own. A sentence joins at step t as `Predictor` starts one
(`IncrementalDecoder.start`: its encoder and the step that reads BOS, for the chunk alone); the
BOS step's keys and values go into position t - 1 of its row (every beam slot), which becomes its
start; its source's cross-attention keys and values replace the row's. Its output index q is at
column (start + q) % W of its tokens: `RefillGreedy`'s `out` [R, W], `RefillBeam`'s sequences
and slot tables (`decode.BeamState.start`; the beam is decode.py's `Beam`, run as it is).

Each sentence's output limit is its own (decode.output_limits), so its translation is the one
`decode.greedy_search` or `decode.beam_search` gives it alone (tests/test_refill.py): the rows
beside it change only the order of float sums over padded positions, as the batch shapes of
`Predictor` do. Sentences are taken longest first, so the tail is of short sentences. One CPU
device, one process, no constraint (`Predictor.refills`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax.data.tokenizer import EOS_ID, PAD_ID
from transformer_jax.decoding import decode, top_k
from transformer_jax.decoding.batch_shapes import Shapes
from transformer_jax.model import kv_cache
from transformer_jax.model.incremental import IncrementalDecoder


class RefillCarry(NamedTuple):
  """R rows on the device between two calls; shapes: R rows, S source length, W ring columns."""

  inputs: jax.Array  # [R, S] int32: each row's source, for the cross-attention mask
  sentence: Any  # the cross-attention cache, [R, ...] (kv_cache.py)
  beams: Any  # the self-attention cache, a ring of W columns with `row_start` [R]
  token: jax.Array  # [R] int32: the token chosen last, the next step's input (PAD once finished)
  finished: jax.Array  # [R] bool: EOS chosen, the limit reached, or no sentence in the row
  out: jax.Array  # [R, W] int32: the tokens chosen, output index q at column (start + q) % W
  start: jax.Array  # [R] int32: the step whose column holds the row's BOS
  end: jax.Array  # [R] int32: the step at which the row reaches its output limit
  step: jax.Array  # int32 scalar: the next step (the ring's write index)


@dataclasses.dataclass
class Refill:
  """A search of a call's sentences in `rows` sentence rows, refilled `chunk` at a time (module
  docstring): the host's loop. `extra`: the output limit over the source length (§6.1);
  `shapes.min_rows` and `shapes.shrink` decide the rows of the tail. Its programs, each over a
  carry whose every leaf but scalars has the sentences on axis 0 (α is traced):
    _empty(rows, source, columns) -> carry, no sentence in any row (done);
    _refill(params, carry, chunk [m, S'], where [m], alpha) -> carry, the sentences in those rows;
    _run(params, carry, exit_at, alpha) -> (carry, (done [R], best [R, W], start [R], step)),
      stepping until at least `exit_at` sentences are done (or all are)."""

  decoder: IncrementalDecoder
  extra: int
  rows: int = 128
  chunk: int = 16
  shapes: Shapes = Shapes()

  def __post_init__(self):
    if self.chunk < 1 or self.rows < self.chunk or self.rows % self.chunk:
      raise ValueError(f"rows={self.rows} must be a multiple of chunk={self.chunk} >= 1")
    self._refill = jax.jit(self._refill_impl, donate_argnames="carry")
    self._run = jax.jit(self._run_impl, donate_argnames="carry")
    self._keep = jax.jit(self._keep_impl)  # smaller: nothing to donate to
    self._empty = jax.jit(self._empty_impl, static_argnames=("rows", "source", "columns"))
    self.signatures: set[tuple] = set()  # the programs called

  @staticmethod
  def _keep_impl(carry: Any, keep) -> Any:
    """The rows `keep` [R'] of `carry`."""
    return jax.tree.map(lambda x: x if x.ndim == 0 else x[keep], carry)

  # --------------------------------------------------------------------------- the host's loop

  def search(
      self, params, sources: Sequence[Sequence[int]], bucket_lengths: Sequence[int],
      max_len: int, stats: dict | None = None, alpha: float = 0.0,
  ) -> list[np.ndarray]:  # fmt: skip
    """The best output (tokens, EOS then PAD) of each token-id source (no EOS), in order.
    Sources longer than the last bucket are cut to it, as `inference.decode_batches` does.
    `stats`, if given, gains the steps run, the rows (the most at once), the row-steps, and the
    chunks taken as "batches"."""
    count = len(sources)
    results: list[np.ndarray] = [np.zeros(0, np.int32)] * count
    if count == 0:
      return results
    lengths = np.fromiter(
        (min(len(s) + 1, bucket_lengths[-1]) for s in sources), np.int64, count=count
    )
    order = np.argsort(-lengths, kind="stable")  # longest first: the tail is of short ones
    bucket_of = np.searchsorted(np.asarray(bucket_lengths), lengths)
    source = bucket_lengths[bucket_of[order[0]]]
    columns = min(source + self.extra, max_len)  # W: the longest output limit
    rows = min(self.rows, -(-count // self.chunk) * self.chunk)
    carry = self._empty(rows=rows, source=source, columns=columns)
    owner = np.full(rows, -1)  # the sentence each row holds, -1: none (or read out)
    finished = np.ones(rows, bool)
    taken, steps, row_steps, chunks = 0, 0, 0, 0
    alpha = jnp.float32(alpha)
    while True:
      free = np.flatnonzero(finished & (owner < 0))
      # The next sentences take the free rows, a whole chunk at a time (a row left over waits
      # for the next call, as it would in a padded chunk) but for the last.
      while taken < count and len(free) >= min(self.chunk, count - taken):
        where = free[: min(self.chunk, count - taken)]
        ids = order[taken : taken + len(where)]
        taken, chunks = taken + len(where), chunks + 1
        carry = self._call_refill(
            params, carry, sources, ids, where, bucket_lengths, bucket_of, alpha
        )
        owner[where], finished[where] = ids, False
        free = free[len(where) :]
      if (owner < 0).all():
        break
      held = len(owner)
      if taken == count:  # the tail: as few rows as hold the sentences left (Shapes.smaller)
        active = np.flatnonzero(owner >= 0)
        size = self.shapes.smaller(held, len(active), 1)
        if size < held:
          keep = np.concatenate([active, np.flatnonzero(owner < 0)])[:size]
          self.signatures.add(("keep", held, size))
          carry, owner, finished = self._keep(carry, keep), owner[keep], finished[keep]
          held = size
        smaller = self.shapes.smaller(held, -(-held // self.shapes.shrink), 1)
        exit_at = held - smaller if smaller < held else held
      else:
        exit_at = min(held, self.chunk)  # rows left over by the last refill count
      self.signatures.add(("run", held, source, columns))
      carry, outputs = self._run(params, carry, np.int32(exit_at), alpha)
      finished, out, start, step = jax.device_get(outputs)
      finished = np.array(finished)  # writable
      row_steps += held * (int(step) - steps)
      steps = int(step)
      for row in np.flatnonzero(finished & (owner >= 0)):  # read out the finished sentences
        results[owner[row]] = np.roll(out[row], -(start[row] % columns))
        owner[row] = -1
    if stats is not None:
      totals = {"batches": chunks, "rows": rows, "steps": steps, "row_steps": row_steps}
      for key, value in totals.items():
        stats[key] = stats.get(key, 0) + value
    return results

  def _call_refill(self, params, carry, sources, ids, where, bucket_lengths, bucket_of, alpha):
    """Puts the sentences `ids` in the rows `where` (a chunk of `self.chunk`, padded by
    repeating its last sentence and row) at the bucket length of the longest."""
    length = bucket_lengths[max(bucket_of[i] for i in ids)]
    chunk = np.full((self.chunk, length), PAD_ID, np.int32)  # [m, S']
    for row, i in enumerate(ids):
      tokens = np.asarray(sources[i], np.int32)[: length - 1]
      chunk[row, : len(tokens)] = tokens
      chunk[row, len(tokens)] = EOS_ID
    chunk[len(ids) :] = chunk[len(ids) - 1]
    padded = np.concatenate([where, np.full(self.chunk - len(where), where[-1])]).astype(np.int32)
    self.signatures.add(("refill", len(carry.inputs), carry.inputs.shape[1], length))
    return self._refill(params, carry, chunk, padded, alpha)

  def programs(self) -> int:
    """The distinct programs called."""
    return len(self.signatures)


@dataclasses.dataclass
class RefillGreedy(Refill):
  """Greedy search (`decoder` with normalize=False: the first maximum of the logits)."""

  # --------------------------------------------------------------------------- programs

  def _empty_impl(self, rows: int, source: int, columns: int) -> RefillCarry:
    """R rows, none holding a sentence (finished)."""
    inputs = jnp.full((rows, source), PAD_ID, jnp.int32)
    beams, sentence = kv_cache.split(self.decoder.init_cache(inputs, columns))
    beams = kv_cache.set_row_starts(beams, jnp.zeros(rows, jnp.int32))
    zeros = jnp.zeros(rows, jnp.int32)
    out = jnp.full((rows, columns), PAD_ID, jnp.int32)
    finished = jnp.ones(rows, bool)
    return RefillCarry(inputs, sentence, beams, zeros, finished, out, zeros, zeros, jnp.int32(0))

  def _refill_impl(self, params, carry: RefillCarry, chunk, where, alpha) -> RefillCarry:
    """The sentences `chunk` [m, S'] (ids, EOS, PAD) take the rows `where` [m] at this step.
    A row given twice must be given the same sentence (the filler of a short chunk)."""
    source, columns = carry.inputs.shape[1], carry.out.shape[1]
    logits, bos, sentence = self.decoder.start(params, chunk, 1)  # [m, v]
    token = top_k.argmax(logits)  # [m]: output index 0
    # decode.output_limits: the source's tokens (EOS included) + extra, within W
    limit = jnp.minimum(jnp.sum(chunk != PAD_ID, axis=1, dtype=jnp.int32) + self.extra, columns)
    start = carry.step - 1  # the BOS step's column, just behind the ring's write index
    column = start % columns
    wide = source - chunk.shape[1]
    sentence = kv_cache.pad_source(sentence, source)  # [m, ..., S]
    beams = kv_cache.put_column(carry.beams, where, column, bos)
    beams = kv_cache.set_row_starts(beams, carry.start.at[where].set(start))
    out = carry.out.at[where].set(PAD_ID).at[where, column].set(token)  # [R, W]
    return RefillCarry(
        inputs=carry.inputs.at[where].set(jnp.pad(chunk, ((0, 0), (0, wide)))),
        sentence=jax.tree.map(lambda old, new: old.at[where].set(new), carry.sentence, sentence),
        beams=beams,
        token=carry.token.at[where].set(token),
        finished=carry.finished.at[where].set((token == EOS_ID) | (limit <= 1)),
        out=out,
        start=carry.start.at[where].set(start),
        end=carry.end.at[where].set(start + limit),
        step=carry.step,
    )

  def _run_impl(self, params, carry: RefillCarry, exit_at, alpha):
    """Steps every row until at least `exit_at` rows are finished (or all are). Returns the
    carry and, for the host, (finished [R], out [R, W], start [R])."""
    columns = carry.out.shape[1]

    def running(carry: RefillCarry):
      finished = jnp.sum(carry.finished)
      return (finished < exit_at) & (finished < carry.finished.shape[0])

    def step(carry: RefillCarry) -> RefillCarry:
      t = carry.step
      step_fn = self.decoder.step_fn(params, carry.inputs, carry.sentence)
      logits, beams = step_fn(carry.token, carry.beams, t - carry.start)  # [R, v]; own positions
      token = jnp.where(carry.finished, PAD_ID, top_k.argmax(logits))  # [R]
      column = t % columns
      kept = jax.lax.dynamic_slice_in_dim(carry.out, column, 1, axis=1)[:, 0]  # [R]
      written = jnp.where(carry.finished, kept, token)[:, None]  # a finished row's out stays
      out = jax.lax.dynamic_update_slice_in_dim(carry.out, written, column, axis=1)  # [R, W]
      finished = carry.finished | (token == EOS_ID) | (t + 1 >= carry.end)
      return carry._replace(beams=beams, token=token, finished=finished, out=out, step=t + 1)

    carry = jax.lax.while_loop(running, step, carry)
    return carry, (carry.finished, carry.out, carry.start, carry.step)


class BeamCarry(NamedTuple):
  """R sentences of a beam search on the device between two calls (k rows each)."""

  inputs: jax.Array  # [R, S] int32: each sentence's source, for the cross-attention mask
  sentence: Any  # the cross-attention cache, [R, ...]
  beams: Any  # the self-attention cache: a ring of W positions of k slots, `row_start` [R]
  state: decode.BeamState  # its `start` [R]: each sentence's BOS step


@dataclasses.dataclass
class RefillBeam(Refill):
  """Beam search (`decode.Beam` with `best_only`, its `stop` rule) of `rows` sentences of
  `beam_size` rows each; its state's sequences and slot tables are rings of W columns, as the
  cache is (`BeamState.start`)."""

  beam_size: int = 4
  stop: str = "proven"

  @property
  def search_rule(self) -> decode.Beam:
    return decode.Beam(self.beam_size, best_only=True, stop=self.stop)

  def _empty_impl(self, rows: int, source: int, columns: int) -> BeamCarry:
    """R sentences, none searched: every one done (its limit 0 reached)."""
    k = self.beam_size
    inputs = jnp.full((rows, source), PAD_ID, jnp.int32)
    beams, sentence = kv_cache.split(self.decoder.init_cache(inputs, columns))
    beams = kv_cache.set_row_starts(kv_cache.add_beam_slots(beams, k), jnp.zeros(rows, jnp.int32))
    empty = jnp.full((rows, k, columns), PAD_ID, jnp.int32)
    nothing = jnp.full((rows, k), -jnp.inf, jnp.float32)
    zeros = jnp.zeros(rows, jnp.int32)
    state = decode.BeamState(
        jnp.int32(0), empty, nothing, empty, nothing, jnp.zeros_like(empty), zeros, zeros
    )
    return BeamCarry(inputs, sentence, beams, state)

  def _refill_impl(self, params, carry: BeamCarry, chunk, where, alpha) -> BeamCarry:
    """As `RefillGreedy`'s: the chunk's first step in every beam slot of its BOS column, and its
    search begun (`Beam.init`) at the step behind the ring's write index."""
    source, columns = carry.inputs.shape[1], carry.state.alive_seqs.shape[2]
    log_probs, bos, sentence = self.decoder.start(params, chunk, 1)  # [m, v]
    limit = jnp.minimum(jnp.sum(chunk != PAD_ID, axis=1, dtype=jnp.int32) + self.extra, columns)
    start = carry.state.step - 1
    begun = self.search_rule.init(log_probs, limit, columns, alpha, step=start)  # step: t
    beams = kv_cache.put_column(carry.beams, where, start % columns, bos, self.beam_size)
    beams = kv_cache.set_row_starts(beams, carry.state.start.at[where].set(start))
    state = carry.state._replace(
        **{
            field: getattr(carry.state, field).at[where].set(getattr(begun, field))
            for field in decode.BeamState._fields
            if field != "step"
        }
    )
    wide = source - chunk.shape[1]
    return BeamCarry(
        inputs=carry.inputs.at[where].set(jnp.pad(chunk, ((0, 0), (0, wide)))),
        sentence=jax.tree.map(
            lambda old, new: old.at[where].set(new),
            carry.sentence,
            kv_cache.pad_source(sentence, source),
        ),
        beams=beams,
        state=state,
    )

  def _run_impl(self, params, carry: BeamCarry, exit_at, alpha):
    search = self.search_rule

    def running(carry: BeamCarry):
      done = jnp.sum(search.done(carry.state, alpha))
      return (done < exit_at) & (done < carry.inputs.shape[0])

    def step(carry: BeamCarry) -> BeamCarry:
      step_fn = self.decoder.step_fn(params, carry.inputs, carry.sentence)
      state, beams = search.step(step_fn, carry.state, carry.beams, alpha)
      return carry._replace(state=state, beams=beams)

    carry = jax.lax.while_loop(running, step, carry)
    state = carry.state
    return carry, (search.done(state, alpha), search.best(state, alpha), state.start, state.step)
