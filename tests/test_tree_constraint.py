"""Constrained decoding for parsing (tree_constraint.py): the legal tokens are exactly those of
the documented rule, every gold tree is legal, and the searches then write only trees that
restore with no repair, over exactly the input's words."""

import functools

import jax
import numpy as np
import pytest
from testing import random_params

from configs import multi30k
from transformer_jax import config as config_lib
from transformer_jax.data.tokenizer import EOS_ID, PAD_ID, RESERVED_TOKENS
from transformer_jax.decoding import decode, search
from transformer_jax.decoding.batch_shapes import Shapes
from transformer_jax.model.transformer import TransformerConfig
from transformer_jax.tasks.parsing import ptb, tree_constraint, trees
from transformer_jax.tasks.parsing.tree_constraint import (
    CLOSE,
    OPEN,
    TAG,
    WORD,
    TreeConstraint,
    token_kind,
)

TREES = """
( (S (NP-SBJ (NNP Pierre) (NNP Vinken) ) (VP (MD will) (VP (VB join) (NP (DT the) (NN board) )
  (PP-CLR (IN as) (NP (DT a) (JJ nonexecutive) (NN director) )))) (. .) ))
( (S (NP-SBJ (NNP Mr.) (NNP Vinken) ) (VP (VBZ is) (NP-PRD (NP (NN chairman) ) (PP (IN of)
  (NP (NNP Elsevier) (NNP N.V.) )))) (. .) ))
( (S (NP-SBJ (-NONE- *-1) ) (VP (VBD rose) (ADVP (RB sharply) )) (. .) ))
( (FRAG (NP (JJ Tough) (NNS times) ) (. !) ))
( (SINV (VP (VBZ Is) ) (NP-SBJ (PRP it) ) (ADJP-PRD (JJ true) ) (. ?) ))
"""
N, S = 64, 24  # output and source lengths of the batches below (one compiled shape each)


def _setup(closing, words, order="top_down"):
  tree_list = [trees.preprocess(t) for t in trees.parse_trees(TREES)]
  tokenizer = ptb.build_vocabulary(tree_list, closing, 200)
  # Every word of these trees in the vocabulary, so that ids and tokens map one to one.
  vocab = tokenizer.words + sorted({w for t in tree_list for w in t.words()} - set(tokenizer.words))
  tokenizer = type(tokenizer)(vocab)
  tokens = list(RESERVED_TOKENS) + tokenizer.words
  constraint = TreeConstraint.for_vocabulary(tokens, closing, words, order)
  return tree_list, tokenizer, tokens, constraint


def _pad(ids, length):
  return np.array(ids + [PAD_ID] * (length - len(ids)), np.int32)


def reference_legal(tokens, prefix, source_words, closing, words, limit=N, order="top_down"):
  """The module docstring's rule, over a stack: the set of legal next token ids."""
  in_order = order == "in_order"
  stack, written, last, run = [], 0, None, 0
  for t in prefix:
    kind = token_kind(tokens[t])
    if in_order:  # openings since the last tag
      run = 0 if kind == TAG else run + (kind == OPEN)
    else:  # openings in a row
      run = run + 1 if kind == OPEN else 0
    if kind == OPEN:
      stack.append(tokens[t][1:])
    elif kind == CLOSE:
      stack.pop()
    written += kind == (WORD if words else TAG)
    last = kind
  pending = words and last == WORD
  remaining = written < len(source_words)
  # The tag of a punctuation word is a punctuation tag (or POS), no other word's is.
  tagged = source_words[min(written - words, len(source_words) - 1)]
  deleted = {f"({t})" for t in (",", ".", ":", "``", "''")}
  if trees.punctuation_tag(tokens[tagged]) in {",", ".", ":", "``", "''"}:
    tag_ok = deleted | {"(POS)"}
  else:
    tag_ok = {t for t in tokens if token_kind(t) == TAG} - deleted
  left, per_word = len(source_words) - written, 2 if words else 1
  # In order, words go inside an open phrase (or first of all), phrases open over a finished node.
  fits = len(prefix) + 2 + len(stack) + per_word * left + 1 <= limit  # an opening, then the rest
  can_open = (last in (TAG, CLOSE) if in_order else remaining) and fits and run < 10
  # In order, beside the tree at the top only when no phrase can open over it any more.
  shift = remaining and (
      not in_order or bool(stack) or not prefix or not (can_open and not pending)
  )
  legal = set()
  for i, token in enumerate(tokens):
    kind = token_kind(token)
    if kind == TAG and token not in tag_ok:
      ok = False
    elif pending:
      ok = kind == TAG
    elif kind == OPEN:  # room to close it, and for every word left, after it
      ok = can_open
    elif kind == TAG and not words:
      ok = shift
    elif kind == CLOSE:
      own = ")" + stack[-1] if stack and closing == "labeled" else ")"
      ok = bool(stack) and token == own
      if in_order and len(stack) == 1 and remaining:  # another phrase must open over it
        ok &= len(prefix) + 3 + per_word * left + 1 <= limit and run < 10
      elif not in_order:
        ok &= last != OPEN
    elif words and kind == WORD:
      ok = shift and i == source_words[written]
    else:
      ok = i == EOS_ID and not remaining and not stack
    if ok:
      legal.add(i)
  return legal


