"""Machine translation (§6.1): parallel text in, sacreBLEU out.

Reads the synthetic task, a directory of parallel text files or a TFDS dataset (data/); scores
with sacreBLEU (tasks/bleu.py) and writes the test translations to test_translations.txt.
"""

from __future__ import annotations

import os

from transformer_jax.data import pipeline
from transformer_jax.tasks import base, bleu

TEST_TRANSLATIONS = "test_translations.txt"


class TranslationTask(base.Task):
  name = "translation"
  command = "translate"
  sources = ("synthetic", "text", "tfds")
  metric = "bleu"

  def load_dataset(self, config, workdir, splits):
    return pipeline.load_corpus(config, workdir, splits)

  def scores(self, config, hypotheses, pairs):
    corpus = bleu.corpus_bleu(hypotheses, [t for _, t in pairs])
    return {"bleu": corpus.score, "length_ratio": corpus.sys_len / max(corpus.ref_len, 1)}

  def test_results(self, config, hypotheses, pairs, workdir, tag=""):
    """Test sacreBLEU and tokenized BLEU; the translations go to test_translations.txt (with
    `tag`, test_translations.TAG.txt)."""
    references = [t for _, t in pairs]
    corpus = bleu.corpus_bleu(hypotheses, references)
    lang = config.data.target_lang
    tokenized = bleu.tokenized_bleu(hypotheses, references, lang)
    tokenized_lowercase = bleu.tokenized_bleu(hypotheses, references, lang, lowercase=True)
    if workdir is not None:
      name = TEST_TRANSLATIONS.replace(".txt", f".{tag}.txt") if tag else TEST_TRANSLATIONS
      with open(os.path.join(workdir, name), "w") as f:
        f.writelines(h + "\n" for h in hypotheses)
    return {
        "test_bleu": float(corpus.score),
        "test_bleu_signature": str(corpus),
        "test_tokenized_bleu": float(tokenized.score),
        "test_tokenized_bleu_lowercase": float(tokenized_lowercase.score),
    }


TASK = TranslationTask()
