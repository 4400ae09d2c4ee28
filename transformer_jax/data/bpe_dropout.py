"""BPE-dropout: the training sentences segmented anew every epoch (`config.data.bpe_dropout`).

Not in the paper: §5.1 segments each sentence once, deterministically. Provilkov et al. 2020
("BPE-Dropout: Simple and Effective Subword Regularization", Algorithm 1) segment a word by BPE
with merges dropped at random: the word starts as its characters; at each merge step every merge
that applies is dropped with probability p, the highest-priority one left is applied, and the
word is done when none is left. With p = 0 it is plain BPE, and it must give the tokenizer's own
ids: `BpeDropout` checks that for every word type of the corpus before training, so a vocabulary
it cannot reproduce (a unigram model, say) is an error, not silently other tokens.

Words: a SentencePiece BPE piece never holds the word boundary ▁ except as its first character,
so no merge crosses a boundary and a sentence is segmented word by word.

SentencePiece samples the same way (`enable_sampling=True, alpha=p`), but from an unseeded
generator per C++ thread, so a resumed run would draw other segmentations. Here epoch e of a run
with seed s is drawn by Python's `random.Random` from (s, e, side), whose `random()` sequence
Python keeps across versions: `examples(e)` is a pure function, a resumed run continues exactly,
and every process draws the same global batches.
"""

from __future__ import annotations

import concurrent.futures
import logging
import random
import time
from collections.abc import Sequence

import numpy as np

from transformer_jax.data import prepared
from transformer_jax.data.tokenizer import SentencePieceTokenizer

SIDES = ("both", "source", "target")  # the sides segmented anew
WORD_START = "\u2581"  # SentencePiece's ▁, the word boundary it keeps inside pieces


def segment(symbols: list[str], rank: dict[str, int], rate: float, draw=random.random) -> list[str]:
  """Algorithm 1 of Provilkov et al. 2020 on one word given as its characters (changed in place
  and returned): the merges of `rank` (lower merges first), each dropped with probability `rate`
  at every step. Ties (one merge at two places) go to the leftmost, as in SentencePiece."""
  while len(symbols) > 1:
    best, best_rank = -1, 0
    for i in range(len(symbols) - 1):
      r = rank.get(symbols[i] + symbols[i + 1])
      if r is None or (best >= 0 and r >= best_rank):
        continue
      if rate and draw() < rate:  # dropped for this step
        continue
      best, best_rank = i, r
    if best < 0:
      break
    symbols[best : best + 2] = [symbols[best] + symbols[best + 1]]
  return symbols


class _Side:
  """One side of the corpus as word occurrences: per occurrence its type, per type its
  characters (None: kept as the tokenizer segmented it) and its tokenizer ids."""

  def __init__(self, arrays: prepared.TokenArrays, starts_word: np.ndarray, pieces: list[str]):
    tokens = np.asarray(arrays.tokens)
    offsets = np.asarray(arrays.offsets)
    first = np.zeros(len(tokens), bool)  # [T] a word begins here
    first[offsets[:-1][np.diff(offsets) > 0]] = True
    first |= starts_word[tokens]
    word_starts = np.flatnonzero(first)  # [W]
    self.words_per_sentence = np.diff(np.searchsorted(word_starts, offsets))  # [N]
    types: dict[tuple[int, ...], int] = {}
    ids_list = np.split(tokens, word_starts[1:]) if len(tokens) else []
    self.occurrences = np.fromiter(
        (types.setdefault(tuple(w.tolist()), len(types)) for w in ids_list),
        np.int64,
        count=len(word_starts),
    )  # [W] type of each occurrence
    self.type_ids = list(types)  # the tokenizer's ids of each type
    self.type_chars = [list("".join(pieces[i] for i in ids)) for ids in self.type_ids]