@functools.cache
def _legal_fn(constraint):
  return jax.jit(constraint.legal)


def _dense(constraint):
  """The constraint's answer as log-probs over the whole vocabulary."""
  return lambda log_probs, *args, **kwargs: search.dense(
      constraint(log_probs, *args, **kwargs), np.shape(log_probs)[-1]
  )


@functools.cache
def _call_fns(constraint):
  return jax.jit(constraint.__call__), jax.jit(constraint.reference)


def _assert_same_as_reference(constraint, rng, prefixes, limits, inputs):
  """The constraint's fast form (over its candidates) equals its definition over the whole
  vocabulary: the same legal tokens, the same renormalized log-probabilities."""
  log_probs = jax.nn.log_softmax(rng.normal(size=prefixes.shape[:-1] + constraint.kinds.shape))
  fast, reference = _call_fns(constraint)
  fast = np.asarray(search.dense(fast(log_probs, prefixes, limits, inputs), log_probs.shape[-1]))
  reference = np.asarray(reference(log_probs, prefixes, limits, inputs))
  np.testing.assert_array_equal(fast == -np.inf, reference == -np.inf)
  np.testing.assert_allclose(fast, reference, rtol=1e-6, atol=1e-6)


@pytest.mark.slow  # 10-60 s on 2 cores: .ci/run runs it after the default suite
@pytest.mark.parametrize("order", trees.ORDERS)
@pytest.mark.parametrize("closing", ["labeled", "bare"])
@pytest.mark.parametrize("words", [False, True], ids=["tags", "words"])
def test_every_prefix_of_every_gold_tree_is_legal_and_eos_comes_last(closing, words, order):
  tree_list, tokenizer, tokens, constraint = _setup(closing, words, order)
  linearization = trees.Linearization(closing, words, order)
  known = set(tokenizer.words)
  for tree in tree_list:
    source = ptb.encode_words(tokenizer, known, tree.words()) + [EOS_ID]
    target = ptb.encode_words(tokenizer, known, linearization.tokens(tree)) + [EOS_ID]
    prefixes = np.stack([_pad(target[:i], N) for i in range(len(target))])  # [t, n]
    inputs = np.broadcast_to(_pad(source, S), (len(target), S))
    limits = np.full(len(target), N, np.int32)
    legal = np.asarray(_legal_fn(constraint)(prefixes, limits, inputs))  # [t, v]
    assert legal[np.arange(len(target)), target].all(), tree
    # After the last word's tag and the last closing bracket, EOS is the one legal token (in
    # order, a phrase may still open over the whole tree: a unary root, `(S (VP ...))`).
    ends = [EOS_ID] + (
        [i for i, t in enumerate(tokens) if token_kind(t) == OPEN] if order == "in_order" else []
    )
    assert np.flatnonzero(legal[-1]).tolist() == sorted(ends)
    _assert_same_as_reference(constraint, np.random.default_rng(1), prefixes, limits, inputs)
    for i in range(len(target)):  # the rule, step by step, as the reference computes it
      expected = reference_legal(tokens, target[:i], source[:-1], closing, words, N, order)
      assert set(np.flatnonzero(legal[i]).tolist()) == expected, (tree, i)


