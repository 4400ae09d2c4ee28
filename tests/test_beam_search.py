"""Beam search (§6.1): the length penalty, EOS handling, early stopping, and the search itself
against exhaustive search, greedy search and the full forward pass of a tiny model."""

import functools
import itertools
import math

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from variants import MODELS, SLOW_VARIANTS

from transformer_jax.data.tokenizer import BOS_ID, EOS_ID, PAD_ID
from transformer_jax.decoding import batch_shapes, compilation, decode, search, top_k
from transformer_jax.decoding import decoder as decoder_lib
from transformer_jax.decoding.batch_shapes import Shapes
from transformer_jax.model.transformer import Transformer, TransformerConfig

A, B = 3, 4  # the two real tokens of the hand-made distributions (vocabulary of 5)


# ----------------------------------------------------------------------------- length penalty


def test_length_penalty_is_the_gnmt_formula():
  for length in (1, 2, 7, 50):
    for alpha in (0.0, 0.6, 1.0, 2.0):
      assert search.length_penalty(length, alpha) == pytest.approx(((5 + length) / 6) ** alpha)
  assert search.length_penalty(1, 0.6) == pytest.approx(1.0)  # lp(1) = 1 for any α
  assert search.length_penalty(9, 0.0) == 1.0  # α = 0: plain log-probability
  assert search.length_penalty(4, 0.6) == pytest.approx(1.5**0.6)
  lengths = jnp.arange(1, 10)  # arrays too, and lp grows with length for α > 0
  assert jnp.all(jnp.diff(search.length_penalty(lengths, 0.6)) > 0)


# ----------------------------------------------------------------------------- hand-made models


class TableModel:
  """Next-token distributions looked up by prefix, one table per sentence, as a step_fn.

  tables[i] maps a prefix (tuple of generated tokens) to {token: probability}; prefixes not listed
  use default[i]. The cache holds what each beam slot wrote at each position (the search's slot
  rows must follow their parents for the lookups to stay right), each row's sentence, and a
  scalar leaf shared by all rows.
  `poison_from`: steps at that position or later return log P(EOS) = +100, an impossible value
  that would win if such a step were ever taken.
  """

  vocab = 5

  def __init__(self, tables, default, max_len, poison_from=None):
    self.max_len = max_len
    self.poison_from = poison_from
    base = self.vocab + 1  # prefix code: sum_j (token_j + 1) * base^j, unique for every length
    log_probs = np.full((len(tables), base**max_len, self.vocab), -np.inf, np.float32)
    for s, (table, fallback) in enumerate(zip(tables, default)):
      log_probs[s] = self._dense(fallback)
      for prefix, dist in table.items():
        log_probs[s, self._code(prefix)] = self._dense(dist)
    self.table = jnp.asarray(log_probs)
    self.tables, self.default = tables, default

  def _dense(self, dist):
    assert sum(dist.values()) == pytest.approx(1.0)
    out = np.full(self.vocab, -np.inf, np.float32)
    for token, p in dist.items():
      out[token] = math.log(p)
    return out

  def _code(self, prefix):
    return sum((t + 1) * (self.vocab + 1) ** j for j, t in enumerate(prefix))

  def log_prob(self, sentence, tokens):
    """log P(Y) of a returned row (stops after EOS) from the tables, in float64."""
    total, prefix = 0.0, ()
    for t in tokens:
      dist = self.tables[sentence].get(prefix, self.default[sentence])
      total += math.log(dist[t]) if t in dist else -math.inf
      if t == EOS_ID:
        break
      prefix += (t,)
    return total, len(prefix) + (1 if EOS_ID in tokens else 0)

  def search(self, beam_size, alpha, stop="proven"):
    found = _search_table(self.table, alpha, self.max_len, beam_size, self.poison_from, stop)
    return tuple(map(np.asarray, found))


@functools.partial(jax.jit, static_argnames=("max_len", "beam_size", "poison_from", "stop"))
def _search_table(table, alpha, max_len, beam_size, poison_from, stop):
  """Beam search over TableModel's tables [sentences, codes, v]; alpha is traced (no recompile)."""
  batch, _, vocab = table.shape
  powers = (vocab + 1) ** jnp.arange(max_len)  # prefix code: sum_j (token_j + 1) * (v + 1)^j

  def step_fn(tokens, cache, position):
    # Like a decoding cache: each row writes its input token (chosen at position - 1) at
    # `position`, and the search makes each row follow its parent (the default `follow`
    # gathers the rows), so a row's tokens are its prefix: a wrong reordering would look up the
    # wrong prefixes.
    n = cache["written"].shape[1]
    written = cache["written"].at[:, position].set(tokens)  # [rows, n]: position q holds q - 1
    q = jnp.arange(n)
    code = jnp.sum((written[:, 1:] + 1) * jnp.where(q[1:] <= position, powers[:-1], 0), axis=-1)
    log_probs = table[cache["sentence"], code]  # [rows, v]
    if poison_from is not None:
      poisoned = log_probs.at[:, EOS_ID].set(100.0)
      log_probs = jnp.where(position >= poison_from, poisoned, log_probs)
    return log_probs, {
        "written": written,
        "sentence": cache["sentence"],
        "steps": cache["steps"] + 1,
    }

  cache = {
      "written": jnp.zeros((batch, max_len), jnp.int32),
      "sentence": jnp.arange(batch),
      "steps": jnp.array(0, jnp.int32),  # a scalar leaf: shared by all rows
  }
  first_log_probs = table[:, 0]  # the empty prefix
  tokens, scores, _ = search.beam_search_with_step_fn(
      step_fn, first_log_probs, cache, max_len, beam_size, alpha, stop=stop
  )
  return tokens, scores


def assert_scores_are_recomputed(model, tokens, scores, alpha):
  """Every returned hypothesis: score == log P(Y) / lp(|Y|), and nothing after its first EOS."""
  for s in range(tokens.shape[0]):
    for row, score in zip(tokens[s], scores[s]):
      if score == -np.inf:
        assert np.all(row == PAD_ID)
        continue
      eos = np.flatnonzero(row == EOS_ID)
      if eos.size:
        assert np.all(row[eos[0] + 1 :] == PAD_ID), row  # a finished hypothesis is never extended
      log_p, length = model.log_prob(s, row.tolist())
      assert score == pytest.approx(log_p / search.length_penalty(length, alpha), rel=1e-5)


