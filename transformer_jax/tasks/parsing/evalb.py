"""EVALB (Sekine & Collins, 1997) in Python: labeled bracketing precision, recall and F1 of parses.

§6.3 reports parsing as EVALB's F1 on WSJ section 23 with the parameters of `COLLINS.prm`. This
module follows `evalb.c` (the 2006 version, public domain) rule by rule, so that its figures are
EVALB's own; tests/test_evalb.py checks that on EVALB's sample and, where a C compiler exists,
against the compiled program on generated gold/test pairs.

    result = evalb.score(gold_lines, test_lines)          # COLLINS.prm's rules
    result.all.f1, result.all.precision, result.all.recall, result.all.complete_match
    print(evalb.format_report(result))                    # the text evalb prints

Input is what EVALB reads: one bracketed tree per line, line i of the test file scored against
line i of the gold file. For each pair of lines, as evalb.c does:

* Terminals (`(TAG word)`) whose tag is a DELETE_LABEL (COLLINS.prm: `-NONE-` and the punctuation
  tags `,` `:` `` `` `` `''` `.`) are removed, word and all; spans count the words left.
* A test line with no words is skipped (status 2). Different numbers of words (e.g. a predicted
  tag deletes a word in one tree only: "Length unmatch"), or different words, make the sentence an
  error (status 1). Both leave the totals untouched; only status-0 sentences are scored.
* Brackets that span no word are deleted; a label loses everything from its first `-` or `=`
  (`NP-SBJ-1` -> `NP`), and a label in DELETE_LABEL (COLLINS.prm: `TOP`) is deleted.
* Each gold bracket matches the first unmatched test bracket of the same span whose label is
  equal or an EQ_LABEL pair (COLLINS.prm: ADVP = PRT); unlabeled scoring (LABELED 0) ignores
  labels. Crossing counts test brackets that cross some gold bracket.
* Totals sum matched, gold and test brackets over valid sentences: recall = matched / gold,
  precision = matched / test, F1 = 2PR / (P + R); complete match = sentences whose three counts
  are equal. A second set of totals covers sentences of at most CUTOFF_LEN gold words (words with
  a DELETE_LABEL_FOR_LENGTH tag not counted).

Not emulated: evalb.c's fixed buffers (lines over 4,999 bytes, 200 words or brackets), its
QUOTE_LABEL option (unused by COLLINS.prm; refused here), and its exit after MAX_ERROR + 1 error
sentences, which ends the report without totals: run the real program with `-e 100000` to compare.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

from transformer_jax import errors

_SPACE = " \t\n\v\f\r"  # C's isspace in the "C" locale: EVALB reads bytes, not Unicode


class EvalbError(errors.UserError):
  """A parameter file or a pair of tree files EVALB cannot score; the message says where."""


@dataclasses.dataclass(frozen=True)
class Params:
  """The settings of an EVALB parameter (.prm) file."""

  labeled: bool = True
  cutoff_len: int = 40
  max_error: int = 10  # kept for reports; the early exit is not emulated (module docstring)
  delete_labels: tuple[str, ...] = ()
  delete_labels_for_length: tuple[str, ...] = ()
  eq_labels: tuple[tuple[str, str], ...] = ()
  eq_words: tuple[tuple[str, str], ...] = ()

  def label_equal(self, a: str, b: str) -> bool:
    return a == b or any((a, b) in (p, p[::-1]) for p in self.eq_labels)

  def word_equal(self, a: str, b: str) -> bool:
    return a == b or any((a, b) in (p, p[::-1]) for p in self.eq_words)


# COLLINS.prm, the parameters of every WSJ parsing result (§6.3, Table 4).
COLLINS = Params(
    labeled=True,
    cutoff_len=40,
    max_error=10,
    delete_labels=("TOP", "-NONE-", ",", ":", "``", "''", "."),
    delete_labels_for_length=("-NONE-",),
    eq_labels=(("ADVP", "PRT"),),
)


def read_params(path: str) -> Params:
  """A .prm file, read as evalb.c's read_parameter_file reads it."""
  values = {"labeled": True, "cutoff_len": 40, "max_error": 10}
  lists = {"delete_labels": [], "delete_labels_for_length": [], "eq_labels": [], "eq_words": []}
  with open(path, encoding="utf-8", errors="surrogateescape") as f:
    for number, raw in enumerate(f, start=1):
      line = raw.rstrip(_SPACE)
      if line.startswith("#") or len(line) < 3:
        continue
      key = line.split(None, 1)[0]
      value = line[len(key) :].lstrip(_SPACE)
      if key == "DEBUG":
        continue
      if key in ("MAX_ERROR", "CUTOFF_LEN", "LABELED"):
        try:
          number_value = int(value.split()[0])
        except (ValueError, IndexError):
          raise EvalbError(f"{path}:{number}: {key} needs an integer, got {value!r}") from None
        field = {"MAX_ERROR": "max_error", "CUTOFF_LEN": "cutoff_len", "LABELED": "labeled"}[key]
        values[field] = bool(number_value) if key == "LABELED" else number_value
      elif key in ("DELETE_LABEL", "DELETE_LABEL_FOR_LENGTH"):
        lists["delete_labels" if key == "DELETE_LABEL" else "delete_labels_for_length"].append(
            value
        )
      elif key in ("EQ_LABEL", "EQ_WORD"):
        pair = value.split()
        if len(pair) != 2:
          raise EvalbError(f"{path}:{number}: {key} needs two values, got {value!r}")
        lists["eq_labels" if key == "EQ_LABEL" else "eq_words"].append(tuple(pair))
      else:
        raise EvalbError(
            f"{path}:{number}: {key} is not a parameter this scorer implements (DEBUG, "
            "MAX_ERROR, CUTOFF_LEN, LABELED, DELETE_LABEL, DELETE_LABEL_FOR_LENGTH, EQ_LABEL, "
            "EQ_WORD)"
        )
  return Params(**values, **{k: tuple(v) for k, v in lists.items()})


