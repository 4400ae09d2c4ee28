"""The Penn Treebank source (tasks/parsing/ptb.py): article selection, the LDC layout, vocabulary,
errors."""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import parsing_sample, parsing_wsj
from transformer_jax import config as config_lib
from transformer_jax import errors
from transformer_jax.data import pipeline
from transformer_jax.data.tokenizer import UNK_ID, WordTokenizer
from transformer_jax.tasks.parsing import ptb, scoring, tree_constraint, trees


def test_selection_specs():
  assert ptb.parse_selection("02-21, 0005", "train_split") == [(2, 2, 21), (4, 5, 5)]
  files = {1: "a/wsj_0001.mrg", 199: "a/wsj_0199.mrg", 2201: "b/wsj_2201.mrg", 2300: "c"}
  assert ptb.select_files(files, "00-01", "k") == ["a/wsj_0001.mrg", "a/wsj_0199.mrg"]
  assert ptb.select_files(files, "0199,22", "k") == ["a/wsj_0199.mrg", "b/wsj_2201.mrg"]
  for bad in ("2-21", "02-0021", "21-02", "sec23", ""):
    with pytest.raises(errors.UserError, match="config.data.train_split"):
      ptb.select_files(files, bad, "train_split")
  with pytest.raises(errors.UserError, match="selects no file.*sections 00, 01, 22, 23"):
    ptb.select_files(files, "24", "test_split")


def _ldc_layout(sample, root, sections):
  """`root/NN/wsj_NNAA.mrg` copies of the sample's first articles, `count` per section."""
  articles = iter(sorted(sample.glob("wsj_*.mrg")))
  for section, count in sections.items():
    (root / f"{section:02d}").mkdir(parents=True)
    for a in range(count):
      shutil.copy(next(articles), root / f"{section:02d}" / f"wsj_{section:02d}{a:02d}.mrg")


def test_wsj_config_reads_an_ldc_like_directory(shared_data, tmp_path):
  """parsing_wsj.py's split (02-21 / 22 / 23) on a directory laid out like the LDC release."""
  wsj = tmp_path / "PTB3" / "parsed" / "mrg" / "wsj"
  _ldc_layout(shared_data / "ptb-sample", wsj, {0: 1, 2: 3, 21: 2, 22: 1, 23: 2, 24: 1})
  config = parsing_wsj.get_config()
  with pytest.raises(config_lib.ConfigError, match="config.data.path"):
    config_lib.validate(config)  # the user must name their copy of the treebank
  config.data.path = str(wsj)
  config_lib.validate(config)
  workdir = tmp_path / "run"
  dataset = pipeline.load_dataset(config, str(workdir))
  sizes = {k: len(s.pairs) for k, s in dataset.splits.items()}
  expected = {}
  for key, names in {"train": ("02/*", "21/*"), "eval": ("22/*",), "test": ("23/*",)}.items():
    paths = sorted(str(p) for n in names for p in wsj.glob(n))
    expected[key] = len(ptb.load_trees(paths)[0])
  assert sizes == expected and min(sizes.values()) > 0
  assert (workdir / "vocab.txt").is_file()
  tokenizer = WordTokenizer.load(str(workdir / "vocab.txt"))
  assert tokenizer.vocab_size == dataset.tokenizer.vocab_size <= config.data.vocab_size
  # Targets are whole tree tokens: no <unk> in the training targets; gold trees rebuild exactly.
  train = dataset.splits["train"]
  assert all(UNK_ID not in target for _, target in train.examples)
  gold = scoring.gold_trees(train.pairs, trees.Linearization.from_config(config.parsing))
  assert [t.words() for t in gold] == [s.split() for s, _ in train.pairs]
  # A second load keeps the workdir's vocabulary.
  again = pipeline.load_dataset(config, str(workdir), splits=("test",))
  assert again.splits["test"].examples == dataset.splits["test"].examples


