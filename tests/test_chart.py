"""The span chart parser (tasks/parsing/chart.py; its model and loss, chart_model.py): trees as
labeled spans and back, CKY against every binary bracketing, targets against the spans, the
loss against its formula, the model's parameters and padding, and a run's parses read back as
trees."""

import itertools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from testing import PTB as TWO_TREES

from transformer_jax.model.config import TransformerConfig
from transformer_jax.tasks.parsing import chart, chart_model, trees

PTB = TWO_TREES + """
( (NP (NNP Pierre) (NNP Vinken)) (, ,) (ADJP (JJ old)) )
( (S (NP (NP (DT the) (NN cat)) (PP (IN on) (NP (DT the) (NN mat)))) (VP (VBD sat))) )
"""


def sample_trees():
  return [trees.preprocess(t) for t in trees.parse_trees(PTB)]


def test_spans_of_a_tree_with_chains_and_one_word_phrases():
  first, second, third, _ = sample_trees()
  assert chart.spans(first) == [
      (0, 8, "S"),
      (0, 2, "NP"),
      (2, 7, "VP"),
      (3, 7, "VP"),
      (4, 7, "S+VP"),  # (S (VP to ...)) once the trace is gone: one span, a chain
      (5, 7, "VP"),
      (6, 7, "PRT"),  # a phrase over one word
  ]
  assert chart.spans(second) == [(0, 2, "FRAG"), (0, 1, "NP")]
  assert chart.spans(third) == [(0, 2, "NP"), (3, 4, "ADJP")]  # TOP over three: no root span


def test_build_inverts_spans():
  for tree in sample_trees():
    tagged = tree.tagged_words()
    words, tags = [w for w, _ in tagged], [t for _, t in tagged]
    built = chart.build(words, tags, chart.spans(tree))
    assert built == tree, str(tree)
    # EMPTY spans (a binarization's extra nodes) change nothing.
    padded = [*chart.spans(tree), (0, len(words), chart.EMPTY), (1, 2, chart.EMPTY)]
    assert chart.build(words, tags, padded) == tree


@pytest.mark.slow  # ~10 s on 2 cores: .ci/run runs it after the default suite
def test_every_sample_tree_round_trips_through_its_spans(shared_data):
  count = 0
  for path in sorted((shared_data / "ptb-sample").glob("wsj_*.mrg")):
    for raw in trees.read_trees(str(path)):
      tree = trees.preprocess(raw)
      tagged = tree.tagged_words()
      words, tags = [w for w, _ in tagged], [t for _, t in tagged]
      assert chart.build(words, tags, chart.spans(tree)) == tree, (path, str(tree))
      count += 1
  assert count == 3669


def binary_bracketings(i: int, j: int):
  """Every binary bracketing of words i..j-1, as frozensets of spans."""
  if j - i == 1:
    yield frozenset({(i, j)})
    return
  for k in range(i + 1, j):
    for left in binary_bracketings(i, k):
      for right in binary_bracketings(k, j):
        yield left | right | {(i, j)}


@pytest.mark.parametrize("n", [1, 2, 3, 5, 7])
def test_cky_finds_the_best_of_every_binary_bracketing(n):
  rng = np.random.default_rng(n)
  for _ in range(5):
    scores = rng.normal(size=(n + 1, n + 1))
    found = chart.cky(scores, n)
    assert len(found) == 2 * n - 1 and len(set(found)) == len(found)
    best = max(sum(scores[s] for s in b) for b in binary_bracketings(0, n))
    assert sum(scores[s] for s in found) == pytest.approx(best)
    assert frozenset(found) in set(binary_bracketings(0, n))


def test_decode_with_the_gold_spans_scored_highest_gives_the_gold_tree():
  for tree in sample_trees():
    labels = chart.labels_of([tree])
    index = {label: i for i, label in enumerate(labels)}
    gold = chart.chart(tree, index)  # [n + 1, n + 1]
    tagged = tree.tagged_words()
    out = chart.decode(
        [w for w, _ in tagged], [t for _, t in tagged], (gold > 0) * 1.0, gold, labels
    )
    assert out == tree


