"""Greedy search of many sentences in one batch whose finished rows take the next sentence.

`decode.Predictor` searches a batch of sentences until the last is done: the batch halves now and
then (`Shapes.smaller`), but between halvings its finished rows are computed for nothing, and the
last steps of every batch carry few rows, where a step costs the weights' read all the same (on a
2-core CPU a step costs ~140 µs a row at 16 rows, ~85 at 128). `RefillGreedy` searches a whole
call's sentences in R rows instead: once `chunk` rows have finished, their translations are read
and the next sentences take those rows, each starting at its own position while the others go on.
The tail of the call (no sentence left to take a row) halves the rows as `Predictor` does.

How a row starts anew (kv_cache.py, "rows that start anew"): the self-attention cache is a ring of
W = the longest output limit columns, step t writes column t % W, and `row_start` [R] tells each
row which columns are its own sentence's. A sentence joins at step t: its chunk's encoder and
cross-attention keys and values run alone (`invariant_cache`) and replace the
row's; the row's next input is BOS and its start is t, so step t of all rows reads its BOS at
position 0 and writes its keys and values into column t % W. Output index q of a row is column
(start + q) % W of `out` [R, W], the column of the step that read its input. (The chunk's BOS
step run apart, as `Predictor` starts a batch, cost more in small operations than a row-step
each in the rows: docs/experiments.md.)

Each sentence's output limit is its own (search.output_limits), so its translation is the one
`search.greedy_search` gives it (tests/test_refill.py): the rows beside it change only the order
of float sums in the padded positions, as the batch shapes of `Predictor` do. Sentences are
taken longest first, so the tail is of short sentences. One device, one process; greedy, no
constraint, a cache that offers a ring (`Predictor.refills`, `offered`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax.data.tokenizer import BOS_ID, EOS_ID, PAD_ID
from transformer_jax.decoding import decoder as decoder_lib
from transformer_jax.decoding import top_k
from transformer_jax.decoding.batch_shapes import Shapes

_STATIC = {"empty": ("rows", "source", "columns")}  # the programs' static arguments


def offered(decoder) -> bool:
  """Whether `decoder`'s cache offers refilled rows: nodes that `restart` as a ring (kv_cache.py
  SelfKV), and invariant ones that `pad_source`."""
  nodes = decoder_lib.nodes(decoder.cache_shapes(jnp.zeros((1, 2), jnp.int32), 2)).values()
  return all(hasattr(n, "pad_source" if n.invariant else "restart") for n in nodes)


def invariant_cache(decoder, params, inputs: jax.Array):
  """The invariant cache of `inputs` [b, s], for rows that run their BOS step among the others.
  The first decoder call fills it, so that call is traced here; under jit, XLA drops the rest of
  it (the step's logits and self-attention keys)."""
  params, bos = decoder.unrolled(params), jnp.full((inputs.shape[0],), BOS_ID, jnp.int32)
  encoded = decoder.encode(params, inputs)  # [b, s, e]
  cache = decoder.step(params, decoder.init_cache(inputs, 1), encoded, inputs, bos, 0)[1]
  return decoder_lib.split(cache)[1]


def restart(cache, starts: jax.Array):
  """Every carried node a ring whose row i holds the sentence that started at step starts[i]."""
  return decoder_lib.map_nodes(lambda n: n.restart(starts), cache)


def pad_source(cache, length: int):
  """Every invariant node padded to `length` source positions."""
  return decoder_lib.map_nodes(lambda n: n.pad_source(length), cache)


class RefillCarry(NamedTuple):
  """R rows on the device between two calls; shapes: R rows, S source length, W ring columns."""

  inputs: jax.Array  # [R, S] int32: each row's source, for the cross-attention mask
  sentence: Any  # the cross-attention cache, [R, ...] (kv_cache.py)
  beams: Any  # the self-attention cache, a ring of W columns with `row_start` [R]
  token: jax.Array  # [R] int32: the next step's input: BOS, the last token, PAD once finished
  finished: jax.Array  # [R] bool: EOS chosen, the limit reached, or no sentence in the row
  out: jax.Array  # [R, W] int32: the tokens chosen, output index q at column (start + q) % W
  start: jax.Array  # [R] int32: the step that reads the row's BOS (its column holds BOS's keys)
  end: jax.Array  # [R] int32: the step at which the row reaches its output limit
  step: jax.Array  # int32 scalar: the next step (the ring's write index)


@dataclasses.dataclass
class RefillGreedy:
  """Greedy search of a call's sentences in `rows` rows, refilled `chunk` at a time (module
  docstring). `extra`: the output limit over the source length (§6.1); `shapes.min_rows` and
  `shapes.shrink` decide the rows of the tail."""

  decoder: decoder_lib.Decoder  # normalize=False: greedy takes the first maximum of the logits
  extra: int
  # 256 rows, 16 at a time: the fastest of the sizes measured (docs/experiments.md, refilled rows).
  # The caches hold rows x (W + S) keys and values per decoder layer: ~2.8 GB for
  # configs/base.py (6 layers, d_model 512, float32) at W = 250 and S = 200.
  rows: int = 256
  chunk: int = 16
  shapes: Shapes = Shapes()

  def __post_init__(self):
    if self.chunk < 1 or self.rows < self.chunk or self.rows % self.chunk:
      raise ValueError(f"rows={self.rows} must be a multiple of chunk={self.chunk} >= 1")
    # name -> (the program, the carry's argument index to donate): jitted here, or exported
    self._impls = {
        "empty": (self._empty_impl, ()),
        "refill": (self._refill_impl, (1,)),
        "run": (self._run_impl, (1,)),
        "keep": (self._keep_impl, ()),  # smaller: nothing to donate to
    }
    self._jitted = {
        name: jax.jit(impl, donate_argnums=donate, static_argnames=_STATIC.get(name, ()))
        for name, (impl, donate) in self._impls.items()
    }
    self.signatures: set[tuple] = set()  # the programs called
    self.saved = None  # saved_programs.SavedPrograms (with the Predictor's): run them exported

  def _program(self, name: str, **static) -> Callable:
    """The jitted program `name` bound to its static arguments, or its exported form
    (saved_programs.py), whose carry is donated as the jitted one's."""
    if self.saved is None:
      return functools.partial(self._jitted[name], **static)
    impl, donate = self._impls[name]
    return self.saved.program(f"refill_{name}", impl, static, donate)

  # --------------------------------------------------------------------------- programs

  def _empty_impl(self, rows: int, source: int, columns: int) -> RefillCarry:
    """R rows, none holding a sentence (finished)."""
    inputs = jnp.full((rows, source), PAD_ID, jnp.int32)
    beams, sentence = decoder_lib.split(self.decoder.init_cache(inputs, columns))
    beams = restart(beams, jnp.zeros(rows, jnp.int32))
    zeros = jnp.zeros(rows, jnp.int32)
    out = jnp.full((rows, columns), PAD_ID, jnp.int32)
    finished = jnp.ones(rows, bool)
    return RefillCarry(inputs, sentence, beams, zeros, finished, out, zeros, zeros, jnp.int32(0))

  def _refill_impl(self, params, carry: RefillCarry, chunk, where) -> RefillCarry:
    """The sentences `chunk` [m, S'] (ids, EOS, PAD) take the rows `where` [m]: the next step
    reads their BOS. A row given twice must be given the same sentence (the filler of a short
    chunk)."""
    source, columns = carry.inputs.shape[1], carry.out.shape[1]
    sentence = pad_source(invariant_cache(self.decoder, params, chunk), source)
    # search.output_limits: the source's tokens (EOS included) + extra, within W
    limit = jnp.minimum(jnp.sum(chunk != PAD_ID, axis=1, dtype=jnp.int32) + self.extra, columns)
    starts = carry.start.at[where].set(carry.step)  # [R]: the carry's and the cache's `row_start`
    wide = source - chunk.shape[1]
    return RefillCarry(
        inputs=carry.inputs.at[where].set(jnp.pad(chunk, ((0, 0), (0, wide)))),
        sentence=jax.tree.map(lambda old, new: old.at[where].set(new), carry.sentence, sentence),
        beams=restart(carry.beams, starts),
        token=carry.token.at[where].set(BOS_ID),
        finished=carry.finished.at[where].set(False),
        out=carry.out.at[where].set(PAD_ID),
        start=starts,
        end=carry.end.at[where].set(carry.step + limit),
        step=carry.step,
    )

  def _run_impl(self, params, carry: RefillCarry, exit_at):
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

  @staticmethod
  def _keep_impl(carry: RefillCarry, keep) -> RefillCarry:
    """The rows `keep` [R'] of `carry`."""
    return jax.tree.map(lambda x: x if x.ndim == 0 else x[keep], carry)

  # --------------------------------------------------------------------------- the host's loop

  def search(
      self, params, sources: Sequence[Sequence[int]], bucket_lengths: Sequence[int],
      max_len: int, stats: dict | None = None,
  ) -> list[np.ndarray]:  # fmt: skip
    """The greedy output (tokens, EOS then PAD) of each token-id source (no EOS), in order.
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
    self.signatures.add(("empty", rows, source, columns))
    carry = self._program("empty", rows=rows, source=source, columns=columns)()
    owner = np.full(rows, -1)  # the sentence each row holds, -1: none (or read out)
    finished = np.ones(rows, bool)
    taken, steps, row_steps, chunks = 0, 0, 0, 0
    while True:
      free = np.flatnonzero(finished & (owner < 0))
      # The next sentences take the free rows, a whole chunk at a time (a row left over waits
      # for the next call, as it would in a padded chunk) but for the last.
      while taken < count and len(free) >= min(self.chunk, count - taken):
        where = free[: min(self.chunk, count - taken)]
        ids = order[taken : taken + len(where)]
        taken, chunks = taken + len(where), chunks + 1
        carry = self._call_refill(params, carry, sources, ids, where, bucket_lengths, bucket_of)
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
          carry = self._program("keep")(carry, keep.astype(np.int32))
          owner, finished = owner[keep], finished[keep]
          held = size
        smaller = self.shapes.smaller(held, -(-held // self.shapes.shrink), 1)
        exit_at = held - smaller if smaller < held else held
      else:
        exit_at = min(held, self.chunk)  # rows left over by the last refill count
      self.signatures.add(("run", held, source, columns))
      carry, outputs = self._program("run")(params, carry, np.int32(exit_at))
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

  def _call_refill(self, params, carry, sources, ids, where, bucket_lengths, bucket_of):
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
    self.signatures.add(("refill", len(carry.out), carry.inputs.shape[1], length))
    return self._program("refill")(params, carry, chunk, padded)

  def programs(self) -> int:
    """The distinct programs called."""
    return len(self.signatures)