def test_targets_with_words_read_their_words_as_the_source_does(shared_data, tmp_path):
  """data.tree_words: a target's word tokens are the source's ids, in order; gold trees rebuild."""
  config = parsing_sample.get_config()
  config.data.train_split, config.data.eval_split = "0001-0020", "0021"
  config.parsing.tree_words = True
  config_lib.validate(config)
  dataset = pipeline.load_dataset(config, str(tmp_path / "run"), splits=("train", "eval"))
  words = dataset.tokenizer.words
  tree_ids = {i + UNK_ID + 1 for i, t in enumerate(words) if t[:1] in ("(", ")")}
  for key in ("train", "eval"):
    split = dataset.splits[key]
    for source, target in split.examples:
      assert [i for i in target if i not in tree_ids | {UNK_ID}] == [
          i for i in source if i != UNK_ID
      ]
    gold = scoring.gold_trees(split.pairs, trees.Linearization.from_config(config.parsing))
    assert [t.words() for t in gold] == [s.split() for s, _ in split.pairs]


def test_sample_config_split_is_by_article(shared_data):
  config = parsing_sample.get_config()
  config_lib.validate(config)
  files = ptb.treebank_files(config.data.path)
  chosen = [
      set(ptb.select_files(files, config.data[k], k))
      for k in ("train_split", "eval_split", "test_split")
  ]
  assert sum(len(c) for c in chosen) == 179 and set.union(*chosen) == set(files.values())
  assert [len(ptb.load_trees(sorted(c))[0]) for c in chosen] == [3068, 328, 273]
  assert config.eval.beam_size == 21 and config.eval.alpha == 0.3
  assert config.eval.max_decode_extra == 300
  assert config.model.max_len >= config.data.max_len + config.eval.max_decode_extra
  assert 0 < config.train.max_train_minutes <= 60


def test_malformed_tree_stops_loading_naming_file_and_tree(tmp_path):
  good = "( (S (NP (DT The) (NN dog)) (VP (VBZ barks)) (. .)) )\n"
  (tmp_path / "wsj_0001.mrg").write_text(good * 3)
  (tmp_path / "wsj_0002.mrg").write_text(good + "( (S (NP (DT a) (NN cat)) (VP (VBZ sits)) )\n")
  config = parsing_sample.get_config()
  config.data.path = str(tmp_path)
  config.data.train_split, config.data.eval_split, config.data.test_split = "0001", "0002", "0002"
  with pytest.raises(trees.TreebankError, match=r"wsj_0002\.mrg: tree 2 \(from line 2\)"):
    pipeline.load_dataset(config, splits=("train", "eval"))
  (tmp_path / "notes.txt").write_text("not a tree")
  (tmp_path / "wsj_0002.mrg").write_text("Pierre Vinken , 61 years old .\n")
  with pytest.raises(trees.TreebankError, match=r"wsj_0002\.mrg: before the first tree"):
    pipeline.load_dataset(config, splits=("train", "eval"))
  config.data.path = str(tmp_path / "missing")
  with pytest.raises(errors.UserError, match="not a directory"):
    pipeline.load_dataset(config)


THREE_TREES = (
    "( (S (NP (NNP Smith)) (VP (VBD walked) (ADVP (RB quickly))) (. .)) )\n"
    "( (S (NP (NNP Smith)) (VP (VBD talked) (ADVP (RB slowly))) (. .)) )\n"
    "( (S (NP (NNP Jones)) (VP (VBD jumped) (NP (CD 42))) (. .)) )\n"
)


def test_vocabulary_and_unknown_word_classes():
  train = [trees.preprocess(t) for t in trees.parse_trees(THREE_TREES)]
  tokenizer = ptb.build_vocabulary(train, "labeled", vocab_size=64)
  words = tokenizer.words
  assert "(S" in words and ")VP" in words and "(NNP)" in words  # tree tokens, whole
  assert "Smith" in words and "." in words  # seen twice
  assert "walked" not in words  # seen once: read as its class
  assert "<unk:low:ed>" in words and "<unk:low:ly>" in words and "<unk:low>" in words
  known = set(words)
  ids = ptb.encode_words(tokenizer, known, ["Smith", "fizzled", "happily", "Zorro", "7"])
  # Zorro and 7: classes seen once in training, so <unk> itself.
  assert tokenizer.decode(ids) == "Smith <unk:low:ed> <unk:low:ly> <unk> <unk>"
  assert ptb.word_class("Wall-Street") == ("<unk:cap-:et>", "<unk:cap->")
  with pytest.raises(errors.UserError, match="vocab_size=10 is smaller"):
    ptb.build_vocabulary(train, "labeled", vocab_size=10)


