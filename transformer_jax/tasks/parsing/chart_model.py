"""The span-chart parser's model and loss: the generic embedding and Encoder, and a span chart
over the encoder's output in the place of a decoder (`config.parsing.decoder="chart"`; a deviation
from §6.3, whose decoder writes the linearized tree). After the chart parsers of Stern et al.
(2017) and Kitaev & Klein (2018); the tree's probability is a TreeCRF's (Finkel et al. 2008;
Zhang et al. 2020), normalized by the inside algorithm.

Shapes: b batch, s source length (words + EOS), e d_model, h the chart's hidden units, L span
labels (EMPTY first, chart.py), T part-of-speech tags.

  model = ChartParser(model_config, labels=L, tags=T, hidden=h)  # ParsingTask.build_model
  spans, tags = model.apply({"params": params}, inputs)          # [b, s, s, L], [b, s, T]
  nll_sum, metrics = chart_loss((spans, tags), batch)             # ParsingTask.loss
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from transformer_jax.model.attention import default_kernel_init
from transformer_jax.model.config import TransformerConfig
from transformer_jax.model.transformer import Embed, Encoder, layer_norm
from transformer_jax.parallel import sharding

# A span chart's targets: [b, t, CHART_COLUMNS] int, one row per source token (PAD/EOS rows:
# none), as chart.targets writes them:
#   0  its tag's class + CHART_TAG_OFFSET (batching reads column 0 as a token: never PAD/EOS/BOS)
#   1  the label of the span of this token alone (0: none)
#   2  the label of the span whose first part ends at this token (0: none); in a tree each
#      token ends the first part of at most one span of two or more parts
#   3  that span's first token; 4 its last token
CHART_COLUMNS = 5
CHART_TAG_OFFSET = 3
# What a chart run's batches carry to the device (data/batching.py): no decoder inputs.
BATCH_KEYS = ("inputs", "inputs_positions", "inputs_segmentation", "targets")


class SpanChart(nn.Module):
  """Span and tag scores over the encoder's output. A span's features are those of its first
  and last tokens, each projected, summed, normalized and passed through a ReLU; a linear layer
  scores its labels. A token's tags are scored from its own features alike.

  x [b, s, e] -> (spans [b, s, s, L], tags [b, s, T]), float32: spans[:, i, j] scores the span
  of tokens i..j (j >= i; the rest is never read)."""

  config: TransformerConfig  # dtypes, dropout, LayerNorm's ε: the encoder's
  labels: int  # L
  tags: int  # T
  hidden: int  # h

  def _dense(self, features: int, axes: tuple, bias: bool, name: str) -> nn.Dense:
    cfg = self.config
    return nn.Dense(
        features,
        use_bias=bias,
        dtype=cfg.dtype,
        param_dtype=cfg.param_dtype,
        kernel_init=nn.with_logical_partitioning(default_kernel_init, axes),
        bias_init=nn.with_logical_partitioning(nn.initializers.zeros, axes[1:]),
        name=name,
    )

  def _hidden(self, h: jax.Array, name: str) -> jax.Array:
    cfg = self.config
    h = nn.relu(layer_norm(cfg, name, sharding.MLP)(h))
    return nn.Dropout(rate=cfg.dropout_rate, deterministic=cfg.deterministic)(h)

  @nn.compact
  def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    hidden = (sharding.EMBED, sharding.MLP)
    first = self._dense(self.hidden, hidden, True, "span_first")(x)  # [b, s, h]
    last = self._dense(self.hidden, hidden, False, "span_last")(x)  # [b, s, h]
    h = self._hidden(first[:, :, None, :] + last[:, None, :, :], "span_norm")  # [b, i, j, h]
    spans = self._dense(self.labels, (sharding.MLP, None), True, "span_labels")(h)  # [b,i,j,L]
    t = self._dense(self.hidden, hidden, True, "tag_hidden")(x)  # [b, s, h]
    t = self._hidden(t, "tag_norm")
    tags = self._dense(self.tags, (sharding.MLP, None), True, "tag_labels")(t)  # [b, s, T]
    return spans.astype(jnp.float32), tags.astype(jnp.float32)


class ChartParser(nn.Module):
  """The generic embedding (§3.4's √d_model scaling) and Encoder (§3.1, with the config's
  positions), then `SpanChart`: no decoder. Variants by `.clone(config=config.replace(...))`."""

  config: TransformerConfig
  labels: int
  tags: int
  hidden: int

  def setup(self):
    self.source_embedding = Embed(self.config)
    self.encoder = Encoder(self.config, embed=self.source_embedding)
    self.chart = SpanChart(self.config, self.labels, self.tags, self.hidden)

  def __call__(
      self,
      inputs,  # [b, s]
      decoder_inputs=None,  # not read: the model has no decoder (init passes one)
      inputs_positions=None,
      targets_positions=None,
      inputs_segmentation=None,
      targets_segmentation=None,
  ) -> tuple[jax.Array, jax.Array]:
    """-> (spans [b, s, s, L], tags [b, s, T]) float32."""
    del decoder_inputs, targets_positions, targets_segmentation
    return self.chart(self.encoder(inputs, inputs_positions, inputs_segmentation))


# ----------------------------------------------------------------------------- the loss


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


def log_partition(scores: jax.Array, lengths: jax.Array) -> jax.Array:
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


def tree_cross_entropy(
    spans: jax.Array,  # [b, s, s, L] logits
    tags: jax.Array,  # [b, s, T] logits
    targets: jax.Array,  # [b, t, CHART_COLUMNS] int
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(nll_sum, correct_tags, token_count): each token's tag's cross entropy plus the gold tree's,
  a conditional random field over binary trees (Finkel et al. 2008; Zhang et al. 2020's TreeCRF,
  labels included): a tree's score is the sum of its spans' label logits (0 for the nodes of its
  binarization, the targets' splits), normalized over every binary tree of the words with every
  labeling (`log_partition`). Divided by the token count by the caller."""
  s = spans.shape[1]
  targets = targets[:, :s]
  _, gold_tags, valid = chart_gold(targets, s)  # [b, s], [b, s]
  tag_nll = (
      jax.nn.logsumexp(tags, axis=-1)
      - jnp.take_along_axis(tags, gold_tags[..., None], axis=-1)[..., 0]
  )  # [b, s]
  nll = jnp.sum(jnp.where(valid, tag_nll, 0.0))
  lengths = jnp.sum(valid, axis=-1)  # [b]
  log_z = log_partition(jax.nn.logsumexp(spans, axis=-1), lengths)  # [b]
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
  correct = jnp.sum((jnp.argmax(tags, axis=-1) == gold_tags) & valid)
  return nll, correct, jnp.sum(valid).astype(jnp.float32)


def chart_loss(outputs: tuple[jax.Array, jax.Array], batch: dict) -> tuple[jax.Array, dict]:
  """The chart's loss (ParsingTask.loss): `tree_cross_entropy`, unsmoothed, over the source
  tokens, with its metric sums; its accuracy is the tags'."""
  spans, tags = outputs
  nll_sum, correct, weight_sum = tree_cross_entropy(spans, tags, batch["targets"])
  metrics = {"loss_sum": nll_sum, "nll_sum": nll_sum, "correct_sum": correct}
  return nll_sum, {**metrics, "weight_sum": weight_sum}
