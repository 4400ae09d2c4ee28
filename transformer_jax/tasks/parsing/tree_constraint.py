"""Decoding that can only write well-formed trees over the input's words (§6.3 parsing runs).

`config.parsing.tree_constraints` (off by default; not in the paper: §6.3 and Vinyals et al. 2015
decode freely and repair what comes out): at every step of the greedy or beam search, the tokens
that would leave the output something other than a prefix of a well-formed linearization
(data/trees.py) over the input sentence get probability 0, and the model's distribution over the
rest is renormalized (so a step with one legal token costs nothing). Given the tokens written so
far, a token is legal if it is

  * an opening bracket `(NP`: while words remain (no phrase is opened that could hold none), and
    only if the output can still end within the sentence's limit (input + `max_decode_extra`)
    after it: one more bracket to close, and every remaining word and tag, fit; at most
    `max_open_run` (10) in a row (the Penn Treebank sample's longest run is 6: this only stops
    a model's endless unary chains, `(NX (NX (NX ...`);
  * a tag `(NNP)`: without words in the output, while words remain; with them
    (`parsing.tree_words`), right after a word and only then. The tag of a punctuation word
    (`,` `.` `:` `--` quotes ...; data/trees.py's table) is one of the punctuation tags that
    EVALB deletes (COLLINS.prm: `,` `.` `:` ``` `` ``` `''`) or POS (`'` is one), and no other
    word gets those: the model chooses among them, and EVALB, which deletes punctuation by each
    tree's own tags, then sees the gold tree's words (the Penn Treebank sample breaks the rule
    once in 73,842 words);
  * a word (`parsing.tree_words` only): the input's next word itself (its token id), when no word
    waits for its tag — the model chooses where words go, never which: the forced word gets the
    model's probability of writing any word there (the sum over the vocabulary's words), not
    its probability of that word, which a decoder that has not learned to copy puts far too low
    (it then opens phrase after phrase rather than write a word it did not expect);
  * a closing bracket: the innermost open phrase's own (`)NP` for `(NP`; `)` when closings are
    bare), once that phrase holds a word;
  * EOS: once every word is written and tagged and every phrase closed.

In order (`parsing.tree_order="in_order"`, where a phrase's opening follows its first child), the
same rules hold but for where phrases open and words go, as in a shift-reduce parser: an opening
bracket only right after a finished node (a tag, or a closing) and also once every word is
written, a word or tag only inside an open phrase (or first of all), and a closing bracket as
soon as its phrase is open (it holds its first child); at most `max_open_run` openings between
two words, and closing the outermost phrase before the last word only with room left to open
another over it. Should the limit leave no room for a phrase over the words written, the next
word goes beside them at the top (a flat forest, which restores with one counted repair).

Anything else (reserved ids, other words) is never legal. There is always a legal token, and
every output restores with no repair (data/trees.py) as long as the limit leaves room for the
sentence's own tree: a tag per word (two tokens per word with `parsing.tree_words`) and EOS, which
§6.3's input + 300 does for every sentence up to 300 words. The state is recomputed from each
hypothesis' tokens (depth, words written, innermost phrase), so the searches carry nothing new:
`search.Greedy` and `search.Beam` call the constraint on their prefixes as they are. It answers
with `search.Candidates`, the log-probabilities of the ~100 tokens that can ever be legal (tree
tokens, EOS, the next word), so a step's constraint and choice never pass over the vocabulary
but to sum the words' mass; `reference` is the same over the whole vocabulary.

Shapes: v vocabulary, n output length, s source length; leading axes `...` are the hypotheses
([b] for greedy, [b, k] for beam search).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, RESERVED_TOKENS
from transformer_jax.decoding import search
from transformer_jax.tasks.parsing import evalb, trees

# The kinds of token ids.
OTHER, OPEN, CLOSE, TAG, WORD = range(5)


def token_kind(token: str) -> int:
  """The kind of a vocabulary entry: tree tokens (data/trees.py) by their brackets; `<unk>` is a
  word (an input word the vocabulary lacks)."""
  if token in RESERVED_TOKENS[: BOS_ID + 1]:  # <pad>, </s>, <s>
    return OTHER
  if len(token) > 2 and token[0] == "(" and token[-1] == ")":
    return TAG
  if token[0] == "(":
    return OPEN
  if token[0] == ")":
    return CLOSE
  return WORD


@dataclasses.dataclass(frozen=True, eq=False)
class TreeConstraint:
  """The legal next tokens of linearized trees (module docstring) over a vocabulary.

  Called as `constraint(log_probs [..., v], prefixes [..., n], limit [b], inputs [b, s])`, it
  returns the log-probabilities renormalized over the legal tokens (-inf elsewhere). `prefixes`
  are each hypothesis' tokens so far, PAD after them; `limit` each sentence's maximum output
  length (EOS included); `inputs` the batch's source ids, whose words (all but PAD and EOS) the
  output must cover.
  """

  kinds: np.ndarray  # [v] int32: OTHER, OPEN, CLOSE, TAG or WORD
  closing: np.ndarray  # [v] int32: an opening bracket's closing token id; -1 for other tokens
  words: bool  # parsing.tree_words: each word is written before its tag
  punctuation: np.ndarray  # [v] bool: a word whose tag EVALB deletes (trees.punctuation_tag)
  tag_class: np.ndarray  # [v] int32: 1 for the tags EVALB deletes, 2 for POS, 0 otherwise
  in_order: bool = False  # parsing.tree_order == "in_order"
  max_open_run: int = 10  # opening brackets in a row (in order: between two words), at most
  # The answer renormalizes over the legal tokens, so it is the same for the logits as for their
  # log-softmax: decode.Predictor gives it the logits.
  takes_logits = True

  @classmethod
  def for_vocabulary(
      cls, tokens: Sequence[str], closing: str, words: bool, order: str = "top_down"
  ) -> TreeConstraint:
    """From the run's vocabulary (id -> token) and its linearization (`parsing.tree_closing`,
    `parsing.tree_words`, `parsing.tree_order`). A vocabulary without the closing token of one
    of its phrases is not a tree vocabulary: ValueError."""
    ids = {token: i for i, token in enumerate(tokens)}
    kinds = np.array([token_kind(t) for t in tokens], np.int32)
    deleted = set(evalb.COLLINS.delete_labels)
    punctuation = np.array([trees.punctuation_tag(t) in deleted for t in tokens])
    deleted_tags = {trees.tag_token(t) for t in deleted}
    tag_class = [
        1 if t in deleted_tags else 2 if t == trees.tag_token("POS") else 0 for t in tokens
    ]
    closes = np.full(len(tokens), -1, np.int32)
    for i in np.flatnonzero(kinds == OPEN):
      close = ")" + tokens[i][1:] if closing == "labeled" else ")"
      if close not in ids:
        raise ValueError(f"the vocabulary has {tokens[i]!r} but not its closing token {close!r}")
      closes[i] = ids[close]
    punctuation &= kinds == WORD
    tag_class = np.array(tag_class, np.int32)
    return cls(kinds, closes, words, punctuation, tag_class, order == "in_order")

  def __call__(self, log_probs, prefixes, limit, inputs) -> search.Candidates:
    """The log-probabilities renormalized over the legal tokens, as `search.Candidates`: those
    of the few tokens that can ever be legal, the tree tokens and EOS (`candidates`, fixed), and
    of the input's next word. `reference` is the same over the whole vocabulary; this form spares
    every pass over the vocabulary but the mass of the words, and lets the searches choose among
    ~100 tokens instead of v (at beam 1 a step takes half the time: docs/experiments.md)."""
    r = self._rules(prefixes, limit, inputs)
    log_probs = self._checked(log_probs)
    candidates = jnp.asarray(self.candidates)  # [c]
    legal = self._legal_among(r, candidates)  # [..., c]
    scores = jnp.take(log_probs, candidates, axis=-1)  # [..., c]
    ids = jnp.broadcast_to(candidates, scores.shape)
    if self.words:  # the one legal word takes the mass of every word (module docstring)
      word_mass = self._word_mass(log_probs)  # [...]
      legal = jnp.concatenate([legal, (r.free & r.shift)[..., None]], axis=-1)  # [..., c + 1]
      scores = jnp.concatenate([scores, word_mass[..., None]], axis=-1)
      ids = jnp.concatenate([ids, r.next_word[..., None]], axis=-1)
    kept = jnp.where(legal, scores, -jnp.inf)
    # -inf, not NaN, where nothing is legal: the prefixes of a beam's empty (-inf) hypotheses,
    # made of whatever tokens filled its top-k, follow no rule.
    normalized = jnp.where(legal, kept - jax.nn.logsumexp(kept, axis=-1, keepdims=True), -jnp.inf)
    return search.Candidates(normalized, ids.astype(jnp.int32))

  def reference(self, log_probs, prefixes, limit, inputs) -> jax.Array:
    """`__call__`'s log-probabilities [..., v] written over the whole vocabulary with `legal`'s
    mask: the definition the tests hold it to."""
    legal = self.legal(prefixes, limit, inputs)
    log_probs = self._checked(log_probs)
    if self.words:
      word_mass = self._word_mass(log_probs)[..., None]  # [..., 1]
      is_word = jnp.asarray(self.kinds) == WORD  # [v]
      log_probs = jnp.where(is_word, word_mass, log_probs)
    kept = jnp.where(legal, log_probs, -jnp.inf)
    return jnp.where(legal, kept - jax.nn.logsumexp(kept, axis=-1, keepdims=True), -jnp.inf)

  def _checked(self, log_probs) -> jax.Array:
    """`log_probs` [..., v] as float32; over another width than the vocabulary: ValueError."""
    outputs, v = log_probs.shape[-1], self.kinds.shape[0]
    if outputs != v:
      raise ValueError(f"log-probabilities over {outputs} outputs: expected the vocabulary's {v}")
    return log_probs.astype(jnp.float32)

  def _word_mass(self, log_probs) -> jax.Array:
    """[...]: the log-probability that a word comes next, from `_checked` log-probs: the words'
    logsumexp over the vocabulary."""
    is_word = jnp.asarray(self.kinds) == WORD  # [v]
    return jax.nn.logsumexp(jnp.where(is_word, log_probs, -jnp.inf), -1)

  @property
  def candidates(self) -> np.ndarray:
    """[c] int32: the ids that can be legal other than words: tree tokens and EOS."""
    return np.flatnonzero(
        (self.kinds == OPEN)
        | (self.kinds == CLOSE)
        | (self.kinds == TAG)
        | (np.arange(len(self.kinds)) == EOS_ID)
    ).astype(np.int32)

  def legal(self, prefixes: jax.Array, limit: jax.Array, inputs: jax.Array) -> jax.Array:
    """[..., v] bool: the tokens that may follow each prefix [..., n]."""
    r = self._rules(prefixes, limit, inputs)
    vocab = jnp.arange(self.kinds.shape[0])  # [v]
    legal = self._legal_among(r, vocab)
    if self.words:
      legal |= (vocab == r.next_word[..., None]) & (r.free & r.shift)[..., None]
    return legal  # [..., v]

  def _legal_among(self, r: _Rules, ids: jax.Array) -> jax.Array:
    """[..., c] bool: which of the token ids [c] that are not words `r` allows (a word id: never;
    the next word is `r.next_word`, legal where `r.free & r.shift`)."""
    kind, tag_class = jnp.asarray(self.kinds)[ids], jnp.asarray(self.tag_class)[ids]  # [c]
    legal = (kind == OPEN) & r.can_open[..., None]
    tag = (kind == TAG) & jnp.where(r.punctuation[..., None], tag_class > 0, tag_class != 1)
    legal |= tag & (r.pending if self.words else r.shift)[..., None]
    legal |= (ids == r.close[..., None]) & r.can_close[..., None]
    legal |= (ids == EOS_ID) & r.can_end[..., None]
    return legal

  def _rules(self, prefixes: jax.Array, limit: jax.Array, inputs: jax.Array) -> _Rules:
    """What each prefix [..., n] allows next (`_Rules`), from its tokens."""
    kinds_table, closing_table = jnp.asarray(self.kinds), jnp.asarray(self.closing)
    n = prefixes.shape[-1]
    per_row = (1,) * (prefixes.ndim - 2)  # the beam axis, if any
    src = inputs.reshape(inputs.shape[:1] + per_row + inputs.shape[1:])  # [b, (1,) s]
    limit = limit.reshape(limit.shape + per_row)  # [b, (1)]
    kinds = kinds_table[prefixes]  # [..., n]
    opens = kinds == OPEN
    depth_after = jnp.cumsum(opens.astype(jnp.int32) - (kinds == CLOSE), axis=-1)  # [..., n]
    depth = depth_after[..., -1]  # [...]: phrases open now
    written = jnp.sum(kinds == (WORD if self.words else TAG), axis=-1)  # [...]
    is_word = (src != PAD_ID) & (src != EOS_ID)  # [b, (1,) s]
    words_left = jnp.sum(is_word, axis=-1) - written  # [...]
    remaining = words_left > 0
    length = jnp.sum(prefixes != PAD_ID, axis=-1)  # [...]: no legal token is PAD
    last = jnp.where(length > 0, _at(kinds, length - 1), OTHER)  # [...]
    if self.in_order:  # the opening brackets since the last word (its tag)
      after_tag = (
          jnp.arange(n) > jnp.max(jnp.where(kinds == TAG, jnp.arange(n), -1), axis=-1)[..., None]
      )
      open_run = jnp.sum(opens & after_tag, axis=-1)  # [...]
    else:  # the opening brackets that end the prefix
      before_run = jnp.max(jnp.where(~opens & (prefixes != PAD_ID), jnp.arange(n), -1), axis=-1)
      open_run = length - 1 - before_run  # [...]
    # The innermost open phrase: the last opening bracket after which the depth is today's.
    positions = jnp.where(opens & (depth_after == depth[..., None]), jnp.arange(n), -1)
    innermost = jnp.max(positions, axis=-1)  # [...]; -1: none open
    close = jnp.where(innermost >= 0, closing_table[_at(prefixes, innermost)], -1)  # [...]

    pending = (last == WORD) if self.words else jnp.zeros_like(remaining)  # a word waits
    free = ~pending
    # The shortest end after an opening: its closing, the other closings, each word left (word
    # and tag, or tag) and EOS.
    per_word = 2 if self.words else 1
    fits = length + 1 + (depth + 1) + per_word * words_left + 1 <= limit
    can_open = free & fits & (open_run < self.max_open_run)
    if self.in_order:  # over the node just finished
      can_open &= (last == TAG) | (last == CLOSE)
      # A word or tag inside an open phrase, or first of all; beside the tree at the top only
      # when no phrase can open over it any more (a limit too tight for a tree: a flat forest).
      shift = remaining & ((depth > 0) | (length == 0) | ~can_open)
      # Closing the outermost phrase with words left: another must open over it, and fit.
      reopen = (depth == 1) & remaining
      reopen_fits = (length + 3 + per_word * words_left + 1 <= limit) & (
          open_run < self.max_open_run
      )
      can_close = free & (~reopen | reopen_fits)
    else:  # while words remain; a phrase closes once it holds a word
      can_open &= remaining
      shift = remaining
      can_close = free & (last != OPEN)
    words = jnp.broadcast_to(src, prefixes.shape[:-1] + src.shape[-1:])  # [..., s]
    # The word a tag now would belong to: the one just written, or the next one.
    tagged = _at(words, written - 1 if self.words else written)  # [...]
    return _Rules(
        can_open=can_open,
        shift=shift,
        pending=pending,
        free=free,
        close=close,
        can_close=can_close,
        can_end=free & ~remaining & (depth == 0),
        next_word=_at(words, written),
        punctuation=jnp.asarray(self.punctuation)[tagged],
    )


class _Rules(NamedTuple):
  """Per hypothesis [...]: what the module docstring's rules allow after its prefix."""

  can_open: jax.Array  # bool: an opening bracket
  shift: jax.Array  # bool: the next word (with tree_words, once no word waits), or a tag
  pending: jax.Array  # bool: a word waits for its tag (tree_words)
  free: jax.Array  # bool: no word waits
  close: jax.Array  # int32: the innermost open phrase's closing token id; -1: none open
  can_close: jax.Array  # bool: that closing
  can_end: jax.Array  # bool: EOS
  next_word: jax.Array  # int32: the input's next word
  punctuation: jax.Array  # bool: the word a tag now would tag is punctuation


def _at(x: jax.Array, index: jax.Array) -> jax.Array:
  """x [..., m] at index [...] (clipped to the last axis) -> [...]."""
  index = jnp.clip(index, 0, x.shape[-1] - 1)
  return jnp.take_along_axis(x, index[..., None], axis=-1)[..., 0]


def _tokens(tokenizer) -> list[str]:
  """The vocabulary, id -> token."""
  return list(RESERVED_TOKENS) + tokenizer.words


def from_config(config, tokenizer) -> TreeConstraint | None:
  """The run's constraint (`config.parsing.tree_constraints` on a parsing run), or None."""
  if not config.parsing.tree_constraints:
    return None
  p = config.parsing
  return TreeConstraint.for_vocabulary(
      _tokens(tokenizer), p.tree_closing, p.tree_words, p.tree_order
  )