def test_longer_word_endings_fall_back_to_shorter_ones_and_the_shape():
  assert ptb.word_class("fizzled", 3) == ("<unk:low:led>", "<unk:low:ed>", "<unk:low>")
  assert ptb.word_class("fizzled") == ("<unk:low:ed>", "<unk:low>")  # the default, 2
  assert ptb.word_class("Abed", 3) == ("<unk:cap:ed>", "<unk:cap>")  # k letters: > k + 1 long
  assert ptb.word_class("Abe", 3) == ("<unk:cap>",)
  assert ptb.word_class("4-to-1", 3) == ("<unk:num->",)
  # Seen once each: walked, talked (-ked), jumped (-ped), quickly (-kly), slowly (-wly).
  train = [trees.preprocess(t) for t in trees.parse_trees(THREE_TREES)]
  tokenizer = ptb.build_vocabulary(train, "labeled", vocab_size=64, suffix_letters=3)
  classes = {w for w in tokenizer.words if w.startswith("<unk")}
  assert {"<unk:low:ked>", "<unk:low:ed>", "<unk:low:ly>", "<unk:low>"} <= classes
  assert not classes & {"<unk:low:ped>", "<unk:low:kly>", "<unk:low:wly>"}  # seen once
  known = set(tokenizer.words)
  ids = ptb.encode_words(tokenizer, known, ["balked", "hopped", "oddly", "Smith"], 3)
  assert tokenizer.decode(ids) == "<unk:low:ked> <unk:low:ed> <unk:low:ly> Smith"
  # The default reads the same vocabulary's words by two letters at most.
  ids = ptb.encode_words(tokenizer, known, ["balked", "hopped"])
  assert tokenizer.decode(ids) == "<unk:low:ed> <unk:low:ed>"


def test_word_dropout_reads_words_as_their_classes_in_source_and_target_alike():
  text = THREE_TREES + "( (S (NP (NNP Smith)) (VP (VBD walked)) (. .)) )\n"  # walked twice
  train_trees = [trees.preprocess(t) for t in trees.parse_trees(text)]
  tokenizer = ptb.build_vocabulary(train_trees, "labeled", vocab_size=64)
  table = ptb.word_class_table(tokenizer)
  known = set(tokenizer.words)
  for i, token in enumerate(tokenizer.words, start=4):
    if token in ("Smith", "walked", "."):  # words: read as a word outside the vocabulary is
      expected = next((c for c in ptb.word_class(token) if c in known), "<unk>")
      assert tokenizer.decode([int(table[i])]) == expected
    else:  # tree tokens and classes stay
      assert token[0] in "()<" and table[i] == i
  assert tokenizer.decode([int(table[i]) for i in tokenizer.encode("Smith walked .")]) == (
      "<unk> <unk:low:ed> <unk>"  # <unk:cap:th> and <unk:sym> were not seen twice
  )
  assert list(table[:4]) == [0, 1, 2, 3]

  source = ptb.encode_words(tokenizer, known, "Smith walked .".split())
  target = ptb.encode_words(tokenizer, known, "Smith (NNP) (NP walked (VBD) )NP . (.)".split())
  batch = {
      "inputs": jnp.asarray([source * 3]),
      "targets": jnp.asarray([target]),
      "decoder_inputs": jnp.asarray([[2] + target[:-1]]),
      "targets_positions": jnp.arange(len(target))[None],
  }
  classes = jnp.asarray(table)
  none = ptb.drop_words(batch, jax.random.PRNGKey(0), 0.0, classes)
  assert none.keys() == batch.keys()
  for key in batch:
    np.testing.assert_array_equal(none[key], batch[key])
  every = ptb.drop_words(batch, jax.random.PRNGKey(0), 1.0, classes)
  for key in ("inputs", "targets", "decoder_inputs"):
    np.testing.assert_array_equal(every[key], table[np.asarray(batch[key])])
  np.testing.assert_array_equal(every["targets_positions"], batch["targets_positions"])
  # At 0.5, some words are dropped and some kept, and a word is dropped everywhere or nowhere.
  seen = set()
  for seed in range(20):
    half = ptb.drop_words(batch, jax.random.PRNGKey(seed), 0.5, classes)
    changed = np.asarray(batch["inputs"]) != np.asarray(half["inputs"])
    dropped = sorted(set(np.asarray(batch["inputs"])[changed].tolist()))
    for key in ("inputs", "targets", "decoder_inputs"):
      before, after = np.asarray(batch[key]), np.asarray(half[key])
      expected = np.where(np.isin(before, dropped), table[before], before)
      np.testing.assert_array_equal(after, expected)
    seen.add(frozenset(dropped))
  assert len(seen) > 2