# A short hypothesis "A EOS" with the higher probability and a long one "B B B EOS" with a lower
# probability but, per token, a better one: α decides which wins.
FLIP = {
    (): {A: 0.55, B: 0.45},
    (A,): {EOS_ID: 0.6, A: 0.2, B: 0.2},
    (B,): {B: 0.99, EOS_ID: 0.01},
    (B, B): {B: 0.99, EOS_ID: 0.01},
    (B, B, B): {EOS_ID: 0.6, A: 0.2, B: 0.2},
}
UNIFORMISH = {EOS_ID: 0.2, A: 0.4, B: 0.4}


@pytest.mark.parametrize("alpha", [0.0, 0.6, 1.0])
def test_length_penalty_decides_between_short_and_long(alpha):
  model = TableModel([FLIP], [UNIFORMISH], max_len=4)
  tokens, scores = model.search(beam_size=2, alpha=alpha)
  short = math.log(0.55 * 0.6) / search.length_penalty(2, alpha)
  long = math.log(0.45 * 0.99 * 0.99 * 0.6) / search.length_penalty(4, alpha)
  # By hand: α = 0: -1.109 vs -1.330; α = 0.6: -1.011 vs -1.043; α = 1: -0.950 vs -0.886.
  expected = [[A, EOS_ID, PAD_ID, PAD_ID], [B, B, B, EOS_ID]]
  if alpha == 1.0:
    assert long > short
    expected.reverse()
  else:
    assert short > long
  np.testing.assert_array_equal(tokens[0], expected)
  np.testing.assert_allclose(scores[0], sorted([short, long], reverse=True), rtol=1e-5)
  assert_scores_are_recomputed(model, tokens, scores, alpha)


def test_finished_hypotheses_are_never_extended():
  # EOS is the most likely first token. Were "EOS" extended, "EOS A EOS" (p = .7 * .9 * .6) would
  # be the runner-up; it must be "A EOS" (p = .3 * .6).
  model = TableModel(
      [{(): {EOS_ID: 0.7, A: 0.3}, (EOS_ID,): {A: 0.9, EOS_ID: 0.1}}],
      [{EOS_ID: 0.6, A: 0.4}],
      max_len=3,
  )
  tokens, scores = model.search(beam_size=2, alpha=0.6)
  np.testing.assert_array_equal(tokens[0, 0], [EOS_ID, PAD_ID, PAD_ID])
  assert scores[0, 0] == pytest.approx(math.log(0.7))
  np.testing.assert_array_equal(tokens[0, 1], [A, EOS_ID, PAD_ID])
  assert scores[0, 1] == pytest.approx(math.log(0.3 * 0.6) / search.length_penalty(2, 0.6))
  assert_scores_are_recomputed(model, tokens, scores, 0.6)


def test_unfinished_hypotheses_are_returned_only_when_nothing_finished():
  # Sentence 0 finishes; sentence 1 gives EOS too little probability to ever enter its beam.
  never_eos = {A: 0.7, B: 0.299, EOS_ID: 0.001}
  model = TableModel([FLIP, {(): {A: 0.6, B: 0.399, EOS_ID: 0.001}}], [UNIFORMISH, never_eos], 4)
  tokens, scores = model.search(beam_size=2, alpha=0.6)
  alone = TableModel([FLIP], [UNIFORMISH], 4).search(beam_size=2, alpha=0.6)
  np.testing.assert_array_equal(tokens[:1], alone[0])  # sentences do not affect each other
  np.testing.assert_allclose(scores[:1], alone[1], rtol=1e-6)
  assert not np.any(tokens[1] == EOS_ID)
  np.testing.assert_array_equal(tokens[1], [[A, A, A, A], [B, A, A, A]])
  # Alive hypotheses are scored as what they are: log P(prefix) / lp(n), no EOS.
  assert scores[1, 0] == pytest.approx(math.log(0.6 * 0.7**3) / search.length_penalty(4, 0.6))
  assert_scores_are_recomputed(model, tokens, scores, 0.6)


# After step 1 the beam (k = 2) holds two finished hypotheses, "EOS" and "A EOS"; the best alive
# one has log P = log .01, and even at the longest length -4.6 / lp(6) = -3.2 < -1.56 = the worst
# finished score, so the search must stop before step 2, which is poisoned.
STOPS = {
    (): {EOS_ID: 0.7, A: 0.2, B: 0.1},
    (A,): {EOS_ID: 0.9, A: 0.05, B: 0.05},
    (B,): {EOS_ID: 0.9, A: 0.05, B: 0.05},
}
# Same, but "A A" (log .12 / lp(6) = -1.47) can still beat "A EOS" (-2.30): the search goes on.
GOES_ON = {
    (): {EOS_ID: 0.7, A: 0.2, B: 0.1},
    (A,): {EOS_ID: 0.4, A: 0.6},
    (B,): {EOS_ID: 0.4, B: 0.6},
}


def test_search_stops_once_no_alive_hypothesis_can_win():
  model = TableModel([STOPS], [UNIFORMISH], max_len=6, poison_from=2)
  tokens, scores = model.search(beam_size=2, alpha=0.6)
  np.testing.assert_array_equal(tokens[0, :, :3], [[EOS_ID, PAD_ID, PAD_ID], [A, EOS_ID, PAD_ID]])
  np.testing.assert_allclose(
      scores[0], [math.log(0.7), math.log(0.18) / search.length_penalty(2, 0.6)], rtol=1e-5
  )
  # The poison check itself works: where the bound does not hold, step 2 runs and its +100 wins.
  _, poisoned = TableModel([GOES_ON], [UNIFORMISH], max_len=6, poison_from=2).search(2, 0.6)
  assert poisoned[0, 0] > 0


def test_k_finished_stops_once_k_hypotheses_have_finished():
  # eval.beam_stop="k_finished" (CTranslate2's and fairseq's rule). In GOES_ON the beam (k = 2)
  # has finished "EOS" at step 0 and "A EOS" at step 1: two, so it stops before the poisoned step
  # 2, where the proven rule goes on (above) because "A A" could still win.
  model = TableModel([GOES_ON], [UNIFORMISH], max_len=6, poison_from=2)
  tokens, scores = model.search(beam_size=2, alpha=0.6, stop="k_finished")
  np.testing.assert_array_equal(tokens[0, :, :3], [[EOS_ID, PAD_ID, PAD_ID], [A, EOS_ID, PAD_ID]])
  np.testing.assert_allclose(
      scores[0], [math.log(0.7), math.log(0.08) / search.length_penalty(2, 0.6)], rtol=1e-5
  )
  # With k = 3 the same two are not enough ("B EOS" ranks 4th at step 1): step 2 runs.
  _, poisoned = model.search(beam_size=3, alpha=0.6, stop="k_finished")
  assert poisoned[0, 0] > 0
  # Where the proven rule stops first (STOPS, k = 2, one finished at step 0), it still does.
  stops_first = TableModel([STOPS], [UNIFORMISH], max_len=6, poison_from=2)
  for stop in search.STOPS:
    tokens, _ = stops_first.search(beam_size=2, alpha=0.6, stop=stop)
    np.testing.assert_array_equal(tokens[0, 0, :2], [EOS_ID, PAD_ID])
  with pytest.raises(ValueError, match="stop='k_best'"):
    search.Beam(2, stop="k_best")


