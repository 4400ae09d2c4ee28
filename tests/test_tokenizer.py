"""Tokenizers: reserved ids, round trips, save/load, SentencePiece training."""

import numpy as np
import pytest
import sentencepiece as spm

from transformer_jax.data import synthetic
from transformer_jax.data.tokenizer import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    UNK_ID,
    SentencePieceTokenizer,
    WordTokenizer,
    load_tokenizer,
    train_sentencepiece,
)


def test_reserved_ids_are_distinct_and_first():
  assert (PAD_ID, EOS_ID, BOS_ID, UNK_ID) == (0, 1, 2, 3)
  tok = WordTokenizer(["a", "b"])
  assert tok.vocab_size == 6
  assert tok.encode("a b") == [4, 5]


def test_word_round_trip_and_unknown_words():
  tok = WordTokenizer(["the", "cat", "sat"])
  ids = tok.encode("the  cat sat\n")
  assert ids == [4, 5, 6]  # Any whitespace separates words; no EOS appended.
  assert tok.decode(ids) == "the cat sat"
  assert tok.encode("the dog") == [4, UNK_ID]
  assert tok.decode([4, UNK_ID]) == "the <unk>"


def test_decode_stops_at_eos_and_skips_pad_and_bos():
  tok = WordTokenizer(["the", "cat"])
  row = np.array([BOS_ID, 4, PAD_ID, 5, EOS_ID, 4, 4, PAD_ID], np.int32)
  assert tok.decode(row) == "the cat"
  assert tok.decode_batch([row, [EOS_ID, 4]]) == ["the cat", ""]


@pytest.mark.parametrize("words", [["a", "a"], ["a b"], [""], ["<unk>"]])
def test_word_tokenizer_rejects_bad_vocabularies(words):
  with pytest.raises(ValueError, match="WordTokenizer"):
    WordTokenizer(words)


def test_word_save_load(tmp_path):
  tok = WordTokenizer(["x", "y", "z"])
  path = str(tmp_path / "vocab.txt")
  tok.save(path)
  assert open(path).read().splitlines()[4:] == ["x", "y", "z"]  # Line number == id.
  loaded = load_tokenizer(path)
  assert isinstance(loaded, WordTokenizer)
  assert loaded.words == tok.words
  assert loaded.encode("z y q") == tok.encode("z y q")


def test_word_load_rejects_file_without_reserved_header(tmp_path):
  path = tmp_path / "words.vocab"
  path.write_text("x\ny\n")
  with pytest.raises(ValueError, match="expected the first lines"):
    load_tokenizer(str(path))


def test_load_tokenizer_rejects_unknown_extension(tmp_path):
  with pytest.raises(ValueError, match="extension"):
    load_tokenizer(str(tmp_path / "vocab.json"))


def test_sentencepiece_train_encode_decode(tmp_path):
  pairs = synthetic.SyntheticTask(num_train=300, num_valid=0, num_test=0).pairs("train")
  sentences = [s for pair in pairs for s in pair]
  prefix = str(tmp_path / "spm")
  tok = train_sentencepiece(iter(sentences), prefix, vocab_size=100)
  assert tok.vocab_size == 100

  sp = spm.SentencePieceProcessor(model_file=prefix + ".model")
  assert (sp.pad_id(), sp.eos_id(), sp.bos_id(), sp.unk_id()) == (PAD_ID, EOS_ID, BOS_ID, UNK_ID)

  for sentence in sentences[:20]:
    ids = tok.encode(sentence)
    assert EOS_ID not in ids and BOS_ID not in ids and PAD_ID not in ids
    assert tok.decode([BOS_ID, *ids, EOS_ID, PAD_ID, 7]) == sentence
  rows = [tok.encode(s) + [EOS_ID] for s in sentences[:3]]
  assert tok.decode_batch(rows) == sentences[:3]

  # save() writes a model load_tokenizer() can read back.
  tok.save(str(tmp_path / "copy.model"))
  copy = load_tokenizer(str(tmp_path / "copy.model"))
  assert isinstance(copy, SentencePieceTokenizer)
  assert copy.encode(sentences[0]) == tok.encode(sentences[0])


def test_sentencepiece_rejects_missing_file(tmp_path):
  with pytest.raises(FileNotFoundError, match="train_sentencepiece"):
    SentencePieceTokenizer(str(tmp_path / "missing.model"))


def test_sentencepiece_rejects_other_special_ids(tmp_path):
  # SentencePiece's own defaults (unk=0, bos=1, eos=2, no pad) clash with ours.
  sentences = [s for pair in synthetic.SyntheticTask(num_train=100).pairs("test") for s in pair]
  spm.SentencePieceTrainer.train(
      sentence_iterator=iter(sentences),
      model_prefix=str(tmp_path / "default"),
      vocab_size=60,
      minloglevel=2,
  )
  with pytest.raises(ValueError, match="special ids"):
    SentencePieceTokenizer(str(tmp_path / "default.model"))