@pytest.mark.parametrize("order", trees.ORDERS)
# Words and labeled closings in the default suite, the other combinations in .ci/run's slow stage.
@pytest.mark.parametrize("closing", ["labeled", pytest.param("bare", marks=pytest.mark.slow)])
@pytest.mark.parametrize(
    "words",
    [pytest.param(False, marks=pytest.mark.slow, id="tags"), pytest.param(True, id="words")],
)
def test_random_walks_match_the_reference_and_restore_without_repair(closing, words, order):
  """Prefixes no gold tree has: legal tokens chosen at random (a kind first, then a token), under
  limits from the tightest the sentence's words allow up: every walk ends within its limit, and
  runs of openings (in order: between two words) stop at 10."""
  in_order = order == "in_order"
  tree_list, tokenizer, tokens, constraint = _setup(closing, words, order)
  rng = np.random.default_rng(0)
  kinds = np.array([token_kind(t) for t in tokens])
  for walk in range(12):
    sentence = tree_list[walk % len(tree_list)].words()[: 1 + walk % 6]
    source = tokenizer.encode(" ".join(sentence)) + [EOS_ID]
    # The tightest: a tag (and word) per word, EOS, and in order one phrase over them.
    limit = (2 if words else 1) * len(sentence) + 1 + 2 * in_order + walk % 4 * 3
    limit += (walk % 3 == 0) * 30
    prefix = []
    while not prefix or prefix[-1] != EOS_ID:
      args = _pad(prefix, N)[None], np.array([limit], np.int32), _pad(source, S)[None]
      legal = np.asarray(_legal_fn(constraint)(*args))[0]
      expected = reference_legal(tokens, prefix, source[:-1], closing, words, limit, order)
      assert set(np.flatnonzero(legal).tolist()) == expected, (walk, prefix)
      _assert_same_as_reference(constraint, rng, *args)
      choices = np.flatnonzero(legal)
      kind = rng.choice(sorted(set(kinds[choices])))
      if walk % 3 == 0:  # endless openings, as an untrained model (in order: unary chains)
        kind = next((k for k in (OPEN, CLOSE)[: 1 + in_order] if k in kinds[choices]), kind)
      prefix.append(int(rng.choice(choices[kinds[choices] == kind])))
      assert len(prefix) <= limit
    separator = (lambda k: k == TAG) if in_order else (lambda k: k != OPEN)
    runs = "".join(" " if separator(kinds[t]) else "o" if kinds[t] == OPEN else "" for t in prefix)
    runs = runs.split(" ")
    longest = max(len(r) for r in runs)
    assert longest <= 10 and (walk % 3 or longest == 10), (walk, longest)
    restored = trees.Linearization(closing, words, order).restore(
        tokenizer.decode(prefix).split(), sentence
    )
    assert restored.repairs == 0 and restored.tree.words() == sentence


@pytest.mark.parametrize("words", [False, True], ids=["tags", "words"])
def test_in_order_under_a_limit_too_tight_for_a_tree_writes_a_flat_forest(words):
  """In order, a phrase opens only over words already written: with room for the words' tokens
  and EOS alone, the output is the words side by side (one counted repair), never a dead end."""
  _, tokenizer, tokens, constraint = _setup("labeled", words, "in_order")
  sentence = ["Pierre", "Vinken", "will"]
  source = tokenizer.encode(" ".join(sentence)) + [EOS_ID]
  limit = (2 if words else 1) * len(sentence) + 1
  prefix = []
  while not prefix or prefix[-1] != EOS_ID:
    args = _pad(prefix, N)[None], np.array([limit], np.int32), _pad(source, S)[None]
    legal = np.asarray(_legal_fn(constraint)(*args))[0]
    expected = reference_legal(tokens, prefix, source[:-1], "labeled", words, limit, "in_order")
    assert set(np.flatnonzero(legal).tolist()) == expected, prefix
    prefix.append(int(np.flatnonzero(legal)[-1]))  # a tag, word or EOS: never an opening
    assert len(prefix) <= limit
  restored = trees.Linearization("labeled", words, "in_order").restore(
      tokenizer.decode(prefix).split(), sentence
  )
  assert restored.repairs == 1 and restored.tree.words() == sentence


