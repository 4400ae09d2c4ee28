"""The text-file source: a directory of parallel plain-text files `{split}.{lang}`, line-aligned.

    DIR/train.en  DIR/train.de     line i of train.en translates line i of train.de
    DIR/valid.en  DIR/valid.de
    DIR/test.en   DIR/test.de

Files are UTF-8 with one sentence per line ('\\n' or '\\r\\n'). Lines are stripped of surrounding
whitespace; a pair with an empty side carries nothing to learn and is skipped (and counted).
Anything that would silently misalign the corpus is an error naming the file and line: files of
different lengths, bytes that are not UTF-8, a missing or unreadable file.

Lines are split on '\\n' only, never with `str.splitlines`, which also breaks at U+2028, U+0085,
form feeds and other characters that may legitimately occur inside a sentence and would shift
every later line against the other language.
"""

from __future__ import annotations

import dataclasses
import glob
import logging
import os

from transformer_jax import errors

Pair = tuple[str, str]


class CorpusError(errors.UserError):
  """A corpus file is malformed; the message names the file (and line, where there is one)."""


@dataclasses.dataclass
class ParallelText:
  pairs: list[Pair]  # (source, target), both stripped and non-empty
  num_skipped: int  # line pairs dropped because one side (or both) was empty


def split_path(directory: str, split: str, lang: str) -> str:
  return os.path.join(directory, f"{split}.{lang}")


def read_lines(path: str) -> list[str]:
  """The file's lines, unstripped, without line terminators; errors name the file and line."""
  try:
    with open(path, "rb") as f:
      data = f.read()
  except FileNotFoundError:
    raise FileNotFoundError(_missing_message(path)) from None
  except OSError as e:  # a directory, no permission, an I/O error
    raise CorpusError(f"{path}: cannot read the file: {e.strerror or e}.") from e
  try:
    # One decode of the whole file is ~50x faster than decoding line by line; the line number
    # of a bad byte is recovered from its offset only when there is one.
    text = data.decode("utf-8")
  except UnicodeDecodeError as e:
    line = data.count(b"\n", 0, e.start) + 1
    column = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
    raise CorpusError(
        f"{path}:{line}: invalid UTF-8 at byte {e.start} (line {line}, byte {column} of the "
        f"line: {data[e.start:e.end]!r}, {e.reason}). Corpus files must be UTF-8; convert it, "
        f"e.g. `iconv -f LATIN1 -t UTF-8`, or fix that line."
    ) from None
  text = text.removeprefix("\ufeff")  # a byte-order mark is not part of the first sentence
  lines = text.split("\n")
  if lines[-1] == "":  # the final newline ends the last line; it does not start a new one
    lines.pop()
  return lines


def read_parallel(source_path: str, target_path: str) -> ParallelText:
  """Line-aligned pairs from two files; pairs with an empty side are skipped and counted."""
  source_lines = read_lines(source_path)
  target_lines = read_lines(target_path)
  if len(source_lines) != len(target_lines):
    shorter, longer = sorted(
        [(len(source_lines), source_path), (len(target_lines), target_path)]
    )
    raise CorpusError(
        f"{source_path} has {len(source_lines)} lines but {target_path} has "
        f"{len(target_lines)}: parallel files must be aligned line by line. {longer[1]} has "
        f"extra lines from line {shorter[0] + 1}; check for a missing or wrapped line."
    )
  pairs = []
  num_skipped = 0
  for src, tgt in zip(source_lines, target_lines):
    src, tgt = src.strip(), tgt.strip()
    if src and tgt:
      pairs.append((src, tgt))
    else:
      num_skipped += 1
  return ParallelText(pairs, num_skipped)


def load_split(directory: str, split: str, source_lang: str, target_lang: str) -> list[Pair]:
  """(source, target) pairs of `{directory}/{split}.{source_lang|target_lang}`."""
  source_path = split_path(directory, split, source_lang)
  target_path = split_path(directory, split, target_lang)
  text = read_parallel(source_path, target_path)
  if text.num_skipped:
    logging.warning(
        "data: %s/%s: skipped %d of %d line pairs with an empty side",
        directory,
        f"{split}.{{{source_lang},{target_lang}}}",
        text.num_skipped,
        text.num_skipped + len(text.pairs),
    )
  return text.pairs


def _missing_message(path: str) -> str:
  directory = os.path.dirname(path) or "."
  if not os.path.isdir(directory):
    return f"{path}: not found, and neither is its directory {directory}; check config.data.path."
  present = sorted(os.path.basename(p) for p in glob.glob(os.path.join(directory, "*.*")))
  return (
      f"{path}: not found. The text source reads {{split}}.{{lang}} files (config.data.*_split, "
      f"config.data.source_lang/target_lang); {directory} holds {present[:20] or 'no such files'}."
  )