def test_beam_search_of_table_model_is_exhaustive_with_a_wide_beam():
  model = TableModel([GOES_ON, FLIP], [UNIFORMISH, {A: 0.5, B: 0.3, EOS_ID: 0.2}], max_len=4)
  # At the last step the 8 prefixes over {A, B} have 24 possible extensions: a beam of 40 keeps
  # them all, so every possible final (1 + 2 + 4 + 8 EOS endings) must be found, in order.
  tokens, scores = model.search(beam_size=40, alpha=0.6)
  for s in range(2):
    finals = []
    for length in range(1, 5):
      for body in itertools.product([A, B], repeat=length - 1):
        log_p, _ = model.log_prob(s, [*body, EOS_ID])
        if log_p > -math.inf:
          finals.append(log_p / search.length_penalty(length, 0.6))
    finals.sort(reverse=True)
    found = scores[s][scores[s] > -np.inf]
    np.testing.assert_allclose(found, finals, rtol=1e-5)
  assert_scores_are_recomputed(model, tokens, scores, 0.6)


def test_beam_size_one_differs_from_greedy_only_by_a_better_score():
  # Greedy: "A EOS" (EOS is the argmax after A). A single beam keeps "A A" alive beside it, and
  # with α = 1 "A A EOS" (log .235 / lp(3) = -1.086) beats "A EOS" (log .275 / lp(2) = -1.107).
  tables = {
      (): {A: 0.55, B: 0.45},
      (A,): {EOS_ID: 0.5, A: 0.45, B: 0.05},
      (A, A): {EOS_ID: 0.95, A: 0.05},
  }
  model = TableModel([tables], [UNIFORMISH], max_len=4)
  tokens, scores = model.search(beam_size=1, alpha=0.0)
  np.testing.assert_array_equal(tokens[0, 0], [A, EOS_ID, PAD_ID, PAD_ID])  # greedy's
  tokens, scores = model.search(beam_size=1, alpha=1.0)
  np.testing.assert_array_equal(tokens[0, 0], [A, A, EOS_ID, PAD_ID])
  greedy_score = math.log(0.55 * 0.5) / search.length_penalty(2, 1.0)
  assert scores[0, 0] == pytest.approx(math.log(0.55 * 0.45 * 0.95) / search.length_penalty(3, 1.0))
  assert scores[0, 0] > greedy_score


# ----------------------------------------------------------------------------- a tiny Transformer


VOCAB = 6  # PAD, EOS, BOS and three real tokens
CONFIG = TransformerConfig(
    vocab_size=VOCAB,
    d_model=32,
    num_heads=4,
    num_layers=1,
    d_ff=64,
    max_len=16,
    share_embeddings=False,
    deterministic=True,
)
EXTRA = 3  # sources of 5 tokens -> at most 8 output tokens
N = 8


@functools.cache
def tiny_model(name="stock"):
  """A random tiny Transformer (`name`: variants.MODELS's) that, like a trained one, never emits
  PAD, and 6 sources.

  A trained model gives PAD (never a target) ~zero probability; a random one does not, and a
  hypothesis containing PAD is scored differently by the cache (which attends to it) and by the
  full forward pass (which masks PAD keys). So: the last LayerNorm's bias is set to 1 and the
  output projection's columns are centred, which makes logit_v = (normalised y)·W_v + bias_v
  exactly, with bias_PAD = -1000 (and 0 for the others).
  """
  rng = np.random.default_rng(0)
  inputs = np.concatenate([rng.integers(3, VOCAB, (6, 4)), np.ones((6, 1), int)], 1)
  inputs = jnp.asarray(inputs, jnp.int32)  # [6, 5], each ends with EOS
  # The "rbg" PRNG compiles in a third of threefry's time on CPU; any random model will do.
  key = jax.random.key(2, impl="rbg")
  params = jax.jit(MODELS[name](CONFIG).init)(key, inputs, inputs)["params"]
  params = nn.unbox(params)
  bias = np.zeros(VOCAB, np.float32)
  bias[PAD_ID] = -1000.0
  last = f"layer_{CONFIG.decoder_layers - 1}"
  params["decoder"][last]["ffn_block"]["norm"]["bias"] = jnp.ones(CONFIG.d_model)
  kernel = params["output_projection"]["kernel"]  # [e, v]
  params["output_projection"]["kernel"] = (
      kernel - kernel.mean(0, keepdims=True) + jnp.asarray(bias) / CONFIG.d_model
  )
  return params, inputs


DECODERS = {name: decoder_lib.Decoder(model(CONFIG)) for name, model in MODELS.items()}
DECODER = DECODERS["stock"]
PREDICT_GREEDY = decode.Predictor(CONFIG, EXTRA)
PREDICT_BEAM = decode.Predictor(CONFIG, EXTRA, beam_size=4, alpha=0.6)


@functools.partial(jax.jit, static_argnames=("n", "beam_size", "best_only", "stop", "name"))
def reference_beam_search(
    params, inputs, n, beam_size, alpha, best_only=False, stop="proven", name="stock"
):
  """search.beam_search, compiled once per shape and beam size (α traced, as the Predictor's)."""
  return search.beam_search(
      DECODERS[name], params, inputs, n, beam_size, alpha, best_only=best_only, stop=stop
  )


def run_beam_search(params, inputs, n, beam_size, alpha, name="stock"):
  return reference_beam_search(params, inputs, n, beam_size, alpha, name=name)[:2]


@functools.partial(jax.jit, static_argnames=("n",))
def reference_greedy_search(params, inputs, n):
  return search.greedy_search(DECODER, params, inputs, n)


@functools.partial(jax.jit, static_argnames=("name",))
def _token_log_probs(params, inputs, decoder_inputs, targets, name="stock"):
  logits = MODELS[name](CONFIG).apply({"params": params}, inputs, decoder_inputs)  # [r, N, v]
  return jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1)[..., 0]


