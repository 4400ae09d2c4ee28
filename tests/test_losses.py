"""Label-smoothed cross entropy (§5.4) and token accuracy against hand computations."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax.training import losses
from transformer_jax.training.losses import label_smoothed_cross_entropy, token_accuracy

V = 5  # vocabulary


def example(seed=0):
  rng = np.random.default_rng(seed)
  logits = rng.standard_normal((2, 3, V)).astype(np.float32)
  targets = np.array([[1, 4, 0], [2, 2, 3]])
  weights = np.array([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]], np.float32)  # [0, 2] is padding
  return logits, targets, weights


def hand_loss(logits, targets, weights, eps):
  """Σ over tokens of weight · (−Σ_v q_v log p_v − H(q)),
  q = 1−ε on the target, ε/(V−1) elsewhere."""
  total = nll_total = 0.0
  for b in range(logits.shape[0]):
    for t in range(logits.shape[1]):
      z = logits[b, t].astype(np.float64)
      log_p = z - np.log(np.sum(np.exp(z)))
      q = np.full(V, eps / (V - 1))
      q[targets[b, t]] = 1.0 - eps
      entropy = -sum(qv * np.log(qv) for qv in q if qv > 0)
      total += weights[b, t] * (-np.sum(q * log_p) - entropy)
      nll_total += weights[b, t] * -log_p[targets[b, t]]
  return total, nll_total


@pytest.mark.parametrize("eps", [0.1, 0.3])
def test_label_smoothed_cross_entropy_matches_hand_computation(eps):
  logits, targets, weights = example()
  loss, nll, weight = label_smoothed_cross_entropy(logits, targets, weights, eps)
  expected_loss, expected_nll = hand_loss(logits, targets, weights, eps)
  np.testing.assert_allclose(loss, expected_loss, rtol=1e-5)
  np.testing.assert_allclose(nll, expected_nll, rtol=1e-5)
  assert weight == 5.0


def test_zero_smoothing_is_plain_nll():
  logits, targets, weights = example(1)
  loss, nll, _ = label_smoothed_cross_entropy(logits, targets, weights, 0.0)
  _, expected_nll = hand_loss(logits, targets, weights, 0.0)
  np.testing.assert_allclose(loss, expected_nll, rtol=1e-5)
  np.testing.assert_allclose(nll, expected_nll, rtol=1e-5)


def test_padding_is_ignored():
  logits, targets, weights = example(2)
  changed = logits.copy()
  changed[0, 2] = 1e3 * np.arange(V)  # the padding position: any logits, any target
  before = label_smoothed_cross_entropy(logits, targets, weights, 0.1)
  after = label_smoothed_cross_entropy(changed, targets, weights, 0.1)
  np.testing.assert_allclose(after, before, rtol=1e-6)


def test_smoothed_target_prediction_has_zero_loss():
  """Subtracting H(q) puts the minimum at 0: predicting q exactly costs nothing."""
  eps = 0.1
  targets = np.array([[3]])
  q = np.full(V, eps / (V - 1))
  q[3] = 1.0 - eps
  loss, _, _ = label_smoothed_cross_entropy(
      np.log(q)[None, None].astype(np.float32), targets, np.ones((1, 1), np.float32), eps
  )
  np.testing.assert_allclose(loss, 0.0, atol=1e-6)


def test_token_accuracy_counts_non_pad_hits():
  logits = np.zeros((1, 4, V), np.float32)
  for t, predicted in enumerate([1, 2, 3, 4]):
    logits[0, t, predicted] = 1.0
  targets = np.array([[1, 0, 3, 4]])  # hits at 0, 2, 3; position 3 is padding
  weights = np.array([[1.0, 1.0, 1.0, 0.0]], np.float32)
  assert token_accuracy(logits, targets, weights) == 2.0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gradient_is_softmax_minus_smoothed_target(dtype):
  """d loss / d logits = weight · (softmax(logits) − q), the closed form of §5.4's smoothed cross
  entropy; checked in float32 and for bfloat16 logits (the mixed-precision path)."""
  import jax
  import jax.numpy as jnp

  eps = 0.1
  logits, targets, weights = example(3)
  logits = jnp.asarray(logits, dtype)
  grad = jax.grad(lambda z: label_smoothed_cross_entropy(z, targets, weights, eps)[0])(logits)
  assert grad.dtype == logits.dtype
  z = np.asarray(logits, np.float64)
  softmax = np.exp(z) / np.exp(z).sum(-1, keepdims=True)
  q = np.full(z.shape, eps / (V - 1))
  np.put_along_axis(q, targets[..., None], 1.0 - eps, axis=-1)
  expected = weights[..., None] * (softmax - q)
  tol = 1e-6 if dtype == "float32" else 1e-2
  np.testing.assert_allclose(np.asarray(grad, np.float64), expected, atol=tol)


@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_word_set_scores_a_word_target_as_any_word(eps):
  """train.word_loss="any": where the target is in the set, p_target is Σ_{w in set} p_w."""
  logits, targets, weights = example(1)
  word_set = np.array([False, False, True, True, True])  # ids 2, 3, 4 are words
  loss, nll, weight = label_smoothed_cross_entropy(logits, targets, weights, eps, word_set)
  expected_loss = expected_nll = 0.0
  for b in range(2):
    for t in range(3):
      log_p = logits[b, t].astype(np.float64) - np.log(np.sum(np.exp(logits[b, t])))
      target = targets[b, t]
      log_target = np.log(np.sum(np.exp(log_p[word_set]))) if word_set[target] else log_p[target]
      q = np.full(V, eps / (V - 1))
      q[target] = 1.0 - eps
      entropy = -sum(qv * np.log(qv) for qv in q if qv > 0)
      # −Σ_v q_v log p_v with log p_target replaced by the set's log-probability.
      cross = -(eps / (V - 1)) * (np.sum(log_p) - log_p[target]) - (1.0 - eps) * log_target
      expected_loss += weights[b, t] * (cross - entropy)
      expected_nll += weights[b, t] * -log_target
  np.testing.assert_allclose(loss, expected_loss, rtol=1e-5)
  np.testing.assert_allclose(nll, expected_nll, rtol=1e-5)
  assert float(weight) == 5.0
  # Word targets lose less than their exact-token loss; the others are unchanged.
  _, exact_nll, _ = label_smoothed_cross_entropy(logits, targets, weights, eps)
  assert float(nll) < float(exact_nll)


def test_token_accuracy_with_a_word_set_counts_any_word_at_a_word():
  logits = np.zeros((1, 3, V), np.float32)
  logits[0, 0, 3] = logits[0, 1, 1] = logits[0, 2, 4] = 5.0  # predicts 3, 1, 4
  targets = np.array([[4, 0, 4]])
  weights = np.ones((1, 3), np.float32)
  word_set = np.array([False, False, True, True, True])
  assert float(token_accuracy(logits, targets, weights)) == 1.0  # only position 2
  # Position 0: target word 4, predicted word 3: right; position 1: not a word target.
  assert float(token_accuracy(logits, targets, weights, word_set)) == 2.0


def test_output_targets_map_ids_to_the_models_outputs():
  """TransformerConfig.output_tokens N: ids below N are their own outputs, later ids and those
  of the set are output N; the loss over N + 1 outputs is then -log p of that output."""
  targets = jnp.array([[0, 1, 4, 5, 9, 3]])
  words = np.zeros(12, bool)
  words[[3, 5, 6, 7, 8, 9, 10, 11]] = True
  np.testing.assert_array_equal(losses.output_targets(targets, 5), [[0, 1, 4, 5, 5, 3]])
  np.testing.assert_array_equal(losses.output_targets(targets, 5, words), [[0, 1, 4, 5, 5, 5]])
  logits = jax.random.normal(jax.random.key(0), (1, 6, 6))
  mapped = losses.output_targets(targets, 5, words)
  weights = (targets != 0).astype(jnp.float32)
  _, nll, count = losses.label_smoothed_cross_entropy(logits, mapped, weights, 0.0)
  log_p = jax.nn.log_softmax(logits)
  expected = -sum(float(log_p[0, i, j]) for i, j in enumerate([0, 1, 4, 5, 5, 5]) if i)
  np.testing.assert_allclose(nll, expected, rtol=1e-5)
  assert float(count) == 5
