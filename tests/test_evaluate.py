"""BLEU: sacreBLEU as the headline, and the paper-style tokenized BLEU with compound splitting."""

import pytest
import sacrebleu

from transformer_jax.tasks import bleu


def test_corpus_bleu_is_sacrebleu_with_its_defaults():
  hyps = ["Ein Mann fährt Rad.", "Zwei Hunde spielen im Schnee."]
  refs = ["Ein Mann fährt ein Rad.", "Zwei Hunde spielen im Schnee."]
  ours = bleu.corpus_bleu(hyps, refs)
  reference = sacrebleu.corpus_bleu(hyps, [refs])  # default tokenizer 13a, cased
  assert ours.score == pytest.approx(reference.score) and ours.counts == reference.counts
  assert 0 < ours.score < 100


def test_tokenized_bleu_splits_hyphenated_compounds():
  # get_ende_bleu.sh rewrites "a-b" as "a ##AT##-##AT## b": a hypothesis that gets one half of a
  # compound right earns n-gram credit for it, which plain whitespace tokens would not give.
  ref = ["Ein Mann steht in Baden-Württemberg am Bahnhof ."]
  hyp = ["Ein Mann steht in Baden-Bayern am Bahnhof ."]
  split = bleu.tokenized_bleu(hyp, ref)
  unsplit = sacrebleu.corpus_bleu(hyp, [ref], tokenize="none", force=True)
  assert split.counts[0] > unsplit.counts[0]  # "Baden", "##AT##-##AT##" now match as unigrams
  assert bleu.tokenized_bleu(ref, ref).score == pytest.approx(100.0)


def test_tokenized_bleu_tokenizes_punctuation_and_lowercases_on_request():
  hyp, ref = ["Ein Hund, der rennt."], ["ein Hund , der rennt ."]
  assert bleu.tokenized_bleu(hyp, ref, lowercase=True).score == pytest.approx(100.0)
  assert bleu.tokenized_bleu(hyp, ref).score < 100.0  # "Ein" vs "ein" differs when cased


def test_mismatched_lengths_are_an_error():
  with pytest.raises(ValueError, match="2 hypotheses for 1 references"):
    bleu.corpus_bleu(["a", "b"], ["a"])
  with pytest.raises(ValueError, match="1 hypotheses for 2 references"):
    bleu.tokenized_bleu(["a"], ["a", "b"])