@pytest.mark.slow  # 5-10 s on 2 cores: .ci/run runs it after the default suite
def test_renormalizes_over_the_legal_tokens():
  _, tokenizer, tokens, tree_constraint = _setup("labeled", True)
  source = _pad(tokenizer.encode("Pierre Vinken") + [EOS_ID], S)[None]
  logits = np.random.default_rng(0).normal(size=(1, len(tokens))) + 7.5
  log_probs = jax.nn.log_softmax(logits)
  constraint = functools.partial(
      _dense(tree_constraint), limit=np.array([N], np.int32), inputs=source
  )
  # The same answer for the logits as for their log-softmax: the search gives it the logits.
  for prefix in ("(S (NP", "(S (NP Pierre", ""):
    prefix = _pad(tokenizer.encode(prefix), N)[None]
    np.testing.assert_allclose(
        constraint(logits, prefix), constraint(log_probs, prefix), rtol=1e-5, atol=1e-5
    )
  config = TransformerConfig(vocab_size=len(tokens), d_model=8, num_heads=2, num_layers=1)
  assert tree_constraint.takes_logits
  assert decode.Predictor(config, 10, constraint=tree_constraint).decoder.normalize is False
  assert decode.Predictor(config, 10).decoder.normalize  # log-probs for the other searches
  # After "(S (NP": the word "Pierre" or a phrase opening, nothing else.
  out = np.asarray(constraint(log_probs, _pad(tokenizer.encode("(S (NP"), N)[None]))[0]
  legal = np.flatnonzero(out > -np.inf)
  opening = [i for i, t in enumerate(tokens) if token_kind(t) == OPEN]
  assert sorted(legal.tolist()) == sorted(opening + tokenizer.encode("Pierre"))
  # The forced word carries the model's probability of writing any word here.
  kept = np.asarray(log_probs)[0].copy()
  is_word = np.array([token_kind(t) == WORD for t in tokens])
  kept[is_word] = np.logaddexp.reduce(kept[is_word])
  kept = kept[legal]
  np.testing.assert_allclose(out[legal], kept - np.logaddexp.reduce(kept), rtol=1e-5)
  # After "(S (NP Pierre": any tag but the punctuation tags, and nothing else.
  out = np.asarray(constraint(log_probs, _pad(tokenizer.encode("(S (NP Pierre"), N)[None]))
  tags = [i for i, t in enumerate(tokens) if token_kind(t) == TAG and t not in ("(.)", "(,)")]
  assert np.flatnonzero(out[0] > -np.inf).tolist() == tags
  # Every word tagged: the innermost phrase's closing bracket is the one legal token, free.
  done = _pad(tokenizer.encode("(S (NP Pierre (NNP) Vinken (NNP)"), N)[None]
  out = np.asarray(constraint(log_probs, done))[0]
  assert np.flatnonzero(out > -np.inf).tolist() == tokenizer.encode(")NP")
  assert out[tokenizer.encode(")NP")[0]] == pytest.approx(0.0)


def test_punctuation_words_get_punctuation_tags_and_no_other_word_does():
  """EVALB deletes punctuation by each tree's tags: a `,` tagged NN, or a word tagged `.`, would
  make it skip the sentence."""
  _, tokenizer, tokens, constraint = _setup("labeled", False)
  source = _pad(tokenizer.encode("Pierre ? Vinken .") + [EOS_ID], S)[None]
  legal = functools.partial(_legal_fn(constraint), limit=np.array([N], np.int32), inputs=source)
  punctuation = {"(.)", "(,)", "(POS)"} & set(tokens)
  for prefix, words_before in [("(S (NP", 0), ("(S (NP (NNP)", 1), ("(S (NP (NNP) (.)", 2)]:
    allowed = np.flatnonzero(np.asarray(legal(_pad(tokenizer.encode(prefix), N)[None]))[0])
    tags = {tokens[i] for i in allowed if token_kind(tokens[i]) == TAG}
    if words_before == 1:  # the next word is "?"
      assert tags == punctuation
    else:
      assert tags and not tags & {"(.)", "(,)"} and "(NNP)" in tags


def test_a_prefix_with_no_legal_token_gets_minus_infinity_not_nan():
  """A beam's empty hypotheses (-inf) carry arbitrary tokens: e.g. a closing bracket first."""
  _, tokenizer, tokens, constraint = _setup("labeled", False)
  source = _pad(tokenizer.encode("Pierre") + [EOS_ID], S)[None]
  prefix = _pad(tokenizer.encode(")NP (NNP)"), N)[None]  # depth -1, no word left
  log_probs = np.zeros((1, len(tokens)), np.float32)
  limit = np.array([N], np.int32)
  assert np.all(np.asarray(_dense(constraint)(log_probs, prefix, limit, source)) == -np.inf)
  assert np.all(np.asarray(constraint.reference(log_probs, prefix, limit, source)) == -np.inf)


def test_log_probs_over_another_width_than_the_vocabulary_are_refused():
  """The constraint reads log-probabilities over the whole vocabulary, the decoder's: any other
  width is a ValueError naming both, in the fast form and the reference alike."""
  _, tokenizer, tokens, constraint = _setup("labeled", True)
  source = _pad(tokenizer.encode("Pierre") + [EOS_ID], S)[None]
  prefix = _pad(tokenizer.encode("(S"), N)[None]
  limit = np.array([N], np.int32)
  for width in (len(tokens) - 2, len(tokens) + 1):
    log_probs = np.zeros((1, width), np.float32)
    for call in (constraint, constraint.reference):
      with pytest.raises(ValueError, match=f"over {width} outputs.*vocabulary's {len(tokens)}"):
        call(log_probs, prefix, limit, source)


