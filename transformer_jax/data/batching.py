"""Tokenized sentence pairs -> fixed-shape numpy batches, deterministic and resumable.

Every batch is a dict of int32 arrays; B rows, L positions, PAD_ID after the sentence:

    inputs          [B, L]  source ids + [EOS]
    decoder_inputs  [B, L]  [BOS] + target ids      (targets shifted right, §3.1)
    targets         [B, L]  target ids + [EOS]

A side whose examples are [n, 1 + C] arrays (a task's per-token columns: a token and C labels of
it, say) gives [B, L, 1 + C]: column 0 is read as the token (EOS and PAD have no columns).

Pairs are grouped by length into a few buckets (L = the bucket's length, for
source and target alike) so that jit compiles one program per bucket rather
than one per batch, while short sentences are not padded to the longest one.
The number of rows follows from a token budget, like the paper's batches of
~25k source and ~25k target tokens (§5.1): rows * L <= tokens_per_batch.

Or, with `packing=True`, several pairs share each row of max_len positions
(as google/flax's WMT input pipeline packs them), each a segment (the source
rows may be shorter than the target rows: `packed_source_len`):

    inputs_segmentation   [B, L]  1, 2, ... per pair in the row; 0 on padding
    inputs_positions      [B, L]  0, 1, ... restarting at each pair
    targets_segmentation, targets_positions   the same on the target side

The model keeps segments apart in every attention (attention.segment_mask)
and restarts positional encodings at each pair (§3.5), so a packed row trains
like its pairs apart; a row's padding is only what is left after the last pair.

Training resumes exactly: an epoch's batches are a pure function of
(seed, epoch), so the state to save is just (epoch, batch index).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator, Sequence

import numpy as np

from transformer_jax.data.tokenizer import BOS_ID, EOS_ID, PAD_ID

Example = tuple[Sequence[int], Sequence[int]]  # (source ids, target ids), no EOS.
Batch = dict[str, np.ndarray]


def make_bucket_lengths(max_len: int, num_buckets: int = 8, multiple: int = 8) -> tuple[int, ...]:
  """About `num_buckets` evenly spaced lengths, multiples of `multiple`, ending at max_len.

  E.g. max_len=64 -> (8, 16, ..., 64); max_len=256 -> (32, 64, ..., 256).
  Multiples of 8 keep matrix shapes friendly to TPU/GPU tiles.
  """
  if max_len < 2:
    raise ValueError(f"max_len={max_len} must be >= 2: one token plus EOS/BOS.")
  if num_buckets < 1 or multiple < 1:
    raise ValueError(f"num_buckets={num_buckets} and multiple={multiple} must be >= 1.")
  lengths = set()
  for i in range(1, num_buckets + 1):
    length = -(-(max_len * i // num_buckets) // multiple) * multiple  # Round up.
    lengths.add(min(max(length, multiple), max_len))
  return tuple(sorted(lengths))


class _Packed:
  """One side of the corpus as a flat int32 array plus per-example start and length.

  Flat storage lets a batch be gathered with one fancy-indexing call instead
  of a Python loop over rows. A prepared corpus (data/prepared.py) brings its
  arrays already flat, memory-mapped: a batch then reads only its own rows'
  pages, so each process touches its share of the corpus and no more.
  """

  @classmethod
  def from_arrays(cls, arrays) -> _Packed:
    """From prepared.TokenArrays, without copying (ids were checked when prepared)."""
    self = cls.__new__(cls)
    self.lengths = np.diff(arrays.offsets)  # [N]
    self.starts = np.asarray(arrays.offsets[:-1])  # [N]
    # A plain ndarray view of the map: numpy.memmap adds Python overhead to every gather.
    self.flat = np.asarray(arrays.tokens) if len(arrays.tokens) else np.zeros(1, np.int32)
    return self

  def __init__(self, seqs: Sequence[Sequence[int]], side: str):
    self.lengths = np.fromiter((len(s) for s in seqs), dtype=np.int64, count=len(seqs))
    self.starts = np.concatenate([[0], np.cumsum(self.lengths)[:-1]]).astype(np.int64)
    total = int(self.lengths.sum())
    width = feature_width(seqs)
    if width:  # [n, 1 + C] per example: ids and their columns (module docstring)
      rows = [np.asarray(s, np.int64).reshape(-1, width) for s in seqs]
      # One trailing PAD row so clipped indices of empty sequences stay in range.
      self.flat = np.concatenate([*rows, np.zeros((1, width), np.int64)])  # [T + 1, 1 + C]
      ids = self.flat[:-1, 0]
    else:
      # Iterating a numpy array yields slow numpy scalars; .tolist() first is ~5x faster.
      tokens = itertools.chain.from_iterable(
          s.tolist() if isinstance(s, np.ndarray) else s for s in seqs
      )
      # One trailing PAD so clipped indices of empty sequences stay in range.
      self.flat = np.fromiter(itertools.chain(tokens, [PAD_ID]), dtype=np.int64, count=total + 1)
      ids = self.flat[:-1]
    bad = (ids < 0) | np.isin(ids, (PAD_ID, EOS_ID, BOS_ID))
    if bad.any():
      example = int(np.searchsorted(self.starts, np.argmax(bad), side="right") - 1)
      raise ValueError(
          f"{side} ids of example {example} contain {int(ids[np.argmax(bad)])}: "
          f"ids must be >= 0 and not PAD/EOS/BOS ({PAD_ID}/{EOS_ID}/{BOS_ID}), "
          "which batching adds itself; tokenize with encode(), which appends none."
      )
    self.flat = self.flat.astype(np.int32)

  def rows(
      self, index: np.ndarray, length: int, lengths: np.ndarray, bos: bool, eos: bool
  ) -> np.ndarray:
    """[len(index), length] ids of examples `index` (-1: an all-PAD row).

    `lengths` are the (possibly truncated) lengths, which leave room for BOS/EOS.
    """
    valid = index >= 0
    lens = np.where(valid, lengths[index], 0)  # [R]
    pos = np.arange(length)[None, :] - int(bos)  # [1, L]
    in_sentence = (pos >= 0) & (pos < lens[:, None])  # [R, L]
    flat_index = np.clip(self.starts[index][:, None] + pos, 0, len(self.flat) - 1)
    values = self.flat[flat_index]  # [R, L] (or [R, L, 1 + C] with features)
    keep = in_sentence if values.ndim == 2 else in_sentence[..., None]
    out = np.where(keep, values, PAD_ID).astype(np.int32)  # [R, L(, 1 + C)]
    if bos:
      out[:, 0] = marker(BOS_ID, out.shape[2:])
    if eos:
      out[np.arange(len(index)), lens + int(bos)] = marker(EOS_ID, out.shape[2:])
    out[~valid] = PAD_ID
    return out


def feature_width(seqs: Sequence) -> int:
  """0 for sequences of ids; 1 + C for [n, 1 + C] arrays, each token's id and C columns (module
  docstring), which must all be as wide."""
  widths = {s.shape[1] if isinstance(s, np.ndarray) and s.ndim == 2 else 0 for s in seqs}
  if len(widths) > 1:
    raise ValueError(
        f"examples mix token ids and [n, 1 + C] arrays of ids and features (widths "
        f"{sorted(widths)}): a side's examples are all one or all the other, of one width"
    )
  return widths.pop() if widths else 0


def marker(token: int, features: tuple[int, ...]) -> np.ndarray | int:
  """EOS or BOS as a batch writes it: the id, with no features (zeros) where a token has them."""
  if not features:
    return token
  out = np.zeros(features, np.int32)
  out[0] = token
  return out


class _Corpus:
  """Examples packed once, truncated to max_len and assigned to buckets."""

  def __init__(
      self, examples: Sequence[Example], bucket_lengths: Sequence[int], source_len: int = 0
  ):
    if len(examples) == 0:
      raise ValueError("examples is empty: nothing to batch. Check the data path and split.")
    bucket_lengths = tuple(int(b) for b in bucket_lengths)
    if (
        not bucket_lengths
        or bucket_lengths[0] < 2
        or any(a >= b for a, b in zip(bucket_lengths, bucket_lengths[1:]))
    ):
      raise ValueError(
          f"bucket_lengths={bucket_lengths} must be strictly increasing and "
          ">= 2 (one token plus EOS/BOS); see make_bucket_lengths(max_len)."
      )
    self.bucket_lengths = bucket_lengths
    if hasattr(examples, "source") and hasattr(examples, "target"):  # prepared.Examples
      self.src = _Packed.from_arrays(examples.source)
      self.tgt = _Packed.from_arrays(examples.target)
    else:
      self.src = _Packed([s for s, _ in examples], "source")
      self.tgt = _Packed([t for _, t in examples], "target")
    # The longest bucket is max_len (or source_len, the source rows' length when packing);
    # keep one slot for EOS (and BOS, on the target side).
    cap = bucket_lengths[-1] - 1
    src_cap = (source_len or bucket_lengths[-1]) - 1
    self.src_lengths = np.minimum(self.src.lengths, src_cap)  # [N]
    self.tgt_lengths = np.minimum(self.tgt.lengths, cap)  # [N]
    self.num_truncated = int(((self.src.lengths > src_cap) | (self.tgt.lengths > cap)).sum())
    # Smallest bucket that holds both sides; one bucket for both keeps shapes few.
    needed = np.maximum(self.src_lengths, self.tgt_lengths) + 1  # [N]
    self.bucket = np.searchsorted(bucket_lengths, needed, side="left")  # [N]

  def __len__(self) -> int:
    return len(self.src_lengths)

  def packed_rows(
      self, pairs: np.ndarray, counts: np.ndarray, length: int, source_len: int = 0
  ) -> Batch:
    """[len(counts), length] packed rows ([len(counts), source_len] on the source side when
    given): row r holds the next counts[r] pairs of `pairs`."""
    num_rows, n = len(counts), len(pairs)
    row_of = np.repeat(np.arange(num_rows), counts)  # [n]
    first = np.concatenate([[0], np.cumsum(counts)[:-1]])  # [R]
    segment = (np.arange(n) - first[row_of] + 1).astype(np.int32)  # [n] 1-based
    batch = {}
    for side, packed, lengths, row_len in (
        ("inputs", self.src, self.src_lengths, source_len or length),
        ("targets", self.tgt, self.tgt_lengths, length),
    ):
      lens = lengths[pairs]  # [n]
      end = np.cumsum(lens + 1)  # [n] ids + EOS
      start = end - lens - 1  # [n] in the chunk
      pair_of = np.repeat(np.arange(n), lens + 1)  # [T]
      pos = np.arange(int(end[-1]) if n else 0) - start[pair_of]  # [T] in its pair
      is_id = pos < lens[pair_of]  # [T] else EOS
      flat_index = np.where(is_id, packed.starts[pairs][pair_of] + pos, 0)
      # One flat index into [R * L]: the pair's row, and its offset in the row plus pos.
      cell = (row_of * row_len + start - start[first[row_of]])[pair_of] + pos  # [T]
      taken = np.take(packed.flat, flat_index, axis=0)  # [T] (or [T, 1 + C] with features)
      eos = marker(EOS_ID, taken.shape[1:])
      values = np.where(is_id if taken.ndim == 1 else is_id[:, None], taken, eos)
      for key, fill in (
          (side, values),
          (f"{side}_positions", pos),
          (f"{side}_segmentation", segment[pair_of]),
      ):
        out = np.zeros((num_rows * row_len,) + fill.shape[1:], np.int32)  # [R * L(, 1 + C)]
        out[cell] = fill
        batch[key] = out.reshape((num_rows, row_len) + fill.shape[1:])  # [R, L(, 1 + C)]
    # Decoder inputs: the targets shifted right within each pair, BOS first (§3.1).
    targets = batch["targets"]
    decoder_inputs = np.zeros_like(targets)  # [R, L]
    decoder_inputs[:, 1:] = targets[:, :-1]
    decoder_inputs[batch["targets_positions"] == 0] = BOS_ID
    decoder_inputs[batch["targets_segmentation"] == 0] = PAD_ID
    batch["decoder_inputs"] = decoder_inputs
    return batch

  def batch(self, index: np.ndarray, length: int) -> Batch:
    return {
        "inputs": self.src.rows(index, length, self.src_lengths, bos=False, eos=True),
        "decoder_inputs": self.tgt.rows(index, length, self.tgt_lengths, bos=True, eos=False),
        "targets": self.tgt.rows(index, length, self.tgt_lengths, bos=False, eos=True),
    }


# Rows a pair may still be placed in while packing: first fit over these (flax's WMT pipeline
# fills one row at a time). Measured on the WMT-sized corpus at max_len 256 (~36 pieces a side):
# 1 open row leaves ~8% of positions empty, 8 leave ~2%; more gain little and cost time.
_OPEN_ROWS = 8
# Pairs packed at a time (an epoch's shuffled order is cut into parts of this many): about 0.5 s
# of packing, and a partial batch dropped per part (~0.3% of 2^17 pairs at base's 96 rows).
_PACK_PART = 1 << 17


def pack(
    order: np.ndarray,
    src_need: np.ndarray,
    tgt_need: np.ndarray,
    length: int,
    open_rows: int = _OPEN_ROWS,
    source_len: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
  """Pairs `order` into rows of `length` positions a side (`source_len` on the source side,
  when given), first fit over `open_rows` rows.

  A pair needs src_need[i] positions of the source row and tgt_need[i] of the target row
  (ids + EOS/BOS). Returns (pairs, bounds): row r holds pairs[bounds[r]:bounds[r + 1]], in
  order of placement. Every pair is placed once; rows are closed oldest first."""
  src_need, tgt_need = src_need.tolist(), tgt_need.tolist()
  src_length = source_len or length
  open_src, open_tgt, open_members = [], [], []
  closed: list[list[int]] = []
  for i in order.tolist():
    s, t = src_need[i], tgt_need[i]
    for r in range(len(open_src)):
      if open_src[r] + s <= src_length and open_tgt[r] + t <= length:
        open_src[r] += s
        open_tgt[r] += t
        open_members[r].append(i)
        break
    else:
      if len(open_src) == open_rows:
        closed.append(open_members.pop(0))
        del open_src[0], open_tgt[0]
      open_src.append(s)
      open_tgt.append(t)
      open_members.append([i])
  closed.extend(open_members)
  counts = np.fromiter(map(len, closed), np.int64, count=len(closed))
  bounds = np.zeros(len(closed) + 1, np.int64)
  np.cumsum(counts, out=bounds[1:])
  pairs = np.fromiter((i for row in closed for i in row), np.int64, count=int(bounds[-1]))
  return pairs, bounds


class BatchIterator:
  """Infinite, shuffled, bucketed training batches; `get_state`/`set_state` resume exactly.

  Each epoch: permute the examples with np.random.default_rng([seed, epoch]),
  split each bucket's examples (in that order) into batches, then shuffle the
  order of the batches. Every process builds the same global batch and keeps
  rows [i*B/P, (i+1)*B/P) of it, so no communication is needed.

  Args:
    examples: (source ids, target ids) pairs, without EOS/BOS.
    seed: the shuffling seed.
    bucket_lengths: increasing padded lengths; the last one is max_len, and
      longer pairs are truncated (counted in `num_truncated`).
    tokens_per_batch: token budget per global batch (source side; the target
      side has the same shape): rows = tokens_per_batch // L, rounded down to a
      multiple of batch_multiple. Give this or `batch_size`.
    batch_size: a fixed number of global rows for every bucket instead.
    shuffle: False keeps the corpus order (bucket by bucket): for debugging.
    batch_multiple: rows are a multiple of this (the number of data-parallel
      devices, so every device gets an equal share; training also folds in
      config.data.row_multiple, so that a later resume on more devices that
      divide it keeps these rows: `set_state`).
    process_index, process_count: this host's slice of each global batch.
    drop_remainder: drop each bucket's last, partial batch, so that every
      step sees a full token budget; the next epoch's shuffle changes which
      examples are dropped. False pads it with all-PAD rows instead.
    packing: pack several pairs into each row of max_len (the last bucket
      length; the others are unused) instead of bucketing: one shape, rows =
      tokens_per_batch // max_len, almost no padding. Batches then also carry
      *_segmentation and *_positions.
    packed_source_len: with packing, the source rows' length (0: max_len, as the
      targets'); longer sources are truncated to it (counted in `num_truncated`).
  """

  def __init__(
      self,
      examples: Sequence[Example],
      *,
      seed: int,
      bucket_lengths: Sequence[int],
      tokens_per_batch: int | None = None,
      batch_size: int | None = None,
      shuffle: bool = True,
      batch_multiple: int = 1,
      process_index: int = 0,
      process_count: int = 1,
      drop_remainder: bool = True,
      packing: bool = False,
      packed_source_len: int = 0,
  ):
    if batch_multiple < 1:
      raise ValueError(f"batch_multiple={batch_multiple} must be >= 1.")
    if not 0 <= process_index < process_count:
      raise ValueError(
          f"process_index={process_index} must be in [0, process_count=" f"{process_count})."
      )
    if batch_multiple % process_count:
      raise ValueError(
          f"batch_multiple={batch_multiple} must be a multiple of process_count="
          f"{process_count} so every process gets the same number of rows; pass the "
          "global device count (jax.device_count())."
      )
    max_len = tuple(bucket_lengths)[-1]
    if packed_source_len and not (packing and 2 <= packed_source_len <= max_len):
      raise ValueError(
          f"packed_source_len={packed_source_len} needs packing=True and must be in [2, "
          f"max_len={max_len}]."
      )
    if packing:
      bucket_lengths = tuple(bucket_lengths)[-1:]  # one row length: max_len
    self._packing = packing
    self._source_len = packed_source_len
    self._corpus = _Corpus(examples, bucket_lengths, packed_source_len)
    self._rows = self._rows_per_bucket(tokens_per_batch, batch_size, batch_multiple)
    self._batch_multiple = batch_multiple
    self._seed = seed
    self._shuffle = shuffle
    self._drop_remainder = drop_remainder
    self._process_index = process_index
    self._process_count = process_count
    self.num_truncated = self._corpus.num_truncated
    self._order_cache = (-1, None)
    self._batches_per_epoch = None
    self._epoch, self._part, self._batch = 0, 0, 0
    self._part_plan = self._plan(0, 0)
    if not self._part_plan:
      raise ValueError(
          f"No full batch in {len(self._corpus)} examples: every bucket holds fewer "
          f"examples than its batch rows {self.rows_per_bucket}. Lower tokens_per_batch/"
          "batch_size or pass drop_remainder=False."
      )

  @property
  def batches_per_epoch(self) -> int:
    """Batches in epoch 0. With packing the count varies a little from epoch to epoch, and
    asking packs the whole epoch (seconds for millions of pairs), so training never asks."""
    if self._batches_per_epoch is None:
      self._batches_per_epoch = sum(len(self._plan(0, k)) for k in range(self._num_parts))
    return self._batches_per_epoch

  @property
  def _num_parts(self) -> int:
    """Packing plans an epoch in parts of _PACK_PART pairs, so that a start or a resume packs
    one part, not the epoch; bucketing plans the epoch at once (it is fast)."""
    return -(-len(self._corpus) // _PACK_PART) if self._packing else 1

  def _rows_per_bucket(self, tokens_per_batch, batch_size, batch_multiple) -> list[int]:
    lengths = self._corpus.bucket_lengths
    if (tokens_per_batch is None) == (batch_size is None):
      raise ValueError(
          f"Give exactly one of tokens_per_batch={tokens_per_batch} and "
          f"batch_size={batch_size}."
      )
    if batch_size is not None:
      if batch_size < 1 or batch_size % batch_multiple:
        raise ValueError(
            f"batch_size={batch_size} must be a positive multiple of "
            f"batch_multiple={batch_multiple}."
        )
      return [batch_size] * len(lengths)
    if tokens_per_batch < batch_multiple * lengths[-1]:
      raise ValueError(
          f"tokens_per_batch={tokens_per_batch} is too small: the longest bucket "
          f"(L={lengths[-1]}) needs batch_multiple*L = {batch_multiple * lengths[-1]} tokens "
          "for one row per device. Raise tokens_per_batch or lower the max length."
      )
    return [tokens_per_batch // length // batch_multiple * batch_multiple for length in lengths]

  @property
  def rows_per_bucket(self) -> dict[int, int]:
    """Global batch rows for each bucket length: the (rows, L) shapes jit will see."""
    return dict(zip(self._corpus.bucket_lengths, self._rows))

  def _order(self, epoch: int) -> tuple[np.ndarray, np.random.Generator]:
    rng = np.random.default_rng([self._seed, epoch])
    n = len(self._corpus)
    return (rng.permutation(n) if self._shuffle else np.arange(n)), rng  # [N]

  def _plan(self, epoch: int, part: int) -> list:
    """Global batches of one part of an epoch as (bucket, example indices), or with packing as
    (pairs, counts): the pairs of each row, in order. Pure in (seed, epoch, part)."""
    if self._packing:
      if self._order_cache[0] != epoch:
        self._order_cache = (epoch, self._order(epoch)[0])
      order = self._order_cache[1][part * _PACK_PART : (part + 1) * _PACK_PART]
      return self._packed_plan(order)
    order, rng = self._order(epoch)
    # A stable sort by bucket keeps the shuffled order within each bucket.
    order = order[np.argsort(self._corpus.bucket[order], kind="stable")]
    bounds = np.searchsorted(self._corpus.bucket[order], np.arange(len(self._rows) + 1))
    plan = []
    for b, rows in enumerate(self._rows):
      members = order[bounds[b] : bounds[b + 1]]
      for start in range(0, len(members), rows):
        chunk = members[start : start + rows]
        if len(chunk) < rows:
          if self._drop_remainder:
            break
          chunk = np.concatenate([chunk, np.full(rows - len(chunk), -1, chunk.dtype)])
        plan.append((b, chunk))
    if self._shuffle:
      # Without this, an epoch would run through the buckets short to long.
      plan = [plan[i] for i in rng.permutation(len(plan))]
    return plan

  def _packed_plan(self, order: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    corpus, rows = self._corpus, self._rows[0]
    pairs, bounds = pack(
        order,
        corpus.src_lengths + 1,
        corpus.tgt_lengths + 1,
        corpus.bucket_lengths[0],
        source_len=self._source_len,
    )
    counts = np.diff(bounds)  # [num_rows]
    plan = []
    for start in range(0, len(counts), rows):
      batch_counts = counts[start : start + rows]
      if len(batch_counts) < rows:
        if self._drop_remainder:
          break
        batch_counts = np.concatenate([batch_counts, np.zeros(rows - len(batch_counts), np.int64)])
      plan.append((pairs[bounds[start] : bounds[min(start + rows, len(counts))]], batch_counts))
    return plan

  def __iter__(self) -> BatchIterator:
    return self

  def __next__(self) -> Batch:
    while self._batch == len(self._part_plan):  # a part of a small corpus may have no batch
      self._part += 1
      if self._part == self._num_parts:
        self._epoch, self._part = self._epoch + 1, 0
      self._batch = 0
      self._part_plan = self._plan(self._epoch, self._part)
    if self._packing:
      pairs, counts = self._part_plan[self._batch]
      self._batch += 1
      local_rows = len(counts) // self._process_count
      first = self._process_index * local_rows
      skip = int(counts[:first].sum())
      counts = counts[first : first + local_rows]
      pairs = pairs[skip : skip + int(counts.sum())]
      return self._corpus.packed_rows(
          pairs, counts, self._corpus.bucket_lengths[0], self._source_len
      )
    bucket, index = self._part_plan[self._batch]
    self._batch += 1
    local_rows = len(index) // self._process_count
    local = index[self._process_index * local_rows : (self._process_index + 1) * local_rows]
    return self._corpus.batch(local, self._corpus.bucket_lengths[bucket])

  def get_state(self) -> dict:
    """JSON-serialisable position: the next batch is batch `batch` of part `part` (always 0
    without packing) of epoch `epoch`. `rows`, the global rows per bucket, lets a run resume on
    another number of devices or processes and still draw the same global batches
    (`set_state`)."""
    return {
        "epoch": self._epoch,
        "part": self._part,
        "batch": self._batch,
        "num_examples": len(self._corpus),
        "rows": list(self._rows),
        "packed_source_len": self._source_len,
    }

  def set_state(self, state: dict) -> None:
    """Resumes at `state`'s position. Elastic: a state saved with other global rows (another
    device count changes the rounding to batch_multiple) keeps those rows when this iterator's
    batch_multiple divides them, so the global batches continue unchanged."""
    # The example count is a cheap guard against resuming over different data,
    # which would silently train on another sequence of batches.
    if state["num_examples"] != len(self._corpus):
      raise ValueError(
          f"Saved data state is for {state['num_examples']} examples, this iterator has "
          f"{len(self._corpus)}: the training data changed since the checkpoint. Restore "
          "the same data or start a new workdir."
      )
    saved_source_len = int(state.get("packed_source_len", 0))  # states saved before the key
    if saved_source_len != self._source_len:
      raise ValueError(
          f"Saved data state has packed_source_len={saved_source_len}, this run "
          f"{self._source_len}: data.packed_source_len changed since the checkpoint, which "
          "would draw other batches. Restore the setting or start a new workdir."
      )
    rows = [int(r) for r in state["rows"]]
    if rows != self._rows:
      if len(rows) != len(self._rows) or any(r % self._batch_multiple for r in rows):
        raise ValueError(
            f"Saved data state has global rows per bucket {rows}; this run needs "
            f"{len(self._rows)} buckets with rows a multiple of batch_multiple="
            f"{self._batch_multiple} (devices x gradient accumulation, and processes): the "
            "batching settings or the device count changed incompatibly since the checkpoint. "
            "Resume on a device count that divides the saved rows."
        )
      logging.info(
          "data: keeping the checkpoint's global rows per bucket %s (this device "
          "count alone would give %s): the same global batches",
          rows,
          self._rows,
      )
      self._rows = rows
      self._batches_per_epoch = None
    epoch, part = int(state["epoch"]), int(state["part"])
    if not 0 <= part < self._num_parts:
      raise ValueError(
          f"Saved data state part={part} is outside [0, {self._num_parts}): "
          "packing was switched on or off since the checkpoint."
      )
    plan = self._plan(epoch, part)
    if not 0 <= state["batch"] <= len(plan):
      raise ValueError(
          f"Saved data state batch={state['batch']} is outside [0, "
          f"{len(plan)}] (epoch {epoch}, part {part}): the batching settings "
          "changed since the checkpoint."
      )
    self._epoch, self._part, self._batch = epoch, part, int(state["batch"])
    self._part_plan = plan


def eval_batches(
    examples: Sequence[Example], batch_size: int, bucket_lengths: Sequence[int]
) -> Iterator[Batch]:
  """Every example exactly once, in fixed shapes, with "index" [B] to restore order.

  Examples are ordered by bucket (in their original order within a bucket) and cut into
  batches of `batch_size` rows; each batch is padded to the bucket of its longest member, so
  jit sees at most len(bucket_lengths) shapes. Only the last batch has all-PAD filler rows
  (index -1), so decoding cost follows the number of sentences, not the number of buckets.
  Put outputs back in order with
  `out[batch["index"][i]] = prediction[i]` for rows with index >= 0.
  """
  if batch_size < 1:
    raise ValueError(f"batch_size={batch_size} must be >= 1.")
  corpus = _Corpus(examples, bucket_lengths)
  if corpus.num_truncated:
    logging.warning(
        "eval_batches: %d of %d pairs are longer than max_len=%d and were "
        "truncated; raise the last bucket length to evaluate them whole.",
        corpus.num_truncated,
        len(corpus),
        corpus.bucket_lengths[-1],
    )
  order = np.argsort(corpus.bucket, kind="stable")
  for start in range(0, len(order), batch_size):
    index = order[start : start + batch_size]
    length = corpus.bucket_lengths[corpus.bucket[index].max()]
    index = np.concatenate([index, np.full(batch_size - len(index), -1, index.dtype)])
    batch = corpus.batch(index, length)
    batch["index"] = index.astype(np.int32)
    yield batch


def padding_efficiency(batch: Batch) -> float:
  """Share of non-PAD positions over inputs and targets: 1.0 means no wasted compute. A position
  is one token, however many columns it has ([B, L, 1 + C]: column 0)."""
  tokens = [x if x.ndim == 2 else x[..., 0] for x in (batch["inputs"], batch["targets"])]
  real = sum(np.count_nonzero(x != PAD_ID) for x in tokens)  # [B, L] each
  return real / sum(x.size for x in tokens)
