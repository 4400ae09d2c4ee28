"""Tree reading, preprocessing and linearization (tasks/parsing/trees.py): exact round trips,
repairs."""

import pytest
from testing import PTB

from transformer_jax.tasks.parsing import trees


def test_reads_several_multi_line_trees_with_the_outer_bracket():
  read = trees.parse_trees(PTB, "x.mrg")
  assert len(read) == 2
  assert all(t.label == "TOP" for t in read)
  assert read[0].words() == ["Mr.", "Vinken", "is", "expected", "*-1", "to", "retire", "early", "."]
  assert read[1].children[0].label == "FRAG"


def test_preprocess_removes_empty_elements_emptied_constituents_and_function_tags():
  first, second = (trees.preprocess(t) for t in trees.parse_trees(PTB))
  assert str(first) == (
      "(TOP (S (NP (NNP Mr.) (NNP Vinken)) (VP (VBZ is) (VP (VBN expected) (S (VP (TO to) "
      "(VP (VB retire) (PRT (RP early))))))) (. .)))"
  )
  assert str(second) == "(TOP (FRAG (NP (NN Nothing)) (. .)))"  # SBAR held only traces
  assert trees.preprocess(trees.parse_trees("((S (-NONE- *)))")[0]) is None
  assert trees.strip_function_tags("PP-LOC=2") == "PP"
  assert trees.strip_function_tags("-LRB-") == "-LRB-"


@pytest.mark.parametrize("closing", trees.CLOSINGS)
def test_linearization_and_back(closing):
  tree = trees.preprocess(trees.parse_trees(PTB)[0])
  tokens = trees.linearize(tree, closing)
  assert tokens[:4] == ["(S", "(NP", "(NNP)", "(NNP)"]
  assert tokens[4] == (")NP" if closing == "labeled" else ")")
  assert not set(tokens) & set(tree.words())  # the words are the input, never the output
  restored = trees.delinearize(tokens, tree.words(), closing)
  assert restored.repairs == 0 and restored.tree == tree


def test_linearization_with_words_and_back():
  """data.tree_words: each word before its tag; the words read back are the input's."""
  tree = trees.preprocess(trees.parse_trees(PTB)[0])
  form = trees.Linearization("labeled", words=True)
  tokens = form.tokens(tree)
  assert tokens[:6] == ["(S", "(NP", "Mr.", "(NNP)", "Vinken", "(NNP)"]
  assert [t for t in tokens if t[0] not in "()"] == tree.words()
  assert form.restore(tokens, tree.words()) == trees.Restored(tree, 0)
  # The written words only mark positions: the tree takes the input's words (e.g. a word the
  # model wrote as its unknown-word class).
  marked = ["<unk:cap>" if t == "Vinken" else t for t in tokens]
  assert form.restore(marked, tree.words()) == trees.Restored(tree, 0)


@pytest.mark.slow  # 10-60 s on 2 cores: .ci/run runs it after the default suite
@pytest.mark.parametrize("order", trees.ORDERS)
@pytest.mark.parametrize("closing, words", [(c, w) for c in trees.CLOSINGS for w in (False, True)])
def test_every_sample_tree_round_trips_exactly(shared_data, closing, words, order):
  """Every tree of the Penn Treebank sample: linearize, then delinearize with its words."""
  form = trees.Linearization(closing, words, order)
  paths = sorted((shared_data / "ptb-sample").glob("wsj_*.mrg"))
  count = 0
  for path in paths:
    for raw in trees.read_trees(str(path)):
      tree = trees.preprocess(raw)
      restored = form.restore(form.tokens(tree), tree.words())
      assert restored.repairs == 0 and restored.tree == tree, (path, str(tree))
      assert trees.parse_trees(str(tree))[0] == tree  # one-line output reads back the same
      count += 1
  assert count == 3669


WORDS = ["John", "runs", "."]