# ----------------------------------------------------------------------------- one line


@dataclasses.dataclass
class _Bracket:
  start: int
  end: int
  label: str
  result: int = 0  # evalb.c's codes: 0 unmatched, 1 matched, 5 deleted


@dataclasses.dataclass
class _Line:
  terminals: list[tuple[str, str]]  # (word, tag), DELETE_LABEL terminals removed
  brackets: list[_Bracket]
  length: int  # words not in DELETE_LABEL_FOR_LENGTH, for the CUTOFF_LEN totals
  errors: list[str]


def _terminator(c: str) -> bool:
  return c in _SPACE or c in "()"


def _read_line(line: str, params: Params, where: str) -> _Line:
  """evalb.c's read_line: terminals, brackets (start, end in kept words) and the length."""
  terminals, brackets, stack, errs = [], [], [], []
  length, p, n = 0, 0, len(line)
  while p < n:
    c = line[p]
    if c in _SPACE:
      p += 1
    elif c == "(":
      p += 1
      start = p
      while p < n and not _terminator(line[p]):
        p += 1
      label = line[start:p]
      if p < n and line[p] in _SPACE:  # a word may follow: then this is a terminal
        q = p + 1
        while q < n and line[q] in _SPACE:
          q += 1
        word_start = q
        while q < n and not _terminator(line[q]):
          q += 1
        word, after = line[word_start:q], line[q] if q < n else ""
        if after == ")":
          if label not in params.delete_labels_for_length:
            length += 1
          if label not in params.delete_labels:
            terminals.append((word, label))
          p = q + 1
          continue
        if after != "(":
          errs.append("More than two elements in a bracket")
      stack.append(len(brackets))
      brackets.append(_Bracket(len(terminals), -1, label))
    elif c == ")":
      if not stack:  # evalb.c reads out of its stack here
        raise EvalbError(f"{where}: too many closing brackets: {line.strip()[:200]}")
      brackets[stack.pop()].end = len(terminals)
      p += 1
    else:  # evalb.c loops on this character until it exits
      raise EvalbError(f"{where}: text outside brackets at column {p + 1}: {line.strip()[:200]}")
  if stack:
    errs.append("Bracketing is unbalanced (too many open bracket)")
  return _Line(terminals, brackets, length, errs)


def _massage(brackets: list[_Bracket], params: Params) -> int:
  """Deletes empty brackets and DELETE_LABEL labels, strips function tags; returns how many stay."""
  kept = 0
  for b in brackets:
    b.result = 0
    if b.start == b.end:
      b.result = 5
      continue
    for i, c in enumerate(b.label):  # evalb.c's modify_label: cut at the first '-' or '='
      if c in "-=":
        b.label = b.label[:i]
        break
    if any(params.label_equal(b.label, d) for d in params.delete_labels):
      b.result = 5
    kept += b.result != 5
  return kept


@dataclasses.dataclass(frozen=True)
class Sentence:
  """One line of evalb's per-sentence table."""

  line: int
  length: int  # gold words for the cutoff (DELETE_LABEL_FOR_LENGTH not counted)
  status: int  # 0 scored, 1 error (length or words differ, unreadable), 2 skipped (empty test)
  matched: int
  gold: int
  test: int
  crossing: int
  words: int
  correct_tags: int
  message: str = ""