def test_a_source_word_comes_with_its_first_and_last_letters():
  """parsing.word_chars K: each source word's id, then its first and last K characters
  (1 + code point mod 255; 0 where the word is shorter), also for a word read as its class."""
  code = lambda text: [1 + ord(c) % 255 for c in text]  # noqa: E731
  assert ptb.spelling("fizzled", 3) == code("fiz") + code("led")
  assert ptb.spelling("a", 3) == code("a") + [0, 0] + [0, 0] + code("a")
  assert ptb.spelling("Smith", 2) == code("Sm") + code("th")
  assert ptb.spelling("€", 1) == [1 + ord("€") % 255] * 2  # beyond 255: folded, never 0
  train = [trees.preprocess(t) for t in trees.parse_trees(THREE_TREES)]
  tokenizer = ptb.build_vocabulary(train, "labeled", vocab_size=64)
  known = set(tokenizer.words)
  words = ["Smith", "fizzled", "."]
  ids = ptb.encode_words(tokenizer, known, words)
  assert ptb.encode_source(tokenizer, known, words) == ids  # word_chars 0: the ids alone
  source = ptb.encode_source(tokenizer, known, words, word_chars=3)
  assert source.shape == (3, 7) and source.dtype == np.int32
  np.testing.assert_array_equal(source[:, 0], ids)  # fizzled: its class, <unk:low:ed>
  assert [list(row[1:]) for row in source] == [ptb.spelling(w, 3) for w in words]
  assert ptb.encode_source(tokenizer, known, [], word_chars=3).shape == (0, 7)

  # Word dropout reads a dropped word's id as its class and keeps its letters.
  classes = jnp.asarray(ptb.word_class_table(tokenizer))
  batch = {"inputs": jnp.asarray(source[None]), "targets": jnp.asarray([ids])}
  every = ptb.drop_words(batch, jax.random.PRNGKey(0), 1.0, classes)
  np.testing.assert_array_equal(every["inputs"][0, :, 0], np.asarray(classes)[ids])
  np.testing.assert_array_equal(every["inputs"][0, :, 1:], source[:, 1:])
  np.testing.assert_array_equal(every["targets"][0], np.asarray(classes)[ids])

  config = parsing_sample.get_config()
  for bad in (-1, 17):
    config.parsing.word_chars = bad
    with pytest.raises(config_lib.ConfigError, match="parsing.word_chars"):
      config_lib.validate(config)
  config.parsing.word_chars = 4
  config_lib.validate(config)
  assert config_lib.run_model_config(config, tokenizer).source_chars == 8