def test_the_config_switch_is_off_by_default_and_for_parsing_runs_only(tmp_path):
  config = config_lib.default_config("parsing")
  config.data.source, config.data.path = "ptb", str(tmp_path)
  assert config.parsing.tree_constraints is False
  assert tree_constraint.from_config(config, None) is None
  # A translation run has no parsing section, so no switch to turn on.
  assert "parsing" not in multi30k.get_config() and "tree_constraints" not in config.eval
  config.parsing.tree_constraints = True
  _, tokenizer, _, _ = _setup("bare", True)
  config.parsing.tree_closing, config.parsing.tree_words = "bare", True
  built = tree_constraint.from_config(config, tokenizer)
  tags = sum(t.startswith("(") and t.endswith(")") for t in tokenizer.words)
  assert built.words and not built.in_order and (built.kinds == TAG).sum() == tags
  config.parsing.tree_order = "in_order"
  assert tree_constraint.from_config(config, tokenizer).in_order
  config.parsing.tree_order = "bottom_up"
  with pytest.raises(config_lib.ConfigError, match="parsing.tree_order"):
    config_lib.validate(config)


def test_a_vocabulary_without_a_closing_token_is_an_error():
  with pytest.raises(ValueError, match=r"has '\(NP' but not its closing token '\)NP'"):
    TreeConstraint.for_vocabulary(list(RESERVED_TOKENS) + ["(NP", "(NN)", ")VP"], "labeled", False)


@pytest.mark.slow  # 10-60 s on 2 cores: .ci/run runs it after the default suite
@pytest.mark.parametrize(
    "words, beam_size, order",
    [(False, 1, "top_down"), (True, 3, "top_down"), (True, 3, "in_order")],
    ids=["tags-greedy", "words-beam", "words-beam-in-order"],
)
def test_searches_write_only_well_formed_trees_and_agree(words, beam_size, order):
  """A random (untrained) model: unconstrained, it writes anything; constrained, every output
  restores with no repair, over the input's words, and the fast search equals the reference."""
  tree_list, tokenizer, tokens, constraint = _setup("labeled", words, order)
  config = TransformerConfig(
      vocab_size=len(tokens), d_model=32, num_heads=4, num_layers=1, d_ff=64, max_len=64,
      deterministic=True,
  )  # fmt: skip
  params = random_params(config)
  sentences = [t.words()[:6] for t in tree_list] * 2
  inputs = np.stack([_pad(tokenizer.encode(" ".join(s)) + [EOS_ID], 8) for s in sentences])
  extra = 40
  # Two blocks of cache length (24, 48): the constraint reads each block's window of the prefixes.
  predictor = decode.Predictor(
      config, extra, beam_size, alpha=0.6, shapes=Shapes(block=24), constraint=constraint
  )
  outputs, _ = predictor.search(params, inputs)
  linearization = trees.Linearization("labeled", words, order)
  for sentence, out in zip(sentences, outputs):
    restored = linearization.restore(tokenizer.decode(out).split(), sentence)
    assert restored.repairs == 0 and restored.tree.words() == sentence
    if words:  # the word tokens are the input's, in order
      written = [t for t in out.tolist() if token_kind(tokens[t]) == WORD]
      assert written == tokenizer.encode(" ".join(sentence))
  unconstrained = decode.Predictor(config, extra, beam_size, alpha=0.6, shapes=Shapes(block=None))
  unconstrained = unconstrained.search(params, inputs)[0]
  assert (
      sum(
          linearization.restore(tokenizer.decode(o).split(), s).repairs > 0
          for s, o in zip(sentences, unconstrained)
      )
      > 0
  )  # the constraint is what makes them well formed
  n = outputs.shape[1]
  limit = search.output_limits(inputs, extra, n)
  decoder = predictor.decoder

  def reference(p, x):  # the best output of the reference search, [b, n]
    if beam_size == 1:
      return search.greedy_search(decoder, p, x, n, limit, constraint)[0]
    return search.beam_search(decoder, p, x, n, beam_size, 0.6, limit, constraint)[0][:, 0]

  expected = jax.jit(reference)(params, inputs)
  np.testing.assert_array_equal(outputs, expected)
