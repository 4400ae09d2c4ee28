"""§6.3 English constituency parsing as a task: sentences in, linearized trees out, EVALB's F1.

Its own config section, `config.parsing`, holds the switches of the parsing pipeline; the
deviations from §6.3 among them are off by default:

  tree_closing      "labeled" (")NP", Vinyals et al. 2015) or "bare" (")")
  tree_words        write each word before its tag in the target (a deviation)
  tree_order        "top_down" (§6.3) or "in_order" (Liu & Zhang 2017; a deviation)
  suffix_letters    the longest word ending an unknown-word class keeps (2; ptb.py)
  word_dropout      read each vocabulary word of a training batch as its unknown-word class with
                    this probability (a deviation; ptb.py)
  word_chars        the encoder also reads each source word's first and last this many
                    characters (a deviation, 0 = off; ptb.py, model/transformer.py)
  word_affixes      the encoder also reads each source word's beginnings and endings of 1 to this
                    many letters, hashed, as a bag (a deviation, 0 = off; ptb.py)
  word_loss         "exact" (the paper) or "any": a target word scored as "a word comes here"
                    (a deviation; needs tree_words; training/losses.py)
  word_output       "vocabulary" (the paper) or "one": the decoder scores the tree tokens one by
                    one and every word as one output, "a word comes here" (a deviation; needs
                    tree_words and tree_constraints, which write the input's word; model/config.py)
  tree_constraints  decode only well-formed trees over the input's words (a deviation;
                    tree_constraint.py)
  decoder           "sequence" (§6.3: the decoder writes the linearized tree) or "chart" (a
                    deviation: no decoder; a span chart over the encoder scores every span's
                    label and every word's tag, and CKY finds the best tree; chart.py)
  chart_hidden      the span chart's hidden units (with decoder="chart")
  chart_loss        "spans" (each span's label alone) or "tree" (a TreeCRF) (with "chart")
"""

from __future__ import annotations

import functools
import os
import time

import ml_collections

from transformer_jax.tasks import base