def full_forward_scores(params, inputs, tokens, alpha, name="stock"):
  """log P(Y) / lp(|Y|) of rows `tokens` [b, m, n] (n <= N) by a teacher-forced full forward pass.

  |Y| runs to the first EOS (included), or is n when there is none. Rows are padded to one shape
  [256, N] so that this compiles once (padding after position n does not change earlier logits).
  """
  batch, m, n = tokens.shape
  rows = batch * m
  assert rows <= 256 and n <= N
  targets = np.full((256, N), PAD_ID, np.int32)
  targets[:rows, :n] = tokens.reshape(rows, n)
  decoder_inputs = np.concatenate([np.full((256, 1), BOS_ID), targets[:, :-1]], axis=1)
  sources = np.zeros((256, inputs.shape[1]), np.int32)
  sources[:rows] = np.repeat(np.asarray(inputs), m, axis=0)
  token_lp = np.asarray(_token_log_probs(params, sources, decoder_inputs, targets, name))
  token_lp = token_lp[:rows, :n]
  flat = targets[:rows, :n]
  is_eos = flat == EOS_ID
  length = np.where(is_eos.any(1), is_eos.argmax(1) + 1, n)  # [b*m]
  log_p = np.sum(np.where(np.arange(n) < length[:, None], token_lp, 0.0), axis=1)
  return (log_p / search.length_penalty(length, alpha)).reshape(batch, m)


@pytest.mark.parametrize("name", SLOW_VARIANTS)
def test_beam_search_equals_exhaustive_search(name):
  # Every sequence of up to n = 4 tokens over {3, 4, 5} ending in EOS (searches never emit PAD or
  # BOS): 1 + 3 + 9 + 27 = 40, scored by the full forward pass. A beam of 320 holds, at the last
  # step, every extension of the 27 length-3 prefixes, so every EOS ending is ranked in the beam
  # and the search is exhaustive: its finished set must be exactly the 40, in order.
  params, inputs = tiny_model(name)
  inputs, n, alpha = inputs[:2], 4, 0.6
  tokens, scores = map(np.asarray, run_beam_search(params, inputs, n, 320, alpha, name))
  finals = [
      [*body, EOS_ID] + [PAD_ID] * (n - 1 - len(body))
      for length in range(1, n + 1)
      for body in itertools.product([3, 4, 5], repeat=length - 1)
  ]
  exhaustive = full_forward_scores(
      params, inputs, np.broadcast_to(np.array(finals), (2, len(finals), n)), alpha, name
  )  # [2, 40]
  for s in range(2):
    order = np.argsort(-exhaustive[s], kind="stable")
    np.testing.assert_allclose(scores[s, :40], exhaustive[s, order], atol=1e-5)
    assert {tuple(r) for r in tokens[s, :40]} == {tuple(r) for r in finals}
    assert np.all(scores[s, 40:] == -np.inf)  # nothing else can be finished
    np.testing.assert_array_equal(tokens[s, 0], finals[order[0]])  # the optimum


@pytest.mark.parametrize("name", SLOW_VARIANTS)
def test_scores_equal_the_full_forward_pass_and_sentences_are_independent(name):
  params, inputs = tiny_model(name)
  tokens, scores = map(np.asarray, run_beam_search(params, inputs, N, 4, 0.6, name))
  assert tokens.shape == (inputs.shape[0], 4, N) and scores.shape == (inputs.shape[0], 4)
  assert np.all(scores[:, :-1] >= scores[:, 1:])  # best first
  finite = scores > -np.inf
  recomputed = full_forward_scores(params, inputs, tokens, 0.6, name)
  np.testing.assert_allclose(scores[finite], recomputed[finite], atol=1e-5)
  # The best hypotheses here are finished ones; the fallback to alive hypotheses (no EOS by the
  # maximum length) is checked on hand-made distributions above.
  assert (tokens[:, 0] == EOS_ID).any(1).all()
  # Each sentence is searched on its own: reversing the batch reverses the results (a wrong
  # gather of the cache or of the hypotheses would mix sentences).
  reversed_tokens, reversed_scores = run_beam_search(params, inputs[::-1], N, 4, 0.6, name)
  np.testing.assert_array_equal(tokens, np.asarray(reversed_tokens)[::-1])
  np.testing.assert_allclose(scores, np.asarray(reversed_scores)[::-1], atol=1e-6)


@pytest.mark.slow  # two searches of a random model: .ci/run runs it after the default suite
def test_beam_size_one_is_greedy():
  # Exact for α = 0; for α > 0 see test_beam_size_one_differs_from_greedy_only_by_a_better_score.
  params, inputs = tiny_model()
  greedy = np.asarray(PREDICT_GREEDY(params, inputs))  # greedy_search, n = 5 + EXTRA = N
  tokens, _ = run_beam_search(params, inputs, N, 1, 0.0)
  np.testing.assert_array_equal(np.asarray(tokens)[:, 0], greedy)
  assert (greedy == EOS_ID).any(1).any() and not (greedy == EOS_ID).any(1).all()


def test_predictor_dispatches_on_beam_size():
  params, inputs = tiny_model()
  out = np.asarray(PREDICT_BEAM(params, inputs))
  np.testing.assert_array_equal(out, run_beam_search(params, inputs, N, 4, 0.6)[0][:, 0])
  assert out.shape == (inputs.shape[0], N)
  for row in out:  # same format as greedy: tokens, EOS, then PAD
    eos = np.flatnonzero(row == EOS_ID)
    if eos.size:
      assert np.all(row[eos[0] + 1 :] == PAD_ID)
  with compilation.CompileLog() as log:
    PREDICT_BEAM(params, inputs)
  assert log.programs == 0 and not log.traces  # one compilation per input shape, reused
  with pytest.raises(ValueError, match="beam_size"):
    decode.Predictor(CONFIG, EXTRA, beam_size=0)


def _alternating(log_probs, prefixes, limit, inputs):
  """A constraint over the whole vocabulary: tokens 3 and 5 (and EOS) after an even number of
  tokens, 4 (and EOS) after an odd one, renormalized."""
  del limit, inputs
  odd = (jnp.sum(prefixes != PAD_ID, axis=-1) % 2 == 1)[..., None]  # [...]
  token = jnp.arange(VOCAB)
  legal = (token == EOS_ID) | jnp.where(odd, token == 4, (token == 3) | (token == 5))
  kept = jnp.where(legal, log_probs, -jnp.inf)
  return jnp.where(legal, kept - jax.nn.logsumexp(kept, axis=-1, keepdims=True), -jnp.inf)


def _alternating_candidates(log_probs, prefixes, limit, inputs):
  """The same constraint answered as search.Candidates: a few ids each, in no particular order,
  one never legal (-inf), and given twice."""
  dense = _alternating(log_probs, prefixes, limit, inputs)
  ids = jnp.broadcast_to(jnp.array([5, EOS_ID, 2, 4, 3, 2], jnp.int32), dense.shape[:-1] + (6,))
  return search.Candidates(jnp.take_along_axis(dense, ids, axis=-1), ids)


