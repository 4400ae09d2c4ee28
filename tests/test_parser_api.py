"""The parser's Python API as a user calls it (tasks/parsing/parser.py): every input mistake is a
UserError naming the sentence (and token), and a tree's leaves are the tokens handed in.

Input mistakes are refused before anything is decoded, so their tests need no model; the trees
come from a tiny span-chart run trained for one update on the two trees of testing.PTB (no
corpus needed, ~15 s): what it predicts is noise, but the leaves, the batching and the checks
are the parser's own whatever the model.
"""

import types

import jax
import ml_collections
import nltk
import pytest
import testing

from configs import parsing_sample
from transformer_jax import errors
from transformer_jax.tasks.parsing import parser, scoring

MAX_LEN = 32  # config.data.max_len of the tiny run: sentences of up to 31 words


def _unloaded(max_len: int = MAX_LEN) -> parser.Parser:
  """A Parser whose run has only a config: enough for everything checked before decoding."""
  config = ml_collections.ConfigDict({"data": {"max_len": max_len}})
  return parser.Parser(types.SimpleNamespace(config=config))


@pytest.fixture(scope="module")
def tiny_parser(tmp_path_factory) -> parser.Parser:
  from transformer_jax.training import train

  data = tmp_path_factory.mktemp("ptb")
  for article in (1, 2, 3):
    (data / f"wsj_{article:04d}.mrg").write_text(testing.PTB)
  config = parsing_sample.get_config("chart")
  config.data.path = str(data)
  config.data.train_split, config.data.eval_split, config.data.test_split = "0001", "0002", "0003"
  config.model.d_model, config.model.num_heads, config.model.d_ff = 32, 4, 64
  config.model.num_layers = 1
  config.parsing.chart_hidden = 32
  config.data.num_buckets, config.data.max_len = 1, MAX_LEN
  config.data.tokens_per_batch = 64
  config.train.num_steps, config.train.warmup_steps = 1, 1
  config.train.checkpoint_every, config.train.eval_every = 1, 1
  config.train.average_last = 0
  config.train.max_train_minutes = 0.0
  config.eval.num_sentences = 2
  workdir = tmp_path_factory.mktemp("run")
  train.run(config, str(workdir), devices=jax.devices()[:1])
  return parser.Parser.load(str(workdir))


# ------------------------------------------------------------------ refused before decoding


@pytest.mark.parametrize("method", ["parse", "parse_strings", "parse_restored"])
def test_one_string_is_refused_saying_to_pass_a_list(method):
  """benepar's `parse` takes one sentence; ours a list: one string would be read as sentences of
  one character each."""
  with pytest.raises(errors.UserError, match=r"one string; .* pass \[sentence\] to parse one"):
    getattr(_unloaded(), method)("The cat sat on the mat.")
  with pytest.raises(errors.UserError, match=r"one bytes object; .* pass \[sentence\]"):
    getattr(_unloaded(), method)(b"The cat sat on the mat.")
  with pytest.raises(errors.UserError, match=r"^the sentences are an int \(42\); the parser takes"):
    getattr(_unloaded(), method)(42)


@pytest.mark.parametrize(
    "sentences, message",
    [
        ([None], r"^sentence 1 is None; expected a string \(plain text\) or a list of its tokens"),
        (["Fine.", 42], r"^sentence 2 is an int \(42\); expected a string"),
        ([b"bytes ."], r"^sentence 1 is a bytes \(b'bytes .'\); expected a string"),
        ([["Prices", 3, "."]], r"^sentence 1 token 2 is an int \(3\); a sentence given as a list"),
        ([["Prices", None]], r"^sentence 1 token 2 is None; a sentence given as a list holds"),
        ([["Prices", "", "fell"]], r"^sentence 1 token 2 \(''\) is empty: .*; drop it"),
        ([["a"], [" ", "b"]], r"^sentence 2 token 1 \(' '\) is only whitespace: .*; drop it"),
        (
            [["New York", "rose", "."]],
            r"^sentence 1 token 1 \('New York'\) holds whitespace: each token of a tokenized "
            r"sentence is one word without spaces; split it into its tokens, or pass the "
            r"sentence as one string of plain text$",
        ),
        ([["a\tb"]], r"^sentence 1 token 1 \('a\\tb'\) holds whitespace"),
        ([["New\u00a0York"]], r"^sentence 1 token 1 \('New\\xa0York'\) holds whitespace"),
        (["Fine.", "   "], r"^sentence 2 is empty: give it at least one word"),
        ([["a"], []], r"^sentence 2 is empty: give it at least one word"),
        (["  "], r"^sentence 1 is empty"),
    ],
)
def test_a_sentence_the_model_cannot_read_is_named(sentences, message):
  for method in ("parse", "parse_strings", "parse_restored"):
    with pytest.raises(errors.UserError, match=message):
      getattr(_unloaded(), method)(sentences)


def test_the_length_limit_is_checked_at_both_edges_before_decoding():
  words = ["w"] * (MAX_LEN - 1)
  assert _unloaded().read([words])[1] == [words]  # at the limit: read
  with pytest.raises(errors.UserError, match=r"^sentence 2 has 32 words; this model reads at most"):
    _unloaded().parse([words, [*words, "w"]])
  # Plain text is counted in its Treebank tokens, as the model reads it.
  with pytest.raises(errors.UserError, match=r"^sentence 1 has 32 words"):
    _unloaded().parse(["w " * (MAX_LEN - 2) + "w."])


