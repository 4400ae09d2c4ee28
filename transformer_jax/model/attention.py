"""Multi-head scaled dot-product attention (§3.2) and its masks. Letters: b batch, q query
length, k key length, h heads, d head dim (d_k for queries and keys, d_v for values), e d_model.

`dot_product_attention` is Eq. 1, the one function that training, the encoder and every cached
decoding step compute; a `Layout` says where its operands lie (a decoding cache may keep keys in
its own). Fused kernels (kernels.py) stand in for it only while it is the function they were
checked against. Masks are boolean, broadcastable to [b, h, q, k], True: "may attend".
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp

from transformer_jax import kernels
from transformer_jax.model.config import TransformerConfig
from transformer_jax.parallel import sharding

# Glorot/Xavier uniform, as in tensor2tensor's Transformer; the paper does not state an init.
default_kernel_init = nn.initializers.xavier_uniform()


@flax.struct.dataclass
class AttentionMask:
  """What each query may attend to, in the pieces fused kernels take: `key_valid` [b, k] (False:
  padding, trailing in every batch this package builds, so the fused paths take key lengths),
  `causal` (§3.2.3; static: it selects a kernel), `extra` [b | 1, 1, q, k] (packed segments), and
  `bias` [b | 1, h, q, k] (the encoder's relative positions: not a mask, it travels with one)."""

  key_valid: jax.Array | None = None
  extra: jax.Array | None = None
  bias: jax.Array | None = None
  causal: bool = flax.struct.field(pytree_node=False, default=False)

  def dense(self, query_length: int) -> jax.Array | None:
    """The whole mask as one boolean array broadcastable to [b, 1, q, k] (None: attend to all).
    Queries are not masked: a padding query's output is unused."""
    causal = None
    if self.causal:  # §3.2.3: position i attends to positions <= i
      idx = jnp.arange(query_length)
      causal = (idx[:, None] >= idx[None, :])[None, None]  # [1, 1, q, q]
    padding = None if self.key_valid is None else self.key_valid[:, None, None, :]  # [b, 1, 1, k]
    masks = [m for m in (causal, padding, self.extra) if m is not None]
    return functools.reduce(jnp.logical_and, masks) if masks else None


def segment_mask(query_segments: jax.Array, key_segments: jax.Array) -> jax.Array:
  """[b, q], [b, k] int -> [b, 1, q, k]: packed sentences never attend across each other."""
  return (query_segments[:, :, None] == key_segments[:, None, :])[:, None]


class Layout:
  """Where Eq. 1's operands lie: its two products, with the logits [b, h, q, k] between them.
  This one: query [b, q, h, d_k], key [b, k, h, d_k], value [b, k, h, d_v] -> [b, q, h, d_v]."""

  def logits(self, query: jax.Array, key: jax.Array) -> jax.Array:
    return jnp.einsum("bqhd,bkhd->bhqk", query, key, preferred_element_type=jnp.float32)

  def combine(self, weights: jax.Array, value: jax.Array) -> jax.Array:
    return jnp.einsum("bhqk,bkhd->bqhd", weights, value)


SEQUENCE = Layout()


def dot_product_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    mask: jax.Array | None,
    *,
    bias: jax.Array | None = None,
    layout: Layout = SEQUENCE,
    dropout_rng: jax.Array | None = None,
    dropout_rate: float = 0.0,
    deterministic: bool = True,
    return_weights: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
  """softmax(Q Kᵀ / √d_k + bias) V — §3.2.1, Eq. 1 (the paper has no bias), per head.

  query [b, q, h, d_k]; key and value as `layout` keeps them (default [b, k, h, d]); mask
  broadcastable to [b, h, q, k] -> [b, q, h, d_v], and with `return_weights` the weights
  [b, h, q, k] (float32, before dropout). Logits and softmax are float32 whatever the dtype.
  """
  depth = query.shape[-1]
  query = query / jnp.sqrt(depth).astype(query.dtype)
  logits = layout.logits(query, key)  # [b, h, q, k], float32
  if bias is not None:
    logits = logits + bias.astype(jnp.float32)
  if mask is not None:
    # A large negative rather than -inf keeps fully-masked rows (padding queries) finite.
    logits = jnp.where(mask, logits, jnp.finfo(jnp.float32).min)
  probabilities = jax.nn.softmax(logits, axis=-1)  # [b, h, q, k], float32
  weights = probabilities
  if not deterministic and dropout_rate > 0.0:
    keep = jax.random.bernoulli(dropout_rng, 1.0 - dropout_rate, weights.shape)
    weights = jnp.where(keep, weights / (1.0 - dropout_rate), 0.0)
  out = layout.combine(weights.astype(value.dtype), value)  # [b, q, h, d_v]
  return (out, probabilities) if return_weights else out


# The fused kernels were checked equal to `dot_product_attention` (tests/test_fused_attention.py)
# as its source reads at this digest: after an edit no fused kernel stands in for it, so the
# edit reaches GPU training too; run those tests and update the digest to have them again.
FUSED_CHECKED_AGAINST = "a9a34bbe4d3db1d3cc13815aa117b5717f58a5fb781b407a650e3926e3d23790"


def fused_kernels_match() -> bool:
  """Whether `dot_product_attention` is still the function the fused kernels were checked
  against (`FUSED_CHECKED_AGAINST`)."""
  return kernels.source_digest(dot_product_attention) == FUSED_CHECKED_AGAINST


class CachedKeys(NamedTuple):
  """What a decoding cache (`TransformerConfig.cache`) gives one step's attention: the keys and
  values so far in its `layout`, over b' groups of queries (a step's r rows are r / b' queries of
  each: a sentence's beams, or 1), `mask` broadcastable to [b', h, r / b', k], and the keys'
  positions [b' | 1, k] (None for cross-attention)."""

  key: jax.Array
  value: jax.Array
  mask: jax.Array | None
  key_positions: jax.Array | None
  layout: Layout


class MultiHeadAttention(nn.Module):
  """MultiHead(Q, K, V) = Concat(head_1..head_h) Wᴼ, head_i = Attention(Q W_iᵠ, K W_iᴷ, V W_iⱽ).

  §3.2.2; the projections carry no bias (pure matrices in the paper). `kind`: "encoder",
  "causal" (decoder self-attention) or "cross". In decode mode a `config.cache` module keeps the
  keys and values: given a step's (cross: the encoder's, on the first step only) and the source's
  padding, it returns `CachedKeys` (docs/changing_the_model.md)."""

  config: TransformerConfig
  kind: str = "encoder"

  def bias(self, query_positions: jax.Array, key_positions: jax.Array | None) -> Any:
    """A term [b | 1, h, q, k] added to the logits, from the positions of queries [b | 1, q] and
    keys [b | 1, k] (None: cross-attention); none in the paper. A variant overrides it."""
    del query_positions, key_positions
    return None

  @nn.compact
  def __call__(
      self,
      inputs_q: jax.Array,  # [b, q, e]
      inputs_kv: jax.Array | None,  # [b, k, e]; None: the cache's cross-attention keys
      mask: AttentionMask | jax.Array | None,  # or a dense [b | 1, 1, q, k] bool array
      positions: jax.Array | None = None,  # [b | 1, q] int: the queries' (and self-keys') positions
  ) -> jax.Array:
    cfg = self.config
    query = self._project("query", inputs_q, cfg.head_key_dim)  # [b, q, h, d_k]
    key = value = None
    if inputs_kv is not None:
      key = self._project("key", inputs_kv, cfg.head_key_dim)  # [b, k, h, d_k]
      value = self._project("value", inputs_kv, cfg.head_value_dim)  # [b, k, h, d_v]
    if positions is None:
      positions = jnp.arange(query.shape[1])[None]  # [1, q]
    key_positions = None if self.kind == "cross" else positions
    if cfg.decode and self.kind != "encoder":
      if cfg.cache is None:
        raise ValueError("decode mode needs config.cache, a decoding cache module (decoding/)")
      valid = mask.key_valid if isinstance(mask, AttentionMask) else None
      cache = cfg.cache(kind=self.kind, name="kv_cache")
      if not self.is_initializing():
        return self._output_projection(self._cached(cache(key, value, valid), query, positions))
      cache(key, value, valid)  # model init in decode mode: creates the cache (shapes only)
      mask = None if self.kind == "causal" else mask
    return self._output_projection(self._attend(query, key, value, mask, positions, key_positions))

  def _attend(self, query, key, value, mask, positions, key_positions) -> jax.Array:
    """Eq. 1 over whole sequences by the configured implementation -> [b, q, h, d_v]."""
    cfg = self.config
    query = nn.with_logical_constraint(
        query, (sharding.BATCH, sharding.LENGTH, sharding.HEADS, sharding.KV)
    )
    bias = self.bias(positions, key_positions)
    if isinstance(mask, AttentionMask) and mask.bias is not None:
      bias = mask.bias if bias is None else mask.bias + bias
    dropout = not cfg.deterministic and cfg.attention_dropout_rate > 0.0
    # Applying with mutable=["intermediates"] records every layer's attention weights
    # [b, h, q, k] as "attention_weights" (transformer_jax/plot_attention.py); only the einsum
    # path has them. Otherwise sow is never reached and costs nothing.
    capture = self.is_mutable_collection("intermediates")
    fused = kernels.fused_attention(
        cfg, query, key, value, mask, bias, dropout=dropout, capture=capture,
        eq1_unchanged=fused_kernels_match(),
    )  # fmt: skip
    if fused is not None:
      return fused
    if isinstance(mask, AttentionMask):
      mask = mask.dense(query.shape[1])
    out, weights = dot_product_attention(
        query,
        key,
        value,
        mask,
        bias=bias,
        dropout_rng=self.make_rng("dropout") if dropout else None,
        dropout_rate=cfg.attention_dropout_rate,
        deterministic=cfg.deterministic,
        return_weights=True,
    )  # [b, q, h, d_v], [b, h, q, k]
    if capture:
      self.sow("intermediates", "attention_weights", weights)
    return out

  def _cached(self, keys: CachedKeys, query: jax.Array, positions: jax.Array) -> jax.Array:
    """One decoding step: query [r, 1, h, d_k] against the cache -> [r, 1, h, d_v]."""
    groups = keys.key.shape[0]  # b': the cache's groups of queries
    query = query.reshape((groups, -1) + query.shape[2:])  # [b', r / b', h, d_k]
    positions = jnp.broadcast_to(positions, (query.shape[0] * query.shape[1], 1))
    bias = self.bias(positions.reshape(groups, -1), keys.key_positions)
    out, weights = dot_product_attention(
        query, keys.key, keys.value, keys.mask, bias=bias, layout=keys.layout, return_weights=True
    )  # [b', r / b', h, d_v], [b', h, r / b', k]
    if self.is_mutable_collection("intermediates"):
      self.sow("intermediates", "attention_weights", weights)
    return out.reshape((-1, 1) + out.shape[2:])  # [r, 1, h, d_v]

  def _project(self, name: str, x: jax.Array, head_dim: int) -> jax.Array:
    """x [b, q, e] @ W [e, h, d] -> [b, q, h, d]: W^Q, W^K or W^V of all heads, Glorot-uniform
    (fan-in e, fan-out h*d)."""
    cfg = self.config
    axes = (sharding.EMBED, sharding.HEADS, sharding.KV)
    kernel = self._kernel(name, (cfg.d_model, cfg.num_heads, head_dim), axes, 0, (1, 2))
    return kernels.einsum(cfg, "bqe,ehd->bqhd", x.astype(cfg.dtype), kernel)

  def _kernel(self, name, shape, axes, in_axis, out_axis) -> jax.Array:
    cfg = self.config
    init = nn.initializers.xavier_uniform(in_axis=in_axis, out_axis=out_axis)
    kernel = self.param(name, nn.with_logical_partitioning(init, axes), shape, cfg.param_dtype)
    return jnp.asarray(kernel, cfg.dtype)

  def _output_projection(self, out: jax.Array) -> jax.Array:
    """Concat(head_1..head_h) Wᴼ: out [b, q, h, d_v] -> [b, q, e]."""
    cfg = self.config
    axes = (sharding.HEADS, sharding.KV, sharding.EMBED)
    shape = (cfg.num_heads, cfg.head_value_dim, cfg.d_model)
    w_out = self._kernel("out", shape, axes, (0, 1), 2)  # W^O [h, d_v, e]
    return kernels.einsum(cfg, "bqhd,hde->bqe", out, w_out)  # [b, q, e]
