"""Translation quality: sacreBLEU (detokenized, 13a) as the headline; paper-style tokenized BLEU."""

from __future__ import annotations

import re
from collections.abc import Sequence

import sacrebleu
import sacremoses

# get_ende_bleu.sh: perl -ple 's{(\S)-(\S)}{$1 ##AT##-##AT## $2}g'
_COMPOUND = re.compile(r"(\S)-(\S)")


def corpus_bleu(
    hypotheses: Sequence[str], references: Sequence[str]
) -> sacrebleu.metrics.BLEUScore:
  """sacreBLEU with its defaults (13a tokenizer, exponential smoothing off, cased)."""
  if len(hypotheses) != len(references):
    raise ValueError(f"{len(hypotheses)} hypotheses for {len(references)} references")
  return sacrebleu.corpus_bleu(list(hypotheses), [list(references)])


def tokenized_bleu(
    hypotheses: Sequence[str],
    references: Sequence[str],
    lang: str = "de",
    lowercase: bool = False,
) -> sacrebleu.metrics.BLEUScore:
  """Paper-style BLEU, for comparison with published WMT numbers: Moses-tokenize both sides,
  split hyphenated compounds ("Baden-Württemberg" -> "Baden ##AT##-##AT## Württemberg", as
  tensor2tensor's get_ende_bleu.sh did for the paper's EN-DE results), then BLEU on those tokens.

  `lowercase=True` gives the lowercased tokenized variant that Multi30k papers report.
  """
  if len(hypotheses) != len(references):
    raise ValueError(f"{len(hypotheses)} hypotheses for {len(references)} references")
  tokenizer = sacremoses.MosesTokenizer(lang=lang)

  def prepare(text: str) -> str:
    tokens = tokenizer.tokenize(text, return_str=True, escape=True)
    tokens = _COMPOUND.sub(r"\1 ##AT##-##AT## \2", tokens)
    return tokens.lower() if lowercase else tokens

  return sacrebleu.corpus_bleu(
      [prepare(h) for h in hypotheses],
      [[prepare(r) for r in references]],
      tokenize="none",
      force=True,  # the input is tokenized on purpose
  )