@pytest.mark.slow  # ~10 s on 2 cores: .ci/run runs it after the default suite
def test_a_constraint_may_answer_with_a_few_candidates_and_the_searches_are_the_same():
  params, inputs = tiny_model()
  limit = jnp.full(inputs.shape[:1], N, jnp.int32)

  @functools.partial(jax.jit, static_argnames=("beam_size", "constraint"))
  def searched(params, inputs, beam_size, constraint):
    if beam_size == 1:
      return search.greedy_search(DECODER, params, inputs, N, limit, constraint)[0], None
    tokens, scores, _ = search.beam_search(
        DECODER, params, inputs, N, beam_size, 0.6, limit, constraint
    )
    return tokens, scores

  for beam_size in (1, 3):
    dense = searched(params, inputs, beam_size, _alternating)
    few = searched(params, inputs, beam_size, _alternating_candidates)
    np.testing.assert_array_equal(few[0], dense[0])
    if beam_size > 1:
      np.testing.assert_allclose(few[1], dense[1], rtol=1e-6)
    best = np.asarray(dense[0] if beam_size == 1 else dense[0][:, 0])
    for row in best:  # the constraint was obeyed: 3 or 5, then 4, ..., until EOS
      body = row[: np.argmax(row == EOS_ID)] if (row == EOS_ID).any() else row
      assert set(body[0::2]) <= {3, 5} and set(body[1::2]) <= {4}, row
  candidates = _alternating_candidates(jnp.zeros((2, VOCAB)), jnp.zeros((2, N), jnp.int32), 0, 0)
  np.testing.assert_array_equal(
      search.dense(candidates, VOCAB), _alternating(jnp.zeros((2, VOCAB)), jnp.zeros((2, N)), 0, 0)
  )


def blocks_by_hand(searcher, params, inputs, n, block, alpha):
  """The search run as Predictor runs it, block after block with the cache grown in between
  (no sentence dropped): the final state."""
  ends = batch_shapes.cache_block_ends(n, block)
  first_log_probs, beams, sentence = DECODER.start(params, inputs, ends[0])
  state = searcher.init(first_log_probs, jnp.full(inputs.shape[:1], n), n, alpha)
  if searcher.beam_size > 1:
    beams = DECODER.widen(beams, searcher.beam_size)
  model = search.Stepper(DECODER.step_fn(params, inputs, sentence), DECODER.follow)
  for end in ends:
    beams = DECODER.grow(beams, end)
    state, beams = search.run_steps(searcher, model, state, beams, alpha, end)
  return state


@pytest.mark.slow  # 10-60 s on 2 cores: .ci/run runs it after the default suite
def test_blocks_of_cache_length_change_nothing():
  # Decoding in blocks of cache length (here 3: caches of 3, 6 then 8 positions, grown between
  # while loops) gives the same hypotheses and scores as one cache of the whole length.
  params, inputs = tiny_model()
  whole = reference_beam_search(params, inputs, N, 4, 0.6)
  searcher = search.Beam(4)
  blocks = jax.jit(lambda p, x: blocks_by_hand(searcher, p, x, N, 3, 0.6))(params, inputs)
  assert batch_shapes.cache_block_ends(N, 3) == (3, 6, 8)
  tokens, scores = searcher.result(blocks, 0.6)
  np.testing.assert_array_equal(tokens, whole[0])
  np.testing.assert_allclose(scores, whole[1], atol=1e-6)
  assert int(blocks.step) == int(whole[2]) > 3  # the search ran into the second block
  predictor = decode.Predictor(CONFIG, EXTRA, 4, 0.6, Shapes(block=3), compact=False)
  got, steps = predictor.search(params, inputs)
  np.testing.assert_array_equal(got, whole[0][:, 0])
  # The Predictor returns the best hypothesis only, so a sentence is done once no alive one can
  # beat its best finished one (the k-best reference: its worst): the same best, sooner.
  best_only = search.Beam(4, best_only=True)
  early = jax.jit(lambda p, x: blocks_by_hand(best_only, p, x, N, 3, 0.6))(params, inputs)
  np.testing.assert_array_equal(best_only.best(early, 0.6), whole[0][:, 0])
  assert steps == int(early.step) < int(whole[2])
  greedy_whole = reference_greedy_search(params, inputs, N)
  greedy = search.Greedy()
  greedy_blocks = jax.jit(lambda p, x: blocks_by_hand(greedy, p, x, N, 3, 0.0))(params, inputs)
  np.testing.assert_array_equal(greedy_blocks.out, greedy_whole[0])
  assert int(greedy_blocks.step) == int(greedy_whole[1])
  got, steps = decode.Predictor(CONFIG, EXTRA, shapes=Shapes(block=3), compact=False).search(
      params, inputs
  )
  np.testing.assert_array_equal(got, greedy_whole[0])
  assert steps == int(greedy_whole[1])


class RecordingDecoder(decoder_lib.Decoder):
  """Records, for every decoding step traced, the rows decoded and the invariant cache."""

  def step(self, params, cache, encoded, inputs, tokens, position):
    flat = flax.traverse_util.flatten_dict(cache)
    cross = {k: v for k, v in flat.items() if v.invariant}
    log_probs, new_cache = super().step(params, cache, encoded, inputs, tokens, position)
    out = flax.traverse_util.flatten_dict(new_cache)
    self.calls.append((tokens.shape[0], cross, {k: out[k] for k in cross}))
    return log_probs, new_cache


def test_cross_attention_caches_are_never_tiled_or_reordered():
  params, inputs = tiny_model()
  decoder = RecordingDecoder(Transformer(CONFIG))
  object.__setattr__(decoder, "calls", [])
  batch, k = inputs.shape[0], 4
  beams = jax.jit(lambda p, x: search.beam_search(decoder, p, x, N, k, 0.6))
  tokens, _, _ = beams(params, inputs)  # traced once: the calls recorded are the traced steps
  first_rows, _, filled = decoder.calls[0]  # the step that read BOS and projected the encoder
  assert first_rows == batch and len(filled) == CONFIG.decoder_layers
  later = decoder.calls[1:]
  assert len(later) == 1  # the loop's step, traced once
  for rows, cross_in, cross_out in later:
    assert rows == batch * k  # the beams are decoded ...
    for key, value in cross_in.items():
      # ... against the one copy per sentence: batch b, the very arrays of the first step,
      # handed to every step unchanged (not carried through the loop, so never gathered).
      assert value.key.shape[0] == batch and value.key is filled[key].key, key
      assert cross_out[key].key is value.key
  # And the split keeps them out of the state that the search carries.
  carried, invariant = decoder_lib.split(DECODER.init_cache(inputs, N))
  assert all(n.invariant for n in flax.traverse_util.flatten_dict(invariant).values())
  assert not any(n.invariant for n in flax.traverse_util.flatten_dict(carried).values())
  expected = reference_beam_search(params, inputs, N, k, 0.6)
  np.testing.assert_array_equal(tokens, expected[0])


