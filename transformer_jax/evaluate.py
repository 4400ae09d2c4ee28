"""Translation quality: sacreBLEU (detokenized, 13a) on decoded test/valid sentences."""

from __future__ import annotations

from collections.abc import Sequence

import sacrebleu


def corpus_bleu(hypotheses: Sequence[str], references: Sequence[str]) -> sacrebleu.metrics.BLEUScore:
  """sacreBLEU with its defaults (13a tokenizer, exponential smoothing off, cased)."""
  if len(hypotheses) != len(references):
    raise ValueError(f"{len(hypotheses)} hypotheses for {len(references)} references")
  return sacrebleu.corpus_bleu(list(hypotheses), [list(references)])
