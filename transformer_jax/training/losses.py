"""Label-smoothed cross entropy (§5.4) and token accuracy, as (sum, weight) pairs.

Returning sums rather than means lets the caller normalise once over the whole global batch (or
over all micro-batches of a gradient-accumulation step), so the result does not depend on how the
batch was split.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def label_smoothed_cross_entropy(
    logits: jax.Array,  # [b, t, v]
    targets: jax.Array,  # [b, t] int
    weights: jax.Array,  # [b, t] float, 0 at padding
    label_smoothing: float,
    interchangeable: jax.Array | None = None,  # [v] bool
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Returns (smoothed_loss_sum, nll_sum, weight_sum).

  The smoothed target puts 1 - ε on the true token and spreads ε uniformly over the other V - 1
  tokens (tensor2tensor's form of §5.4's ε_ls = 0.1). The constant entropy of that distribution is
  subtracted, so a perfect prediction of the smoothed target has loss 0 and the loss stays
  comparable across ε. `nll_sum` is the plain negative log-likelihood, for perplexity.

  `interchangeable` (a task's loss variant, a deviation from the paper; tasks/base.py): where the
  target is in the set, its probability is the set's, Σ_{w in set} p_w — the model is taught
  *that* a token of the set comes, not which (a search constraint dictates which).
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
  if interchangeable is not None:  # a target in the set: its probability is the set's
    interchangeable = jnp.asarray(interchangeable)
    token_nll = nll  # -log p of the target token itself, for the smoothing below
    set_logit = jax.nn.logsumexp(jnp.where(interchangeable, logits, -jnp.inf), axis=-1)  # [b, t]
    nll = jnp.where(interchangeable[targets], log_z - set_logit, nll)
  if label_smoothing > 0.0:
    confidence = 1.0 - label_smoothing
    low = label_smoothing / (vocab_size - 1)
    # Cross entropy against q = low everywhere + (confidence - low) on the target:
    #   -Σ_v q_v log p_v = -low Σ_v log p_v - (confidence - low) log p_target,
    # with Σ_v log p_v = Σ_v logits_v - V logsumexp(logits).
    sum_log_probs = jnp.sum(logits, axis=-1) - vocab_size * log_z
    if interchangeable is None:
      smoothed = -low * sum_log_probs + (confidence - low) * nll
    else:  # 1 - ε on the target (its set), ε/(V-1) on each other token
      smoothed = -low * (sum_log_probs + token_nll) + confidence * nll
    # Entropy of q, its minimum over p: makes the optimum 0.
    normalizer = -(confidence * jnp.log(confidence) + (vocab_size - 1) * low * jnp.log(low + 1e-20))
    smoothed = smoothed - normalizer
  else:
    smoothed = nll
  return jnp.sum(smoothed * weights), jnp.sum(nll * weights), jnp.sum(weights)


def output_targets(
    targets: jax.Array, output_tokens: int, interchangeable: jax.Array | None = None
) -> jax.Array:
  """Target ids [b, t] -> the model's outputs (model/config.py, `output_tokens` N): an id below N
  is its own output, unless in `interchangeable` ([v] bool); every other id is output N."""
  other = targets >= output_tokens
  if interchangeable is not None:
    other |= jnp.asarray(interchangeable)[targets]
  return jnp.where(other, output_tokens, targets)


def token_accuracy(
    logits: jax.Array,
    targets: jax.Array,
    weights: jax.Array,
    interchangeable: jax.Array | None = None,
) -> jax.Array:
  """Number of correctly predicted (non-pad) tokens; divide by the weight sum for accuracy.
  With `interchangeable` [v] bool, any token of the set is right where the target is in it."""
  predicted = jnp.argmax(logits, axis=-1)
  correct = predicted == targets
  if interchangeable is not None:
    interchangeable = jnp.asarray(interchangeable)
    correct = correct | (interchangeable[targets] & interchangeable[predicted])
  return jnp.sum(correct * weights)


# A span chart's targets (model/transformer.py SpanChart; a task's deviation, tasks/base.py
# Task.chart_model): [b, t, CHART_COLUMNS] int, one row per source token (PAD/EOS rows: none):
#   0  its tag's class + CHART_TAG_OFFSET (batching reads column 0 as a token: never PAD/EOS/BOS)
#   1  the label of the span of this token alone (0: none)
#   2  the label of the span whose first part ends at this token (0: none); in a tree each
#      token ends the first part of at most one span of two or more parts
#   3  that span's first token; 4 its last token
CHART_COLUMNS = 5
CHART_TAG_OFFSET = 3


def chart_gold(targets: jax.Array, length: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Chart targets [b, t, 5] -> (span labels [b, length, length], tags [b, t], token mask [b, t]):
  spans[:, i, j] the label of the span of tokens i..j, 0 where none is given."""
  b, t, _ = targets.shape
  valid = targets[..., 0] >= CHART_TAG_OFFSET  # [b, t]
  rows = jnp.arange(b)[:, None]  # [b, 1]
  tokens = jnp.arange(t)[None, :]  # [1, t]
  spans = jnp.zeros((b, length, length), jnp.int32)
  spans = spans.at[rows, tokens, tokens].set(jnp.where(valid, targets[..., 1], 0), mode="drop")
  has_span = valid & (targets[..., 2] > 0)  # [b, t]
  first = jnp.where(has_span, targets[..., 3], length)  # out of range: dropped
  spans = spans.at[rows, first, targets[..., 4]].set(targets[..., 2], mode="drop")
  tags = jnp.where(valid, targets[..., 0] - CHART_TAG_OFFSET, 0)
  return spans, tags, valid


