"""§6.3 English constituency parsing as a task: decoded sequences -> trees -> EVALB's scores.

The model reads a sentence's words and writes its linearized tree (trees.py). Here decoded
outputs become trees over the input's words (`delinearize`, repairing ill-formed outputs by its
documented rule), which are scored against the gold trees by EVALB's rules (evalb.py, COLLINS.prm)
and written one per line as EVALB reads them:

    (TOP (S (NP (NNP Ms.) (NNP Haag)) (VP (VBZ plays) (NP (NNP Elianti))) (. .)))

The tags in an output tree are the model's own predictions (never the gold tags); TOP is deleted
by COLLINS.prm. Used by the training loop (validation and test scores), tune_decoding and the
parse command.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from transformer_jax.tasks.parsing import evalb, trees

TEST_TREES = "test_trees.mrg"  # the model's parses of the test split, one per line
TEST_GOLD = "test_gold.mrg"  # the preprocessed gold trees, line for line, for EVALB itself

# Characters a Penn Treebank word never holds (the bracket format would break), as it spells them.
_ESCAPES = {"(": "-LRB-", ")": "-RRB-", "{": "-LCB-", "}": "-RCB-"}


def sentence_words(line: str) -> list[str]:
  """A raw input line's words: split on whitespace (the input is tokenized as the Penn Treebank
  is), brackets spelled as the treebank spells them (`(` -> `-LRB-`, `{` -> `-LCB-`)."""
  words = []
  for word in line.split():
    if word in _ESCAPES:
      word = _ESCAPES[word]
    elif "(" in word or ")" in word:
      word = word.replace("(", "-LRB-").replace(")", "-RRB-")
    words.append(word)
  return words


def to_trees(
    hypotheses: Sequence[str],
    sentences: Sequence[Sequence[str]],
    linearization: trees.Linearization,
) -> list[trees.Restored]:
  """Each decoded linearization (tokens joined by spaces) as a tree over its sentence's words."""
  return [linearization.restore(h.split(), words) for h, words in zip(hypotheses, sentences)]


def gold_trees(
    pairs: Sequence[tuple[str, str]], linearization: trees.Linearization
) -> list[trees.Tree]:
  """The gold trees of (words, linearization) pairs (tasks/parsing/ptb.py), rebuilt exactly."""
  out = []
  for source, target in pairs:
    restored = linearization.restore(target.split(), source.split())
    if restored.repairs:  # cannot happen for pairs made by tasks/parsing/ptb.py
      raise ValueError(f"not a linearized tree: {target[:200]!r}")
    out.append(restored.tree)
  return out


def scores(
    hypotheses: Sequence[str],
    pairs: Sequence[tuple[str, str]],
    linearization: trees.Linearization,
) -> tuple[dict, list[trees.Tree], list[trees.Tree]]:
  """EVALB's figures (COLLINS.prm) of decoded outputs against the pairs' gold trees, the number
  of outputs that needed repair, and (predicted trees, gold trees)."""
  restored = to_trees(hypotheses, [source.split() for source, _ in pairs], linearization)
  predicted = [r.tree for r in restored]
  gold = gold_trees(pairs, linearization)
  result = evalb.score([str(t) for t in gold], [str(t) for t in predicted])
  a = result.all
  values = {
      "f1": a.f1,
      "precision": a.precision,
      "recall": a.recall,
      "complete_match": a.complete_match,
      "tagging_accuracy": a.tagging_accuracy,
      "repaired": sum(r.repairs > 0 for r in restored),
      "evalb_error_sentences": a.error_sentences,
      "evalb_skip_sentences": a.skip_sentences,
      f"f1_len_le_{result.params.cutoff_len}": result.cutoff.f1,
  }
  return values, predicted, gold


def write_trees(path: str, tree_list: Sequence[trees.Tree]) -> None:
  with open(path, "w", encoding="utf-8") as f:
    f.writelines(f"{tree}\n" for tree in tree_list)


def test_results(
    hypotheses: Sequence[str],
    pairs: Sequence[tuple[str, str]],
    linearization: trees.Linearization,
    workdir: str | None,
    trees_file: str = TEST_TREES,
) -> dict:
  """`scores` with a `test_` prefix; the workdir (if given) gets the predicted and gold trees."""
  values, predicted, gold = scores(hypotheses, pairs, linearization)
  if workdir is not None:
    write_trees(os.path.join(workdir, trees_file), predicted)
    write_trees(os.path.join(workdir, TEST_GOLD), gold)
  out = {f"test_{k}": v for k, v in values.items()}
  out["test_trees"] = trees_file
  out["evalb"] = (
      f"EVALB with COLLINS.prm (transformer_jax/tasks/parsing/evalb.py) on {trees_file} "
      f"against {TEST_GOLD}; "
      f"evalb -p COLLINS.prm -e 100000 {TEST_GOLD} {trees_file} prints the same"
  )
  return out