def test_targets_give_the_loss_every_span_of_the_tree():
  tree_list = sample_trees()
  vocabulary = [
      *trees.iter_tree_tokens(tree_list, "labeled"),
      *chart.chain_tokens(tree_list),
  ]
  labels, tags = chart.classes(vocabulary)
  assert labels[0] == chart.EMPTY and "S+VP" in labels and "NP" in labels
  assert "NNP" in tags and "-NONE-" not in tags
  label_index = {label: i for i, label in enumerate(labels)}
  tag_index = {tag: i for i, tag in enumerate(tags)}
  width = 12
  batch = np.zeros((len(tree_list), width, chart_model.CHART_COLUMNS), np.int32)
  for row, tree in enumerate(tree_list):
    rows = chart.targets(tree, label_index, tag_index)
    batch[row, : len(rows)] = rows
    batch[row, len(rows), 0] = 1  # EOS, as batching writes it
  spans, tags_out, valid = jax.device_get(chart_model.chart_gold(jnp.asarray(batch), width))
  for row, tree in enumerate(tree_list):
    n = len(tree.words())
    expected = np.zeros((width, width), np.int32)  # [i, j]: the span of words i..j
    expected[:n, :n] = chart.chart(tree, label_index)[:-1, 1:]
    np.testing.assert_array_equal(spans[row], expected)
    assert valid[row].sum() == n
    assert [tags[t] for t in tags_out[row, :n]] == [t for _, t in tree.tagged_words()]


def test_chart_loss_is_each_tag_cross_entropy_plus_the_tree_cross_entropy():
  """With every span logit 0 each labeled binary tree is as likely as any other: the tree's part
  is log(#binary bracketings × L^(2n - 1)) per sentence, whatever its gold tree, and the rest is
  each tag's cross entropy; `chart_loss` reports those sums, the tags' hits and the word count."""
  rng = np.random.default_rng(0)
  b, s, num_labels, num_tags = 2, 4, 3, 5
  spans = np.zeros((b, s, s, num_labels), np.float32)
  tag_logits = rng.normal(size=(b, s, num_tags)).astype(np.float32)
  lengths = [3, 2]
  targets = np.zeros((b, s, chart_model.CHART_COLUMNS), np.int32)
  gold_tags = rng.integers(0, num_tags, size=(b, s))
  for row, n in enumerate(lengths):
    targets[row, :n, 0] = gold_tags[row, :n] + chart_model.CHART_TAG_OFFSET
    targets[row, n, 0] = 1  # EOS
  targets[0, 1, 1] = 2  # the span of word 1 alone: label 2
  targets[0, 0, 2:] = (1, 0, 2)  # the span of words 0..2, its first part ending at word 0
  targets[0, 1, 2:] = (0, 1, 2)  # its binarization's node over words 1..2, EMPTY
  targets[1, 0, 2:] = (2, 0, 1)  # the span of words 0..1
  nll, correct, count = chart_model.tree_cross_entropy(
      jnp.asarray(spans), jnp.asarray(tag_logits), jnp.asarray(targets)
  )

  def log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))

  expected, hits = 0.0, 0
  for row, n in enumerate(lengths):
    bracketings = len(list(binary_bracketings(0, n)))
    expected += np.log(bracketings) + (2 * n - 1) * np.log(num_labels)
    for i in range(n):
      expected -= log_softmax(tag_logits[row, i])[gold_tags[row, i]]
      hits += int(tag_logits[row, i].argmax() == gold_tags[row, i])
  assert float(nll) == pytest.approx(expected, rel=1e-5)
  assert int(correct) == hits and float(count) == sum(lengths)
  loss_sum, metrics = chart_model.chart_loss(
      (jnp.asarray(spans), jnp.asarray(tag_logits)), {"targets": jnp.asarray(targets)}
  )
  assert float(loss_sum) == float(metrics["loss_sum"]) == float(metrics["nll_sum"]) == float(nll)
  assert int(metrics["correct_sum"]) == hits and float(metrics["weight_sum"]) == sum(lengths)


def _chart_config(**kwargs) -> TransformerConfig:
  return TransformerConfig(
      **{"vocab_size": 30, "d_model": 16, "num_heads": 2, "num_layers": 1, "d_ff": 32, **kwargs}
  )