def chart_log_partition(scores: jax.Array, lengths: jax.Array) -> jax.Array:
  """log Σ over the binary trees of each sentence's tokens of exp(Σ of their spans' scores): the
  inside algorithm (Baker 1979), vectorized over starts, one `scan` step per width.

  scores [b, s, s]: span i..j's (j >= i); lengths [b] >= 1 -> [b]. Its gradient is each span's
  probability of being in the tree (a TreeCRF's marginals)."""
  b, s, _ = scores.shape
  index = jnp.arange(s)
  words = scores[:, index, index]  # [b, s]
  # by_start[:, i, w - 1]: the inside score of the span of width w from token i; by_end[:, j, w - 1]
  # that of the span of width w ending at token j (-inf: not yet, or out of the row).
  by_start = jnp.full((b, s, s), -jnp.inf, scores.dtype).at[:, :, 0].set(words)
  by_end = jnp.full((b, s, s), -jnp.inf, scores.dtype).at[:, :, 0].set(words)

  def width_step(carry, width):
    by_start, by_end = carry
    ends = index + width - 1  # [s]: the span from token i ends at i + width - 1
    in_row = ends < s
    ends = jnp.minimum(ends, s - 1)
    # Split after the left part's k-th token (k = 1 .. width - 1): left = by_start[i, k - 1],
    # right = by_end[end, width - k - 1]; part index p = k - 1 on the last axis.
    right = by_end[:, ends, :][:, :, jnp.clip(width - 2 - index, 0, s - 1)]  # [b, i, p]
    parts = jnp.where(index <= width - 2, by_start + right, -jnp.inf)  # [b, i, p]
    inside = jax.nn.logsumexp(parts, axis=-1) + scores[:, index, ends]  # [b, i]
    inside = jnp.where(in_row, inside, -jnp.inf)
    by_start = by_start.at[:, :, width - 1].set(inside)
    by_end = by_end.at[:, jnp.where(in_row, ends, s), width - 1].set(inside, mode="drop")
    return (by_start, by_end), None

  (by_start, _), _ = jax.lax.scan(width_step, (by_start, by_end), jnp.arange(2, s + 1))
  return by_start[jnp.arange(b), 0, jnp.maximum(lengths, 1) - 1]


def chart_cross_entropy(
    spans: jax.Array,  # [b, s, s, L] logits
    tags: jax.Array,  # [b, s, T] logits
    targets: jax.Array,  # [b, t, CHART_COLUMNS] int
    structure: str = "spans",
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(nll_sum, correct_tags, token_count) of a span chart, each token's tag's cross entropy plus:

    "spans"  every span's label's (each span i..j of the sentence, i <= j, its label or 0,
             none), independent labels per span (Teng & Zhang 2018's local model);
    "tree"   the tree's, a conditional random field over binary trees (Finkel et al. 2008; Zhang
             et al. 2020's TreeCRF, labels included): a tree's score is the sum of its spans'
             label logits (0 for the nodes of its binarization, the targets' splits), normalized
             over every binary tree of the words with every labeling (`chart_log_partition`).

  Both are deviations (§6.3 trains a decoder). Divided by the token count by the caller."""
  s = spans.shape[1]
  targets = targets[:, :s]
  gold, gold_tags, valid = chart_gold(targets, s)  # [b, s, s], [b, s], [b, s]
  tag_nll = (
      jax.nn.logsumexp(tags, axis=-1)
      - jnp.take_along_axis(tags, gold_tags[..., None], axis=-1)[..., 0]
  )  # [b, s]
  nll = jnp.sum(jnp.where(valid, tag_nll, 0.0))
  if structure == "spans":
    in_sentence = valid[:, :, None] & valid[:, None, :] & jnp.triu(jnp.ones((s, s), bool))
    span_nll = (
        jax.nn.logsumexp(spans, axis=-1)
        - jnp.take_along_axis(spans, gold[..., None], axis=-1)[..., 0]
    )  # [b, s, s]
    nll += jnp.sum(jnp.where(in_sentence, span_nll, 0.0))
  elif structure == "tree":
    lengths = jnp.sum(valid, axis=-1)  # [b]
    log_z = chart_log_partition(jax.nn.logsumexp(spans, axis=-1), lengths)  # [b]
    rows = jnp.arange(spans.shape[0])[:, None]  # [b, 1]
    index = jnp.arange(s)[None, :]  # [1, s]
    word_spans = spans[rows, index, index, jnp.where(valid, targets[..., 1], 0)]  # [b, s]
    splits = valid & jnp.roll(valid, -1, axis=1) & (index < s - 1)  # a next token: a split
    split_spans = spans[
        rows,
        jnp.where(splits, targets[..., 3], 0),
        jnp.where(splits, targets[..., 4], 0),
        jnp.where(splits, targets[..., 2], 0),
    ]  # [b, s]
    gold_score = jnp.sum(jnp.where(valid, word_spans, 0.0), -1) + jnp.sum(
        jnp.where(splits, split_spans, 0.0), -1
    )
    nll += jnp.sum(jnp.where(lengths > 0, log_z - gold_score, 0.0))
  else:
    raise ValueError(f"structure={structure!r}: expected 'spans' or 'tree'")
  correct = jnp.sum((jnp.argmax(tags, axis=-1) == gold_tags) & valid)
  return nll, correct, jnp.sum(valid).astype(jnp.float32)