def test_alpha_is_an_argument_of_the_compiled_search():
  params, inputs = tiny_model()
  predictor = decode.Predictor(CONFIG, EXTRA, beam_size=4, alpha=0.6)
  with compilation.CompileLog() as log:
    for alpha in (0.0, 0.6, 2.0):
      got = np.asarray(predictor(params, inputs, alpha=alpha))
      np.testing.assert_array_equal(got, run_beam_search(params, inputs, N, 4, alpha)[0][:, 0])
  assert log.traces["_start_impl"] == 1  # three α, one search traced
  assert predictor.searches() == 1 and predictor.programs() == log.traces["_start_impl"] + (
      log.traces["_block_impl"]
  )
  with compilation.CompileLog() as log:
    predictor(params, inputs, beam_size=1)  # greedy: another program, same Predictor
  assert log.traces["_start_impl"] == 1 and predictor.searches() == 2
  greedy = predictor(params, inputs, beam_size=1)
  np.testing.assert_array_equal(greedy, PREDICT_GREEDY(params, inputs))


def assert_flat_top_k(got, candidates, count):
  """`got` (values, index) is exactly top_k over the flattened k*v, bit for bit, ties included."""
  batch = candidates.shape[0]
  want_values, want_index = jax.lax.top_k(candidates.reshape(batch, -1), count)
  values, index = (np.asarray(x) for x in got)
  np.testing.assert_array_equal(index, np.asarray(want_index))
  # The bits, so that -0.0 against +0.0 and one NaN against another also count.
  np.testing.assert_array_equal(values.view(np.int32), np.asarray(want_values).view(np.int32))


def tied_candidates(rng, batch, beam, vocab):
  """Few distinct values, each twice as rare as the one below it: many exact ties at every level,
  and chunks whose maxima differ (so the chunks kept are not in flat order). Some beams and one
  row all -inf (dead beams, a sentence whose beams all are), -inf sprinkled."""
  candidates = rng.geometric(0.5, (batch, beam, vocab)).astype(np.float32) - 30.0
  candidates[rng.random((batch, beam, vocab)) < 0.1] = -np.inf
  candidates[rng.random((batch, beam)) < 0.3] = -np.inf
  candidates[0] = -np.inf
  return candidates


# (batch, beam, vocab, count): the real shape (beam 4, 8k vocabulary); beam 1; a vocabulary that
# the chunk does not divide; count above v (more than a beam's worth, and pads past each beam's
# end could be reached); tiny shapes that take the flat top_k.
TOP_K_SHAPES = [
    (32, 4, 8000, 8),
    (16, 1, 5003, 2),
    (8, 4, 1000, 8),
    (8, 64, 70, 100),
    (3, 4, 50, 8),
    (4, 2, 2, 4),
    (4, 3, 7, 21),
]


@pytest.mark.parametrize("batch,beam,vocab,count", TOP_K_SHAPES)
def test_top_extensions_is_the_flat_top_k_ties_included(batch, beam, vocab, count):
  rng = np.random.default_rng(vocab)
  top_extensions = jax.jit(top_k.top_extensions, static_argnums=1)
  ties = tied_candidates(rng, batch, beam, vocab)
  assert_flat_top_k(top_extensions(jnp.asarray(ties), count), ties, count)
  # Distinct realistic values: log-probabilities plus each beam's own score.
  logits = rng.normal(0.0, 3.0, (batch, beam, vocab)).astype(np.float32)
  scores = jax.nn.log_softmax(jnp.asarray(logits)) - rng.exponential(5.0, (batch, beam, 1))
  assert_flat_top_k(top_extensions(scores.astype(jnp.float32), count), scores, count)