def test_chart_parser_keeps_the_parameter_names_of_the_old_chart_model():
  """ChartParser's tree is the one the Transformer with a span chart had (source_embedding,
  encoder, chart, then the chart's layers), so the chart runs saved before it still restore;
  its embedding and encoder are the paper's Transformer's, shape for shape."""
  from flax.traverse_util import flatten_dict

  from transformer_jax.model.transformer import Transformer

  cfg = _chart_config(share_embeddings=False)
  model = chart_model.ChartParser(cfg, labels=4, tags=3, hidden=8)
  shapes = jax.eval_shape(model.init, jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32))
  params = nn.unbox(shapes)["params"]
  assert set(params) == {"source_embedding", "encoder", "chart"}
  assert set(params["chart"]) == {
      "span_first", "span_last", "span_norm", "span_labels", "tag_hidden", "tag_norm",
      "tag_labels",
  }  # fmt: skip
  assert params["chart"]["span_labels"]["kernel"].shape == (8, 4)
  assert params["chart"]["tag_labels"]["kernel"].shape == (8, 3)
  assert "bias" not in params["chart"]["span_last"]  # the span's bias is span_first's
  dummy = jnp.zeros((1, 8), jnp.int32)
  paper = jax.eval_shape(Transformer(cfg).init, jax.random.PRNGKey(0), dummy, dummy)
  paper = nn.unbox(paper)["params"]
  for name in ("source_embedding", "encoder"):
    assert jax.tree.map(lambda x: x.shape, flatten_dict(params[name])) == jax.tree.map(
        lambda x: x.shape, flatten_dict(paper[name])
    )


@pytest.mark.slow  # ~10 s on 2 cores: .ci/run runs it after the default suite
def test_span_chart_reads_each_sentence_alone():
  """Padding and the other rows change nothing of a sentence's span and tag scores."""
  model = chart_model.ChartParser(_chart_config(deterministic=True), labels=4, tags=3, hidden=8)
  inputs = np.array([[5, 6, 7, 1, 0, 0], [8, 9, 1, 0, 0, 0]], np.int32)
  params = model.init(jax.random.PRNGKey(0), inputs)["params"]
  assert "decoder" not in params
  spans, tags = model.apply({"params": params}, inputs)
  assert spans.shape == (2, 6, 6, 4) and tags.shape == (2, 6, 3)
  assert spans.dtype == tags.dtype == jnp.float32
  alone, alone_tags = model.apply({"params": params}, inputs[1:, :3])
  np.testing.assert_allclose(spans[1, :3, :3], alone[0], atol=1e-5)
  np.testing.assert_allclose(tags[1, :3], alone_tags[0], atol=1e-5)


def test_chain_tokens_and_classes_are_sorted_and_unique():
  tree_list = sample_trees()
  assert chart.chain_tokens(tree_list) == ["(S+VP"]
  labels, tags = chart.classes(["(NP", ")NP", "(NN)", "(S+VP", "(-LRB-)", "word", "(S", "("])
  assert labels == ["", "NP", "S", "S+VP"] and tags == ["-LRB-", "NN"]
  assert list(itertools.chain(labels)) == sorted(labels)


@pytest.mark.slow  # 5-10 s on 2 cores: .ci/run runs it after the default suite
@pytest.mark.parametrize("order", trees.ORDERS)
@pytest.mark.parametrize("words", [False, True])
def test_chart_search_writes_trees_over_the_input_words(order, words):
  """An untrained chart's parses, written as the run's linearization, read back (delinearize)
  with no repair, over exactly each sentence's words, whatever the batch's padding."""
  from transformer_jax.data.tokenizer import WordTokenizer
  from transformer_jax.runs import inference

  tree_list = sample_trees()
  vocabulary = sorted(
      {*trees.iter_tree_tokens(tree_list, "labeled"), *chart.chain_tokens(tree_list)}
  )
  sentence_words = sorted({w for t in tree_list for w in t.words()})
  tokenizer = WordTokenizer(vocabulary + sentence_words)
  labels, tags = chart.classes(tokenizer.words)
  cfg = _chart_config(vocab_size=tokenizer.vocab_size)
  model = chart_model.ChartParser(cfg, labels=len(labels), tags=len(tags), hidden=8)
  params = model.init(jax.random.PRNGKey(1), jnp.zeros((1, 8), jnp.int32))["params"]
  form = trees.Linearization("labeled", words, order)
  search = chart.ChartSearch(model, tokenizer, form)
  assert search.model.config.deterministic and not model.config.deterministic
  sentences = [t.words() for t in tree_list]
  sources = [tokenizer.encode(" ".join(s)) for s in sentences]
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1), ("data", "fsdp", "tensor"))
  with jax.set_mesh(mesh):
    outputs = inference.decode_sources(
        search, params, sources, (8, 16), mesh, beam_size=4, alpha=0.6, batch_tokens=32
    )
  for tokens, sentence in zip(outputs, sentences):
    restored = form.restore(tokenizer.decode(tokens.tolist()).split(), sentence)
    assert restored.repairs == 0 and restored.tree.words() == sentence
    assert all(tag in tags for _, tag in restored.tree.tagged_words())
  assert search.searches() == 2  # one program per bucket