class BpeDropout:
  """The training examples of a SentencePiece BPE corpus, segmented with BPE-dropout at `rate`
  per epoch: `examples(epoch)`, a pure function of (seed, epoch)."""

  def __init__(
      self,
      tokenizer: SentencePieceTokenizer,
      examples: prepared.Examples,
      rate: float,
      seed: int,
      sides: str = "both",
  ):
    if not 0.0 <= rate < 1.0:
      raise ValueError(f"BPE-dropout rate={rate} must be in [0, 1)")
    if sides not in SIDES:
      raise ValueError(f"BPE-dropout sides={sides!r}: expected one of {SIDES}")
    start = time.perf_counter()
    self.rate, self.seed = rate, seed
    self._arrays = (examples.source, examples.target)
    self._dropped = tuple(sides in ("both", side) for side in ("source", "target"))
    self._executor = concurrent.futures.ThreadPoolExecutor(1, "bpe-dropout")
    self._next: tuple[int, concurrent.futures.Future] | None = None
    pieces, merge_rank, special = [], {}, set()
    for i, (piece, score, normal) in enumerate(tokenizer.pieces()):
      pieces.append(piece)
      if not normal:
        special.add(i)
      # SentencePiece's BPE merges the pair whose piece scores highest: its rank is -score.
      # Control, unknown and unused pieces are never made by a merge.
      if normal and len(piece) > 1:
        merge_rank[piece] = -score
    self._rank = merge_rank
    self._id_of = {p: i for i, p in enumerate(pieces)}
    starts_word = np.array([p.startswith(WORD_START) for p in pieces])
    self._num = len(examples)
    self._sides = [_Side(a, starts_word, pieces) for a in (examples.source, examples.target)]
    for side_index, side in enumerate(self._sides):
      for t, (ids, chars) in enumerate(zip(side.type_ids, side.type_chars)):
        # <unk> (a character the vocabulary lacks) stands for text the pieces cannot spell:
        # such a word is kept as the tokenizer segmented it.
        if special.intersection(ids) or not all(c in self._id_of for c in chars):
          side.type_chars[t] = None
          continue
        got = [self._id_of[p] for p in segment(list(chars), merge_rank, 0.0)]
        if got != list(ids):
          raise ValueError(
              f"BPE-dropout: the vocabulary's merges segment the {('source', 'target')[side_index]}"
              f" word {''.join(chars)!r} as {got}, the tokenizer as {list(ids)}: "
              "data.bpe_dropout needs a SentencePiece BPE vocabulary (model_type 'bpe')"
          )
      # One character: nothing to merge, nothing to drop.
      side.type_chars = [c if c is not None and len(c) > 1 else None for c in side.type_chars]
    logging.info(
        "data: BPE-dropout %.2f over %s word types, checked against the tokenizer in %.1fs",
        rate,
        " and ".join(str(len(s.type_ids)) for s in self._sides),
        time.perf_counter() - start,
    )

  def __len__(self) -> int:
    return self._num

  def _draw(self, epoch: int, side_index: int) -> prepared.TokenArrays:
    side = self._sides[side_index]
    state = np.random.SeedSequence([self.seed, epoch, side_index]).generate_state(2)
    draw = random.Random(int(state[0]) << 32 | int(state[1])).random
    rank, id_of, rate = self._rank, self._id_of, self.rate
    out: list[int] = []
    lengths = np.empty(len(side.occurrences), np.int64)  # [W]
    for w, t in enumerate(side.occurrences.tolist()):
      chars = side.type_chars[t]
      if chars is None:
        ids = side.type_ids[t]
      else:
        ids = [id_of[p] for p in segment(list(chars), rank, rate, draw)]
      out.extend(ids)
      lengths[w] = len(ids)
    sentence_of_word = np.repeat(np.arange(self._num), side.words_per_sentence)  # [W]
    per_sentence = np.bincount(sentence_of_word, weights=lengths, minlength=self._num)  # [N]
    offsets = np.zeros(self._num + 1, np.int64)
    np.cumsum(per_sentence.astype(np.int64), out=offsets[1:])
    return prepared.TokenArrays(np.asarray(out, np.int32), offsets)

  def _make(self, epoch: int) -> prepared.Examples:
    return prepared.Examples(
        *(self._draw(epoch, k) if self._dropped[k] else self._arrays[k] for k in (0, 1))
    )

  def examples(self, epoch: int) -> prepared.Examples:
    """Every pair of the corpus, its `sides` segmented with BPE-dropout for `epoch`. Epoch
    `epoch + 1` is then drawn in a background thread (seconds for Multi30k's 29k pairs), so
    that training does not wait for it at the next epoch."""
    future = self._next if self._next is not None and self._next[0] == epoch else None
    result = future[1].result() if future else self._make(epoch)
    self._next = (epoch + 1, self._executor.submit(self._make, epoch + 1))
    return result


def check_corpus(tokenizer, examples: Sequence) -> str | None:
  """Why BPE-dropout cannot run on these training examples, or None."""
  if not isinstance(tokenizer, SentencePieceTokenizer):
    return "it needs a SentencePiece vocabulary (data.source 'text' or 'tfds')"
  if not isinstance(examples, prepared.Examples) or np.ndim(examples.source.tokens) != 1:
    return "it needs a prepared corpus of token ids (data.source 'text' or 'tfds')"
  return None