class ParsingTask(base.Task):
  name = "parsing"
  command = "parse"
  sources = ("ptb",)
  metric = "f1"
  model_keys = (
      "word_output",
      "suffix_letters",
      "word_chars",
      "word_affixes",
      "decoder",
      "chart_hidden",
      "chart_loss",
  )

  def config_section(self):
    s = ml_collections.ConfigDict()
    # Closing brackets of the linearized trees carry their label, ")NP", as in Vinyals et al.
    # (2015) ("labeled"), or are a bare ")" ("bare") (trees.py).
    s.tree_closing = "labeled"
    # True writes each word before its tag in the target ("(NP Mr. (NNP) Vinken (NNP) )NP"): a
    # deviation from Vinyals et al. (2015) and §6.3, whose targets hold no words; the written
    # words mark the decoder's position in the sentence (trees.py). Off: the paper's form.
    s.tree_words = False
    # "top_down" writes each phrase's opening before its words (Vinyals et al. 2015, §6.3);
    # "in_order" after its first child (Liu & Zhang 2017's in-order order; a deviation, off by
    # default): "(NNP) (NP (NNP) )NP (S ..." (trees.py).
    s.tree_order = "top_down"
    # A word outside the vocabulary is read as its shape and its last letters, up to this many,
    # falling back to fewer (down to two) and then the shape alone where a class was not seen
    # twice in training (ptb.py). Not in the paper, which does not say how it reads unknown words.
    s.suffix_letters = 2
    # In each training batch, each vocabulary word is read as its unknown-word class with this
    # probability, in source and target alike (word dropout, a deviation, off by default; ptb.py).
    s.word_dropout = 0.0
    # K > 0: the encoder reads each source word's first and last K characters beside its id,
    # embedded and added to its embedding, so that a word read as its unknown-word class still
    # shows its letters (a deviation, off by default: §6.3 reads tokens by their ids; ptb.py
    # `spelling`, model/transformer.py SpellingFeatures).
    s.word_chars = 0
    # K > 0: the encoder reads each source word's proper beginnings and endings of 1..K letters
    # (lowercased, hashed; never the whole word), each embedded, summed and added to its
    # embedding: what a rare or unknown word shares with others (a deviation, off by default;
    # ptb.py `affixes`, model/transformer.py AffixFeatures). Not with word_chars.
    s.word_affixes = 0
    # "exact" (the paper): every target token is scored. "any" (a deviation; with tree_words): a
    # target word is scored as "a word comes here", its probability the sum over the
    # vocabulary's words, since the decoding constraint dictates which (training/losses.py).
    s.word_loss = "exact"
    # "vocabulary" (the paper): the decoder's output layer scores every vocabulary id. "one" (a
    # deviation): it scores the tree tokens one by one and every word as one output, "a word
    # comes here", whose word the decoding constraint dictates: an output layer of ~100 rows
    # instead of the vocabulary's thousands (model/config.py `output_tokens`; tree_constraint.py).
    s.word_output = "vocabulary"
    # The search writes only well-formed trees over the input's words (tree_constraint.py). Not
    # in the paper (§6.3 decodes freely): off by default.
    s.tree_constraints = False
    # "sequence" (§6.3): the decoder writes the linearized tree. "chart" (a deviation, off by
    # default): the encoder's output scores each span's label and each word's tag, trained by
    # `chart_loss`, and the best tree is found by CKY (Stern et al. 2017, Kitaev & Klein 2018;
    # chart.py, model/transformer.py SpanChart). The search's settings (beam, α,
    # tree_constraints) have no meaning there: every output is a tree over the words.
    s.decoder = "sequence"
    s.chart_hidden = 256  # the span chart's hidden units (Kitaev & Klein 2018 use 250)
    # "spans": each span's label by its own cross entropy (Teng & Zhang 2018's local model);
    # "tree": the gold tree's, normalized over all trees (a TreeCRF; training/losses.py).
    s.chart_loss = "spans"
    return s

  def validate(self, config, check):
    p = config.parsing
    # Whether data.path exists is checked when it is read: parsing sentences needs no trees.
    check(bool(config.data.path), "data.path", "the ptb source needs a directory of .mrg files")
    check(
        p.tree_closing in ("labeled", "bare"),
        "parsing.tree_closing",
        "expected 'labeled' or 'bare'",
    )
    check(
        p.tree_order in ("top_down", "in_order"),
        "parsing.tree_order",
        "expected 'top_down' or 'in_order'",
    )
    check(
        2 <= p.suffix_letters <= 8,
        "parsing.suffix_letters",
        "expected the longest ending an unknown-word class keeps, 2 to 8 letters",
    )
    check(0.0 <= p.word_dropout < 1.0, "parsing.word_dropout", "must be in [0, 1)")
    check(
        0 <= p.word_chars <= 16,
        "parsing.word_chars",
        "expected how many of a word's first and last characters the encoder reads, 0 (off) to 16",
    )
    check(
        0 <= p.word_affixes <= 8,
        "parsing.word_affixes",
        "expected the longest beginning and ending of a word the encoder reads, 0 (off) to 8",
    )
    check(
        not (p.word_chars and p.word_affixes),
        "parsing.word_affixes",
        "a word's letters are read as its spelling (word_chars) or as its affixes "
        "(word_affixes), not both: set one of them to 0",
    )
    check(p.word_loss in ("exact", "any"), "parsing.word_loss", "expected 'exact' or 'any'")
    check(
        p.word_loss == "exact" or p.tree_words,
        "parsing.word_loss",
        "'any' scores the words a target writes: with parsing.tree_words=True only",
    )

    check(
        p.word_output in ("vocabulary", "one"),
        "parsing.word_output",
        "expected 'vocabulary' or 'one'",
    )
    check(
        p.word_output == "vocabulary" or (p.tree_words and p.tree_constraints),
        "parsing.word_output",
        "'one' scores every word as one output, so only a search that writes the input's words "
        "can decode it: with parsing.tree_words=True and parsing.tree_constraints=True only",
    )
    check(
        p.word_output == "vocabulary" or p.word_loss == "exact",
        "parsing.word_loss",
        "parsing.word_output='one' already scores a word as 'a word comes here': leave "
        "word_loss 'exact'",
    )

    check(p.decoder in ("sequence", "chart"), "parsing.decoder", "expected 'sequence' or 'chart'")
    check(p.chart_hidden >= 1, "parsing.chart_hidden", "must be >= 1")
    check(p.chart_loss in ("spans", "tree"), "parsing.chart_loss", "expected 'spans' or 'tree'")
    if p.decoder == "chart":
      check(
          not config.data.packing,
          "data.packing",
          "a span chart scores the spans of one sentence per row: set data.packing=False with "
          "parsing.decoder='chart'",
      )
      check(
          p.word_output == "vocabulary" and p.word_loss == "exact",
          "parsing.decoder",
          "'chart' has no decoder to write words: leave parsing.word_output 'vocabulary' and "
          "parsing.word_loss 'exact'",
      )

  def load_dataset(self, config, workdir, splits):
    from transformer_jax.data import pipeline
    from transformer_jax.tasks.parsing import ptb

    start = time.perf_counter()
    vocab_path = os.path.join(workdir, pipeline.WORD_VOCAB) if workdir else None
    tokenizer, loaded = ptb.load_splits(config, vocab_path, splits)
    out = {key: pipeline.Split(pairs, examples) for key, (pairs, examples) in loaded.items()}
    return pipeline.Dataset(tokenizer, out, {"prepare": 0.0, "open": time.perf_counter() - start})

  def batch_transform(self, config, tokenizer):
    if not config.parsing.word_dropout:
      return None
    from transformer_jax.tasks.parsing import ptb

    # [v] int32, a constant of the compiled step
    table = ptb.word_class_table(tokenizer, config.parsing.suffix_letters)
    # A chart's targets are classes, not words: only its inputs are dropped.
    keys = ("inputs",) if config.parsing.decoder == "chart" else ptb.WORD_KEYS
    return functools.partial(
        ptb.drop_words, rate=config.parsing.word_dropout, classes=table, keys=keys
    )

  def interchangeable_tokens(self, config, tokenizer):
    if config.parsing.word_loss != "any" and config.parsing.word_output != "one":
      return None
    from transformer_jax.tasks.parsing import tree_constraint

    return tree_constraint.word_set(tokenizer)  # [v] bool, likewise

  def output_tokens(self, config, tokenizer):
    if config.parsing.word_output != "one":
      return 0
    from transformer_jax.tasks.parsing import tree_constraint

    return tree_constraint.output_tokens(tokenizer)

  def source_chars(self, config):
    p = config.parsing
    # the first and the last word_chars (ptb.spelling), or word_affixes of each (ptb.affixes)
    return 2 * (p.word_chars or p.word_affixes)

  def source_affixes(self, config):
    return bool(config.parsing.word_affixes)

  def has_decoder(self, config):
    return config.parsing.decoder != "chart"

  def chart_model(self, config, tokenizer):
    if self.has_decoder(config):
      return {}
    from transformer_jax.tasks.parsing import chart

    labels, tags = chart.classes(tokenizer.words)
    return {
        "chart_labels": len(labels),
        "chart_tags": len(tags),
        "chart_hidden": config.parsing.chart_hidden,
        "chart_loss": config.parsing.chart_loss,
    }

  def predictor(self, config, model_config, tokenizer):
    if config.parsing.decoder != "chart":
      return None
    from transformer_jax.tasks.parsing import chart, trees

    return chart.ChartSearch(
        model_config, tokenizer, trees.Linearization.from_config(config.parsing)
    )

  def constraint(self, config, tokenizer):
    if config.parsing.decoder == "chart":  # no search to constrain (chart.ChartSearch)
      return None
    from transformer_jax.tasks.parsing import tree_constraint

    return tree_constraint.from_config(config, tokenizer)

  def scores(self, config, hypotheses, pairs):
    from transformer_jax.tasks.parsing import scoring, trees

    linearization = trees.Linearization.from_config(config.parsing)
    values, _, _ = scoring.scores(hypotheses, pairs, linearization)
    # EVALB skips sentences whose words it cannot match (a tag count or a punctuation tag
    # wrong): their number says how much of the split the F1 covers.
    kept = ("f1", "precision", "recall", "repaired", "evalb_error_sentences")
    return {k: values[k] for k in kept}

  def test_results(self, config, hypotheses, pairs, workdir):
    """EVALB's F1 and the rest (scoring.py); test_trees.mrg and test_gold.mrg in `workdir`."""
    from transformer_jax.tasks.parsing import scoring, trees

    linearization = trees.Linearization.from_config(config.parsing)
    return scoring.test_results(hypotheses, pairs, linearization, workdir)


TASK = ParsingTask()
