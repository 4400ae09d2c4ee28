"""The TFDS source, on mocked WMT data and on a real local TranslateFolder dataset.

Skipped when tensorflow_datasets is not installed (`pip install '.[tfds]'`).
"""

import builtins

import pytest

tfds = pytest.importorskip("tensorflow_datasets")

from configs import quickstart  # noqa: E402
from transformer_jax import config as config_lib  # noqa: E402
from transformer_jax.data import pipeline, tfds_source  # noqa: E402
from transformer_jax.data.tokenizer import SentencePieceTokenizer  # noqa: E402


def wmt_config():
  config = quickstart.get_config("smoke")
  config.data.source = "tfds"
  config.data.tfds_name = "wmt14_translate/de-en"
  config.data.source_lang = "en"
  config.data.target_lang = "de"
  config.data.eval_split = "validation"
  config.data.vocab_size = 32  # mocked text is random letters a-j and spaces
  config_lib.validate(config)
  return config


@pytest.mark.slow  # ~8 s on 2 cores: .ci/run runs it after the default suite
def test_load_dataset_reads_mocked_wmt14_as_en_to_de(tmp_path):
  # mock_data replaces the download and the reading with random examples of the dataset's own
  # features ({'de': Text, 'en': Text}); everything else is our loading code.
  with tfds.testing.mock_data(num_examples=64):
    expected = [
        (ex["en"].decode().strip(), ex["de"].decode().strip())
        for ex in tfds.as_numpy(tfds.load("wmt14_translate/de-en", split="train"))
    ]
    dataset = pipeline.load_dataset(wmt_config(), str(tmp_path))
  expected = [(s, t) for s, t in expected if s and t]
  assert len(expected) > 50
  train = dataset.splits["train"]
  assert train.pairs == expected  # EN first: the direction comes from the config, not the name
  assert all(isinstance(s, str) and isinstance(t, str) for s, t in train.pairs)
  assert [len(dataset.splits[k].pairs) for k in ("eval", "test")] == [len(expected)] * 2
  assert isinstance(dataset.tokenizer, SentencePieceTokenizer)
  assert (tmp_path / pipeline.SPM_VOCAB).exists()
  src, tgt = train.pairs[0]
  assert dataset.tokenizer.decode(train.examples[0][0]) == " ".join(src.split())
  assert dataset.tokenizer.decode(train.examples[0][1]) == " ".join(tgt.split())


def test_unknown_language_names_the_key():
  config = wmt_config()
  config.data.target_lang = "fr"
  with (
      tfds.testing.mock_data(num_examples=4),
      pytest.raises(ValueError, match=r"config.data.target_lang='fr'.*\['de', 'en'\]"),
  ):
    pipeline.load_dataset(config)


def test_unknown_dataset_name_names_the_key():
  with pytest.raises(ValueError, match=r"config.data.tfds_name='no_such_dataset_xyz'"):
    tfds_source.load_splits("no_such_dataset_xyz", {"train": "train"}, "en", "de")


@pytest.fixture
def translate_folder(tmp_path):
  """A real prepared TFDS dataset from local files: {lang}.{split}.txt."""
  root = tmp_path / "folder"
  root.mkdir()
  data = {
      "train": [("A dog runs.", "Ein Hund läuft."), (" ", "leer"), ("Two cats.", "Zwei Katzen.")],
      "test": [("A man.", "Ein Mann.")],
  }
  for split, pairs in data.items():
    for lang, column in (("en", 0), ("de", 1)):
      with open(root / f"{lang}.{split}.txt", "w", encoding="utf-8") as f:
        f.write("\n".join(p[column] for p in pairs) + "\n")
  return tfds.TranslateFolder(root_dir=str(root))  # reads the files itself, nothing to prepare


def test_read_builder_on_real_files(translate_folder, caplog):
  out = tfds_source.read_builder(translate_folder, {"train": "train", "test": "test"}, "en", "de")
  assert out == {
      "train": [("A dog runs.", "Ein Hund läuft."), ("Two cats.", "Zwei Katzen.")],
      "test": [("A man.", "Ein Mann.")],
  }
  assert "skipped 1 of 3" in caplog.text
  reverse = tfds_source.read_builder(translate_folder, {"test": "test"}, "de", "en")
  assert reverse == {"test": [("Ein Mann.", "A man.")]}


def test_unknown_split_lists_the_known_ones(translate_folder):
  with pytest.raises(ValueError, match=r"config.data.eval_split='valid'.*\['test', 'train'\]"):
    tfds_source.read_builder(translate_folder, {"eval": "valid"}, "en", "de")


def test_missing_tfds_says_how_to_install(monkeypatch):
  real_import = builtins.__import__

  def no_tfds(name, *args, **kwargs):
    if name.startswith("tensorflow_datasets"):
      raise ImportError("No module named 'tensorflow_datasets'")
    return real_import(name, *args, **kwargs)

  monkeypatch.setattr(builtins, "__import__", no_tfds)
  with pytest.raises(ImportError, match=r"pip install '\.\[tfds\]'"):
    tfds_source.load_splits("wmt14_translate/de-en", {"train": "train"}, "en", "de")
