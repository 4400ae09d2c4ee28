"""The text-file source: aligned reading, skipped empty pairs, errors that name file and line."""

import logging
import os

import pytest

from transformer_jax.data import text


def write(path, content: str | bytes):
  mode = "wb" if isinstance(content, bytes) else "w"
  with open(path, mode, **({} if mode == "wb" else {"encoding": "utf-8", "newline": ""})) as f:
    f.write(content)


def test_reads_aligned_stripped_pairs(tmp_path):
  write(tmp_path / "train.en", "A dog runs.\n  Two men\u00a0talk. \r\nA cat\u2028sleeps.\n")
  write(tmp_path / "train.de", "\ufeffEin Hund läuft.\nZwei Männer reden.\nEine Katze schläft.")
  pairs = text.load_split(str(tmp_path), "train", "en", "de")
  assert pairs == [
      ("A dog runs.", "Ein Hund läuft."),
      ("Two men\u00a0talk.", "Zwei Männer reden."),
      # U+2028 is inside a sentence, not a line break: splitlines() would misalign the corpus.
      ("A cat\u2028sleeps.", "Eine Katze schläft."),
  ]


def test_pairs_with_an_empty_side_are_skipped_and_counted(tmp_path, caplog):
  write(tmp_path / "train.en", "one\n\nthree\n   \nfive\n")
  write(tmp_path / "train.de", "eins\nzwei\n\t\nvier\nfünf\n")
  parallel = text.read_parallel(str(tmp_path / "train.en"), str(tmp_path / "train.de"))
  assert parallel.pairs == [("one", "eins"), ("five", "fünf")]
  assert parallel.num_skipped == 3
  with caplog.at_level(logging.WARNING):
    assert text.load_split(str(tmp_path), "train", "en", "de") == parallel.pairs
  assert "skipped 3 of 5" in caplog.text


def test_mismatched_line_counts_name_both_files_and_counts(tmp_path):
  write(tmp_path / "valid.en", "a\nb\nc\n")
  write(tmp_path / "valid.de", "a\nb\n")
  with pytest.raises(text.CorpusError) as e:
    text.load_split(str(tmp_path), "valid", "en", "de")
  message = str(e.value)
  assert str(tmp_path / "valid.en") in message and "3 lines" in message
  assert str(tmp_path / "valid.de") in message and "2" in message


def test_invalid_utf8_names_file_and_line(tmp_path):
  write(tmp_path / "test.en", "fine\nfine\nfine\n")
  write(tmp_path / "test.de", b"gut\nsch\xf6n\ngut\n")  # Latin-1 'ö' on line 2
  with pytest.raises(text.CorpusError, match=r"test\.de:2: invalid UTF-8"):
    text.load_split(str(tmp_path), "test", "en", "de")


def test_missing_file_names_it_and_lists_what_is_there(tmp_path):
  write(tmp_path / "train.en", "a\n")
  write(tmp_path / "train.fr", "a\n")
  with pytest.raises(FileNotFoundError) as e:
    text.load_split(str(tmp_path), "train", "en", "de")
  assert str(tmp_path / "train.de") in str(e.value)
  assert "train.fr" in str(e.value)


def test_unreadable_file_is_a_clear_error(tmp_path):
  write(tmp_path / "train.en", "a\n")
  os.mkdir(tmp_path / "train.de")  # a directory where a file should be
  with pytest.raises(text.CorpusError, match=r"train\.de: cannot read"):
    text.load_split(str(tmp_path), "train", "en", "de")


def test_multi30k_reads_whole(shared_data):
  pairs = text.load_split(str(shared_data / "multi30k"), "train", "en", "de")
  assert len(pairs) == 29000
  assert all(s == s.strip() and t == t.strip() and s and t for s, t in pairs)
