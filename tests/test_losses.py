"""Label-smoothed cross entropy (§5.4) and token accuracy against hand computations."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax.training.losses import (
    label_smoothed_cross_entropy,
    sequence_loss,
    token_accuracy,
)

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


def test_sequence_loss_is_the_smoothed_loss_of_the_batchs_non_pad_targets():
  """losses.sequence_loss (every task's default, tasks/base.py Task.loss): the label-smoothed sum
  over the targets that are not PAD, and its metric sums, from `batch["targets"]` alone."""
  logits, targets, _ = example()
  targets = np.asarray(targets).copy()
  targets[0, -2:] = 0  # PAD
  weights = (targets != 0).astype(np.float32)
  assert weights.sum() == 4
  loss_sum, metrics = sequence_loss(logits, {"targets": jnp.asarray(targets)}, 0.1)
  expected, _ = hand_loss(np.asarray(logits), targets, weights, 0.1)
  np.testing.assert_allclose(loss_sum, expected, rtol=1e-5)
  assert float(metrics["loss_sum"]) == float(loss_sum)
  assert float(metrics["weight_sum"]) == weights.sum()
  assert float(metrics["correct_sum"]) == float(
      token_accuracy(logits, jnp.asarray(targets), jnp.asarray(weights))
  )