def test_a_source_word_comes_with_its_affixes():
  """parsing.word_affixes K: each source word's id, then its proper beginnings and endings of
  1..K letters, lowercased, each 1 + CRC-32("<" or ">" + affix) mod (AFFIX_BUCKETS - 1); 0 where
  the word is not longer than the affix (the whole word is never an affix)."""
  import zlib

  from transformer_jax.model.config import AFFIX_BUCKETS

  code = lambda key: 1 + zlib.crc32(key.encode()) % (AFFIX_BUCKETS - 1)  # noqa: E731
  assert ptb.affixes("Fizzled", 2) == [code("<f"), code("<fi"), code(">d"), code(">ed")]
  assert ptb.affixes("fizzled", 2) == ptb.affixes("FIZZLED", 2)  # lowercased
  assert ptb.affixes("ox", 3) == [code("<o"), 0, 0, code(">x"), 0, 0]
  assert ptb.affixes("a", 2) == [0, 0, 0, 0]
  # A beginning and an ending of the same letters are two features.
  assert ptb.affixes("ete", 1) == [code("<e"), code(">e")] and code("<e") != code(">e")
  # Words that share an ending share its id (what a rare word borrows from the others).
  assert ptb.affixes("fizzled", 3)[3:] == ptb.affixes("sizzled", 3)[3:]
  assert all(0 < i < AFFIX_BUCKETS for i in ptb.affixes("extraordinary", 8))

  train = [trees.preprocess(t) for t in trees.parse_trees(THREE_TREES)]
  tokenizer = ptb.build_vocabulary(train, "labeled", vocab_size=64)
  known = set(tokenizer.words)
  words = ["Smith", "fizzled", "."]
  ids = ptb.encode_words(tokenizer, known, words)
  source = ptb.encode_source(tokenizer, known, words, word_affixes=3)
  assert source.shape == (3, 7) and source.dtype == np.int32
  np.testing.assert_array_equal(source[:, 0], ids)
  assert [list(row[1:]) for row in source] == [ptb.affixes(w, 3) for w in words]
  assert ptb.encode_source(tokenizer, known, [], word_affixes=3).shape == (0, 7)

  config = parsing_sample.get_config("chart")
  for bad in (-1, 9):
    config.parsing.word_affixes = bad
    with pytest.raises(config_lib.ConfigError, match="parsing.word_affixes"):
      config_lib.validate(config)
  config.parsing.word_affixes = 3
  config.parsing.word_chars = 2
  with pytest.raises(config_lib.ConfigError, match="parsing.word_affixes.*not both"):
    config_lib.validate(config)
  config.parsing.word_chars = 0
  config_lib.validate(config)
  model = config_lib.run_model_config(config, tokenizer)
  assert model.source_chars == 6 and model.source_affixes
  assert not config_lib.run_model_config(parsing_sample.get_config(), tokenizer).source_affixes


def test_a_span_chart_may_see_order_through_relative_positions_alone():
  """model.positional="none" with model.relative_positions: valid for the span chart (no decoder,
  Task.has_decoder), refused before any work for §6.3's encoder-decoder, whose decoder would
  see no order."""
  train = [trees.preprocess(t) for t in trees.parse_trees(THREE_TREES)]
  tokenizer = ptb.build_vocabulary(train, "labeled", vocab_size=64)
  for variant, valid in (("chart", True), (None, False)):
    config = parsing_sample.get_config(variant)
    config.model.positional = "none"
    config.model.relative_positions = 8
    if not valid:
      with pytest.raises(config_lib.ConfigError, match="positional='none' leaves the model"):
        config_lib.validate(config)
      continue
    config_lib.validate(config)
    model = config_lib.run_model_config(config, tokenizer)
    assert model.positional == "none" and model.relative_positions == 8 and model.chart_labels


def test_word_dropout_and_suffix_letters_config():
  config = parsing_sample.get_config()
  config.parsing.word_dropout = 0.1
  config_lib.validate(config)
  config.parsing.word_dropout = 1.0
  with pytest.raises(config_lib.ConfigError, match="parsing.word_dropout"):
    config_lib.validate(config)
  config.parsing.word_dropout = 0.0
  for letters in (1, 9):
    config.parsing.suffix_letters = letters
    with pytest.raises(config_lib.ConfigError, match="parsing.suffix_letters.*2 to 8"):
      config_lib.validate(config)
  # The parsing switches live in the parsing task's section: a translation run has none, and
  # reading trees (data.source='ptb') is the parsing task's.
  config = config_lib.default_config()
  assert config.task == "translation" and "parsing" not in config
  config.data.source = "ptb"
  with pytest.raises(config_lib.ConfigError, match="data.source.*translation task reads"):
    config_lib.validate(config)


def test_packed_source_len_config():
  config = parsing_sample.get_config()
  config.data.packed_source_len = 96
  config_lib.validate(config)
  for value, expected in ((1, r"in \[2, data.max_len=256\]"), (257, "data.packed_source_len")):
    config.data.packed_source_len = value
    with pytest.raises(config_lib.ConfigError, match=expected):
      config_lib.validate(config)
  config.data.packed_source_len = 96
  config.data.packing = False  # bucketed rows have one length for both sides
  with pytest.raises(config_lib.ConfigError, match="with data.packing=True"):
    config_lib.validate(config)


