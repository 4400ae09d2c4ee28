"""§6.3 English constituency parsing as a task: sentences in, linearized trees out, EVALB's F1.

Its own config section, `config.parsing`, holds the switches of the parsing pipeline; the
deviations from §6.3 among them are off by default:

  tree_closing      "labeled" (")NP", Vinyals et al. 2015) or "bare" (")")
  tree_words        write each word before its tag in the target (a deviation)
  tree_order        "top_down" (§6.3) or "in_order" (Liu & Zhang 2017; a deviation)
  suffix_letters    the longest word ending an unknown-word class keeps (2; ptb.py)
  word_dropout      read each vocabulary word of a training batch as its unknown-word class with
                    this probability (a deviation; ptb.py)
  tree_constraints  decode only well-formed trees over the input's words (a deviation;
                    tree_constraint.py)
  decoder           "sequence" (§6.3: the decoder writes the linearized tree) or "chart" (a
                    deviation: no decoder; a span chart over the encoder scores every span's
                    label and every word's tag, and CKY finds the best tree; chart.py,
                    chart_model.py: the task's own model and loss)
  chart_hidden      the span chart's hidden units (with decoder="chart")
"""

from __future__ import annotations

import functools
import os
import time

import ml_collections

from transformer_jax.tasks import base

# The last commit that has the code of the retired keys (docs/experiments.md).
RETIRED_AT = "commit 3d33068"


def _at(default, value, section) -> bool:
  """A retired key's value that changes nothing: its old default."""
  del section
  return value == default


class ParsingTask(base.Task):
  name = "parsing"
  command = "parse"
  sources = ("ptb",)
  metric = "f1"
  model_keys = ("suffix_letters", "decoder", "chart_hidden")
  decoding_keys = ("tree_constraints",)
  retired_keys = {
      key: (
          functools.partial(_at, value),
          f"{what}: measured and not adopted, its code is at {RETIRED_AT}",
      )
      for key, value, what in (
          ("word_chars", 0, "the encoder's spelling features"),
          ("word_affixes", 0, "the encoder's hashed affixes"),
          ("word_loss", "exact", "the 'any word' loss"),
          ("word_output", "vocabulary", "one output for every word"),
      )
  } | {
      "chart_loss": (
          lambda value, section: value == "tree" or section.get("decoder") != "chart",
          f"the chart's 'spans' loss (the chart's loss is now the tree's, chart_loss='tree'): "
          f"measured and not adopted, its code is at {RETIRED_AT}",
      )
  }

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
    # The search writes only well-formed trees over the input's words (tree_constraint.py). Not
    # in the paper (§6.3 decodes freely): off by default.
    s.tree_constraints = False
    # "sequence" (§6.3): the decoder writes the linearized tree. "chart" (a deviation, off by
    # default): the encoder's output scores each span's label and each word's tag, trained by
    # the tree's cross entropy (a TreeCRF), and the best tree is found by CKY (Stern et al. 2017,
    # Kitaev & Klein 2018; chart.py, chart_model.py). The search's settings (beam, α,
    # tree_constraints) have no meaning there: every output is a tree over the words.
    s.decoder = "sequence"
    s.chart_hidden = 256  # the span chart's hidden units (Kitaev & Klein 2018 use 250)
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

    check(p.decoder in ("sequence", "chart"), "parsing.decoder", "expected 'sequence' or 'chart'")
    check(p.chart_hidden >= 1, "parsing.chart_hidden", "must be >= 1")
    if p.decoder == "chart":
      check(
          not config.data.packing,
          "data.packing",
          "a span chart scores the spans of one sentence per row: set data.packing=False with "
          "parsing.decoder='chart'",
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

  def build_model(self, config, tokenizer):
    if config.parsing.decoder != "chart":
      return super().build_model(config, tokenizer)  # §6.3: the paper's Transformer
    from transformer_jax import config as config_lib
    from transformer_jax.tasks.parsing import chart, chart_model

    labels, tags = chart.classes(tokenizer.words)
    return chart_model.ChartParser(
        config_lib.model_config(config, tokenizer.vocab_size),
        labels=len(labels),
        tags=len(tags),
        hidden=config.parsing.chart_hidden,
    )

  def loss(self, config, tokenizer):
    if config.parsing.decoder != "chart":
      return super().loss(config, tokenizer)
    from transformer_jax.tasks.parsing import chart_model

    return chart_model.chart_loss

  def batch_keys(self, config):
    if config.parsing.decoder != "chart":
      return None
    from transformer_jax.tasks.parsing import chart_model

    return chart_model.BATCH_KEYS

  def predictor(self, config, model, tokenizer):
    if config.parsing.decoder != "chart":
      return None
    from transformer_jax.tasks.parsing import chart, trees

    return chart.ChartSearch(model, tokenizer, trees.Linearization.from_config(config.parsing))

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

  def test_results(self, config, hypotheses, pairs, workdir, tag=""):
    """EVALB's F1 and the rest (scoring.py); test_trees.mrg (with `tag`, test_trees.TAG.mrg) and
    test_gold.mrg in `workdir`."""
    from transformer_jax.tasks.parsing import scoring, trees

    linearization = trees.Linearization.from_config(config.parsing)
    name = scoring.TEST_TREES.replace(".mrg", f".{tag}.mrg") if tag else scoring.TEST_TREES
    return scoring.test_results(hypotheses, pairs, linearization, workdir, trees_file=name)


TASK = ParsingTask()
