"""Translation quality: sacreBLEU (detokenized, 13a) as the headline; paper-style tokenized BLEU;
the Multi30k papers' BLEU on lowercased, punctuation-normalized, Moses-tokenized text."""

from __future__ import annotations

import functools
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

  `lowercase=True`: the same, lowercased. Neither is the Multi30k papers' BLEU, which scores
  against the dataset's own tokenized references, punctuation normalized and hyphens unsplit
  (`multi30k_bleu`).
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


@functools.cache
def _moses(lang: str) -> tuple[sacremoses.MosesPunctNormalizer, sacremoses.MosesTokenizer]:
  return sacremoses.MosesPunctNormalizer(lang=lang), sacremoses.MosesTokenizer(lang=lang)


def lc_norm_tok(sentence: str, lang: str = "de") -> str:
  """A sentence as Multi30k's `scripts/task1-tokenize.sh` made its `data/task1/tok/*.lc.norm.tok.*`
  files: `lowercase.perl | normalize-punctuation.perl -l LANG | tokenizer.perl -l LANG` (Moses:
  `&`, `"`, `'` escaped as `&amp;`, `&quot;`, `&apos;`; hyphens not split), with sacremoses.

  The perl script saw each line with its newline: its German rule that moves a period after a
  closing quote (`(\\.+)"(\\s*[^<])`) then also fires at the end of a line ('tea."' -> 'tea ".'),
  which sacremoses, given the sentence alone, would not do; so the newline is given too.
  """
  normalizer, tokenizer = _moses(lang)
  normalized = normalizer.normalize(sentence.lower() + "\n")  # strips the newline again
  return tokenizer.tokenize(normalized, return_str=True, escape=True)


def multi30k_bleu(
    hypotheses: Sequence[str], tokenized_references: Sequence[str], lang: str = "de"
) -> sacrebleu.metrics.BLEUScore:
  """BLEU as the Multi30k papers report it (e.g. Wu et al. 2021, "Good for Misconceived Reasons:
  An Empirical Revisiting on the Need for Visual Context in Multimodal Machine Translation",
  ACL 2021; multi-bleu.perl style): the hypotheses lowercased, punctuation-normalized and
  Moses-tokenized (`lc_norm_tok`), scored on those tokens (sacreBLEU, tokenize="none") against
  the dataset's own tokenized references (`data/task1/tok/*.lc.norm.tok.de` of
  github.com/multi30k/dataset), or references processed the same way."""
  if len(hypotheses) != len(tokenized_references):
    raise ValueError(f"{len(hypotheses)} hypotheses for {len(tokenized_references)} references")
  return sacrebleu.corpus_bleu(
      [lc_norm_tok(h, lang) for h in hypotheses],
      [list(tokenized_references)],
      tokenize="none",
      force=True,  # the input is tokenized on purpose
  )
