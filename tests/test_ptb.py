"""The Penn Treebank source (tasks/parsing/ptb.py): article selection, the LDC layout, vocabulary,
errors; the parsing config's checks, what a resumed run keeps, and saved runs' retired keys."""

import json
import re
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
from transformer_jax.tasks.parsing import ptb, scoring, trees


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
  # Defined by its updates, the same model on any machine; the chart picks its average on
  # validation (a seq2seq evaluation at beam 21 is too costly to repeat along the way).
  assert config.train.max_train_minutes == 0 and config.train.num_steps == 10_750
  chart = parsing_sample.get_config("chart")
  assert chart.train.max_train_minutes == 0 and chart.train.num_steps == 8_600
  assert chart.train.select_on_validation and chart.train.patience


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


def test_resuming_under_other_word_classes_or_another_chart_is_refused(tmp_path):
  """The vocabulary's classes and how words are read as them are fixed when a run starts: a
  workdir resumed with another parsing.suffix_letters would read unknown words otherwise; so are
  parsing.decoder and parsing.chart_hidden, which shape the parameters as config.model does."""
  from transformer_jax import tasks
  from transformer_jax.training import train

  task = tasks.get("parsing")
  config = parsing_sample.get_config()
  train._check_workdir_config(str(tmp_path), config, task)  # writes config.json, as run() does
  config.parsing.suffix_letters = 3
  with pytest.raises(config_lib.ConfigError, match="parsing.suffix_letters"):
    train._check_workdir_config(str(tmp_path), config, task)
  chart = parsing_sample.get_config("chart")
  for key, value, message in (
      ("chart_hidden", 64, r"parsing.chart_hidden.*\(128, 64\)"),
      ("decoder", "sequence", r"parsing.decoder.*\('chart', 'sequence'\)"),
  ):
    workdir = tmp_path / key
    workdir.mkdir()
    train._check_workdir_config(str(workdir), chart, task)
    train._check_workdir_config(str(workdir), chart, task)  # the same run: resumed
    changed = config_lib.from_saved(json.loads(chart.to_json_best_effort()))
    changed.parsing[key] = value
    with pytest.raises(config_lib.ConfigError, match=message):
      train._check_workdir_config(str(workdir), changed, task)


# parsing's keys retired at commit 3d33068 (measured and not adopted; docs/experiments.md): the
# value that changed nothing, and one that a run set.
RETIRED = {
    "word_chars": (0, 2),
    "word_affixes": (0, 3),
    "word_loss": ("exact", "any"),
    "word_output": ("vocabulary", "one"),
}


def _old_config_json(variant=None, model=None, **parsing) -> dict:
  """config.json as a run of parsing_sample.py:`variant` saved it before the keys retired:
  today's keys, with the retired ones at their old defaults (chart_loss: the "tree" the chart
  variant set, "spans" elsewhere), then `parsing` and `model` set."""
  saved = json.loads(parsing_sample.get_config(variant).to_json_best_effort())
  saved["parsing"].update({k: default for k, (default, _) in RETIRED.items()})
  saved["parsing"]["chart_loss"] = "tree" if variant == "chart" else "spans"
  saved["parsing"].update(parsing)
  saved["model"].update(model or {})
  return saved


@pytest.mark.parametrize("variant", [None, "chart"])
def test_a_saved_run_with_retired_keys_at_their_defaults_loads_without_them(tmp_path, variant):
  """What changed nothing is dropped: the run loads (for decoding and for resuming) as today's
  config of the same run; a non-chart run's chart_loss never mattered, whatever it was."""
  from transformer_jax import tasks
  from transformer_jax.runs import inference
  from transformer_jax.training import train

  today = parsing_sample.get_config(variant)
  chart_losses = ("tree",) if variant else ("spans", "tree")
  for chart_loss in chart_losses:
    saved = _old_config_json(variant, chart_loss=chart_loss)
    assert set(saved["parsing"]) > set(today.parsing)
    config = config_lib.from_saved(saved)
    assert config.parsing.to_dict() == today.parsing.to_dict()
    assert config.model.to_dict() == today.model.to_dict()
    config_lib.validate(config)
  workdir = tmp_path / "run"
  workdir.mkdir()
  (workdir / "config.json").write_text(json.dumps(_old_config_json(variant)))
  config = inference.load_config(str(workdir))  # what parse and tune_decoding load
  assert not set(RETIRED) & set(config.parsing) and "chart_loss" not in config.parsing
  train._check_workdir_config(str(workdir), today, tasks.get("parsing"))  # resumed