def test_word_loss_config_and_word_set():
  config = parsing_sample.get_config()
  config.parsing.word_loss = "any"
  config_lib.validate(config)
  config.parsing.tree_words = False  # no words in the targets to score
  with pytest.raises(config_lib.ConfigError, match="parsing.word_loss.*tree_words"):
    config_lib.validate(config)
  config.parsing.tree_words = True
  config.parsing.word_loss = "some"
  with pytest.raises(config_lib.ConfigError, match="expected 'exact' or 'any'"):
    config_lib.validate(config)
  assert "word_loss" not in config.train  # the paper's loss for every other task
  train_trees = [trees.preprocess(t) for t in trees.parse_trees(THREE_TREES)]
  tokenizer = ptb.build_vocabulary(train_trees, "labeled", vocab_size=64)
  words = tree_constraint.word_set(tokenizer)
  assert words.shape == (tokenizer.vocab_size,)
  tokens = ["<pad>", "</s>", "<s>", "<unk>"] + tokenizer.words
  for token, is_word in zip(tokens, words):  # words, <unk> and its classes; no tree token
    assert is_word == (token not in ("<pad>", "</s>", "<s>") and not trees.is_tree_token(token))
  assert words.any() and not words.all()


def test_word_output_config_output_tokens_and_resume_check(tmp_path):
  """parsing.word_output="one": needs the words in the targets and the constraint that writes
  them; N is the tree tokens' end of the vocabulary; a workdir keeps its choice."""
  from transformer_jax import tasks
  from transformer_jax.training import train

  config = parsing_sample.get_config()
  config.parsing.word_output = "one"
  config_lib.validate(config)
  for key, value, message in (
      ("tree_words", False, "parsing.word_output.*tree_words=True"),
      ("tree_constraints", False, "parsing.word_output.*tree_constraints=True"),
      ("word_loss", "any", "parsing.word_loss.*leave word_loss 'exact'"),
      ("word_output", "some", "expected 'vocabulary' or 'one'"),
  ):
    changed = config_lib.from_saved(json.loads(config.to_json_best_effort()))
    changed.parsing[key] = value
    with pytest.raises(config_lib.ConfigError, match=message):
      config_lib.validate(changed)
  train_trees = [trees.preprocess(t) for t in trees.parse_trees(THREE_TREES)]
  tokenizer = ptb.build_vocabulary(train_trees, "labeled", vocab_size=64)
  tokens = ["<pad>", "</s>", "<s>", "<unk>"] + tokenizer.words
  n = tree_constraint.output_tokens(tokenizer)
  assert trees.is_tree_token(tokens[n - 1]) and not any(map(trees.is_tree_token, tokens[n:]))
  model = config_lib.run_model_config(config, tokenizer)
  assert model.output_tokens == n and model.num_outputs == n + 1
  assert tasks.get("parsing").interchangeable_tokens(config, tokenizer).tolist() == (
      tree_constraint.word_set(tokenizer).tolist()
  )
  config.parsing.word_output = "vocabulary"
  assert config_lib.run_model_config(config, tokenizer).num_outputs == tokenizer.vocab_size
  (tmp_path / "config.json").write_text(config.to_json_best_effort())
  config.parsing.word_output = "one"  # the same config.model, other parameters: refused
  with pytest.raises(config_lib.ConfigError, match="parsing.word_output.*vocabulary.*one"):
    train._check_workdir_config(str(tmp_path), config)


def test_resuming_under_other_word_classes_is_refused(tmp_path):
  """The vocabulary's classes and how words are read as them are fixed when a run starts: a
  workdir resumed with another parsing.suffix_letters would read unknown words otherwise."""
  from transformer_jax.training import train

  config = parsing_sample.get_config()
  train._check_workdir_config(str(tmp_path), config)  # writes config.json, as run() does first
  config.parsing.suffix_letters = 3
  with pytest.raises(config_lib.ConfigError, match="parsing.suffix_letters"):
    train._check_workdir_config(str(tmp_path), config)
