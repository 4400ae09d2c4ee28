"""The Transformer of "Attention Is All You Need" (Vaswani et al., 2017), §3, in Flax linen.

Shapes: b batch, s source length, t target length, e d_model, f d_ff, v vocabulary, n layers.

Two switches change how the layer stacks run, not what they compute:
  remat_policy  rematerialise each layer in the backward pass (`nn.remat`): activation memory
                per layer drops to its inputs (plus what the policy saves) for one more forward.
  scan_layers   run each stack as `nn.scan` over one layer with stacked parameters [n, ...]
                (`encoder/layers/...`, logical axis "layers"): compile time no longer grows with
                depth. `stack_layer_params`/`unstack_layer_params` convert the parameter trees.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax.model import config as config_lib
from transformer_jax.model.attention import (
    AttentionMask,
    MultiHeadAttention,
    default_kernel_init,
    segment_mask,
)
from transformer_jax.model.config import PAD_ID, TransformerConfig
from transformer_jax.parallel import sharding

# The JAX policy of each of model_config.REMAT_POLICIES: what a rematerialised layer saves.
_REMAT_SAVEABLE = {
    "full": None,  # only the layer's inputs
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


# ----------------------------------------------------------------------------- positions


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
    length = x.shape[1]
    if cfg.positional == "sinusoidal":
      table = jnp.asarray(sinusoidal_positions(cfg.max_len, cfg.d_model))
    else:
      table = self.param(
          "position_embedding",
          nn.with_logical_partitioning(nn.initializers.normal(stddev=0.02), (None, sharding.EMBED)),
          (cfg.max_len, cfg.d_model),
          cfg.param_dtype,
      )
    if positions is None:
      if length > cfg.max_len:
        raise ValueError(f"sequence length {length} exceeds max_len={cfg.max_len}")
      pos = table[None, :length]  # [1, L, e]
    else:
      pos = jnp.take(table, positions, axis=0)  # [b, L, e]
    return x + pos.astype(x.dtype)


class RelativePositions(nn.Module):
  """The encoder's relative positions (`relative_positions` K; a deviation, off by default): a
  learned scalar per head for each key's offset from its query, clipped to [-K, K] (Shaw et al.
  2018), added to the attention logits of every encoder layer (one table, as in T5).

  positions [b | 1, s] int (a packed row's restart at each sentence) -> bias [b | 1, h, s, s]:
  bias[:, h, q, k] = table[clip(pos_k - pos_q, -K, K) + K, h]. The table starts at zero, so an
  untrained model attends as without it."""

  config: TransformerConfig

  @nn.compact
  def __call__(self, positions: jax.Array) -> jax.Array:
    cfg = self.config
    clip = cfg.relative_positions  # K
    table = self.param(
        "bias",
        nn.with_logical_partitioning(nn.initializers.zeros, (None, sharding.HEADS)),
        (2 * clip + 1, cfg.num_heads),
        cfg.param_dtype,
    )  # [2K + 1, h]
    offset = positions[:, None, :] - positions[:, :, None]  # [b, q, k]: key minus query
    offset = jnp.clip(offset, -clip, clip) + clip  # [b, q, k]: rows of the table
    return jnp.take(table, offset, axis=0).transpose(0, 3, 1, 2)  # [b, h, q, k]


# ----------------------------------------------------------------------------- blocks


class FeedForward(nn.Module):
  """FFN(x) = max(0, x W1 + b1) W2 + b2 — §3.3, Eq. 2."""

  config: TransformerConfig

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    cfg = self.config
    h = nn.Dense(
        cfg.d_ff,
        dtype=cfg.dtype,
        param_dtype=cfg.param_dtype,
        dot_general=config_lib.dot_general(cfg),
        kernel_init=nn.with_logical_partitioning(
            default_kernel_init, (sharding.EMBED, sharding.MLP)
        ),
        bias_init=nn.with_logical_partitioning(nn.initializers.zeros, (sharding.MLP,)),
        name="wi",
    )(
        x
    )  # [b, L, f]
    h = nn.relu(h)
    h = nn.with_logical_constraint(h, (sharding.BATCH, sharding.LENGTH, sharding.MLP))
    return nn.Dense(
        cfg.d_model,
        dtype=cfg.dtype,
        param_dtype=cfg.param_dtype,
        dot_general=config_lib.dot_general(cfg),
        kernel_init=nn.with_logical_partitioning(
            default_kernel_init, (sharding.MLP, sharding.EMBED)
        ),
        bias_init=nn.with_logical_partitioning(nn.initializers.zeros, (sharding.EMBED,)),
        name="wo",
    )(
        h
    )  # [b, L, e]


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
  """Residual + dropout + LayerNorm around one sub-layer.

  post-LN (§3.1, §5.4): LayerNorm(x + Dropout(Sublayer(x))).
  pre-LN:               x + Dropout(Sublayer(LayerNorm(x))).
  """

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
  scanned: bool = False  # return (x, None), the (carry, output) pair nn.scan expects

  @nn.compact
  def __call__(self, x: jax.Array, mask: AttentionMask | jax.Array | None):
    cfg = self.config
    attention = MultiHeadAttention(cfg, kind="encoder", name="self_attention")
    x = SubLayer(cfg, name="attention_block")(x, lambda y: attention(y, y, mask))
    x = SubLayer(cfg, name="ffn_block")(x, FeedForward(cfg, name="ffn"))
    x = nn.with_logical_constraint(x, (sharding.BATCH, sharding.LENGTH, sharding.EMBED))
    return (x, None) if self.scanned else x


class DecoderLayer(nn.Module):
  """Masked self-attention, encoder-decoder attention, then FFN (§3.1, decoder)."""

  config: TransformerConfig
  scanned: bool = False  # return (y, None), the (carry, output) pair nn.scan expects

  @nn.compact
  def __call__(
      self,
      y: jax.Array,  # [b, t, e]
      encoded: jax.Array | None,  # [b, s, e]; None while decoding from the cache
      self_mask: AttentionMask | jax.Array | None,
      cross_mask: AttentionMask | jax.Array | None,
      cache_slots: jax.Array | None = None,  # decode mode, beam search (kv_cache.py)
  ):
    cfg = self.config
    self_attention = MultiHeadAttention(cfg, kind="causal", name="self_attention")
    cross_attention = MultiHeadAttention(cfg, kind="cross", name="cross_attention")
    y = SubLayer(cfg, name="self_attention_block")(
        y, lambda z: self_attention(z, z, self_mask, cache_slots)
    )
    y = SubLayer(cfg, name="cross_attention_block")(
        y, lambda z: cross_attention(z, encoded, cross_mask)
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
    self.embedding = self.param(
        "embedding",
        nn.with_logical_partitioning(
            nn.initializers.normal(stddev=cfg.d_model**-0.5), (sharding.VOCAB, sharding.EMBED)
        ),
        (cfg.vocab_size, cfg.d_model),
        cfg.param_dtype,
    )

  def __call__(self, tokens: jax.Array) -> jax.Array:
    cfg = self.config
    x = jnp.take(self.embedding, tokens, axis=0).astype(cfg.dtype)  # [b, L, e]
    return x * jnp.sqrt(cfg.d_model).astype(cfg.dtype)

  def attend(self, x: jax.Array) -> jax.Array:
    """x [b, t, e] -> logits [b, t, v] in float32 (accumulated in float32 even for bf16 x)."""
    cfg = self.config
    if cfg.matmul_dtype is not None:  # model/config.py; the products are summed in float32
      x = x.astype(cfg.matmul_dtype)
    return _output_projection(x, self.embedding.astype(cfg.matmul_dtype or cfg.dtype))


@jax.custom_vjp
def _output_projection(x: jax.Array, embedding: jax.Array) -> jax.Array:
  """x [b, t, e] @ embedding [v, e]ᵀ -> logits [b, t, v], float32.

  The custom backward only fixes which operand XLA transposes for the embedding gradient: left
  alone, XLA:CPU materialises the transpose of the logits gradient [v, b*t] (the largest tensor
  of the step); here it transposes x [e, b*t] and the small result [e, v] instead.
  """
  return jnp.einsum("bte,ve->btv", x, embedding, preferred_element_type=jnp.float32)


def _output_projection_fwd(x, embedding):
  return _output_projection(x, embedding), (x, embedding)


def _output_projection_bwd(residuals, g):
  """The gradients JAX's own rule computes (same dtypes: float32 accumulation, cast back)."""
  x, embedding = residuals  # g: [b, t, v] float32
  dx = jax.lax.dot_general(
      g, embedding, (((2,), (0,)), ((), ())), preferred_element_type=jnp.float32
  )  # [b, t, e]
  x_t = jax.lax.optimization_barrier(jnp.transpose(x, (2, 0, 1)))  # [e, b, t], materialised
  d_embedding = jax.lax.dot_general(
      x_t, g, (((1, 2), (0, 1)), ((), ())), preferred_element_type=jnp.float32
  ).T  # [e, v] -> [v, e]
  return dx.astype(x.dtype), d_embedding.astype(embedding.dtype)


_output_projection.defvjp(_output_projection_fwd, _output_projection_bwd)


# ----------------------------------------------------------------------------- stacks


def _maybe_remat(layer_cls, cfg: TransformerConfig):
  """The layer class, rematerialised under `cfg.remat_policy` (never in decode mode: no
  backward pass there)."""
  if cfg.remat_policy == "none" or cfg.decode:
    return layer_cls
  # prevent_cse stops XLA from merging the recomputation back into the forward pass; inside
  # nn.scan the loop boundary already does that, and the flag would only block optimisations.
  return nn.remat(
      layer_cls, policy=_REMAT_SAVEABLE[cfg.remat_policy], prevent_cse=not cfg.scan_layers
  )


def _scan_layers(layer_cls, num_layers: int, num_broadcast_args: int):
  """nn.scan over `num_layers` copies of a layer: parameters [n, ...] (logical axis "layers"),
  a fresh dropout key per layer, and the non-carried arguments (masks, encoder output) shared."""
  return nn.scan(
      layer_cls,
      variable_axes={"params": 0},
      split_rngs={"params": True, "dropout": True},
      in_axes=(nn.broadcast,) * num_broadcast_args,
      length=num_layers,
      metadata_params={nn.PARTITION_NAME: sharding.LAYERS},
  )


def _is_boxed(x) -> bool:
  return isinstance(x, nn.LogicallyPartitioned)


def _stack(*xs):
  """Stacks layer values on a new leading axis; boxed values get the logical name "layers"."""
  if _is_boxed(xs[0]):
    return xs[0].replace(
        value=jnp.stack([x.value for x in xs]), names=(sharding.LAYERS, *xs[0].names)
    )
  return jnp.stack(xs)


def stack_layer_params(params):
  """Unrolled parameters (`layer_0`, `layer_1`, ... under a stack) -> scanned (`layers`, [n, ...]).

  Works on any (sub)tree: every dict holding `layer_0` is converted; other entries are kept.
  """
  if not isinstance(params, dict) and not hasattr(params, "items"):
    return params
  params = dict(params)
  if "layer_0" in params:
    n = sum(1 for k in params if k.startswith("layer_"))
    layers = [params.pop(f"layer_{i}") for i in range(n)]
    params["layers"] = jax.tree.map(_stack, *layers, is_leaf=_is_boxed)  # [n, ...]
  return {k: stack_layer_params(v) for k, v in params.items()}


def unstack_layer_params(params):
  """Scanned parameters (`layers`, [n, ...]) -> unrolled (`layer_0`, ...); inverse of the above."""
  if not isinstance(params, dict) and not hasattr(params, "items"):
    return params
  params = dict(params)
  if "layers" in params:
    stacked = params.pop("layers")
    n = jax.tree.leaves(stacked)[0].shape[0]
    for i in range(n):
      params[f"layer_{i}"] = jax.tree.map(lambda x, i=i: _index(x, i), stacked, is_leaf=_is_boxed)
  return {k: unstack_layer_params(v) for k, v in params.items()}


def _index(x, i: int):
  if _is_boxed(x):
    return x.replace(value=x.value[i], names=x.names[1:])
  return x[i]


class _DecoderLayersFromStack(nn.Module):
  """Decode mode of a scanned decoder: the stacked parameters, run one layer after another, so
  each layer keeps its own KV cache (kv_cache.py)."""

  config: TransformerConfig

  @nn.compact
  def __call__(self, y, encoded, self_mask, cross_mask, cache_slots):
    for i in range(self.config.decoder_layers):
      layer = DecoderLayer(self.config, name=f"layer_{i}")
      y = layer(y, encoded, self_mask, cross_mask, cache_slots)
    return y


def _unstack_variables(variables):
  # {collection: {"layer_0": ..., ...}} <-> {collection: stacked}; map_variables passes collections.
  return {col: unstack_layer_params({"layers": tree}) for col, tree in variables.items()}


def _stack_variables(variables):
  return {col: stack_layer_params({"layers": tree})["layers"] for col, tree in variables.items()}


class Encoder(nn.Module):
  config: TransformerConfig
  embed: Embed

  @nn.compact
  def __call__(self, inputs, inputs_positions=None, inputs_segmentation=None) -> jax.Array:
    """inputs [b, s] ids -> encoded [b, s, e]."""
    cfg = self.config
    ids = inputs  # [b, s]
    bias = None
    if cfg.relative_positions:
      positions = jnp.arange(ids.shape[1])[None] if inputs_positions is None else inputs_positions
      bias = RelativePositions(cfg, name="relative_positions")(positions)  # [b | 1, h, s, s]
    mask = AttentionMask(
        key_valid=ids != PAD_ID,  # [b, s]
        extra=None
        if inputs_segmentation is None
        else segment_mask(inputs_segmentation, inputs_segmentation),  # [b, 1, s, s]
        bias=bias,
    )
    x = self.embed(ids)  # [b, s, e]
    x = AddPositions(cfg, name="positions")(x, inputs_positions)
    # §5.4: dropout on the sums of the embeddings and the positional encodings.
    x = nn.Dropout(rate=cfg.dropout_rate, deterministic=cfg.deterministic)(x)
    layer = _maybe_remat(EncoderLayer, cfg)
    if cfg.scan_layers:
      x, _ = _scan_layers(layer, cfg.num_layers, 1)(cfg, scanned=True, name="layers")(x, mask)
    else:
      for i in range(cfg.num_layers):
        x = layer(cfg, name=f"layer_{i}")(x, mask)
    if cfg.norm_position == "pre":
      x = layer_norm(cfg, "final_norm")(x)
    return x  # [b, s, e]


class Decoder(nn.Module):
  config: TransformerConfig
  embed: Embed

  @nn.compact
  def __call__(
      self,
      encoded,  # [b, s, e] or None (decoding from the cache after the first step)
      inputs,  # [b, s] source tokens, for the encoder-decoder padding mask
      decoder_inputs,  # [b, t]
      targets_positions=None,
      inputs_segmentation=None,
      targets_segmentation=None,
      cache_slots=None,  # decode mode, beam search: [b, k, n] int32 (kv_cache.py)
  ) -> jax.Array:
    cfg = self.config
    if cfg.decode:
      # The KV cache builds the causal mask from its write index and, in a beam search, from the
      # table of which beam's slot holds each position of each prefix (kv_cache.py).
      self_mask = None
    else:
      self_mask = AttentionMask(
          key_valid=decoder_inputs != PAD_ID,  # [b, t]
          extra=None
          if targets_segmentation is None
          else segment_mask(targets_segmentation, targets_segmentation),  # [b, 1, t, t]
          causal=True,  # §3.2.3: no attention to later positions
      )
    cross_mask = AttentionMask(
        key_valid=inputs != PAD_ID,  # [b, s]
        extra=None
        if targets_segmentation is None
        else segment_mask(targets_segmentation, inputs_segmentation),  # [b, 1, t, s]
    )
    y = self.embed(decoder_inputs)  # [b, t, e]
    y = AddPositions(cfg, name="positions")(y, targets_positions)
    y = nn.Dropout(rate=cfg.dropout_rate, deterministic=cfg.deterministic)(y)
    layer = _maybe_remat(DecoderLayer, cfg)
    if cfg.scan_layers and not cfg.decode:
      scanned = _scan_layers(layer, cfg.decoder_layers, 3)(cfg, scanned=True, name="layers")
      y, _ = scanned(y, encoded, self_mask, cross_mask)
    elif cfg.scan_layers:  # decoding: per-layer caches, read from the stacked parameters
      unrolled = nn.map_variables(
          _DecoderLayersFromStack,
          "params",
          trans_in_fn=_unstack_variables,
          trans_out_fn=_stack_variables,
          init=self.is_initializing(),
      )
      y = unrolled(cfg, name="layers")(y, encoded, self_mask, cross_mask, cache_slots)
    else:
      for i in range(cfg.decoder_layers):
        y = layer(cfg, name=f"layer_{i}")(y, encoded, self_mask, cross_mask, cache_slots)
    if cfg.norm_position == "pre":
      y = layer_norm(cfg, "final_norm")(y)
    return y  # [b, t, e]


class Transformer(nn.Module):
  """Encoder-decoder Transformer. `encode` and `decode` are usable on their own (for decoding).

  Token id PAD_ID (0) is padding everywhere. Packed batches pass `*_segmentation` (sentence ids,
  0 = padding) and `*_positions` (restarting at 0 for each sentence).
  """

  config: TransformerConfig

  def setup(self):
    cfg = self.config
    if cfg.share_embeddings:
      # §3.4: the same weight matrix for both embedding layers and the pre-softmax projection.
      self.shared_embedding = Embed(cfg)
      source_embed = target_embed = self.shared_embedding
    else:
      self.source_embedding = Embed(cfg)
      self.target_embedding = Embed(cfg)
      source_embed, target_embed = self.source_embedding, self.target_embedding
      self.output_projection = nn.DenseGeneral(
          cfg.vocab_size,
          use_bias=False,
          dtype=cfg.dtype,
          param_dtype=cfg.param_dtype,
          dot_general=config_lib.dot_general(cfg),
          kernel_init=nn.with_logical_partitioning(
              default_kernel_init, (sharding.EMBED, sharding.VOCAB)
          ),
      )
    self.encoder = Encoder(cfg, embed=source_embed)
    self.decoder = Decoder(cfg, embed=target_embed)

  def encode(self, inputs, inputs_positions=None, inputs_segmentation=None) -> jax.Array:
    """inputs [b, s] -> encoded [b, s, e]."""
    return self.encoder(inputs, inputs_positions, inputs_segmentation)

  def decode(
      self,
      encoded,
      inputs,
      decoder_inputs,
      targets_positions=None,
      inputs_segmentation=None,
      targets_segmentation=None,
      cache_slots=None,
  ) -> jax.Array:
    """-> logits [b, t, v], float32. In decode
    mode t = 1 and `encoded` may be None (cached).

    Decode mode with k beams per sentence: decoder_inputs has b*k rows (sentence-major) while
    `inputs` and `encoded` keep b, and `cache_slots` [b, k, n] says which beam's cache slot holds
    each position of each beam's prefix (kv_cache.py).
    """
    y = self.decoder(
        encoded,
        inputs,
        decoder_inputs,
        targets_positions,
        inputs_segmentation,
        targets_segmentation,
        cache_slots,
    )
    if not self.config.share_embeddings:
      return self.output_projection(y).astype(jnp.float32)
    return self.shared_embedding.attend(y)

  def __call__(
      self,
      inputs,
      decoder_inputs,
      inputs_positions=None,
      targets_positions=None,
      inputs_segmentation=None,
      targets_segmentation=None,
  ) -> jax.Array:
    """inputs [b, s], decoder_inputs [b, t] (BOS + target, shifted right) -> logits [b, t, v]."""
    encoded = self.encode(inputs, inputs_positions, inputs_segmentation)
    return self.decode(
        encoded,
        inputs,
        decoder_inputs,
        targets_positions,
        inputs_segmentation,
        targets_segmentation,
    )
