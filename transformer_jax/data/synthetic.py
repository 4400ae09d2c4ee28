"""A synthetic translation task, generated in code: the offline default.

A toy "English" -> toy "German" pair over a random lexicon of pseudowords
drawn from the seed. Every source sentence follows

    S  = NP VERB NP [PREP NP]           (subject, verb, object, optional PP)
    NP = DET ADJ{0,2} NOUN

and its one correct translation is

    S' = NP' NP' [PREP' NP'] VERB'      verb last, as in a German subordinate clause
    NP' = DET'(definiteness, gender(NOUN)) NOUN' ADJ'*     adjectives after the noun

where X' is X's entry in the lexicon. Some nouns and verbs translate to two
target words (compounds, separable verbs), so lengths differ between sides.

Why it needs attention and reordering, not just a word-by-word lookup:
  * the verb moves from position 3-5 to the very end, past the object and the
    prepositional phrase (up to 9 source words later), so the decoder must find
    it again when the clause ends;
  * the determiner comes first in the target but depends on the noun's gender
    (one of three, fixed per noun), and the noun sits behind up to two
    adjectives in the source, so choosing it means looking ahead in the source;
  * the adjectives are emitted after the noun, i.e. in a different order.

Sources have 5-14 words, targets 5-18. With 40 nouns, 20 adjectives and 20
verbs there are over 10^15 distinct sentences, so the test set cannot be memorised
from the training set. Yet it is easy to learn: configs/quickstart.py's
2-layer, d_model=128 Transformer learns it within its 600 steps of 2k-token
batches (its expected result: the config's header).

Splits are disjoint by source sentence and drawn from one stream in the order
test, valid, train, so changing `num_train` never changes the test set.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from transformer_jax.data.tokenizer import WordTokenizer

NUM_NOUNS = 40
NUM_ADJECTIVES = 20
NUM_VERBS = 20
NUM_PREPOSITIONS = 5
NUM_GENDERS = 3  # Like German: the target determiner has a form per gender.
# Source determiners: 0 = definite ("the"), 1 = indefinite ("a").
NUM_DETERMINERS = 2
# Share of nouns and verbs whose translation is two words.
TWO_WORD_FRACTION = 0.25
ADJECTIVE_COUNT_PROBS = (0.4, 0.35, 0.25)  # P(0), P(1), P(2) adjectives in an NP.
PP_PROB = 0.5  # P(the sentence ends in a prepositional phrase).

# Syllable inventories give each side a look of its own, so a reader can tell
# source from target at a glance; the two sides never share a word.
_SOURCE_SYLLABLES = (
    (
        "b",
        "bl",
        "br",
        "d",
        "dr",
        "f",
        "fl",
        "g",
        "gr",
        "h",
        "j",
        "k",
        "l",
        "m",
        "n",
        "p",
        "pl",
        "pr",
        "r",
        "s",
        "sh",
        "sl",
        "st",
        "t",
        "th",
        "tr",
        "w",
    ),
    ("a", "e", "i", "o", "u", "ai", "ee", "oo", "ou"),
    ("", "", "n", "t", "ck", "sh", "st", "ll", "m", "p"),
)
_TARGET_SYLLABLES = (
    (
        "b",
        "d",
        "f",
        "g",
        "h",
        "k",
        "kr",
        "l",
        "m",
        "n",
        "pf",
        "r",
        "s",
        "sch",
        "st",
        "t",
        "v",
        "w",
        "z",
    ),
    ("a", "e", "i", "o", "u", "au", "ei", "ie", "eu"),
    ("", "", "n", "r", "t", "ch", "ng", "tz", "rn", "lt"),
)

# Sentences are drawn in fixed-size chunks so that sentence i does not depend
# on how many sentences were asked for.
_CHUNK = 4096
SPLITS = ("train", "valid", "test")


@dataclasses.dataclass(frozen=True)
class Lexicon:
  """Source words and their translations; target entries are word tuples."""

  determiners: tuple[str, ...]  # [NUM_DETERMINERS]
  target_determiners: tuple[tuple[str, ...], ...]  # [NUM_DETERMINERS][NUM_GENDERS]
  nouns: tuple[str, ...]
  noun_genders: tuple[int, ...]
  target_nouns: tuple[tuple[str, ...], ...]
  adjectives: tuple[str, ...]
  target_adjectives: tuple[tuple[str, ...], ...]
  verbs: tuple[str, ...]
  target_verbs: tuple[tuple[str, ...], ...]
  prepositions: tuple[str, ...]
  target_prepositions: tuple[tuple[str, ...], ...]

  def source_words(self) -> list[str]:
    return [*self.determiners, *self.nouns, *self.adjectives, *self.verbs, *self.prepositions]

  def target_words(self) -> list[str]:
    entries = [
        *self.target_nouns,
        *self.target_adjectives,
        *self.target_verbs,
        *self.target_prepositions,
    ]
    determiners = [w for forms in self.target_determiners for w in forms]
    return determiners + [w for entry in entries for w in entry]


def _make_lexicon(seed: int) -> Lexicon:
  rng = np.random.default_rng([seed, 0])
  used: set[str] = set()

  def word(syllables, max_syllables: int) -> str:
    # Rejection sampling: the inventories hold ~10^4 words per syllable, far
    # more than the ~200 needed, so this ends after a few tries.
    while True:
      n = rng.integers(1, max_syllables + 1)
      w = "".join(part[rng.integers(len(part))] for _ in range(n) for part in syllables)
      if len(w) >= 2 and w not in used:
        used.add(w)
        return w

  def entries(count: int, two_word_fraction: float = 0.0):
    src = tuple(word(_SOURCE_SYLLABLES, 2) for _ in range(count))
    num_two = round(count * two_word_fraction)
    tgt = tuple(
        tuple(word(_TARGET_SYLLABLES, 2) for _ in range(2 if i < num_two else 1))
        for i in range(count)
    )
    # Shuffle so two-word translations are not just the first entries.
    order = rng.permutation(count)
    return src, tuple(tgt[i] for i in order)

  determiners = tuple(word(_SOURCE_SYLLABLES, 1) for _ in range(NUM_DETERMINERS))
  target_determiners = tuple(
      tuple(word(_TARGET_SYLLABLES, 1) for _ in range(NUM_GENDERS)) for _ in range(NUM_DETERMINERS)
  )
  nouns, target_nouns = entries(NUM_NOUNS, TWO_WORD_FRACTION)
  adjectives, target_adjectives = entries(NUM_ADJECTIVES)
  verbs, target_verbs = entries(NUM_VERBS, TWO_WORD_FRACTION)
  prepositions, target_prepositions = entries(NUM_PREPOSITIONS)
  return Lexicon(
      determiners=determiners,
      target_determiners=target_determiners,
      nouns=nouns,
      noun_genders=tuple(int(g) for g in rng.integers(NUM_GENDERS, size=NUM_NOUNS)),
      target_nouns=target_nouns,
      adjectives=adjectives,
      target_adjectives=target_adjectives,
      verbs=verbs,
      target_verbs=target_verbs,
      prepositions=prepositions,
      target_prepositions=target_prepositions,
  )


def _sample_chunk(rng: np.random.Generator, lex: Lexicon) -> list[tuple[str, str]]:
  """_CHUNK sentence pairs; random choices drawn as arrays, strings built after."""
  n = _CHUNK

  def noun_phrases():
    det = rng.integers(NUM_DETERMINERS, size=n)
    noun = rng.integers(NUM_NOUNS, size=n)
    num_adj = rng.choice(3, size=n, p=ADJECTIVE_COUNT_PROBS)
    adj1 = rng.integers(NUM_ADJECTIVES, size=n)
    # Offset by 1..NUM_ADJECTIVES-1 so an NP never repeats an adjective.
    adj2 = (adj1 + rng.integers(1, NUM_ADJECTIVES, size=n)) % NUM_ADJECTIVES
    # .tolist(): Python ints index tuples much faster than numpy scalars.
    return list(zip(det.tolist(), noun.tolist(), num_adj.tolist(), adj1.tolist(), adj2.tolist()))

  subjects, objects, pp_objects = noun_phrases(), noun_phrases(), noun_phrases()
  verbs = rng.integers(NUM_VERBS, size=n).tolist()
  has_pp = (rng.random(n) < PP_PROB).tolist()
  preps = rng.integers(NUM_PREPOSITIONS, size=n).tolist()

  def render(np_choice) -> tuple[list[str], list[str]]:
    det, noun, num_adj, adj1, adj2 = np_choice
    adjs = (adj1, adj2)[:num_adj]
    src = [lex.determiners[det], *(lex.adjectives[a] for a in adjs), lex.nouns[noun]]
    tgt = [
        lex.target_determiners[det][lex.noun_genders[noun]],
        *lex.target_nouns[noun],
        *(w for a in adjs for w in lex.target_adjectives[a]),
    ]
    return src, tgt

  pairs = []
  for i in range(n):
    subj_src, subj_tgt = render(subjects[i])
    obj_src, obj_tgt = render(objects[i])
    src = [*subj_src, lex.verbs[verbs[i]], *obj_src]
    tgt = [*subj_tgt, *obj_tgt]
    if has_pp[i]:
      pp_src, pp_tgt = render(pp_objects[i])
      src += [lex.prepositions[preps[i]], *pp_src]
      tgt += [*lex.target_prepositions[preps[i]], *pp_tgt]
    tgt += lex.target_verbs[verbs[i]]  # SOV: the verb closes the clause.
    pairs.append((" ".join(src), " ".join(tgt)))
  return pairs


@dataclasses.dataclass(frozen=True)
class SyntheticTask:
  """The task for one seed: lexicon, splits and a joint word tokenizer."""

  seed: int = 0
  num_train: int = 50_000
  num_valid: int = 500
  num_test: int = 500

  def __post_init__(self):
    for name in ("num_train", "num_valid", "num_test"):
      if getattr(self, name) < 0:
        raise ValueError(f"SyntheticTask.{name}={getattr(self, name)} must be >= 0.")

  @functools.cached_property
  def lexicon(self) -> Lexicon:
    return _make_lexicon(self.seed)

  @functools.cached_property
  def _all_pairs(self) -> list[tuple[str, str]]:
    """Unique-by-source pairs in stream order: test, then valid, then train."""
    total = self.num_test + self.num_valid + self.num_train
    rng = np.random.default_rng([self.seed, 1])
    by_source: dict[str, str] = {}  # Dicts keep insertion order: deterministic.
    while len(by_source) < total:
      for src, tgt in _sample_chunk(rng, self.lexicon):
        by_source.setdefault(src, tgt)
    return list(by_source.items())[:total]

  def pairs(self, split: str) -> list[tuple[str, str]]:
    """(source, target) sentence pairs of 'train', 'valid' or 'test'."""
    t, v = self.num_test, self.num_valid
    bounds = {"test": (0, t), "valid": (t, t + v), "train": (t + v, None)}
    if split not in bounds:
      raise ValueError(f"SyntheticTask.pairs: split={split!r}; expected one of {SPLITS}.")
    start, stop = bounds[split]
    return self._all_pairs[start:stop]

  def vocabulary(self) -> list[str]:
    """Every word of both languages: one joint vocabulary, as in the paper (§3.4)."""
    return self.lexicon.source_words() + self.lexicon.target_words()

  def tokenizer(self) -> WordTokenizer:
    return WordTokenizer(self.vocabulary())