def _score_line(number: int, gold_text: str, test_text: str, params: Params) -> Sentence:
  gold = _read_line(gold_text, params, f"gold line {number}")
  test = _read_line(test_text, params, f"test line {number}")
  messages = gold.errors + test.errors
  status = 1 if messages else 0
  empty = Sentence(number, gold.length, status, 0, 0, 0, 0, 0, 0, "; ".join(messages))
  if not test.terminals:
    return dataclasses.replace(empty, status=2)
  if len(gold.terminals) != len(test.terminals):
    message = f"Length unmatch ({len(gold.terminals)}|{len(test.terminals)})"
    return dataclasses.replace(empty, status=1, message=message)
  for (gold_word, _), (test_word, _) in zip(gold.terminals, test.terminals):
    if not params.word_equal(gold_word, test_word):
      message = f"Words unmatch ({gold_word}|{test_word})"
      return dataclasses.replace(empty, status=1, message=message)
  gold_count = _massage(gold.brackets, params)
  test_count = _massage(test.brackets, params)
  matched = 0
  for g in gold.brackets:
    if g.result == 5:
      continue
    for t in test.brackets:
      if t.result == 0 and (g.start, g.end) == (t.start, t.end):
        if not params.labeled or params.label_equal(g.label, t.label):
          g.result = t.result = 1
          matched += 1
          break
  crossing = 0
  for t in test.brackets:
    if t.result == 5:
      continue
    for g in gold.brackets:
      if g.result != 5 and (
          (g.start < t.start < g.end < t.end) or (t.start < g.start < t.end < g.end)
      ):
        crossing += 1
        break
  tags = sum(
      params.label_equal(g_tag, t_tag)
      for (_, g_tag), (_, t_tag) in zip(gold.terminals, test.terminals)
  )
  return Sentence(
      number,
      gold.length,
      status,
      matched,
      gold_count,
      test_count,
      crossing,
      len(gold.terminals),
      tags,
      "; ".join(messages),
  )


# ----------------------------------------------------------------------------- totals


@dataclasses.dataclass(frozen=True)
class Summary:
  """One `-- All --` (or `-- len<=40 --`) block of evalb's summary; percentages in [0, 100]."""

  sentences: int
  error_sentences: int
  skip_sentences: int
  matched: int
  gold_brackets: int
  test_brackets: int
  crossing: int
  words: int
  correct_tags: int
  complete_match_sentences: int
  no_crossing_sentences: int
  two_or_less_crossing_sentences: int

  @property
  def valid_sentences(self) -> int:
    return self.sentences - self.error_sentences - self.skip_sentences

  @property
  def recall(self) -> float:
    return 100.0 * self.matched / self.gold_brackets if self.gold_brackets else 0.0

  @property
  def precision(self) -> float:
    return 100.0 * self.matched / self.test_brackets if self.test_brackets else 0.0

  @property
  def f1(self) -> float:
    """2PR / (P + R) of the percentages, as evalb.c computes it (0 where P + R = 0)."""
    p, r = self.precision, self.recall
    return 2 * p * r / (p + r) if p + r else 0.0

  def _per_sentence(self, count: int, scale: float = 100.0) -> float:
    return scale * count / self.valid_sentences if self.valid_sentences > 0 else 0.0

  @property
  def complete_match(self) -> float:
    return self._per_sentence(self.complete_match_sentences)

  @property
  def average_crossing(self) -> float:
    return self._per_sentence(self.crossing, 1.0)

  @property
  def no_crossing(self) -> float:
    return self._per_sentence(self.no_crossing_sentences)

  @property
  def two_or_less_crossing(self) -> float:
    return self._per_sentence(self.two_or_less_crossing_sentences)

  @property
  def tagging_accuracy(self) -> float:
    return 100.0 * self.correct_tags / self.words if self.words else 0.0


def _summarize(sentences: Sequence[Sentence]) -> Summary:
  valid = [s for s in sentences if s.status == 0]
  return Summary(
      sentences=len(sentences),
      error_sentences=sum(s.status == 1 for s in sentences),
      skip_sentences=sum(s.status == 2 for s in sentences),
      matched=sum(s.matched for s in valid),
      gold_brackets=sum(s.gold for s in valid),
      test_brackets=sum(s.test for s in valid),
      crossing=sum(s.crossing for s in valid),
      words=sum(s.words for s in valid),
      correct_tags=sum(s.correct_tags for s in valid),
      complete_match_sentences=sum(s.gold == s.test == s.matched for s in valid),
      no_crossing_sentences=sum(s.crossing == 0 for s in valid),
      two_or_less_crossing_sentences=sum(s.crossing <= 2 for s in valid),
  )


