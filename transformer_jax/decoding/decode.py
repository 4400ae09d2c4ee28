"""`Predictor`: the searches of search.py run fast, in blocks of steps driven from the host.

The model side is decoder.py's `Decoder` over the run's own model. What makes it fast on a CPU
(each measured, see benchmarks/decode.py): the cache is laid out for the search and never
reordered (kv_cache.py); it grows in blocks of positions (batch_shapes.py); finished sentences
leave the batch; α is traced, so trying several α compiles once; a greedy call on one CPU device
may run in refilled rows (refill.py). A constraint whose answer is the same for any per-row
shift of its input (it renormalizes; `takes_logits = True`) is given the model's logits, not
their log-softmax. Tests compare every path with search.py's reference.

Shapes: b sentences, s source length, n output length, v vocabulary, k beams, r = b * k rows.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax.data.tokenizer import PAD_ID
from transformer_jax.decoding import batch_shapes, kv_cache
from transformer_jax.decoding import refill as refill_lib
from transformer_jax.decoding.batch_shapes import Shapes
from transformer_jax.decoding.decoder import Decoder
from transformer_jax.decoding.search import (
    Stepper,
    check_beam_size,
    check_stop,
    make_search,
    output_limits,
    run_steps,
)
from transformer_jax.model.config import TransformerConfig
from transformer_jax.model.transformer import Transformer
from transformer_jax.parallel import distributed

# ----------------------------------------------------------------------------- the fast run


class SearchCarry(NamedTuple):
  """A batch between two blocks: every leaf but scalars has the sentences on axis 0, so
  dropping finished sentences is one gather per leaf."""

  inputs: jax.Array  # [b, s]
  sentence: Any  # the invariant cache (cross-attention's), one copy per sentence
  beams: Any  # the cache the search carries (self-attention's, k beams per sentence)
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
  """(params, inputs [b, s]) -> tokens [b, n], EOS then PAD: the best output of each row by
  `model` (the run's: any decodable module, decoder.py; a TransformerConfig: the paper's
  Transformer of it), its attention's keys kept in `cache`.

  beam_size 1 is greedy search, otherwise beam search: the best hypothesis of `greedy_search` or
  `beam_search` (`Beam.best_only`), run as jitted blocks of steps driven from the host, one
  program per cache length (`cache_block_ends`), the first with the encoder and first step.
  Between blocks the host reads which sentences are done; once few enough are still decoding
  (and `compact`), they go on in a smaller batch (`Shapes.smaller`). `shapes` is a `Shapes`
  or a name of batch_shapes.NAMES (`shapes_for`); it decides only which programs are compiled. A
  done sentence's hypotheses never change, so this changes no translation, and the last blocks of
  a batch do not carry its finished sentences along. α is traced, the beam size static.
  With `refill`, a greedy call on one CPU device is searched whole by `refiller` instead
  (refill.py, `refills`; `inference.decode_sources`), with the same translations, where the
  cache offers it (`refill.offered`).
  `constraint(log_probs, prefixes, limit, inputs [b, s])` constrains every step (module docstring);
  `stop` is the beam's (`Beam.done`).
  """

  def __init__(
      self, model: Any, max_decode_extra: int, beam_size: int = 1,
      alpha: float = 0.6, shapes: Shapes | str = "fast", compact: bool = True,
      constraint: Callable | None = None, stop: str = "proven", refill: bool = False,
      cache: Any = kv_cache.SlotCache,
  ):  # fmt: skip
    check_beam_size(beam_size)
    check_stop(stop)  # here too: before any program is traced
    if not isinstance(shapes, Shapes) and shapes not in batch_shapes.NAMES:
      raise ValueError(f"shapes={shapes!r}: expected a Shapes or one of {batch_shapes.NAMES}")
    if isinstance(model, TransformerConfig):  # the paper's Transformer of it
      model = Transformer(model)
    self.model, self.config, self.max_decode_extra = model, model.config, max_decode_extra
    self.beam_size, self.alpha, self.shapes, self.compact = beam_size, alpha, shapes, compact
    self.auto_fast = False  # "auto" has decoded a call of AUTO_FEW_BELOW sentences or more
    self.constraint, self.stop = constraint, stop
    # A constraint that renormalizes over the tokens it allows answers the same for the logits
    # as for their log-softmax: it is given the logits, sparing a pass over the vocabulary.
    self.decoder = Decoder(model, cache, normalize=not getattr(constraint, "takes_logits", False))
    # Greedy without a constraint takes each row's first maximum, which the log-softmax (a shift
    # of the row) leaves where it is: it is given the logits too.
    self.greedy_decoder = (
        self.decoder if constraint else dataclasses.replace(self.decoder, normalize=False)
    )
    # Greedy search of a whole call in rows that finished sentences leave (refill.py).
    self.refiller = None
    if refill and refill_lib.offered(self.greedy_decoder):
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
    search = make_search(beam_size, self.constraint, inputs, True, end, self.stop)
    state = search.init(log_probs, limit, n, alpha)
    if beam_size > 1:
      beams = decoder.widen(beams, beam_size)
    carry = SearchCarry(inputs, sentence, beams, state)
    return self._block_impl(params, carry, alpha, exit_at, None, beam_size, end)

  def _block_impl(self, params, carry, alpha, exit_at, keep, beam_size, end):
    """Keeps the sentences `keep` [b'] of `carry` (None: all), then steps until position `end`
    (the cache grown to it) or until at most `exit_at` sentences are not done. Returns (carry,
    done [b], steps run so far, the best tokens so far [b, n])."""
    if keep is not None:
      carry = jax.tree.map(lambda x: x if x.ndim == 0 else x[keep], carry)
    search = make_search(beam_size, self.constraint, carry.inputs, True, end, self.stop)
    decoder = self.greedy_decoder if beam_size == 1 else self.decoder
    model = Stepper(decoder.step_fn(params, carry.inputs, carry.sentence), decoder.follow)
    beams = decoder.grow(carry.beams, end)
    state, beams = run_steps(search, model, carry.state, beams, alpha, end, exit_at)
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
    check_beam_size(beam_size)
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
