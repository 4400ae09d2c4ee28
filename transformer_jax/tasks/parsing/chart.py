"""Trees as charts of labeled spans, and the best tree of a chart's scores (CKY).

A span (i, j) covers words i..j-1 (0 <= i < j <= n). A tree's chart gives each span the label of
the phrase that covers exactly those words, or `EMPTY` (index 0) where none does; a unary chain
(`(S (VP ...))` once the subject trace is gone, or `(NP (NNP Elianti))`) is one label, its labels
joined outer first: `S+VP`, `NP`. The root `TOP` and the part-of-speech tags are not spans (a tag
is each word's own label). `spans` and `build` are inverse for every preprocessed tree
(trees.preprocess): the chart parser's targets and outputs (Stern et al. 2017; Kitaev & Klein
2018, "Constituency Parsing with a Self-Attentive Encoder"; a deviation from §6.3, whose model
writes the linearized tree; `config.parsing.decoder`).

`cky(scores)` finds the binary bracketing of the words whose spans' best label scores sum
highest; spans labeled `EMPTY` in it are dropped, so a phrase's children need not be two. With
a tree CRF's potentials as scores (chart_model.py), that is the most probable tree.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from transformer_jax.tasks.parsing import trees

EMPTY = ""  # the label of a span no phrase covers: index 0 of every label list
CHAIN = "+"  # joins a unary chain's labels, outer first: S+VP

Span = tuple[int, int, str]  # (i, j, label): words i..j-1


def spans(tree: trees.Tree) -> list[Span]:
  """The labeled spans of a preprocessed tree (its `TOP` root's phrases), outer spans first."""
  out = []

  def visit(node: trees.Tree, start: int, chain: list[str]) -> int:
    if node.is_preterminal:
      if chain:  # a phrase over one word: (NP (NNP Elianti))
        out.append((start, start + 1, CHAIN.join(chain)))
      return start + 1
    if len(node.children) == 1:  # the chain goes on: its span is the child's
      return visit(node.children[0], start, [*chain, node.label])
    labels = [*chain, node.label]
    index = len(out)
    out.append(None)  # the phrase's place, outer first; its end is known once its words are
    end = start
    for child in node.children:
      end = visit(child, end, [])
    out[index] = (start, end, CHAIN.join(labels))
    return end

  end = 0
  for child in tree.children:  # TOP is not a span
    end = visit(child, end, [])
  return out


def labels_of(tree_list: Iterable[trees.Tree]) -> list[str]:
  """`EMPTY` then every label of the trees' spans, sorted: a chart parser's classes."""
  return [EMPTY, *sorted({label for tree in tree_list for _, _, label in spans(tree)})]


def tags_of(tree_list: Iterable[trees.Tree]) -> list[str]:
  """Every part-of-speech tag of the trees, sorted: a chart parser's tag classes."""
  return sorted({tag for tree in tree_list for _, tag in tree.tagged_words()})


def chart(tree: trees.Tree, label_index: dict[str, int], unknown: int = 0) -> np.ndarray:
  """[n + 1, n + 1] int32: span (i, j)'s label index (`label_index`; a label not in it ->
  `unknown`), `EMPTY`'s 0 elsewhere, i >= j included."""
  n = len(tree.words())
  out = np.zeros((n + 1, n + 1), np.int32)
  for i, j, label in spans(tree):
    out[i, j] = label_index.get(label, unknown)
  return out


def cky(scores: np.ndarray, n: int) -> list[tuple[int, int]]:
  """The best binary bracketing of n words under `scores`.

  scores [>= n + 1, >= n + 1]: span (i, j)'s score (its best label's). Returns the bracketing's
  spans (i, j), outer first, left to right (2n - 1 of them, the n one-word spans among them)."""
  best = np.zeros((n + 1, n + 1), np.float64)  # best[i, j]: the best subtree over i..j-1
  split = np.zeros((n + 1, n + 1), np.int32)
  idx = np.arange(n)
  best[idx, idx + 1] = scores[idx, idx + 1]
  for width in range(2, n + 1):
    starts = np.arange(n - width + 1)  # [s]
    ks = starts[:, None] + np.arange(1, width)[None, :]  # [s, width - 1]: the split points
    totals = best[starts[:, None], ks] + best[ks, starts[:, None] + width]  # [s, width - 1]
    arg = totals.argmax(axis=1)  # [s]
    ends = starts + width
    best[starts, ends] = totals[starts, arg] + scores[starts, ends]
    split[starts, ends] = ks[starts, arg]
  out, stack = [], [(0, n)]
  while stack:
    i, j = stack.pop()
    out.append((i, j))
    if j - i >= 2:
      k = split[i, j]
      stack.append((k, j))
      stack.append((i, k))
  return out


def build(
    words: Sequence[str],
    tags: Sequence[str],
    labeled: Sequence[Span],
) -> trees.Tree:
  """The tree under `TOP` of words, their tags and labeled spans (nested, `EMPTY` ones skipped
  or kept alike): the inverse of `spans` for a preprocessed tree."""
  n = len(words)
  phrases = sorted(
      ((i, j, label) for i, j, label in labeled if label != EMPTY),
      key=lambda s: (s[0], -s[1]),
  )  # outer first at each start
  root = trees.Tree(trees.ROOT, [])
  stack = [(root, 0, n)]  # open nodes: the innermost last
  position = 0

  def add_words(until: int) -> None:
    nonlocal position
    while position < until:
      while stack[-1][2] <= position:
        stack.pop()
      stack[-1][0].children.append(trees.Tree(tags[position], [words[position]]))
      position += 1

  for i, j, label in phrases:
    add_words(i)
    while stack[-1][2] < j:  # the innermost open phrase ends before this one does
      stack.pop()
    parts = label.split(CHAIN)
    top = trees.Tree(parts[0], [])
    stack[-1][0].children.append(top)
    node = top
    for part in parts[1:]:
      child = trees.Tree(part, [])
      node.children.append(child)
      node = child
    stack.append((node, i, j))
  add_words(n)
  return root


def decode(
    words: Sequence[str],
    tags: Sequence[str],
    label_scores: np.ndarray,
    best_labels: np.ndarray,
    labels: Sequence[str],
) -> trees.Tree:
  """A sentence's tree from the model's outputs: label_scores [>= n+1, >= n+1] (each span's best
  label's score), best_labels (that label's index in `labels`) and each word's tag."""
  n = len(words)
  bracketing = cky(label_scores, n)
  labeled = [(i, j, labels[best_labels[i, j]]) for i, j in bracketing]
  return build(words, tags, labeled)


# ----------------------------------------------------------------------------- the model's classes


def chain_tokens(tree_list: Iterable[trees.Tree]) -> list[str]:
  """The opening tokens of the trees' unary chains, `(S+VP`: with the tree tokens, the vocabulary
  of a chart parser holds every label it predicts (`classes`); no linearization writes them."""
  return sorted(
      {"(" + label for tree in tree_list for _, _, label in spans(tree) if CHAIN in label}
  )


def classes(vocabulary: Sequence[str]) -> tuple[list[str], list[str]]:
  """A run's span labels (`EMPTY` first, then every phrase label and chain its vocabulary opens,
  `(NP`, `(S+VP`) and its tags (`(NN)`), both sorted: what the span chart scores."""
  labels = sorted({t[1:] for t in vocabulary if t[:1] == "(" and t[-1:] != ")" and len(t) > 1})
  tags = sorted({t[1:-1] for t in vocabulary if t[:1] == "(" and t[-1:] == ")" and len(t) > 2})
  return [EMPTY, *labels], tags


def targets(tree: trees.Tree, label_index: dict[str, int], tag_index: dict[str, int]) -> np.ndarray:
  """[n, 5] int32: a tree as a span chart's targets (chart_model.py CHART_COLUMNS): each word's
  tag class + CHART_TAG_OFFSET, the label of its one-word span, and the label, first and last
  word of the node its right edge splits in the tree's right-branching binarization: a phrase
  (c1 c2 ... cm) is (c1 (c2 (... cm))), the phrase split after c1 and `EMPTY`-labeled nodes
  after the later children. Every word but the last splits one node. Labels and tags not in the
  indexes -> 0."""
  from transformer_jax.tasks.parsing.chart_model import CHART_COLUMNS, CHART_TAG_OFFSET

  tagged = tree.tagged_words()
  out = np.zeros((len(tagged), CHART_COLUMNS), np.int32)
  out[:, 0] = [tag_index.get(tag, 0) + CHART_TAG_OFFSET for _, tag in tagged]

  def split(label: int, children: list, start: int) -> int:
    """The binary nodes of a node over `children` from word `start`; returns its end."""
    ends = []
    end = start
    for child in children:
      end = visit(child, end, [])
      ends.append(end)
    for k, edge in enumerate(ends[:-1]):  # the right edge of child k splits one node
      first = start if k == 0 else ends[k - 1]
      out[edge - 1, 2:] = (label if k == 0 else 0, first, end - 1)
    return end

  def visit(node: trees.Tree, start: int, chain: list[str]) -> int:
    if node.is_preterminal:
      if chain:
        out[start, 1] = label_index.get(CHAIN.join(chain), 0)
      return start + 1
    if len(node.children) == 1:
      return visit(node.children[0], start, [*chain, node.label])
    label = label_index.get(CHAIN.join([*chain, node.label]), 0)
    return split(label, node.children, start)

  split(0, tree.children, 0)  # TOP is not a span: its node has no label
  return out


# ----------------------------------------------------------------------------- the search


class ChartSearch:
  """A span chart run's parses, in the place of a decoder's search (decoding.decode.Predictor,
  runs/inference.py `decode_sources`): one jitted pass of the encoder and the chart per batch,
  then `cky` on the host, each tree written as the run's linearization (token ids, EOS, PAD), so
  that scoring, the commands and `delinearize` read it as they read a decoder's. Beam size and α
  have no meaning here; they are accepted and ignored."""

  def __init__(self, model, tokenizer, linearization: trees.Linearization):
    import jax

    self.model = model.clone(config=model.config.replace(deterministic=True))  # ChartParser
    self.labels, self.tags = classes(tokenizer.words)
    self.linearization = linearization
    self.ids = {token: tokenizer.encode(token)[0] for token in tokenizer.words if token[:1] in "()"}
    self.shapes: set[tuple[int, ...]] = set()
    self._scores = jax.jit(self._chart_scores)

  def _chart_scores(self, params, inputs):
    import jax.numpy as jnp

    spans, tags = self.model.apply({"params": params}, inputs)  # [b, s, s, L], [b, s, T]
    # A tree's score is its spans' logits summed (the TreeCRF's potentials, chart_model.py).
    phrase = jnp.argmax(spans[..., 1:], axis=-1) + 1  # [b, s, s]: the best label not EMPTY
    best = (jnp.max(spans, axis=-1), jnp.argmax(spans, axis=-1), phrase)
    return (*best, jnp.argmax(tags, axis=-1))

  def search(self, params, inputs, alpha=None, beam_size=None, stats=None, sentences=None):
    """(tokens [b, t]: each row's tree as the linearization's ids, then EOS and PAD; 1 step)."""
    from transformer_jax.data.tokenizer import EOS_ID, PAD_ID
    from transformer_jax.parallel import distributed

    self.shapes.add(tuple(inputs.shape))
    best, label, phrase, tag = (distributed.gather(x) for x in self._scores(params, inputs))
    ids = distributed.gather(inputs)  # [b, s]
    rows = []
    for row in range(ids.shape[0]):
      n = int(np.argmax(ids[row] == EOS_ID)) if (ids[row] == EOS_ID).any() else ids.shape[1]
      words = [str(i) for i in ids[row, :n]]  # the ids stand for the words (tree_words)
      scores = np.zeros((n + 1, n + 1))  # chart (i, j) = the model's span of tokens i..j-1
      scores[:n, 1:] = best[row, :n, :n]
      best_labels = np.zeros((n + 1, n + 1), np.int64)
      best_labels[:n, 1:] = label[row, :n, :n]
      # The whole sentence is a phrase (TOP's one child, as in the treebank): its best label
      # that is not EMPTY. It is in every tree, so the bracketing is CKY's all the same.
      best_labels[0, n] = phrase[row, 0, max(n - 1, 0)]
      tree = decode(words, [self.tags[t] for t in tag[row, :n]], scores, best_labels, self.labels)
      rows.append(
          [self.ids[t] if t in self.ids else int(t) for t in self.linearization.tokens(tree)]
      )
    out = np.full((ids.shape[0], max(map(len, rows)) + 1), PAD_ID, np.int32)
    for row, tokens in enumerate(rows):
      out[row, : len(tokens)] = tokens
      out[row, len(tokens)] = EOS_ID
    if stats is not None:
      stats["row_steps"] = stats.get("row_steps", 0) + ids.shape[0]
    return out, 1

  def searches(self) -> int:
    """The distinct input shapes parsed: one compiled program each."""
    return len(self.shapes)

  def programs(self) -> int:
    return len(self.shapes)