def brute_log_partition(scores: np.ndarray, n: int) -> float:
  """log Σ over every binary bracketing of n tokens of exp(Σ of its spans' scores[i, j - 1])."""
  totals = [sum(scores[i, j - 1] for i, j in b) for b in binary_bracketings(0, n)]
  return float(np.logaddexp.reduce(np.asarray(totals, np.float64)))


def test_log_partition_sums_over_every_binary_tree():
  rng = np.random.default_rng(1)
  scores = rng.normal(size=(4, 7, 7)).astype(np.float32)
  lengths = np.array([7, 4, 1, 2])
  got = jax.jit(chart_model.log_partition)(jnp.asarray(scores), jnp.asarray(lengths))
  expected = [brute_log_partition(scores[r], n) for r, n in enumerate(lengths)]
  np.testing.assert_allclose(got, expected, rtol=1e-5)
  # Its gradient: each span's probability of being in the tree; 2n - 1 spans per tree.
  grads = jax.grad(lambda s: chart_model.log_partition(s, jnp.asarray(lengths)).sum())(scores)
  np.testing.assert_allclose(grads.sum(axis=(1, 2)), 2 * lengths - 1, rtol=1e-5)


@pytest.mark.slow  # ~10 s on 2 cores: .ci/run runs it after the default suite
def test_tree_loss_is_the_gold_binary_tree_negative_log_probability():
  """tree_cross_entropy: -log P(the gold tree's binarization, labeled) over every binary tree
  with every labeling, by enumeration; the targets' splits and words are that binarization."""
  tree_list = sample_trees()
  labels = chart.labels_of(tree_list)
  label_index = {label: i for i, label in enumerate(labels)}
  tag_index = {tag: i for i, tag in enumerate(chart.tags_of(tree_list))}
  rng = np.random.default_rng(2)
  for tree in tree_list[1:]:  # the first is too long to enumerate quickly
    n = len(tree.words())
    rows = chart.targets(tree, label_index, tag_index)
    batch = np.zeros((1, n + 1, chart_model.CHART_COLUMNS), np.int32)
    batch[0, :n] = rows
    batch[0, n, 0] = 1  # EOS
    spans = rng.normal(size=(1, n + 1, n + 1, len(labels))).astype(np.float32)
    tags = np.zeros((1, n + 1, len(tag_index)), np.float32)
    nll, _, _ = chart_model.tree_cross_entropy(
        jnp.asarray(spans), jnp.asarray(tags), jnp.asarray(batch)
    )
    binary = {(k, k + 1): rows[k, 1] for k in range(n)}
    binary.update({(rows[k, 3], rows[k, 4] + 1): rows[k, 2] for k in range(n - 1)})
    assert frozenset(binary) in set(binary_bracketings(0, n))
    gold = sum(spans[0, i, j - 1, label] for (i, j), label in binary.items())
    log_z = brute_log_partition(np.logaddexp.reduce(spans[0], axis=-1), n)
    tag_nll = n * np.log(len(tag_index))  # uniform tags
    assert float(nll) == pytest.approx(log_z - gold + tag_nll, rel=1e-5)
    # The labeled phrases among the binary nodes are the tree's spans.
    phrases = {(i, j, labels[label]) for (i, j), label in binary.items() if label}
    assert phrases == set(chart.spans(tree))
