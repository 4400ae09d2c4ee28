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
import itertools
import logging
import os
from collections.abc import Iterator

from transformer_jax import errors

Pair = tuple[str, str]


class CorpusError(errors.UserError):
  """A corpus file is malformed; the message names the file (and line, where there is one)."""


class MissingFileError(CorpusError, FileNotFoundError):
  """A corpus file is missing; the message says where it was looked for and what is there."""


@dataclasses.dataclass
class ParallelText:
  pairs: list[Pair]  # (source, target), both stripped and non-empty
  num_skipped: int  # line pairs dropped because one side (or both) was empty


def split_path(directory: str, split: str, lang: str) -> str:
  return os.path.join(directory, f"{split}.{lang}")


def read_lines(path: str) -> list[str]:
  """The file's lines, unstripped, without line terminators; errors name the file and line."""
  with _open(path) as f:
    data = f.read()
  try:
    # One decode of the whole file is ~50x faster than decoding line by line; the line number
    # of a bad byte is recovered from its offset only when there is one.
    text = data.decode("utf-8")
  except UnicodeDecodeError as e:
    raise _utf8_error(path, data, e) from None
  text = text.removeprefix("\ufeff")  # a byte-order mark is not part of the first sentence
  lines = text.split("\n")
  if lines[-1] == "":  # the final newline ends the last line; it does not start a new one
    lines.pop()
  return lines


def read_parallel(source_path: str, target_path: str) -> ParallelText:
  """Line-aligned pairs from two files; pairs with an empty side are skipped and counted."""
  pairs = []
  for _, chunk in iter_parallel(source_path, target_path, 1 << 16):
    pairs.extend(chunk)
  return ParallelText(pairs, count_lines(source_path) - len(pairs))


def count_lines(path: str) -> int:
  """Lines of a file (a last line without a final newline counts), reading 16 MiB at a time."""
  count, last = 0, b"\n"
  with _open(path) as f:
    for block in iter(lambda: f.read(1 << 24), b""):
      count += block.count(b"\n")
      last = block[-1:]
  return count + (last != b"\n")


def iter_parallel(
    source_path: str, target_path: str, chunk_lines: int
) -> Iterator[tuple[list[int], list[Pair]]]:
  """`read_parallel` in chunks of `chunk_lines` line pairs, never holding the whole corpus.

  Yields (rows, pairs): the kept pairs, stripped, and their 0-based line numbers. Invalid UTF-8 and
  files of different lengths are errors naming the file and line, as in `read_lines`."""
  with _open(source_path) as src_file, _open(target_path) as tgt_file:
    first = 0
    while True:
      # Binary files split on b"\n" only, like read_lines.
      src_lines = list(itertools.islice(src_file, chunk_lines))
      tgt_lines = list(itertools.islice(tgt_file, chunk_lines))
      if len(src_lines) != len(tgt_lines):
        source_count = first + len(src_lines) + sum(1 for _ in src_file)
        target_count = first + len(tgt_lines) + sum(1 for _ in tgt_file)
        _raise_misaligned(source_path, source_count, target_path, target_count)
      if not src_lines:
        return
      sources = _decode_lines(src_lines, source_path, first)
      targets = _decode_lines(tgt_lines, target_path, first)
      rows, pairs = [], []
      for row, (src, tgt) in enumerate(zip(sources, targets), start=first):
        src, tgt = src.strip(), tgt.strip()
        if src and tgt:
          rows.append(row)
          pairs.append((src, tgt))
      yield rows, pairs
      first += len(src_lines)


def _open(path: str):
  try:
    return open(path, "rb")
  except FileNotFoundError:
    raise MissingFileError(missing_message(path)) from None
  except OSError as e:
    raise CorpusError(f"{path}: cannot read the file: {e.strerror or e}.") from e


def _decode_lines(lines: list[bytes], path: str, first: int) -> list[str]:
  """Lines [first, first + len(lines)) of `path`, decoded (one decode for the whole chunk)."""
  data = b"".join(lines)
  try:
    decoded = data.decode("utf-8")
  except UnicodeDecodeError as e:
    raise _utf8_error(path, data, e, first) from None
  if first == 0:
    decoded = decoded.removeprefix("\ufeff")  # a byte-order mark is not part of a sentence
  out = decoded.split("\n")
  if out[-1] == "":
    out.pop()
  return out


def _utf8_error(path: str, data: bytes, e: UnicodeDecodeError, first_line: int = 0) -> CorpusError:
  line = data.count(b"\n", 0, e.start) + 1
  column = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
  where = f"line {line + first_line}, byte {column} of the line"
  return CorpusError(
      f"{path}:{line + first_line}: invalid UTF-8 ({where}: {data[e.start:e.end]!r}, {e.reason}). "
      "Corpus files must be UTF-8; convert it, e.g. `iconv -f LATIN1 -t UTF-8`, or fix that line."
  )


def _raise_misaligned(
    source_path: str, source_count: int, target_path: str, target_count: int
) -> None:
  shorter, longer = sorted([(source_count, source_path), (target_count, target_path)])
  raise CorpusError(
      f"{source_path} has {source_count} lines but {target_path} has {target_count}: parallel "
      f"files must be aligned line by line. {longer[1]} has extra lines from line "
      f"{shorter[0] + 1}; check for a missing or wrapped line."
  )


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


def missing_message(path: str) -> str:
  directory = os.path.dirname(path) or "."
  if not os.path.isdir(directory):
    return f"{path}: not found, and neither is its directory {directory}; check config.data.path."
  present = sorted(os.path.basename(p) for p in glob.glob(os.path.join(directory, "*.*")))
  return (
      f"{path}: not found. The text source reads {{split}}.{{lang}} files (config.data.*_split, "
      f"config.data.source_lang/target_lang); {directory} holds {present[:20] or 'no such files'}."
  )