@dataclasses.dataclass(frozen=True)
class Result:
  sentences: list[Sentence]
  all: Summary  # every sentence
  cutoff: Summary  # sentences of at most params.cutoff_len words
  params: Params


def score(gold_lines: Sequence[str], test_lines: Sequence[str], params: Params = COLLINS) -> Result:
  """EVALB on two lists of one-line trees (line i of each is sentence i)."""
  if len(gold_lines) != len(test_lines):
    raise EvalbError(
        f"{len(gold_lines)} gold trees but {len(test_lines)} test trees: EVALB scores line i "
        "against line i, so both files need one tree per line for the same sentences"
    )
  sentences = [
      _score_line(number, gold, test, params)
      for number, (gold, test) in enumerate(zip(gold_lines, test_lines), start=1)
  ]
  short = [s for s in sentences if s.length <= params.cutoff_len]
  return Result(sentences, _summarize(sentences), _summarize(short), params)


def read_lines(path: str) -> list[str]:
  """A tree file's lines as evalb.c's fgets loop reads them (a final newline ends the last)."""
  if not os.path.isfile(path):
    raise EvalbError(f"{path}: no such file")
  with open(path, "rb") as f:
    text = f.read().decode("utf-8", errors="surrogateescape")
  lines = text.split("\n")
  if lines[-1] == "":
    lines.pop()
  return lines


def score_files(gold_path: str, test_path: str, params: Params = COLLINS) -> Result:
  return score(read_lines(gold_path), read_lines(test_path), params)


# ----------------------------------------------------------------------------- report


def _c_float(value: float) -> str:
  return f"{value:6.2f}"


def format_report(result: Result) -> str:
  """The text `evalb -p PARAMS gold test` writes to standard output, character for character."""
  out = [
      "  Sent.                        Matched  Bracket   Cross        Correct Tag",
      " ID  Len.  Stat. Recal  Prec.  Bracket gold test Bracket Words  Tags Accracy",
      "=" * 76,
  ]
  for s in result.sentences:
    recall = 100.0 * s.matched / s.gold if s.gold else 0.0
    precision = 100.0 * s.matched / s.test if s.test else 0.0
    accuracy = 100.0 * s.correct_tags / s.words if s.words else 0.0
    out.append(
        f"{s.line:4d}  {s.length:3d}    {s.status:d}  {recall:6.2f} {precision:6.2f}   "
        f"{s.matched:3d}    {s.gold:3d}  {s.test:3d}    {s.crossing:3d}"
        f"   {s.words:4d}  {s.correct_tags:4d}   {accuracy:6.2f}"
    )
  out.append("=" * 76)
  a = result.all
  totals = ""
  if a.gold_brackets > 0 and a.test_brackets > 0:
    totals = (
        f"                {a.recall:6.2f} {a.precision:6.2f} {a.matched:6d} "
        f"{a.gold_brackets:5d} {a.test_brackets:5d}  {a.crossing:5d}"
    )
  out.append(f"{totals}  {a.words:5d} {a.correct_tags:5d}   {a.tagging_accuracy:6.2f}")
  out.append("=== Summary ===")
  for title, summary in (("All", result.all), (f"len<={result.params.cutoff_len}", result.cutoff)):
    p, r = summary.precision, summary.recall
    f1 = _c_float(2 * p * r / (p + r)) if p + r else "  -nan"  # glibc prints 0.0/0.0 so
    out += [
        "",
        f"-- {title} --",
        f"Number of sentence        = {summary.sentences:6d}",
        f"Number of Error sentence  = {summary.error_sentences:6d}",
        f"Number of Skip  sentence  = {summary.skip_sentences:6d}",
        f"Number of Valid sentence  = {summary.valid_sentences:6d}",
        f"Bracketing Recall         = {_c_float(r)}",
        f"Bracketing Precision      = {_c_float(p)}",
        f"Bracketing FMeasure       = {f1}",
        f"Complete match            = {_c_float(summary.complete_match)}",
        f"Average crossing          = {_c_float(summary.average_crossing)}",
        f"No crossing               = {_c_float(summary.no_crossing)}",
        f"2 or less crossing        = {_c_float(summary.two_or_less_crossing)}",
        f"Tagging accuracy          = {_c_float(summary.tagging_accuracy)}",
    ]
  return "\n".join(out) + "\n"
