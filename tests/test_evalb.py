"""evalb.py equals EVALB: on EVALB's own sample and report, and against the compiled evalb.c."""

import dataclasses
import pathlib
import random
import shutil
import subprocess

import pytest

from transformer_jax.tasks.parsing import evalb, trees

EVALB_DIR = pathlib.Path(__file__).resolve().parents[2] / "shared" / "tools" / "evalb"
PTB_SAMPLE = pathlib.Path(__file__).resolve().parents[2] / "shared" / "data" / "ptb-sample"


@pytest.fixture
def evalb_dir() -> pathlib.Path:
  if not (EVALB_DIR / "evalb.c").is_file():
    pytest.skip(f"{EVALB_DIR} is absent (EVALB is not shipped with the project)")
  return EVALB_DIR


def test_collins_prm_is_the_built_in_parameters(evalb_dir):
  assert evalb.read_params(str(evalb_dir / "COLLINS.prm")) == evalb.COLLINS


def _rsl_fields(text: str):
  """Per-sentence rows (lists of numbers as text) and summary blocks {name: value} of a report."""
  rows, blocks, block = [], [], None
  for line in text.splitlines():
    fields = line.split()
    if block is None and len(fields) == 12 and fields[0].isdigit():
      rows.append(fields)
    elif line.startswith("-- "):
      block = {}
      blocks.append(block)
    elif block is not None and "=" in line:
      name, value = line.split("=")
      block[name.strip()] = value.strip()
  return rows, blocks


def test_sample_equals_the_expected_report(evalb_dir):
  """sample.rsl came from the 1997 program, which printed words for error sentences and had no
  F-measure line; every figure both versions print must agree."""
  sample = evalb_dir / "sample"
  params = evalb.read_params(str(sample / "sample.prm"))
  result = evalb.score_files(str(sample / "sample.gld"), str(sample / "sample.tst"), params)
  expected_rows, expected_blocks = _rsl_fields((sample / "sample.rsl").read_text())
  rows, blocks = _rsl_fields(evalb.format_report(result))
  assert len(rows) == len(expected_rows) == 24
  for row, expected in zip(rows, expected_rows):
    assert row[:9] == expected[:9]  # ID, length, status, recall, precision, brackets, crossing
    if row[2] == "0":
      assert row[9:] == expected[9:]  # words, correct tags, tagging accuracy
  assert len(blocks) == len(expected_blocks) == 2
  for block, expected in zip(blocks, expected_blocks):
    assert {k: v for k, v in block.items() if k in expected} == expected
  assert result.all.valid_sentences == 17 and round(result.all.f1, 2) == 89.12


def _compile_evalb(evalb_dir, tmp_path) -> str:
  compiler = shutil.which("gcc") or shutil.which("cc")
  if compiler is None:
    pytest.skip("no C compiler to build EVALB with")
  binary = tmp_path / "evalb"
  subprocess.run(
      [compiler, "-O1", "-w", "-o", str(binary), str(evalb_dir / "evalb.c")],
      check=True,
      capture_output=True,
  )
  return str(binary)


def _run_evalb(binary, params, gold_lines, test_lines, tmp_path) -> str:
  gold, test = tmp_path / "gold.mrg", tmp_path / "test.mrg"
  gold.write_text("".join(line + "\n" for line in gold_lines))
  test.write_text("".join(line + "\n" for line in test_lines))
  out = subprocess.run(
      [binary, "-p", str(params), "-e", "100000", str(gold), str(test)],
      check=True,
      capture_output=True,
      text=True,
  )
  return out.stdout


def test_sample_report_equals_compiled_evalb(evalb_dir, tmp_path):
  binary = _compile_evalb(evalb_dir, tmp_path)
  sample = evalb_dir / "sample"
  gold = evalb.read_lines(str(sample / "sample.gld"))
  test = evalb.read_lines(str(sample / "sample.tst"))
  expected = _run_evalb(binary, sample / "sample.prm", gold, test, tmp_path)
  params = evalb.read_params(str(sample / "sample.prm"))
  assert evalb.format_report(evalb.score(gold, test, params)) == expected


# ----------------------------------------------------------------------------- generated pairs


def _phrases(tree):
  """Every phrase node under the root (not preterminals), with its parent."""
  out, stack = [], [(tree, None)]
  while stack:
    node, parent = stack.pop()
    if parent is not None:
      out.append((node, parent))
    stack.extend((c, node) for c in node.children if not c.is_preterminal)
  return out


