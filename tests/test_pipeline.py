"""load_dataset: sources wired to tokenizers; the vocabulary kept in, and reused from, a workdir."""

import logging
import os

import numpy as np
import pytest

from configs import multi30k, quickstart
from transformer_jax import config as config_lib
from transformer_jax.data import batching, pipeline, prepared
from transformer_jax.data.tokenizer import SentencePieceTokenizer, WordTokenizer


def small_corpus(directory, num_pairs=400, seed=0):
  """Parallel {train,valid,test}.{en,de} files of pseudo-sentences over a few hundred words."""
  rng = np.random.default_rng(seed)
  syllables = ["ka", "lo", "mi", "ne", "ru", "sa", "te", "vi", "zo", "pe", "da", "gu"]
  words = sorted({"".join(rng.choice(syllables, rng.integers(1, 4))) for _ in range(300)})
  for split, n in (("train", num_pairs), ("valid", 20), ("test", 20)):
    src = [" ".join(rng.choice(words, rng.integers(3, 12))) for _ in range(n)]
    tgt = [" ".join(reversed(s.split())).upper() for s in src]
    for lang, lines in (("en", src), ("de", tgt)):
      with open(os.path.join(directory, f"{split}.{lang}"), "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")


def text_config(path, vocab_size=120):
  config = quickstart.get_config("smoke")
  config.data.source = "text"
  config.data.path = str(path)
  config.data.vocab_size = vocab_size
  config_lib.validate(config)
  return config


def test_sentencepiece_is_trained_into_the_workdir_then_reused(tmp_path, caplog):
  small_corpus(tmp_path)
  workdir = tmp_path / "run"
  config = text_config(tmp_path)
  first = pipeline.load_dataset(config, str(workdir))
  model = workdir / pipeline.SPM_VOCAB
  assert isinstance(first.tokenizer, SentencePieceTokenizer)
  assert first.tokenizer.vocab_size == 120
  assert sorted(os.listdir(workdir)) == [pipeline.SPM_VOCAB]  # no temporary files left behind
  mtime = model.stat().st_mtime_ns
  assert len(first.splits["train"].pairs) == 400 and len(first.splits["test"].pairs) == 20

  with caplog.at_level(logging.INFO):
    second = pipeline.load_dataset(config, str(workdir))
  assert "trained a" not in caplog.text  # reused, not retrained
  assert model.stat().st_mtime_ns == mtime
  assert second.splits["train"].examples == first.splits["train"].examples
  reloaded = pipeline.load_workdir_tokenizer(str(workdir))
  sentence = first.splits["test"].pairs[0][0]
  assert reloaded.encode(sentence) == first.tokenizer.encode(sentence)
  assert reloaded.decode(reloaded.encode(sentence)) == sentence


def test_reused_vocabulary_must_match_the_configured_size(tmp_path):
  small_corpus(tmp_path)
  pipeline.load_dataset(text_config(tmp_path), str(tmp_path / "run"))
  with pytest.raises(ValueError, match=r"has 120 pieces but config.data.vocab_size=100"):
    pipeline.load_dataset(text_config(tmp_path, vocab_size=100), str(tmp_path / "run"))


def test_vocabulary_too_large_for_the_corpus_names_the_key(tmp_path):
  small_corpus(tmp_path, num_pairs=30)
  with pytest.raises(ValueError, match=r"config.data.vocab_size=5000"):
    pipeline.load_dataset(text_config(tmp_path, vocab_size=5000), None)


def test_without_workdir_nothing_is_written(tmp_path):
  small_corpus(tmp_path)
  before = sorted(os.listdir(tmp_path))
  dataset = pipeline.load_dataset(text_config(tmp_path), None)
  assert dataset.tokenizer.vocab_size == 120
  assert sorted(os.listdir(tmp_path)) == before


def test_spm_training_sample_is_bounded_seeded_and_takes_both_sides(tmp_path):
  for lang, prefix in (("en", "s"), ("de", "t")):
    (tmp_path / f"train.{lang}").write_text("".join(f"{prefix}{i}\n" for i in range(1000)))
  source = prepared.text_split(str(tmp_path), "train", "en", "de")
  sample = prepared.sample_sentences(source, 100)
  assert len(sample) == 100
  assert sample == prepared.sample_sentences(source, 100)
  assert {s[1:] for s in sample[0::2]} == {t[1:] for t in sample[1::2]}  # whole pairs
  assert sample[:2] != ["s0", "t0"] or sample[2:4] != ["s1", "t1"]  # random, not the head
  assert len(prepared.sample_sentences(source, 10**6)) == 2000


def test_synthetic_word_vocabulary_is_stored_and_checked(tmp_path):
  config = quickstart.get_config("smoke")
  dataset = pipeline.load_dataset(config, str(tmp_path))
  saved = pipeline.load_workdir_tokenizer(str(tmp_path))
  assert isinstance(saved, WordTokenizer)
  assert saved.words == dataset.tokenizer.words
  assert pipeline.load_dataset(config, str(tmp_path)).splits["train"].examples == (
      dataset.splits["train"].examples
  )
  config.data.synthetic_seed = 1
  with pytest.raises(ValueError, match=r"synthetic_seed"):
    pipeline.load_dataset(config, str(tmp_path))


def test_load_workdir_tokenizer_errors(tmp_path):
  with pytest.raises(FileNotFoundError, match=r"holds no vocabulary"):
    pipeline.load_workdir_tokenizer(str(tmp_path))
  (tmp_path / pipeline.WORD_VOCAB).write_text("x")
  (tmp_path / pipeline.SPM_VOCAB).write_text("x")
  with pytest.raises(ValueError, match=r"two vocabularies"):
    pipeline.load_workdir_tokenizer(str(tmp_path))


def test_unknown_source_is_rejected():
  config = quickstart.get_config("smoke")
  config.data.source = "csv"
  with pytest.raises(ValueError, match=r"config.data.source='csv'"):
    pipeline.load_dataset(config)


def test_multi30k_config_loads_and_batches_with_little_padding(shared_data, tmp_path):
  config = multi30k.get_config()
  config.data.path = str(shared_data / "multi30k")
  config.data.vocab_size = 1000  # small and a small sample: fast to train
  config.data.spm_max_sentences = 4000
  config_lib.validate(config)
  dataset = pipeline.load_dataset(config, str(tmp_path))
  assert [len(dataset.splits[k].pairs) for k in ("train", "eval", "test")] == [29000, 1014, 1000]
  assert dataset.splits["test"].pairs[0][1] == (
      "Ein Mann mit einem orangefarbenen Hut, der etwas anstarrt."
  )
  it = batching.BatchIterator(
      dataset.splits["train"].examples,
      seed=0,
      bucket_lengths=dataset.bucket_lengths(config.data),
      tokens_per_batch=config.data.tokens_per_batch,
  )
  assert it.num_truncated < 100  # with 8000 pieces none; 1000 pieces make a few pairs longer
  real = total = 0
  for _ in range(it.batches_per_epoch):
    batch = next(it)
    size = batch["inputs"].size + batch["targets"].size
    real += batching.padding_efficiency(batch) * size
    total += size
  assert real / total > 0.9, f"padding efficiency {real / total:.3f} over one epoch"