def test_a_token_is_read_as_given_and_brackets_as_the_treebank_spells_them():
  tokens = ["f(x)", "(", "{", "-LRB-", "``", "'s", "$"]
  given, words = _unloaded().read([tokens, " ".join(tokens)], tokenized=True)
  assert given == [tokens, tokens]
  assert words == [["f-LRB-x-RRB-", "-LRB-", "-LCB-", "-LRB-", "``", "'s", "$"]] * 2
  assert parser.words_of(tokens) == words[0]


# ------------------------------------------------------------------ trees from a loaded run


def _leaves(trees):
  return [t.leaves() for t in trees]


@pytest.mark.slow  # a trained parser: .ci/run runs it after the default suite
def test_the_leaves_are_exactly_the_tokens_given(tiny_parser):
  tokenized = [
      ["Profits", "rose", "(", "sharply", ")", "."],
      ["{", "Braces", "}", "and", "f(x)", "and", "-LRB-", "as", "written", "-RRB-", "."],
      ["``", "Quotes", "''", "stay", ",", "as", "do", "$", "3.50", "and", "5", "%", "."],
      ["Prices", "fell"],
  ]
  assert _leaves(tiny_parser.parse(tokenized)) == tokenized
  spaced = [" ".join(t) for t in tokenized]
  assert _leaves(tiny_parser.parse(spaced, tokenized=True)) == tokenized
  plain = ["Profits rose (sharply).", 'He didn\'t say "no"; {it} cost $3.50.']
  assert _leaves(tiny_parser.parse(plain)) == [parser.tokenize(s) for s in plain]
  assert parser.tokenize(plain[0]) == ["Profits", "rose", "-LRB-", "sharply", "-RRB-", "."]
  # The bracketed lines keep the treebank's spelling (a line cannot hold a bracket as a word):
  # the same trees, their leaves the words the model read.
  strings = tiny_parser.parse_strings(tokenized)
  for line, tree, tokens in zip(strings, tiny_parser.parse(tokenized), tokenized):
    read = nltk.Tree.fromstring(line)
    assert read.leaves() == scoring.sentence_words(" ".join(tokens))
    for position, token in zip(read.treepositions("leaves"), tokens):
      read[position] = token
    assert read == tree


@pytest.mark.slow  # a trained parser: .ci/run runs it after the default suite
def test_well_formed_input_gives_the_trees_of_the_bracketed_lines(tiny_parser):
  """Without brackets, a tree's nltk form is its bracketed line read back, as before."""
  sentences = [["Mr.", "Vinken", "is", "expected", "to", "retire", "early", "."], ["Nothing", "."]]
  lines = tiny_parser.parse_strings(sentences)
  assert tiny_parser.parse(sentences) == [nltk.Tree.fromstring(line) for line in lines]
  assert [r.tree.words() for r in tiny_parser.parse_restored(sentences)] == sentences
  assert tiny_parser.parse([]) == []


@pytest.mark.slow  # a trained parser: .ci/run runs it after the default suite
def test_a_generator_of_sentences_is_read_once(tiny_parser):
  sentences = [["Prices", "fell", "."], ["Profits", "rose", "."], "It rained."]
  expected = tiny_parser.parse(sentences)
  assert tiny_parser.parse(s for s in sentences) == expected
  assert tiny_parser.parse_strings(iter(sentences)) == tiny_parser.parse_strings(sentences)
  # A sentence may be any iterable of tokens, a generator too.
  assert tiny_parser.parse([(w for w in s) for s in sentences[:2]]) == expected[:2]


@pytest.mark.slow  # a trained parser: .ci/run runs it after the default suite
def test_many_sentences_are_decoded_in_batches_in_order(tiny_parser):
  """Thousands of sentences at once: decoded batch by batch (rows bounded by eval.batch_tokens),
  each tree over its own sentence's words."""
  sentences = [[f"w{i}"] * (1 + i % 7) for i in range(3000)]
  stats = {}
  restored = tiny_parser.parse_restored(sentences, stats=stats)
  assert [r.tree.words() for r in restored] == sentences
  assert stats["batches"] > 1, stats
  assert stats["rows"] / stats["batches"] <= tiny_parser.run.config.eval.batch_tokens, stats


@pytest.mark.slow  # a trained parser: .ci/run runs it after the default suite
def test_a_sentence_at_the_length_limit_parses_and_one_past_it_is_refused(tiny_parser):
  assert tiny_parser.max_words == MAX_LEN - 1
  longest = [f"w{i}" for i in range(tiny_parser.max_words)]
  [tree] = tiny_parser.parse([longest])
  assert tree.leaves() == longest
  with pytest.raises(errors.UserError, match=r"^sentence 1 has 32 words; this model reads at most"):
    tiny_parser.parse([[*longest, "w"]])


@pytest.mark.slow  # a trained parser: .ci/run runs it after the default suite
def test_an_interrupted_parse_leaves_the_parser_as_it_was(tiny_parser, monkeypatch):
  """Ctrl-C while the second batch is decoded: the KeyboardInterrupt reaches the caller, and the
  same parser then parses as before."""
  sentences = [[f"w{i}"] * (1 + i % 5) for i in range(600)]
  expected = tiny_parser.parse_strings(sentences)
  predictor = tiny_parser.run.predictor
  search, calls = predictor.search, []

  def interrupted(*args, **kwargs):
    calls.append(1)
    if len(calls) == 2:
      raise KeyboardInterrupt
    return search(*args, **kwargs)

  monkeypatch.setattr(predictor, "search", interrupted)
  with pytest.raises(KeyboardInterrupt):
    tiny_parser.parse_strings(sentences)
  monkeypatch.undo()
  assert len(calls) == 2
  assert tiny_parser.parse_strings(sentences) == expected