@pytest.mark.parametrize(
    "tokens, expected, repairs",
    [
        # Well formed.
        ("(S (NP (NNP) )NP (VP (VBZ) )VP (.) )S", "(S (NP (NNP John)) (VP (VBZ runs)) (. .))", 0),
        # A closing label that is not the innermost phrase's closes it all the same.
        ("(S (NP (NNP) )VP (VP (VBZ) )VP (.) )S", "(S (NP (NNP John)) (VP (VBZ runs)) (. .))", 1),
        # Unclosed phrases are closed at the end.
        ("(S (NP (NNP) )NP (VP (VBZ) (.)", "(S (NP (NNP John)) (VP (VBZ runs) (. .)))", 2),
        # A tag after the last word and a closing bracket with nothing open are dropped.
        ("(S (NNP) (VBZ) (.) (NN) )S )S", "(S (NNP John) (VBZ runs) (. .))", 2),
        # Words left over get fallback tags, in the innermost open phrase.
        ("(S (NP (NNP) )NP (VP", "(S (NP (NNP John)) (VP (NN runs) (. .)))", 4),
        # Not tree tokens (a word, a reserved token) are dropped; an empty phrase is removed.
        ("(S (NP (NNP) )NP John </s> (ADJP )ADJP (VP (VBZ) )VP (.) )S", None, 3),
        # Nothing at all: every word gets a fallback tag under the root.
        ("", "(NN John) (NN runs) (. .)", 3),
    ],
)
def test_ill_formed_outputs_are_repaired_by_the_documented_rule(tokens, expected, repairs):
  restored = trees.delinearize(tokens.split(), WORDS)
  assert restored.repairs == repairs
  assert restored.tree.words() == WORDS
  if expected is not None:
    assert str(restored.tree) == f"(TOP {expected})"
  again = trees.delinearize(tokens.split(), WORDS)
  assert again == restored  # deterministic


@pytest.mark.parametrize(
    "tokens, expected, repairs",
    [
        ("(S (NP x (NNP) )NP y (VBZ) z (.) )S", "(S (NP (NNP John)) (VBZ runs) (. .))", 0),
        # A tag with no word before it, and a word with no tag after it.
        ("(S (NP (NNP) )NP y (VBZ) z )S", "(S (NP (NNP John)) (VBZ runs)) (. .)", 3),
        # Two words before one tag; a word left waiting at the end.
        ("(S x y (NNP) z (VBZ) w", "(S (NNP John) (VBZ runs) (. .))", 4),
    ],
)
def test_ill_formed_outputs_with_words_are_repaired_by_the_documented_rule(
    tokens, expected, repairs
):
  restored = trees.delinearize(tokens.split(), WORDS, "labeled", with_words=True)
  assert (str(restored.tree), restored.repairs) == (f"(TOP {expected})", repairs)


@pytest.mark.parametrize(
    "tokens, expected, repairs",
    [
        ("(NNP) (NP )NP (S (VBZ) (VP )VP (.) )S", "(S (NP (NNP John)) (VP (VBZ runs)) (. .))", 0),
        # An opening with no finished node before it is dropped; a wrong closing label counts.
        ("(X (NNP) (NP )VP (S (VBZ) (.) )S", "(S (NP (NNP John)) (VBZ runs) (. .))", 2),
        # A closing with nothing open is dropped; a word left over gets its fallback tag and
        # joins the phrase still open, which is closed at the end.
        (")NP (NNP) (S (VBZ)", "(S (NNP John) (VBZ runs) (. .))", 3),
        # Finished nodes side by side at the top: the root's children, counted once.
        ("(NNP) (VBZ) (.)", "(NNP John) (VBZ runs) (. .)", 1),
    ],
)
def test_ill_formed_in_order_outputs_are_repaired_by_the_documented_rule(tokens, expected, repairs):
  restored = trees.delinearize(tokens.split(), WORDS, "labeled", order="in_order")
  assert (str(restored.tree), restored.repairs) == (f"(TOP {expected})", repairs)


def test_deep_nesting_prints_without_recursion():
  tokens = ["(NP"] * 20_000 + ["(NN)"]
  restored = trees.delinearize(tokens, ["dog"])
  assert restored.repairs == 20_000  # all unclosed
  text = str(restored.tree)
  assert text.count("(NP") == 20_000 and text.endswith("(NN dog)" + ")" * 20_001)


@pytest.mark.parametrize(
    "text, message",
    [
        ("( (S (NP (DT a) (NN b))) )\n( (S (NP (DT c)) )", r"tree 2 \(from line 2\).*still open"),
        ("( (S (NP (DT a))) ))", "tree 1 .*closing bracket with no open bracket"),
        ("Pierre Vinken , 61 years old", "before the first tree.*text outside brackets"),
        ("( (S (NP (DT a b))) )", "two words in one bracket"),
        ("( (S (NP (DT a) b)) )", "beside constituents"),
        ("( (S (NP a (DT b)))) )", "holds the word 'a' and a constituent"),
        ("( (S (NP )) )", r"an empty bracket \(NP\)"),
        ("", "holds no bracketed tree"),
    ],
)
def test_malformed_treebanks_are_errors_naming_file_and_tree(text, message):
  with pytest.raises(trees.TreebankError, match=rf"^bad\.mrg: .*{message}"):
    trees.parse_trees(text, "bad.mrg")


def test_a_binary_file_is_not_a_treebank(tmp_path):
  path = tmp_path / "wsj_0001.mrg"
  path.write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff")
  with pytest.raises(trees.TreebankError, match=r"wsj_0001\.mrg: line 1: not UTF-8"):
    trees.read_trees(str(path))