def test_top_of_chunks_is_the_flat_top_k_for_every_chunk_size():
  # The chunked path itself (no fallback can hide a mistake): chunks that divide v and that do
  # not, a single chunk per beam, chunk 1.
  rng = np.random.default_rng(0)
  for batch, beam, vocab, count in TOP_K_SHAPES:
    ties = tied_candidates(rng, batch, beam, vocab)
    for chunk in {1, 3, 8, 64, 100, vocab}:
      if chunk > vocab or beam * -(-vocab // chunk) < count:
        continue
      got = top_of_chunks(jnp.asarray(ties), count, chunk)
      assert_flat_top_k(got, ties, count)


@functools.partial(jax.jit, static_argnums=(1, 2))
def top_of_chunks(candidates, count, chunk):
  return top_k.top_of_chunks(candidates, top_k.chunk_maxima(candidates, chunk), count, chunk)


@pytest.mark.parametrize("branch", [True, False])  # NaN by a lax.cond (the CPU's) or row by row
@pytest.mark.parametrize("vocab", [50, 128])  # no chunk divides 50; 128: chunks of 64
def test_argmax_is_jnp_argmax_ties_infinities_and_nans_included(vocab, branch):
  argmax = jax.jit(functools.partial(top_k.argmax, branch=branch))
  assert top_k.argmax_chunk(vocab) == (0 if vocab == 50 else 64)
  rng = np.random.default_rng(3)
  x = rng.integers(-3, 3, (14, vocab)).astype(np.float32)  # many tied maxima per row
  x[1] = -np.inf  # every token masked: token 0, as jnp.argmax
  x[2, 7] = np.inf
  x[6, :] = -0.0
  x[6, 9] = 0.0  # -0.0 == +0.0: the first of them, as argmax
  x[7] = rng.normal(size=vocab)  # distinct values
  x[8] = -np.inf
  x[8, [vocab - 3, vocab - 1]] = 5.0  # the maximum in the last chunk only, tied there
  x[9, [3, vocab - 2]] = 9.0  # tied across the first and the last chunk: the first
  x = np.concatenate([x, rng.normal(size=(12, vocab)).astype(np.float32)])
  want = np.asarray(jnp.argmax(jnp.asarray(x), axis=-1))
  got = np.asarray(argmax(jnp.asarray(x)))
  assert got.dtype == np.int32
  np.testing.assert_array_equal(got, want)
  # NaN: the row's first NaN, as jnp.argmax; the other rows of the batch as before.
  x[3, 40] = np.nan  # after the row's first maximum: still the NaN
  x[4, [2, 30]] = np.nan  # the first NaN
  x[5] = np.nan
  x[10, vocab - 5] = np.nan  # in the last chunk, after the row's maxima
  want = np.asarray(jnp.argmax(jnp.asarray(x), axis=-1))
  np.testing.assert_array_equal(argmax(jnp.asarray(x)), want)
  both = np.stack([x[[1, 2]], x[[0, 7]]])  # +inf beside -inf in a batch: no NaN for it
  np.testing.assert_array_equal(argmax(jnp.asarray(both)), np.argmax(both, axis=-1))


@pytest.mark.parametrize("branch", [None, False])  # None: the backend's (the CPU: a branch)
def test_argmax_of_a_large_vocabulary_with_leading_axes(branch):
  argmax = functools.partial(top_k.argmax, branch=branch)
  rng = np.random.default_rng(4)
  big = rng.normal(size=(3, 5, 8000)).astype(np.float32)  # chunks of 64
  big[1, 2, 7999] = 9.0  # the last token
  big[2, 0, [100, 6000]] = 9.0  # a tie across chunks: the first
  big[0, 3, 4000] = np.nan
  np.testing.assert_array_equal(argmax(jnp.asarray(big)), np.argmax(big, axis=-1))
  odd = rng.normal(size=(4, 8001)).astype(np.float32)  # no chunk divides 8001
  assert top_k.argmax_chunk(8001) == 0
  np.testing.assert_array_equal(argmax(jnp.asarray(odd)), np.argmax(odd, axis=-1))


def test_top_extensions_takes_the_chunked_path_where_it_pays():
  assert top_k.chunk_size(4, 8000, 8) == 64  # beam 4, 8k vocabulary: 500 chunks, 512 kept
  assert top_k.chunk_size(4, 32000, 8) == 128
  assert top_k.chunk_size(1, 8000, 2) == 64
  assert top_k.chunk_size(4, 50, 8) == 0  # tiny: the flat top_k
  assert top_k.chunk_size(1000, 10, 8) == 0  # a chunk would be longer than a beam


def test_top_extensions_is_exact_with_zeros_and_nans():
  # top_k orders -0.0 < +0.0, puts NaN first and -NaN last; a float max may return -0.0 for a
  # chunk holding +0.0 and skips NaN. Such batches must still give the flat top_k.
  rng = np.random.default_rng(1)
  candidates = -rng.integers(1, 5, (8, 4, 8000)).astype(np.float32)
  zeros = candidates.copy()
  zeros[1, 0, 0:512:64] = -0.0  # -0.0 in each of the first 8 chunks of 64
  zeros[1, 0, 640:642] = [0.0, -0.0]  # the chunk's float max comes back as -0.0 here
  zeros[2, 3, 5] = 0.0
  positive_nan = candidates.copy()
  positive_nan[3, 1, 4321] = np.nan  # ranks first, in a chunk whose float max is -1
  negative_nan = candidates.copy()
  negative_nan[4] = -np.inf
  negative_nan[4, 0, 3] = -np.float32(np.nan)  # ranks after every -inf
  for case in (zeros, positive_nan, negative_nan):
    assert_flat_top_k(top_k.top_extensions(jnp.asarray(case), 8), case, 8)


def _random_sources() -> np.ndarray:
  """16 sources of 4 random tokens + EOS [16, 5]."""
  inputs = np.random.default_rng(7).integers(3, VOCAB, size=(16, 5)).astype(np.int32)
  inputs[:, -1] = EOS_ID
  return inputs


@pytest.mark.slow  # 10-60 s on 2 cores: .ci/run runs it after the default suite
def test_finished_sentences_leave_the_batch_and_keep_their_translations():
  # A Predictor that halves its batch as soon as half of it is done (blocks of 4 cache
  # positions, down to 1 row) returns exactly the whole-batch search's translations, and it
  # decodes fewer sentence-steps than rows x steps: the finished sentences did leave.
  params, _ = tiny_model()
  inputs, extra = _random_sources(), 11
  n = inputs.shape[1] + extra
  # One Predictor per beam size and batching rule: α is an argument of its programs.
  compact = {
      k: decode.Predictor(CONFIG, extra, k, shapes=Shapes(block=4, min_rows=1)) for k in (1, 4)
  }
  whole = {
      k: decode.Predictor(CONFIG, extra, k, shapes=Shapes(block=4), compact=False) for k in (1, 4)
  }
  for beam, alpha in ((1, 0.6), (4, 0.0), (4, 0.6), (4, -0.5)):
    if beam == 1:
      expected, steps = reference_greedy_search(params, jnp.asarray(inputs), n)
    else:  # the Predictor's rule (best only: the same best, in fewer steps)
      tokens, _, steps = reference_beam_search(
          params, jnp.asarray(inputs), n, beam, alpha, best_only=True
      )
      expected = tokens[:, 0]
      k_best = reference_beam_search(params, jnp.asarray(inputs), n, beam, alpha)
      np.testing.assert_array_equal(expected, k_best[0][:, 0])
      assert int(steps) <= int(k_best[2])
    predictor = compact[beam]
    stats = {}
    got, got_steps = predictor.search(params, jnp.asarray(inputs), alpha, stats=stats)
    np.testing.assert_array_equal(got, np.asarray(expected), err_msg=f"beam {beam}, α {alpha}")
    assert got_steps == int(steps)
    if alpha >= 0:  # (α < 0 favours short outputs: here every sentence is done at step 3)
      assert stats["row_steps"] < inputs.shape[0] * got_steps, (beam, alpha, stats, got_steps)
    # Host (numpy) inputs too.
    np.testing.assert_array_equal(predictor(params, inputs, alpha), got)
    stats_whole = {}
    np.testing.assert_array_equal(
        whole[beam].search(params, jnp.asarray(inputs), alpha, stats=stats_whole)[0], got
    )
    assert stats_whole["row_steps"] == inputs.shape[0] * got_steps


@pytest.mark.slow  # ~20 s on 2 cores: .ci/run runs it after the default suite
def test_predictor_stops_as_the_reference_with_either_rule():
  # The Predictor (finished sentences leave the batch) returns the reference search's best under
  # either stop rule. On this random model "k_finished" stops sooner than "proven" at α = 1 with
  # the same translations, and at α = 2 (long outputs favoured) some translations differ.
  params, _ = tiny_model()
  inputs, extra = _random_sources(), 11
  n = inputs.shape[1] + extra
  predictors = {
      stop: decode.Predictor(CONFIG, extra, 4, shapes=Shapes(block=4, min_rows=1), stop=stop)
      for stop in search.STOPS
  }
  for alpha in (0.6, 1.0, 2.0):
    found = {}
    for stop, predictor in predictors.items():
      tokens, _, steps = reference_beam_search(
          params, jnp.asarray(inputs), n, 4, alpha, best_only=True, stop=stop
      )
      got, got_steps = predictor.search(params, jnp.asarray(inputs), alpha)
      np.testing.assert_array_equal(got, np.asarray(tokens[:, 0]), err_msg=f"{stop}, α {alpha}")
      assert got_steps == int(steps)
      found[stop] = got, got_steps
    differ = np.any(found["k_finished"][0] != found["proven"][0], axis=1).sum()
    assert (found["k_finished"][1] < found["proven"][1]) == (alpha == 1.0), alpha
    assert (differ > 0) == (alpha == 2.0), (alpha, differ)
  with pytest.raises(ValueError, match="stop='first'"):
    decode.Predictor(CONFIG, extra, 4, stop="first")


@pytest.mark.slow  # 10-60 s on 2 cores: .ci/run runs it after the default suite
def test_a_sentence_translates_the_same_alone_and_in_any_batch():
  # Each sentence's output limit is its own length + extra. A random model rarely emits EOS, so
  # most sentences here run to that limit: a short one batched with long ones must stop at its
  # own, not at the batch's padded length + extra.
  params, _ = tiny_model()
  rng = np.random.default_rng(11)
  lengths = [1, 2, 7, 3, 11, 5, 2, 9]
  sources = [rng.integers(3, VOCAB, n).tolist() + [EOS_ID] for n in lengths]
  extra = 2

  def batch(sentences, width):
    """[8, width]: the sentences, then copies of the first (as translation batches fill)."""
    inputs = np.full((8, width), PAD_ID, np.int32)
    for row, ids in enumerate(sentences + [sentences[0]] * (8 - len(sentences))):
      inputs[row, : len(ids)] = ids
    return inputs

  short = [i for i, n in enumerate(lengths) if n < 3]
  for beam in (1, 3):
    predictor = decode.Predictor(CONFIG, extra, beam, 0.6, Shapes(block=None), compact=False)
    alone = [predictor(params, batch([ids], 12))[0] for ids in sources]
    # Any batch: another order, and the short sentences alone in a batch padded to 3 tokens.
    for order, width in ((list(range(8)), 12), (list(rng.permutation(8)), 12), (short, 3)):
      together = predictor(params, batch([sources[i] for i in order], width))
      for row, i in enumerate(order):
        want = alone[i][: together.shape[1]]
        assert np.all(alone[i][together.shape[1] :] == PAD_ID)
        np.testing.assert_array_equal(together[row], want, err_msg=f"beam {beam}, sentence {i}")
    limited = [i for i, out in enumerate(alone) if EOS_ID not in out]
    assert limited, "pick sources that run to their limit"
    for i in limited:  # exactly its own limit, shorter than the batch's
      assert np.sum(alone[i] != PAD_ID) == len(sources[i]) + extra < 12 + extra


def _uneven_batch(rows: int = 16) -> np.ndarray:
  """Sources of 1-5 tokens + EOS: with EXTRA 9 their limits are 11-15 tokens, so the sentences
  finish at different steps and a compacting search shrinks the batch."""
  rng = np.random.default_rng(5)
  inputs = np.full((rows, 6), PAD_ID, np.int32)
  for row, n in enumerate(rng.integers(1, 6, rows)):
    inputs[row, :n] = rng.integers(3, VOCAB, n)
    inputs[row, n] = EOS_ID
  return inputs


@pytest.mark.slow  # ~10 s on 2 cores: .ci/run runs it after the default suite
def test_shape_policies_give_the_same_translations_from_fewer_programs():
  # batch_shapes.SHAPES (eval.shapes, translate --shapes) choose only which batch shapes are
  # compiled: "few" (no smaller batch under 32 rows here) compiles fewer programs than "fast"
  # (which halves the batch of 16 once 8 are done) and returns exactly its translations.
  params, _ = tiny_model()
  inputs = _uneven_batch()
  for beam in (1, 4):
    out, programs = {}, {}
    for name in batch_shapes.SHAPES:
      predictor = decode.Predictor(CONFIG, 9, beam, 0.6, shapes=name)
      out[name] = predictor(params, inputs)
      programs[name] = predictor.programs()
    np.testing.assert_array_equal(out["few"], out["fast"], err_msg=f"beam {beam}")
    assert programs["few"] < programs["fast"], (beam, programs)


@pytest.mark.slow  # ~6 s on 2 cores: .ci/run runs it after the default suite
def test_auto_shapes_take_few_for_small_calls_then_fast_from_the_first_large_one(monkeypatch):
  monkeypatch.setattr(batch_shapes, "AUTO_FEW_BELOW", 20)
  params, _ = tiny_model()
  inputs = _uneven_batch()
  programs, want = {}, None
  for name in batch_shapes.SHAPES:
    predictor = decode.Predictor(CONFIG, 9, 4, 0.6, shapes=name)
    want = predictor(params, inputs)
    programs[name] = predictor.signatures
  assert programs["few"] != programs["fast"]
  auto = decode.Predictor(CONFIG, 9, 4, 0.6, shapes="auto")

  def call(sentences):
    auto.signatures.clear()
    out, _ = auto.search(params, inputs, sentences=sentences)
    np.testing.assert_array_equal(out, want, err_msg=f"a call of {sentences}")  # fast's = few's
    return auto.signatures

  assert call(None) == programs["few"]  # sentences: the batch's 16 rows, fewer than 20
  assert call(19) == programs["few"]
  assert call(20) == programs["fast"]
  assert call(5) == programs["fast"]  # fast's programs are compiled now: it keeps them
  with pytest.raises(ValueError, match="shapes='fastest'"):
    decode.Predictor(CONFIG, 9, shapes="fastest")


def test_smaller_batches_shrink_down_to_min_rows_in_device_multiples():
  shapes = Shapes(shrink=2, min_rows=8)
  assert shapes.smaller(128, 100, 1) == 128  # more than half still decoding
  assert shapes.smaller(128, 64, 1) == 64
  assert shapes.smaller(128, 17, 1) == 32
  assert shapes.smaller(128, 3, 1) == 8  # not below min_rows
  assert shapes.smaller(85, 20, 1) == 22  # ceil(85 / 4)
  assert shapes.smaller(85, 20, 8) == 24  # rounded up to the devices' multiple
  assert shapes.smaller(8, 1, 8) == 8
  few = batch_shapes.SHAPES["few"]  # by 4 at once, not below 32
  assert few.smaller(128, 100, 1) == 128 and few.smaller(128, 31, 1) == 32
  assert few.smaller(128, 33, 1) == 128 and few.smaller(64, 3, 1) == 64
