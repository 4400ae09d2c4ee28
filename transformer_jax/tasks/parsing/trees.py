"""Constituency trees for §6.3: reading Penn Treebank brackets, preprocessing, linearization.

Reading. A treebank file holds one or more bracketed trees, each usually wrapped in an unlabeled
outer bracket and spread over several lines, as in the Penn Treebank's `combined/*.mrg`:

    ( (S (NP-SBJ (NNP Mr.) (NNP Vinken) )
        (VP (VBZ is) ...) ))

`parse_trees` reads them all; a file that is not such a treebank (text outside brackets, brackets
that do not balance, a bracket holding two words or a word beside constituents, an empty bracket)
is a `TreebankError` naming the file, the tree's number in it and its line. The outer bracket
(unlabeled, `TOP` or `ROOT`) becomes a node labeled `TOP`; a tree without one gets one.

Preprocessing (`preprocess`), as WSJ parsing papers and EVALB's COLLINS.prm do: empty elements
(`-NONE-` leaves: traces, null complementizers) are removed, then every constituent left without
children; function tags and indices are stripped from phrase labels (`NP-SBJ-1` -> `NP`,
`PP=2` -> `PP`). Nothing else is normalized: unary chains stay (`(S (VP ...))` once the subject
trace is gone; EVALB scores them), part-of-speech tags and words are the treebank's own (brackets
stay escaped as `-LRB-`, `-RRB-`), ADVP and PRT stay distinct (EVALB equates them when scoring).

Linearization (`linearize`), after Vinyals, Kaiser et al. (2015), "Grammar as a Foreign Language":
a depth-first, top-down walk writes an opening token for each phrase, one token per word for its
part-of-speech tag, and a closing token; the words themselves are not written, since they are the
input (the model copies nothing). Vinyals et al. write the tag as XX; here it is the real tag,
spelled as a bracket with the word left out, so the model predicts tags and the output trees carry
them (EVALB deletes punctuation by its tag in each tree, and placeholder tags would make it skip
sentences). Closing brackets carry their label (Vinyals et al.'s form) or not (`closing="bare"`):

    (S (NP (NNP Mr.) (NNP Vinken)) (VP (VBZ is) ...) (. .))
    labeled: (S (NP (NNP) (NNP) )NP (VP (VBZ) ... )VP (.) )S
    bare:    (S (NP (NNP) (NNP) ) (VP (VBZ) ... ) (.) )

No token can be mistaken for a word: Penn Treebank words never contain brackets.

With words (`config.parsing.tree_words`, a deviation from Vinyals et al. and §6.3, off by default),
each word is written before its tag, so the decoder's own output says which word it is at:

    words:   (S (NP Mr. (NNP) Vinken (NNP) )NP (VP is (VBZ) ... )VP . (.) )S

In order (`config.parsing.tree_order="in_order"`, a deviation from Vinyals et al. and §6.3, off by
default; the in-order order of Liu & Zhang 2017's shift-reduce parser, compared with top-down for
sequence-to-sequence parsing by Fernández-González & Gómez-Rodríguez 2020), a phrase's opening
token comes after its first child and before the others, so a phrase is named once its first
child is seen rather than before any of its words:

    in order:        (NNP) (NP (NNP) )NP (S (VBZ) (VP ... )VP (.) )S
    in order, words: Mr. (NNP) (NP Vinken (NNP) )NP (S is (VBZ) (VP ... )VP . (.) )S

`delinearize(tokens, words)` rebuilds the tree, giving the tag tokens the input's words in order;
for every tree of a treebank it returns the preprocessed tree exactly. A model's output that is
not a well-formed linearization is mapped to a tree by a fixed rule, and every departure counted:
  * a token that is not a tree token (a source word, a reserved id) is dropped;
  * a tag token after the last word is dropped;
  * a closing token with nothing open is dropped; one whose label is not the innermost open
    phrase's closes that phrase all the same (counted);
  * words left over at the end (fewer tags than words) are attached, in order, to the innermost
    phrase still open (or the root), tagged by `fallback_tag`: Penn Treebank's tag for a
    punctuation word, NN for any other word;
  * phrases still open at the end are closed, and phrases that got no word are removed.
With words, a token that is not a tree token is a word: it marks a position and nothing more
(the tree takes the input's words, whatever the model wrote); a tag with no word before it, a
word with no tag after it, and a word left waiting at the end are each counted, the rest as above.
In order, the tree is rebuilt as a shift-reduce parser would: a tag is a finished node; an
opening token takes the finished node just before it as its first child (with none there, it is
dropped); a closing token gives the innermost open phrase the finished nodes after it. Words
left over are finished nodes tagged by `fallback_tag`, phrases still open at the end are closed
so, and finished nodes left side by side at the top become the root's children (counted
once).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator, Sequence
from typing import Any

from transformer_jax import errors

ROOT = "TOP"  # the label of the outer bracket; EVALB's COLLINS.prm deletes it when scoring
_WRAPPERS = ("", "TOP", "ROOT")  # labels an outer bracket has in treebanks and parser outputs
EMPTY = "-NONE-"  # the tag of empty elements (traces, null complementizers)
CLOSINGS = ("labeled", "bare")
ORDERS = ("top_down", "in_order")
_TOKEN = re.compile(r"\(|\)|[^\s()]+")
# Penn Treebank's tag for each punctuation word (for words a broken output left untagged).
_PUNCTUATION_TAGS = {
    ",": ",",
    ".": ".",
    "?": ".",
    "!": ".",
    ":": ":",
    ";": ":",
    "--": ":",
    "-": ":",
    "...": ":",
    "``": "``",
    "`": "``",
    "''": "''",
    "'": "''",
    "-LRB-": "-LRB-",
    "-RRB-": "-RRB-",
    "-LCB-": "-LRB-",
    "-RCB-": "-RRB-",
    "$": "$",
    "#": "#",
}


class TreebankError(errors.UserError):
  """A treebank file that cannot be read as trees; the message names the file and tree."""


@dataclasses.dataclass
class Tree:
  """A constituent: a phrase (children are Trees) or a preterminal (its one child is the word)."""

  label: str
  children: list[Tree | str]

  @property
  def is_preterminal(self) -> bool:
    return len(self.children) == 1 and isinstance(self.children[0], str)

  def tagged_words(self) -> list[tuple[str, str]]:
    """(word, tag) of every leaf, left to right."""
    out = []
    stack = [self]
    while stack:
      node = stack.pop()
      if node.is_preterminal:
        out.append((node.children[0], node.label))
      else:
        stack.extend(reversed(node.children))
    return out

  def words(self) -> list[str]:
    return [word for word, _ in self.tagged_words()]

  def __str__(self) -> str:
    """One line, as EVALB reads trees: `(TOP (S (NP (DT The) (NN dog)) (VP (VBZ barks))))`."""
    parts, stack = [], [self]  # iterative: a broken model output may nest thousands deep
    while stack:
      node = stack.pop()
      if isinstance(node, str):  # a closing bracket
        parts.append(node)
      elif node.is_preterminal:
        parts.append(f" ({node.label} {node.children[0]})")
      else:
        parts.append(f" ({node.label}")
        stack.append(")")
        stack.extend(reversed(node.children))
    return "".join(parts)[1:]


# ----------------------------------------------------------------------------- reading


def parse_trees(text: str, name: str = "<string>") -> list[Tree]:
  """Every tree of a bracketed treebank text, each under a `TOP` node (see module docstring)."""
  trees: list[Tree] = []
  # Open brackets: [label (None until read), children, word, line of the bracket].
  stack: list[list] = []
  number, line_of_tree = 0, 1

  def fail(message: str, position: int):
    line = text.count("\n", 0, position) + 1
    tree = f"tree {number} (from line {line_of_tree})" if number else "before the first tree"
    raise TreebankError(
        f"{name}: {tree}, line {line}: {message}; expected Penn Treebank brackets such as "
        "( (S (NP (DT The) (NN dog)) (VP (VBZ barks))) )"
    )

  for match in _TOKEN.finditer(text):
    token, position = match.group(), match.start()
    if token == "(":
      if not stack:
        number += 1
        line_of_tree = text.count("\n", 0, position) + 1
      else:
        top = stack[-1]
        if top[2] is not None:
          fail(f"a bracket holds the word {top[2]!r} and a constituent", position)
        if top[0] is None:
          top[0] = ""  # an unlabeled bracket, like the outer one
      stack.append([None, [], None])
    elif token == ")":
      if not stack:
        fail("a closing bracket with no open bracket (the brackets do not balance)", position)
      label, children, word = stack.pop()
      if word is not None:
        node = Tree(label, [word])
      elif children:
        node = Tree(label or "", children)
      else:
        fail(f"an empty bracket ({label or ''})", position)
      if stack:
        stack[-1][1].append(node)
      else:
        trees.append(_with_root(node))
    else:
      if not stack:
        fail(f"text outside brackets ({token[:40]!r})", position)
      top = stack[-1]
      if top[0] is None:
        top[0] = token
      elif top[1]:
        fail(f"the word {token!r} beside constituents in one bracket", position)
      elif top[2] is not None:
        fail(f"two words in one bracket ({top[2]!r}, {token!r})", position)
      else:
        top[2] = token
  if stack:
    fail(f"{len(stack)} bracket(s) still open at the end of the file", len(text))
  if not trees:
    raise TreebankError(
        f"{name}: not a treebank file: it holds no bracketed tree (expected Penn Treebank "
        "`.mrg` trees such as ( (S (NP (DT The) (NN dog)) (VP (VBZ barks))) ))"
    )
  return trees


def _with_root(node: Tree) -> Tree:
  if node.label in _WRAPPERS and not node.is_preterminal:
    return Tree(ROOT, node.children)
  return Tree(ROOT, [node])


def read_trees(path: str) -> list[Tree]:
  """The trees of one treebank file (UTF-8; the Penn Treebank is ASCII)."""
  try:
    with open(path, "rb") as f:
      data = f.read()
  except OSError as e:
    raise TreebankError(f"{path}: cannot read the file: {e.strerror or e}") from e
  try:
    text = data.decode("utf-8")
  except UnicodeDecodeError as e:
    line = data.count(b"\n", 0, e.start) + 1
    raise TreebankError(
        f"{path}: line {line}: not UTF-8 text ({data[e.start:e.end]!r}): not a treebank file?"
    ) from None
  return parse_trees(text, path)


# ----------------------------------------------------------------------------- preprocessing


def strip_function_tags(label: str) -> str:
  """`NP-SBJ-1` -> `NP`, `PP=2` -> `PP`; labels that begin with '-' (`-NONE-`) stay whole."""
  if label.startswith("-"):
    return label
  return re.split(r"[-=]", label, maxsplit=1)[0]


def preprocess(tree: Tree) -> Tree | None:
  """Without empty elements, empty constituents and function tags (None: nothing is left)."""
  if tree.is_preterminal:
    return None if tree.label == EMPTY else Tree(tree.label, list(tree.children))
  children = [c for c in (preprocess(child) for child in tree.children) if c is not None]
  if not children:
    return None
  label = tree.label if tree.label == ROOT else strip_function_tags(tree.label)
  return Tree(label, children)


# ----------------------------------------------------------------------------- linearization


def tag_token(tag: str) -> str:
  return f"({tag})"


def is_tree_token(token: str) -> bool:
  """A bracket or a tag of a linearized tree (`(NP`, `)NP`, `)`, `(NNP)`), not a word."""
  return token[:1] in ("(", ")")


def linearize(
    tree: Tree, closing: str = "labeled", words: bool = False, order: str = "top_down"
) -> list[str]:
  """The target tokens of a tree (its root's children; module docstring): top-down, or with each
  phrase's opening token after its first child (`order="in_order"`); with `words`, each tag
  token follows its word (`parsing.tree_words`)."""
  _check_form(closing, order)
  out = []

  def visit(node: Tree):
    if node.is_preterminal:
      if words:
        out.append(node.children[0])
      out.append(tag_token(node.label))
      return
    first, *rest = node.children
    if order == "in_order":
      visit(first)
    out.append("(" + node.label)
    for child in rest if order == "in_order" else node.children:
      visit(child)
    out.append(")" + node.label if closing == "labeled" else ")")

  for child in tree.children:
    visit(child)
  return out


@dataclasses.dataclass(frozen=True)
class Linearization:
  """How a run writes trees as targets: `closing` ("labeled" or "bare"), `words` (each word
  written before its tag; `config.parsing.tree_words`, off in the paper's form) and `order`
  ("top_down", the paper's, or "in_order"; `config.parsing.tree_order`)."""

  closing: str = "labeled"
  words: bool = False
  order: str = "top_down"

  @classmethod
  def from_config(cls, parsing) -> Linearization:
    """From a run's `config.parsing` (`tree_closing`, `tree_words`, `tree_order`)."""
    return cls(parsing.tree_closing, parsing.tree_words, parsing.tree_order)

  def tokens(self, tree: Tree) -> list[str]:
    return linearize(tree, self.closing, self.words, self.order)

  def restore(self, tokens: Sequence[str], words: Sequence[str]) -> Restored:
    return delinearize(tokens, words, self.closing, self.words, self.order)


def punctuation_tag(word: str) -> str | None:
  """Penn Treebank's tag for a punctuation word (`,` -> `,`, `--` -> `:`), or None."""
  return _PUNCTUATION_TAGS.get(word)


def fallback_tag(word: str) -> str:
  """The tag of a word that a broken output left untagged (module docstring)."""
  return _PUNCTUATION_TAGS.get(word, "NN")


@dataclasses.dataclass(frozen=True)
class Restored:
  tree: Tree  # under a TOP node, with exactly the given words in order
  repairs: int  # departures from a well-formed linearization (0: the output was one)


def delinearize(
    tokens: Sequence[str],
    words: Sequence[str],
    closing: str = "labeled",
    with_words: bool = False,
    order: str = "top_down",
) -> Restored:
  """The tree of `tokens` over `words`, repaired by the module docstring's rule if need be.

  `with_words`: `tokens` write each word before its tag (`linearize(..., words=True)`); those
  word tokens are read as position marks only (the tree takes `words`, the input's). `order`:
  the order `tokens` were written in (`linearize`'s)."""
  _check_form(closing, order)
  steps = list(_tree_steps(tokens, words, closing, with_words))
  build = _build_in_order if order == "in_order" else _build_top_down
  root, repairs = build([(step, v) for step, v in steps if step != "repair"], closing)
  return Restored(root, repairs + sum(step == "repair" for step, _ in steps))


def _tree_steps(tokens, words, closing, with_words) -> Iterator[tuple[str, Any]]:
  """The steps of `tokens`: ("tag", a preterminal over the next input word), ("open", label),
  ("close", its token), and at the end ("left", a fallback-tagged preterminal) per word no tag
  took; ("repair", None) for each token that is no tree token, tag past the last word, and (with
  words) unpaired word or tag (module docstring)."""
  used, pending = 0, False  # with_words: a word token waits for its tag
  for token in tokens:
    if with_words and not is_tree_token(token):  # a word
      if pending:  # the word before it got no tag
        yield "repair", None
      pending = True
      continue
    is_tag = len(token) > 2 and token[0] == "(" and token[-1] == ")"
    if with_words and pending != is_tag:  # a word with no tag, or a tag with no word
      yield "repair", None
    pending = False
    if is_tag and used < len(words):
      yield "tag", Tree(token[1:-1], [words[used]])
      used += 1
    elif len(token) > 1 and token[0] == "(" and ")" not in token:  # a phrase opens
      yield "open", token[1:]
    elif token[:1] == ")" and (closing == "labeled" or token == ")"):
      yield "close", token
    else:  # a tag past the last word, or not a tree token
      yield "repair", None
  if pending:
    yield "repair", None
  for word in words[used:]:
    yield "repair", None
    yield "left", Tree(fallback_tag(word), [word])


def _build_top_down(steps, closing) -> tuple[Tree, int]:
  root = Tree(ROOT, [])
  stack, repairs = [root], 0
  for step, value in steps:
    if step in ("tag", "left"):
      stack[-1].children.append(value)
    elif step == "open":
      node = Tree(value, [])
      stack[-1].children.append(node)
      stack.append(node)
    elif len(stack) == 1:  # a closing with nothing open
      repairs += 1
    else:
      node = stack.pop()
      repairs += closing == "labeled" and value[1:] != node.label
  repairs += len(stack) - 1
  repairs += _remove_empty(root)
  return root, repairs


def _build_in_order(steps, closing) -> tuple[Tree, int]:
  stack, repairs = [], 0  # (node, open) pairs, bottom first
  open_count = 0

  def close() -> Tree:  # the innermost open phrase takes the finished nodes after it
    nonlocal open_count
    i = max(j for j, (_, is_open) in enumerate(stack) if is_open)
    node = stack[i][0]
    node.children.extend(n for n, _ in stack[i + 1 :])
    del stack[i + 1 :]
    stack[i] = (node, False)
    open_count -= 1
    return node

  for step, value in steps:
    if step in ("tag", "left"):
      stack.append((value, False))
    elif step == "open":
      if stack and not stack[-1][1]:
        stack[-1] = (Tree(value, [stack[-1][0]]), True)
        open_count += 1
      else:  # no finished node to be its first child
        repairs += 1
    elif open_count == 0:  # a closing with nothing open
      repairs += 1
    else:
      node = close()
      repairs += closing == "labeled" and value[1:] != node.label
  repairs += open_count
  while open_count:
    close()
  repairs += len(stack) > 1  # a forest: one tree, the root's child, is the well-formed output
  return Tree(ROOT, [n for n, _ in stack]), repairs


def _remove_empty(root: Tree) -> int:
  """Removes the phrases without words under `root`; returns how many were removed."""
  order, stack = [], [root]
  while stack:  # iterative, as __str__; children before parents in reversed(order)
    node = stack.pop()
    order.append(node)
    stack.extend(c for c in node.children if isinstance(c, Tree) and not c.is_preterminal)
  removed = 0
  for node in reversed(order):
    kept = [c for c in node.children if isinstance(c, str) or c.children]
    removed += len(node.children) - len(kept)
    node.children = kept
  return removed


def _check_form(closing: str, order: str = "top_down"):
  if closing not in CLOSINGS:
    raise ValueError(f"closing={closing!r}: expected one of {CLOSINGS}")
  if order not in ORDERS:
    raise ValueError(f"order={order!r}: expected one of {ORDERS}")


def iter_tree_tokens(trees: Sequence[Tree], closing: str) -> Iterator[str]:
  for tree in trees:
    yield from linearize(tree, closing)
