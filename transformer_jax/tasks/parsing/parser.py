"""A trained parsing run as a parser: plain or tokenized sentences in, trees in Python out.

  from transformer_jax.tasks.parsing.parser import Parser
  parser = Parser.load("/tmp/parsing_chart")      # the run's --workdir
  trees = parser.parse(["The company's shares rose 5% (to $3.50)."])   # [nltk.Tree]
  trees[0].pretty_print()
  parser.parse([["Prices", "fell", "."]])         # tokenized: the words of each sentence
  parser.parse_strings(sentences)                 # bracketed strings, as `parse` writes them

The methods take a list (or any iterable, a generator read once) of sentences and return one
tree per sentence, in order; one string is refused (`parse(["..."])` parses one sentence). A
sentence is a string of plain text, split into Penn Treebank tokens by NLTK's Treebank tokenizer
(`tokenize`): contractions and possessives apart ("do n't", "company 's"), quotes as the treebank
writes them (`` and ''), brackets as -LRB- and -RRB-, numbers apart from % and $; or, already
tokenized, a list of its tokens (strings, none empty or holding whitespace), or a string of them
separated by spaces with `tokenized=True`. Anything else is a UserError naming the sentence (and
the token). Each tree carries the part-of-speech tags the model predicted, under a TOP node; an
output that was not a well-formed tree is repaired by trees.py's rule (`parse_restored` says how
many were). The search is the run's, as the final evaluation and the parse command decode (the
same function); sentences are decoded in batches of about `eval.batch_tokens` words.

The leaves of a `parse` tree are the sentence's tokens as given (tokenized input) or as
`tokenize` wrote them (plain text). The model reads brackets as the treebank spells them
(`(` `)` `{` `}` as -LRB- -RRB- -LCB- -RCB-, and inside a token `f(x)` as `f-LRB-x-RRB-`), and so
do `parse_strings` and `parse_restored` write them, since a bracketed line cannot hold them.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable, Sequence
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


def tokens_of(sentence: Any, tokenized: bool | None = None, where: str = "sentence") -> list[str]:
  """A sentence's tokens as the user gave them: a string is plain text (`tokenize`) unless
  `tokenized=True` (split on spaces, as `parse` reads its input by default); a list (any
  iterable but a string) is already its tokens, each a non-empty string without whitespace. A
  UserError names `where` (and the token) otherwise."""
  if isinstance(sentence, str):
    return sentence.split() if tokenized else tokenize(sentence)
  if isinstance(sentence, (bytes, bytearray)) or not isinstance(sentence, Iterable):
    raise errors.UserError(
        f"{where} is {_a(sentence)}; expected a string (plain text) or a list of its tokens "
        "(strings)"
    )
  tokens = list(sentence)
  for number, token in enumerate(tokens, start=1):
    if not isinstance(token, str):
      raise errors.UserError(
          f"{where} token {number} is {_a(token)}; a sentence given as a list holds its tokens "
          "as strings"
      )
    if token.split() != [token]:  # the model reads words split on whitespace: one leaf each
      problem, fix = (
          ("holds whitespace", "split it into its tokens")
          if token.strip()
          else ("is empty" if not token else "is only whitespace", "drop it")
      )
      raise errors.UserError(
          f"{where} token {number} ({token!r}) {problem}: each token of a tokenized sentence is "
          f"one word without spaces; {fix}, or pass the sentence as one string of plain text"
      )
  return tokens


def _a(value: Any) -> str:
  """`value` described for a message: its type, and its value if short (`an int (42)`)."""
  if value is None:
    return "None"
  name = type(value).__name__
  shown = repr(value)
  article = "an" if name[0] in "aeiouAEIOU" else "a"
  return f"{article} {name}" + (f" ({shown})" if len(shown) <= 40 else "")


def words_of(sentence: Sentence, tokenized: bool | None = None) -> list[str]:
  """A sentence's words as the model reads them: its tokens (`tokens_of`), brackets spelled as
  the treebank spells them (`(` -> `-LRB-`, `{` -> `-LCB-`)."""
  tokens = tokens_of(sentence, tokenized)
  return tokens if isinstance(sentence, str) and not tokenized else _escaped(tokens)


def check_words(
    words: Sequence[str],
    max_words: int,
    where: str,
    empty: str = "give one sentence per line, its words separated by spaces",
) -> None:
  """A UserError naming `where` (a sentence, a line) if `words` is empty (saying `empty`) or
  longer than the model reads (`max_words`: its config.data.max_len minus the end-of-sentence
  token)."""
  if not words:
    raise errors.UserError(f"{where} is empty: {empty}")
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

  def read(
      self, sentences: Iterable[Sentence], tokenized: bool | None = None
  ) -> tuple[list[list[str]], list[list[str]]]:
    """(tokens as given, words as the model reads them) of every sentence (module docstring),
    each checked: a UserError names the first sentence or token the model cannot read."""
    if isinstance(sentences, (str, bytes, bytearray)):
      kind = "string" if isinstance(sentences, str) else "bytes object"
      raise errors.UserError(
          f"the sentences are one {kind}; the parser takes a list of sentences (each a string "
          "or a list of its tokens): pass [sentence] to parse one"
      )
    if not isinstance(sentences, Iterable):
      raise errors.UserError(
          f"the sentences are {_a(sentences)}; the parser takes a list of sentences (each a "
          "string or a list of its tokens)"
      )
    tokens, words = [], []
    for number, sentence in enumerate(sentences, start=1):
      where = f"sentence {number}"
      given = tokens_of(sentence, tokenized, where)
      read = given if isinstance(sentence, str) and not tokenized else _escaped(given)
      check_words(read, self.max_words, where, "give it at least one word")
      tokens.append(given)
      words.append(read)
    return tokens, words

  def parse_restored(
      self,
      sentences: Iterable[Sentence],
      tokenized: bool | None = None,
      beam_size: int | None = None,
      alpha: float | None = None,
      stats: dict | None = None,
  ) -> list[trees.Restored]:
    """`trees.Restored` (the tree and how many repairs it needed) of each sentence, in order,
    over its words as the model reads them (brackets as -LRB-...); `stats` as
    `LoadedRun.decode_ids`'."""
    _, words = self.read(sentences, tokenized)
    run = self.run
    known = set(run.tokenizer.words)
    p = run.config.parsing
    encoded = [ptb.encode_words(run.tokenizer, known, w, p.suffix_letters) for w in words]
    hypotheses = run.decode_ids(encoded, beam_size=beam_size, alpha=alpha, stats=stats)
    linearization = trees.Linearization.from_config(run.config.parsing)
    return scoring.to_trees(hypotheses, words, linearization)

  def parse_strings(self, sentences: Iterable[Sentence], **kwargs) -> list[str]:
    """Each sentence's tree as one bracketed line, `(TOP (S ...))`, as EVALB reads it (brackets
    in words as -LRB- -RRB- -LCB- -RCB-)."""
    return [str(r.tree) for r in self.parse_restored(sentences, **kwargs)]

  def parse(
      self, sentences: Iterable[Sentence], tokenized: bool | None = None, **kwargs
  ) -> list[Any]:
    """Each sentence's tree as an `nltk.Tree` (label TOP), its leaves exactly the sentence's
    tokens: as given (a list, or a string with `tokenized=True`), or as `tokenize` split plain
    text. One string is refused: `parse([text])` parses one sentence. kwargs: `parse_restored`'s
    search settings."""
    from nltk import Tree

    tokens, words = self.read(sentences, tokenized)
    out = []
    for given, restored in zip(tokens, self.parse_restored(words, **kwargs)):
      tree = Tree.fromstring(str(restored.tree))
      _set_leaves(tree, given)
      out.append(tree)
    return out


def _escaped(tokens: Sequence[str]) -> list[str]:
  """Tokens as the model reads them: brackets spelled as the treebank spells them."""
  return scoring.sentence_words(" ".join(tokens))  # one word per token: none holds whitespace


def _set_leaves(tree: Any, leaves: Sequence[str]) -> None:
  """Replaces the leaves of an nltk.Tree, left to right, with `leaves` (without recursion: a
  repaired output may nest deeply)."""
  leaves = iter(leaves)
  stack = [tree]
  while stack:
    node = stack.pop()
    children = []
    for i, child in enumerate(node):
      if isinstance(child, str):
        node[i] = next(leaves)
      else:
        children.append(child)
    stack.extend(reversed(children))
