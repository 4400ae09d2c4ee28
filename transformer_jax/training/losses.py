"""Label-smoothed cross entropy (§5.4) and token accuracy, as (sum, weight) pairs.

Returning sums rather than means lets the caller normalise once over the whole global batch (or
over all micro-batches of a gradient-accumulation step), so the result does not depend on how the
batch was split.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from transformer_jax.model.config import PAD_ID


def label_smoothed_cross_entropy(
    logits: jax.Array,  # [b, t, v]
    targets: jax.Array,  # [b, t] int
    weights: jax.Array,  # [b, t] float, 0 at padding
    label_smoothing: float,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Returns (smoothed_loss_sum, nll_sum, weight_sum).

  The smoothed target puts 1 - ε on the true token and spreads ε uniformly over the other V - 1
  tokens (tensor2tensor's form of §5.4's ε_ls = 0.1). The constant entropy of that distribution is
  subtracted, so a perfect prediction of the smoothed target has loss 0 and the loss stays
  comparable across ε. `nll_sum` is the plain negative log-likelihood, for perplexity.
  """
  vocab_size = logits.shape[-1]
  logits = logits.astype(jnp.float32)
  # log p_v = logits_v - logsumexp(logits). Written with reductions over the vocabulary alone,
  # never materialising log p (or a one-hot target) as a [b, t, v] array: XLA fuses the float32
  # cast into each reduction, and the backward pass is one elementwise softmax-minus-target.
  # (A gather of the target's log p would backpropagate as a scatter into a [b, t, v] array of
  # zeros; at the big model's 32k tokens x 37k vocabulary that is ~5 GB written per step.)
  log_z = jax.nn.logsumexp(logits, axis=-1)  # [b, t]
  is_target = jnp.arange(vocab_size) == targets[..., None]  # [b, t, v] bool, fused, not stored
  target_logit = jnp.sum(jnp.where(is_target, logits, 0.0), axis=-1)  # [b, t]
  nll = log_z - target_logit  # -log p_target
  if label_smoothing > 0.0:
    confidence = 1.0 - label_smoothing
    low = label_smoothing / (vocab_size - 1)
    # Cross entropy against q = low everywhere + (confidence - low) on the target:
    #   -Σ_v q_v log p_v = -low Σ_v log p_v - (confidence - low) log p_target,
    # with Σ_v log p_v = Σ_v logits_v - V logsumexp(logits).
    sum_log_probs = jnp.sum(logits, axis=-1) - vocab_size * log_z
    smoothed = -low * sum_log_probs + (confidence - low) * nll
    # Entropy of q, its minimum over p: makes the optimum 0.
    normalizer = -(confidence * jnp.log(confidence) + (vocab_size - 1) * low * jnp.log(low + 1e-20))
    smoothed = smoothed - normalizer
  else:
    smoothed = nll
  return jnp.sum(smoothed * weights), jnp.sum(nll * weights), jnp.sum(weights)


def token_accuracy(logits: jax.Array, targets: jax.Array, weights: jax.Array) -> jax.Array:
  """Number of correctly predicted (non-pad) tokens; divide by the weight sum for accuracy."""
  correct = jnp.argmax(logits, axis=-1) == targets
  return jnp.sum(correct * weights)


def sequence_loss(logits: jax.Array, batch: dict, label_smoothing: float) -> tuple[jax.Array, dict]:
  """The paper's loss of a decoder's logits [b, t, v] against `batch["targets"]` [b, t] (PAD
  positions weigh 0): (label-smoothed loss sum, its metric sums), the default of every task
  (tasks/base.py `Task.loss`)."""
  targets = batch["targets"]
  weights = (targets != PAD_ID).astype(jnp.float32)  # [b, t]
  loss_sum, nll_sum, weight_sum = label_smoothed_cross_entropy(
      logits, targets, weights, label_smoothing
  )
  metrics = {
      "loss_sum": loss_sum,
      "nll_sum": nll_sum,
      "correct_sum": token_accuracy(logits, targets, weights),
      "weight_sum": weight_sum,
  }
  return loss_sum, metrics
