"""The Multi30k papers' BLEU: the dataset's processing (lowercase, Moses punctuation normalization
and tokenization) reproduces its tok/ files, and the translation task reports it beside sacreBLEU.
"""

import pytest
import sacrebleu

from configs import multi30k
from transformer_jax import config as config_lib
from transformer_jax import errors
from transformer_jax.data import text
from transformer_jax.tasks import bleu, translation

TASK = translation.TASK


@pytest.mark.parametrize(
    "raw, tokenized, lines",
    [
        ("test.de", "test_2016_flickr.lc.norm.tok.de", 1000),
        ("valid.de", "val.lc.norm.tok.de", 1014),
    ],
)
def test_the_processing_reproduces_the_datasets_tokenized_references(
    shared_data, raw, tokenized, lines
):
  directory = shared_data / "multi30k"
  references = text.read_lines(str(directory / raw))
  expected = text.read_lines(str(directory / "tok" / tokenized))
  assert len(references) == len(expected) == lines
  made = [bleu.lc_norm_tok(r) for r in references]
  assert [i + 1 for i, (a, b) in enumerate(zip(made, expected)) if a != b] == []


def test_the_multi30k_config_reads_the_datasets_tokenized_references(shared_data):
  config = multi30k.get_config()
  config.data.path = str(shared_data / "multi30k")
  config_lib.validate(config)  # the tok/ files have their splits' lengths
  references = text.read_lines(str(shared_data / "multi30k" / "test.de"))[:50]
  tokenized, made = translation.tokenized_references(config, "test", references)
  assert made == str(shared_data / "multi30k" / "tok" / "test_2016_flickr.lc.norm.tok.de")
  assert tokenized == text.read_lines(made)[:50]


def test_lc_norm_tok_is_the_datasets_processing():
  # Lowercased; „“ normalized to " and escaped; the final period moved after the closing quote,
  # as normalize-punctuation.perl -l de did on each line (with its newline); hyphens kept; the
  # apostrophe split off on both sides (the dataset's "what &apos; s").
  assert bleu.lc_norm_tok("Ein saftig-grünes Schild: „Tea & Tom's.“") == (
      "ein saftig-grünes schild : &quot; tea &amp; tom &apos; s &quot; ."
  )


def test_multi30k_bleu_of_the_references_is_100_and_otherwise_sacrebleu_on_tokens():
  references = ["Ein Hund, der rennt.", "Zwei Männer spielen „Fußball“ im Park."]
  tokenized = [bleu.lc_norm_tok(r) for r in references]
  assert bleu.multi30k_bleu(references, tokenized).score == pytest.approx(100.0)
  hypotheses = ["EIN Hund, der läuft.", "Zwei Männer spielen Fußball im Park."]
  direct = sacrebleu.corpus_bleu(
      ["ein hund , der läuft .", "zwei männer spielen fußball im park ."],
      [tokenized],
      tokenize="none",
  )
  ours = bleu.multi30k_bleu(hypotheses, tokenized)
  assert ours.score == pytest.approx(direct.score) and ours.counts == direct.counts
  assert 0 < ours.score < 100
  with pytest.raises(ValueError, match="1 hypotheses for 2 references"):
    bleu.multi30k_bleu(["a"], tokenized)


def _text_config(tmp_path, eval_lines, tok_lines):
  """A text source in tmp_path: valid.{en,de} of `eval_lines` targets and tok/val.tok."""
  (tmp_path / "valid.en").write_text("".join(f"source {i}\n" for i in range(len(eval_lines))))
  (tmp_path / "valid.de").write_text("".join(line + "\n" for line in eval_lines))
  (tmp_path / "tok").mkdir()
  (tmp_path / "tok" / "val.tok").write_text("".join(line + "\n" for line in tok_lines))
  config = config_lib.default_config()
  config.data.source, config.data.path = "text", str(tmp_path)
  config.translation.tokenized_eval_references = "tok/val.tok"
  return config


def test_scores_read_the_tokenized_references_of_the_pairs_scored(tmp_path):
  targets = ["Ein Hund rennt.", "Eine Frau liest ein Buch.", "Ein Kind lacht laut."]
  # The file's own tokens, not what lc_norm_tok would make: the score shows which were read.
  tokenized = ["hund rennt", "frau liest ein buch", "kind lacht laut heute"]
  config = _text_config(tmp_path, targets, tokenized)
  config_lib.validate(config)
  path = str(tmp_path / "tok" / "val.tok")
  # A pair with an empty side is skipped by the text source: the pairs are some of the split.
  (tmp_path / "valid.en").write_text("\nsource 1\nsource 2\n")
  pairs = text.load_split(str(tmp_path), "valid", "en", "de")
  references = [t for _, t in pairs]
  assert translation.tokenized_references(config, "eval", references) == (
      tokenized[1:],
      path,
  )
  scores = TASK.scores(config, ["Frau liest ein Buch", "Kind lacht laut heute"], pairs)
  assert scores["bleu_lc_norm_tok"] == pytest.approx(100.0) and scores["bleu"] < 100
  with pytest.raises(errors.UserError, match="has no line 'Ein Vogel singt.'"):
    TASK.scores(config, ["x"], [("s", "Ein Vogel singt.")])


def test_a_tokenized_references_file_of_another_length_is_a_one_line_error(tmp_path):
  config = _text_config(tmp_path, ["Ein Hund rennt.", "Eine Frau liest."], ["ein hund rennt ."])
  path = tmp_path / "tok" / "val.tok"
  message = (
      f"{path} has 1 lines but {tmp_path / 'valid.de'} has 2: "
      "config.translation.tokenized_eval_references must hold"
  )
  for call in (
      lambda: config_lib.validate(config),  # before any compute
      lambda: TASK.scores(
          config, ["a", "b"], [("s", "Ein Hund rennt."), ("t", "Eine Frau liest.")]
      ),
  ):
    with pytest.raises(errors.UserError) as refused:
      call()
    assert str(refused.value).startswith(message) and "\n" not in str(refused.value)


def test_results_name_both_scores_and_where_the_tokenized_references_came_from(tmp_path):
  config = config_lib.default_config()  # the synthetic source: no tokenized references
  pairs = [("a dog runs", "Ein Hund rennt."), ("a woman reads", "Eine Frau liest.")]
  hypotheses = ["ein Hund rennt.", "Eine Frau liest."]  # lowercased, the one BLEU forgives
  scores = TASK.scores(config, hypotheses, pairs)
  assert set(scores) == {"bleu", "length_ratio", "bleu_lc_norm_tok"}
  assert scores["bleu_lc_norm_tok"] == pytest.approx(100.0) and scores["bleu"] < 100
  results = TASK.test_results(config, hypotheses, pairs, str(tmp_path))
  assert results["test_bleu"] == pytest.approx(scores["bleu"])
  assert results["test_bleu_lc_norm_tok"] == pytest.approx(100.0)
  assert results["test_bleu_lc_norm_tok_references"] == translation.MADE_FROM_RAW
  assert {"test_bleu_signature", "test_tokenized_bleu", "test_tokenized_bleu_lowercase"} <= set(
      results
  )
  assert (tmp_path / translation.TEST_TRANSLATIONS).read_text().splitlines() == hypotheses
  # A text source whose configured file is not there: made from raw, saying so.
  config.data.source, config.data.path = "text", str(tmp_path)
  config.translation.tokenized_test_references = "tok/test.tok"
  results = TASK.test_results(config, hypotheses, pairs, None)
  assert results["test_bleu_lc_norm_tok_references"] == (
      f"made from raw ({tmp_path / 'tok' / 'test.tok'} is not there)"
  )