@pytest.mark.parametrize(
    "variant, key, value",
    [(None, key, value) for key, (_, value) in RETIRED.items()]
    + [("chart", "word_affixes", 2), ("chart", "chart_loss", "spans")],
)
def test_a_saved_run_that_set_a_retired_key_is_refused_naming_it(tmp_path, variant, key, value):
  """A run that used a retired feature cannot be run by this code: one line naming the key, its
  value and the commit that has its code, before anything is loaded."""
  from transformer_jax import tasks
  from transformer_jax.runs import inference
  from transformer_jax.training import train

  saved = _old_config_json(variant, **{key: value})
  with pytest.raises(config_lib.ConfigError) as refused:
    config_lib.from_saved(saved)
  message = str(refused.value)
  assert message.startswith(f"config.parsing.{key}={value!r}: ") and "\n" not in message
  assert "commit 3d33068" in message
  workdir = tmp_path / "run"
  workdir.mkdir()
  (workdir / "config.json").write_text(json.dumps(saved))
  named = f"^{re.escape(str(workdir / 'config.json'))}: config.parsing.{key}=.*3d33068"
  with pytest.raises(config_lib.ConfigError, match=named):
    inference.load_config(str(workdir))
  config = parsing_sample.get_config(variant)
  with pytest.raises(config_lib.ConfigError, match=named):
    train._check_workdir_config(str(workdir), config, tasks.get("parsing"))


def test_the_oldest_layouts_word_loss_moves_to_parsing_then_retires():
  """A config.json from before the task sections (no `task`, no `parsing`; the "any word" loss
  was train.word_loss): moved to parsing.word_loss, then dropped at "exact", refused at "any"; a
  translation run of that layout saved it at its default and loads."""
  saved = json.loads(parsing_sample.get_config().to_json_best_effort())
  del saved["task"], saved["parsing"]
  saved["train"]["word_loss"] = "exact"
  config = config_lib.from_saved(saved)
  assert config.task == "parsing" and "word_loss" not in config.parsing
  assert "word_loss" not in config.train
  saved["train"]["word_loss"] = "any"
  with pytest.raises(config_lib.ConfigError, match="^config.parsing.word_loss='any': .*3d33068"):
    config_lib.from_saved(saved)
  translation = json.loads(config_lib.default_config().to_json_best_effort())
  del translation["task"]
  translation["train"]["word_loss"] = "exact"
  config = config_lib.from_saved(translation)
  assert config.task == "translation" and "word_loss" not in config.train


def test_an_encoder_without_positions_is_refused_saved_or_new():
  """model.positional="none" (order through relative positions alone, for the span chart) is
  retired: a saved run that set it is refused naming the commit; a new config, by validate."""
  saved = _old_config_json("chart", model={"positional": "none"})
  with pytest.raises(config_lib.ConfigError) as refused:
    config_lib.from_saved(saved)
  message = str(refused.value)
  assert message.startswith("config.model.positional='none': ") and "\n" not in message
  assert "commit 3d33068" in message
  for positional in ("sinusoidal", "learned"):  # the kept values load as they were
    saved["model"]["positional"] = positional
    assert config_lib.from_saved(saved).model.positional == positional
  for variant in ("chart", None):
    config = parsing_sample.get_config(variant)
    config.model.positional = "none"
    with pytest.raises(config_lib.ConfigError, match="config.model.*positional='none'.*'learned'"):
      config_lib.validate(config)
