"""A trained parsing run as a parser: plain or tokenized sentences in, trees in Python out.

  from transformer_jax.tasks.parsing.parser import Parser
  parser = Parser.load("/tmp/parsing_sample")     # the run's --workdir
  trees = parser.parse(["The company's shares rose 5% (to $3.50)."])   # [nltk.Tree]
  trees[0].pretty_print()
  parser.parse([["Prices", "fell", "."]])         # tokenized: the words of each sentence
  parser.parse_strings(sentences)                 # bracketed strings, as `parse` writes them

Plain text is split into Penn Treebank tokens by NLTK's Treebank tokenizer (`tokenize`):
contractions and possessives apart ("do n't", "company 's"), quotes as the treebank writes them
(`` and ''), brackets as -LRB- and -RRB-, numbers apart from % and $. Each tree carries the
part-of-speech tags the model predicted, under a TOP node; an output that was not a well-formed
tree is repaired by trees.py's rule (`parse_restored` says how many were). The search is the
run's, as the final evaluation and the parse command decode (the same function).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

from transformer_jax import errors
from transformer_jax.tasks.parsing import ptb, scoring, trees

Sentence = str | Sequence[str]  # plain text, or its words


@functools.cache
def _treebank_tokenizer():
  from nltk.tokenize import TreebankWordTokenizer

  return TreebankWordTokenizer()


def tokenize(text: str) -> list[str]:
  """One sentence of plain text as Penn Treebank tokens (NLTK's Treebank tokenizer, brackets
  spelled -LRB- -RRB- -LCB- -RCB- as the treebank spells them)."""
  words = _treebank_tokenizer().tokenize(text, convert_parentheses=True)
  return scoring.sentence_words(" ".join(words))  # {} and brackets inside words, as the treebank


def words_of(sentence: Sentence, tokenized: bool | None = None) -> list[str]:
  """A sentence's words: a string is plain text (tokenized) unless `tokenized=True` (split on
  spaces, as `parse` reads its input by default); a sequence is already its words."""
  if isinstance(sentence, str):
    return scoring.sentence_words(sentence) if tokenized else tokenize(sentence)
  return scoring.sentence_words(" ".join(sentence))


def check_words(words: Sequence[str], max_words: int, where: str) -> None:
  """A UserError naming `where` (a sentence, a line) if `words` is empty or longer than the
  model reads (`max_words`: its config.data.max_len minus the end-of-sentence token)."""
  if not words:
    raise errors.UserError(
        f"{where} is empty: give one sentence per line, its words separated by spaces"
    )
  if len(words) > max_words:
    raise errors.UserError(
        f"{where} has {len(words)} words; this model reads at most {max_words} (its "
        "config.data.max_len minus the end-of-sentence token): split the sentence"
    )


@dataclasses.dataclass
class Parser:
  run: Any  # runs.inference.LoadedRun of a parsing run

  @classmethod
  def load(
      cls,
      workdir: str,
      checkpoint: str = "auto",
      beam_size: int | None = None,
      alpha: float | None = None,
      tree_constraints: bool | None = None,
      shapes: str | None = None,
  ) -> Parser:
    """The parsing run in `workdir`, its parameters as `translate --checkpoint` chooses them;
    the search settings given override the run's."""
    from transformer_jax import tasks
    from transformer_jax.runs import inference

    tasks.check_command(workdir, "parse")
    overrides = {}
    if tree_constraints is not None:
      overrides["parsing.tree_constraints"] = tree_constraints
    run = inference.load_run(
        workdir, checkpoint, beam_size, alpha, shapes=shapes, overrides=overrides
    )
    return cls(run)

  @property
  def max_words(self) -> int:
    return self.run.config.data.max_len - 1  # room for the end-of-sentence token

  def check(self, sentences: Sequence[Sequence[str]]) -> None:
    """A UserError naming the first empty sentence or one longer than the model reads."""
    for number, words in enumerate(sentences, start=1):
      check_words(words, self.max_words, f"sentence {number}")

  def parse_restored(
      self,
      sentences: Sequence[Sentence],
      tokenized: bool | None = None,
      beam_size: int | None = None,
      alpha: float | None = None,
      stats: dict | None = None,
  ) -> list[trees.Restored]:
    """`trees.Restored` (the tree and how many repairs it needed) of each sentence, in order;
    `stats` as `LoadedRun.decode_ids`'."""
    words = [words_of(s, tokenized) for s in sentences]
    self.check(words)
    run = self.run
    known = set(run.tokenizer.words)
    p = run.config.parsing
    encoded = [ptb.encode_words(run.tokenizer, known, w, p.suffix_letters) for w in words]
    hypotheses = run.decode_ids(encoded, beam_size=beam_size, alpha=alpha, stats=stats)
    linearization = trees.Linearization.from_config(run.config.parsing)
    return scoring.to_trees(hypotheses, words, linearization)

  def parse_strings(self, sentences: Sequence[Sentence], **kwargs) -> list[str]:
    """Each sentence's tree as one bracketed line, `(TOP (S ...))`, as EVALB reads it."""
    return [str(r.tree) for r in self.parse_restored(sentences, **kwargs)]

  def parse(self, sentences: Sequence[Sentence], **kwargs) -> list[Any]:
    """Each sentence's tree as an `nltk.Tree` (label TOP; leaves the sentence's words)."""
    from nltk import Tree

    return [Tree.fromstring(s) for s in self.parse_strings(sentences, **kwargs)]
