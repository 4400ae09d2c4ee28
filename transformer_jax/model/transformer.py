"""The Transformer of "Attention Is All You Need" (Vaswani et al., 2017), §3, in Flax linen.

Shapes: b batch, s source length, t target length, e d_model, f d_ff, v vocabulary. A variant
passes its own attention layer (`attention`: docs/changing_the_model.md). How the stacks run
(`remat_policy`, `scan_layers`) is parallel/layer_params.py's, not what they compute.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax import kernels
from transformer_jax.model.attention import (
    AttentionMask,
    MultiHeadAttention,
    default_kernel_init,
    segment_mask,
)
from transformer_jax.model.config import PAD_ID, TransformerConfig
from transformer_jax.parallel import sharding
from transformer_jax.parallel.layer_params import apply_stack


def sinusoidal_positions(max_len: int, d_model: int) -> np.ndarray:
  """§3.5: PE(pos, 2i) = sin(pos / 10000^(2i/d_model)), PE(pos, 2i+1) = cos(same). [max_len, e]."""
  position = np.arange(max_len, dtype=np.float64)[:, None]  # [max_len, 1]
  two_i = np.arange(0, d_model, 2, dtype=np.float64)[None, :]  # [1, e/2]
  angle = position / np.power(10000.0, two_i / d_model)  # [max_len, e/2]
  table = np.zeros((max_len, d_model), dtype=np.float32)
  table[:, 0::2] = np.sin(angle)  # even dimensions
  table[:, 1::2] = np.cos(angle)  # odd dimensions
  return table


class AddPositions(nn.Module):
  """Adds sinusoidal (§3.5) or learned (Table 3 row E) position embeddings."""

  config: TransformerConfig

  @nn.compact
  def __call__(self, x: jax.Array, positions: jax.Array | None) -> jax.Array:
    cfg = self.config
    if cfg.positional == "sinusoidal":
      table = jnp.asarray(sinusoidal_positions(cfg.max_len, cfg.d_model))
    else:
      init = nn.with_logical_partitioning(nn.initializers.normal(0.02), (None, sharding.EMBED))
      table = self.param("position_embedding", init, (cfg.max_len, cfg.d_model), cfg.param_dtype)
    if positions is None:
      if x.shape[1] > cfg.max_len:
        raise ValueError(f"sequence length {x.shape[1]} exceeds max_len={cfg.max_len}")
      pos = table[None, : x.shape[1]]  # [1, L, e]
    else:
      pos = jnp.take(table, positions, axis=0)  # [b, L, e]
    return x + pos.astype(x.dtype)


class RelativePositions(nn.Module):
  """The encoder's relative positions (`relative_positions` K; a deviation, off by default): a
  learned scalar per head for each key's offset from its query, clipped to [-K, K] (Shaw et al.
  2018), added to the logits of every encoder layer (one table, as in T5). It starts at zero, so
  an untrained model attends as without it.

  positions [b | 1, s] -> bias [b | 1, h, s, s]: bias[:, h, q, k] = table[clip(k - q) + K, h]."""

  config: TransformerConfig

  @nn.compact
  def __call__(self, positions: jax.Array) -> jax.Array:
    cfg, clip = self.config, self.config.relative_positions
    init = nn.with_logical_partitioning(nn.initializers.zeros, (None, sharding.HEADS))
    table = self.param("bias", init, (2 * clip + 1, cfg.num_heads), cfg.param_dtype)  # [2K+1, h]
    offset = positions[:, None, :] - positions[:, :, None]  # [b, q, k]: key minus query
    offset = jnp.clip(offset, -clip, clip) + clip  # [b, q, k]: rows of the table
    return jnp.take(table, offset, axis=0).transpose(0, 3, 1, 2)  # [b, h, q, k]


def _dense(cfg: TransformerConfig, features: int, axes: tuple, name: str) -> nn.Dense:
  return nn.Dense(
      features,
      dtype=cfg.dtype,
      param_dtype=cfg.param_dtype,
      dot_general=kernels.dot_general(cfg),
      kernel_init=nn.with_logical_partitioning(default_kernel_init, axes),
      bias_init=nn.with_logical_partitioning(nn.initializers.zeros, axes[1:]),
      name=name,
  )


class FeedForward(nn.Module):
  """FFN(x) = max(0, x W1 + b1) W2 + b2 — §3.3, Eq. 2."""

  config: TransformerConfig

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    cfg = self.config
    h = nn.relu(_dense(cfg, cfg.d_ff, (sharding.EMBED, sharding.MLP), "wi")(x))  # [b, L, f]
    h = nn.with_logical_constraint(h, (sharding.BATCH, sharding.LENGTH, sharding.MLP))
    return _dense(cfg, cfg.d_model, (sharding.MLP, sharding.EMBED), "wo")(h)  # [b, L, e]


def layer_norm(cfg: TransformerConfig, name: str, axis: str = sharding.EMBED) -> nn.LayerNorm:
  """LayerNorm over a last axis of logical name `axis` (d_model by default)."""
  return nn.LayerNorm(
      epsilon=cfg.layer_norm_epsilon,
      dtype=cfg.dtype,
      param_dtype=cfg.param_dtype,
      scale_init=nn.with_logical_partitioning(nn.initializers.ones, (axis,)),
      bias_init=nn.with_logical_partitioning(nn.initializers.zeros, (axis,)),
      name=name,
  )


class SubLayer(nn.Module):
  """§3.1, §5.4: LayerNorm(x + Dropout(Sublayer(x))); pre-LN: x + Dropout(Sublayer(LayerNorm(x)))"""

  config: TransformerConfig

  @nn.compact
  def __call__(self, x: jax.Array, sublayer) -> jax.Array:
    cfg = self.config
    norm = layer_norm(cfg, "norm")
    dropout = nn.Dropout(rate=cfg.dropout_rate, deterministic=cfg.deterministic)
    if cfg.norm_position == "post":
      return norm(x + dropout(sublayer(x)))
    return x + dropout(sublayer(norm(x)))


class EncoderLayer(nn.Module):
  """Self-attention then FFN (§3.1, encoder)."""

  config: TransformerConfig
  attention: Any = MultiHeadAttention  # the attention layer's class
  scanned: bool = False  # return (x, None), the (carry, output) pair nn.scan expects

  @nn.compact
  def __call__(self, x: jax.Array, mask: AttentionMask | jax.Array | None, positions=None):
    cfg = self.config
    attention = self.attention(cfg, kind="encoder", name="self_attention")
    x = SubLayer(cfg, name="attention_block")(x, lambda y: attention(y, y, mask, positions))
    x = SubLayer(cfg, name="ffn_block")(x, FeedForward(cfg, name="ffn"))
    x = nn.with_logical_constraint(x, (sharding.BATCH, sharding.LENGTH, sharding.EMBED))
    return (x, None) if self.scanned else x


class DecoderLayer(nn.Module):
  """Masked self-attention, encoder-decoder attention, then FFN (§3.1, decoder)."""

  config: TransformerConfig
  attention: Any = MultiHeadAttention  # the attention layers' class
  scanned: bool = False  # return (y, None), the (carry, output) pair nn.scan expects

  @nn.compact
  def __call__(self, y, encoded, self_mask, cross_mask, positions=None):
    """y [b, t, e]; encoded [b, s, e] (None while decoding from the cache); positions [b | 1, t]."""
    cfg = self.config
    self_attention = self.attention(cfg, kind="causal", name="self_attention")
    cross_attention = self.attention(cfg, kind="cross", name="cross_attention")
    y = SubLayer(cfg, name="self_attention_block")(
        y, lambda z: self_attention(z, z, self_mask, positions)
    )
    y = SubLayer(cfg, name="cross_attention_block")(
        y, lambda z: cross_attention(z, encoded, cross_mask, positions)
    )
    y = SubLayer(cfg, name="ffn_block")(y, FeedForward(cfg, name="ffn"))
    y = nn.with_logical_constraint(y, (sharding.BATCH, sharding.LENGTH, sharding.EMBED))
    return (y, None) if self.scanned else y


class Embed(nn.Module):
  """Token embedding scaled by √d_model (§3.4); `attend` is the (shared) pre-softmax layer."""

  config: TransformerConfig

  def setup(self):
    cfg = self.config
    # N(0, d_model^-1/2): after the √d_model scaling the embeddings have unit variance, the same
    # scale as the sinusoidal positions they are added to (tensor2tensor's choice).
    init = nn.initializers.normal(stddev=cfg.d_model**-0.5)
    init = nn.with_logical_partitioning(init, (sharding.VOCAB, sharding.EMBED))
    self.embedding = self.param("embedding", init, (cfg.vocab_size, cfg.d_model), cfg.param_dtype)

  def __call__(self, tokens: jax.Array) -> jax.Array:
    cfg = self.config
    x = jnp.take(self.embedding, tokens, axis=0).astype(cfg.dtype)  # [b, L, e]
    return x * jnp.sqrt(cfg.d_model).astype(cfg.dtype)

  def attend(self, x: jax.Array) -> jax.Array:
    """x [b, t, e] -> logits [b, t, v] in float32 (accumulated in float32 even for bf16 x)."""
    cfg = self.config
    # With matmul_dtype (model/config.py) the inputs are rounded to it, the products summed in
    # float32.
    return kernels.output_projection(x, self.embedding.astype(cfg.dtype), cfg.matmul_dtype)


def _mask(keys, query_segments, key_segments, causal: bool = False) -> AttentionMask:
  """Attention to `keys` [b, k] (tokens: PAD_ID is padding), within packed sentences
  (`*_segments` [b, q], [b, k], or None), causal or not."""
  extra = None if query_segments is None else segment_mask(query_segments, key_segments)
  return AttentionMask(key_valid=keys != PAD_ID, extra=extra, causal=causal)


class Encoder(nn.Module):
  config: TransformerConfig
  embed: Embed
  attention: Any = MultiHeadAttention

  @nn.compact
  def __call__(self, inputs, inputs_positions=None, inputs_segmentation=None) -> jax.Array:
    """inputs [b, s] ids -> encoded [b, s, e]."""
    cfg = self.config
    positions = jnp.arange(inputs.shape[1])[None] if inputs_positions is None else inputs_positions
    mask = _mask(inputs, inputs_segmentation, inputs_segmentation)
    if cfg.relative_positions:  # travels with the mask: [b | 1, h, s, s]
      mask = mask.replace(bias=RelativePositions(cfg, name="relative_positions")(positions))
    x = self.embed(inputs)  # [b, s, e]
    x = AddPositions(cfg, name="positions")(x, inputs_positions)
    # §5.4: dropout on the sums of the embeddings and the positional encodings.
    x = nn.Dropout(rate=cfg.dropout_rate, deterministic=cfg.deterministic)(x)
    x = apply_stack(EncoderLayer, cfg, self.attention, cfg.num_layers, (x, mask, positions))
    if cfg.norm_position == "pre":
      x = layer_norm(cfg, "final_norm")(x)
    return x  # [b, s, e]


class Decoder(nn.Module):
  config: TransformerConfig
  embed: Embed
  attention: Any = MultiHeadAttention

  @nn.compact
  def __call__(
      self, encoded, inputs, decoder_inputs, targets_positions=None, inputs_segmentation=None,
      targets_segmentation=None,
  ) -> jax.Array:  # fmt: skip
    """encoded [b, s, e] (None when decoding from the cache after the first step), inputs [b, s]
    (the source's tokens, for its padding), decoder_inputs [b, t] -> [b, t, e]."""
    cfg = self.config
    self_mask = None  # decode mode: the cache knows which keys each step may see
    if not cfg.decode:  # §3.2.3: no attention to later positions
      self_mask = _mask(decoder_inputs, targets_segmentation, targets_segmentation, causal=True)
    cross_mask = _mask(inputs, targets_segmentation, inputs_segmentation)
    y = self.embed(decoder_inputs)  # [b, t, e]
    y = AddPositions(cfg, name="positions")(y, targets_positions)
    y = nn.Dropout(rate=cfg.dropout_rate, deterministic=cfg.deterministic)(y)
    positions = jnp.arange(y.shape[1])[None] if targets_positions is None else targets_positions
    args = (y, encoded, self_mask, cross_mask, positions)
    y = apply_stack(DecoderLayer, cfg, self.attention, cfg.decoder_layers, args)
    if cfg.norm_position == "pre":
      y = layer_norm(cfg, "final_norm")(y)
    return y  # [b, t, e]


class Transformer(nn.Module):
  """Encoder-decoder Transformer; a search steps `decode` in decode mode (decoding/decoder.py).
  PAD_ID (0) is padding. Packed batches pass `*_segmentation` (sentence ids, 0 = padding) and
  `*_positions` (restarting at 0 for each sentence)."""

  config: TransformerConfig
  attention: Any = MultiHeadAttention  # every attention layer's class (a variant's own)

  def setup(self):
    cfg = self.config
    if cfg.share_embeddings:
      # §3.4: the same weight matrix for both embedding layers and the pre-softmax projection.
      self.shared_embedding = Embed(cfg)
      source_embed = target_embed = self.shared_embedding
    else:
      self.source_embedding, self.target_embedding = Embed(cfg), Embed(cfg)
      source_embed, target_embed = self.source_embedding, self.target_embedding
      self.output_projection = nn.DenseGeneral(
          cfg.vocab_size,
          use_bias=False,
          dtype=cfg.dtype,
          param_dtype=cfg.param_dtype,
          dot_general=kernels.dot_general(cfg),
          kernel_init=nn.with_logical_partitioning(
              default_kernel_init, (sharding.EMBED, sharding.VOCAB)
          ),
      )
    self.encoder = Encoder(cfg, embed=source_embed, attention=self.attention)
    self.decoder = Decoder(cfg, embed=target_embed, attention=self.attention)

  def encode(self, inputs, inputs_positions=None, inputs_segmentation=None) -> jax.Array:
    """inputs [b, s] -> encoded [b, s, e]."""
    return self.encoder(inputs, inputs_positions, inputs_segmentation)

  def decode(
      self, encoded, inputs, decoder_inputs, targets_positions=None, inputs_segmentation=None,
      targets_segmentation=None,
  ) -> jax.Array:  # fmt: skip
    """-> logits [b, t, v], float32. In decode mode t = 1, `encoded` is given on the first step
    only (the cache keeps what it needs), and a sentence may have several rows (its beams:
    decoder_inputs [r, 1] with r a multiple of `inputs`' b, sentence-major)."""
    y = self.decoder(
        encoded, inputs, decoder_inputs, targets_positions, inputs_segmentation,
        targets_segmentation,
    )  # fmt: skip
    if not self.config.share_embeddings:
      return self.output_projection(y).astype(jnp.float32)
    return self.shared_embedding.attend(y)

  def __call__(
      self, inputs, decoder_inputs, inputs_positions=None, targets_positions=None,
      inputs_segmentation=None, targets_segmentation=None,
  ) -> jax.Array:  # fmt: skip
    """inputs [b, s], decoder_inputs [b, t] (BOS + target, shifted right) -> logits [b, t, v]."""
    encoded = self.encode(inputs, inputs_positions, inputs_segmentation)
    return self.decode(
        encoded, inputs, decoder_inputs, targets_positions, inputs_segmentation,
        targets_segmentation,
    )  # fmt: skip