def _perturb(tree: trees.Tree, rng: random.Random) -> str:
  """A test line made from a gold tree by a few random edits of the kinds parsers get wrong."""
  tree = trees.parse_trees(str(tree))[0]  # a copy
  for _ in range(rng.randint(0, 4)):
    phrases = _phrases(tree)
    leaves = [n for n, _ in _phrases_and_leaves(tree) if n.is_preterminal]
    kind = rng.choice(["relabel", "flatten", "group", "tag", "word", "advp", "punct"])
    if kind == "relabel" and phrases:
      node, _ = rng.choice(phrases)
      node.label = rng.choice(["NP", "VP", "S", "PP", "SBAR", "ADJP", "NP-SBJ", "X"])
    elif kind == "advp" and phrases:
      rng.choice(phrases)[0].label = rng.choice(["ADVP", "PRT"])
    elif kind == "flatten" and phrases:
      node, parent = rng.choice(phrases)
      i = parent.children.index(node)
      parent.children[i : i + 1] = node.children
    elif kind == "group":
      parent = rng.choice([tree] + [n for n, _ in phrases])
      if len(parent.children) >= 2:
        i = rng.randrange(len(parent.children) - 1)
        j = rng.randrange(i + 1, len(parent.children)) + 1
        parent.children[i:j] = [trees.Tree(rng.choice(["NP", "VP", "XP"]), parent.children[i:j])]
    elif kind == "tag" and leaves:
      rng.choice(leaves).label = rng.choice(["NN", "VB", "JJ", "IN"])
    elif kind == "punct" and leaves:  # a word's tag becomes punctuation: "Length unmatch"
      rng.choice(leaves).label = rng.choice([",", ".", "``"])
    elif kind == "word" and leaves and rng.random() < 0.3:  # "Words unmatch"
      rng.choice(leaves).children[0] = "different"
  text = str(tree)
  return "" if rng.random() < 0.02 else text  # an empty line: a skipped sentence


def _phrases_and_leaves(tree):
  out, stack = [], [(tree, None)]
  while stack:
    node, parent = stack.pop()
    if parent is not None:
      out.append((node, parent))
    if not node.is_preterminal:
      stack.extend((c, node) for c in node.children)
  return out


def test_generated_pairs_equal_compiled_evalb(evalb_dir, tmp_path):
  """Raw treebank trees (empty elements, function tags, TOP) as gold; perturbed preprocessed trees
  as test; COLLINS.prm and the sample's parameters (EQ_WORD, no `.` deletion)."""
  if not PTB_SAMPLE.is_dir():
    pytest.skip(f"{PTB_SAMPLE} is absent")
  binary = _compile_evalb(evalb_dir, tmp_path)
  rng = random.Random(0)
  raw = [
      t for n in (1, 2, 3, 4, 100) for t in trees.read_trees(str(PTB_SAMPLE / f"wsj_{n:04d}.mrg"))
  ]
  raw = [t for t in raw if len(t.words()) <= 60]  # evalb.c's arrays hold 200 words and brackets
  gold, test = [], []
  for _ in range(3):
    for tree in raw:
      gold.append(str(tree))
      test.append(_perturb(trees.preprocess(tree), rng))
  for params_file in (evalb_dir / "COLLINS.prm", evalb_dir / "sample" / "sample.prm"):
    expected = _run_evalb(binary, params_file, gold, test, tmp_path)
    result = evalb.score(gold, test, evalb.read_params(str(params_file)))
    assert evalb.format_report(result) == expected
    statuses = {s.status for s in result.sentences}
    assert statuses == {0, 1, 2}  # scored, error and skipped sentences were all exercised
    assert 0 < result.all.f1 < 100


def test_rules_on_a_small_example():
  """COLLINS.prm's rules one by one: punctuation and -NONE- words deleted, brackets left empty
  deleted, function tags stripped, TOP deleted, ADVP = PRT. An unlabeled outer bracket is not
  deleted: it counts as a bracket labeled "" (output trees are written under TOP for that)."""
  gold = "( (S (NP-SBJ (-NONE- *)) (NP-SBJ-1 (NNP John)) (VP (VBD gave) (PRT (RP up))) (. .)))"
  test = "(TOP (S (NP (NNP John)) (VP (VBD gave) (ADVP (RB up)) (, .))))"
  result = evalb.score([gold], [test])
  sentence = result.sentences[0]
  # gold: "", S, NP, VP, PRT (the empty NP-SBJ deleted); test: S, NP, VP, ADVP (TOP deleted)
  assert sentence.status == 0 and sentence.words == 3
  assert (sentence.matched, sentence.gold, sentence.test) == (4, 5, 4)
  assert sentence.correct_tags == 2  # RP vs RB differ; ADVP = PRT holds for labels only
  relabeled = evalb.score([gold], [test.replace("ADVP", "X")])
  assert relabeled.sentences[0].matched == 3
  unlabeled = evalb.score(
      [gold], [test.replace("ADVP", "X")], dataclasses.replace(evalb.COLLINS, labeled=False)
  )
  assert unlabeled.sentences[0].matched == 4


def test_length_and_word_mismatches_are_errors_and_empty_test_lines_skipped():
  gold = ["(S (NP (DT a) (NN dog)) (. .))"] * 3
  test = ["(S (NP (DT a) (NN cat)) (. .))", "(S (NP (DT a) (NN dog)) (NN .))", ""]
  result = evalb.score(gold, test)
  assert [s.status for s in result.sentences] == [1, 1, 2]
  assert "Words unmatch" in result.sentences[0].message
  assert "Length unmatch (2|3)" == result.sentences[1].message
  assert result.all.valid_sentences == 0 and result.all.f1 == 0.0


def test_different_numbers_of_lines_are_refused():
  with pytest.raises(evalb.EvalbError, match="2 gold trees but 1 test"):
    evalb.score(["(S (X a))", "(S (X a))"], ["(S (X a))"])
