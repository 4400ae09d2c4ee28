"""Multi-head scaled dot-product attention (§3.2) and its masks.

Einsum letters used throughout:
  b batch, q query length, k key length, h heads, d head dim (d_k = d_v = d_model / h),
  e model dim (d_model).

Masks are boolean arrays broadcastable to [batch, heads, q_len, k_len]; True means "may attend".
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import flax.linen as nn
import jax
import jax.numpy as jnp

from transformer_jax import sharding

if TYPE_CHECKING:  # avoid a circular import at run time; model.py imports this module.
  from transformer_jax.model import TransformerConfig

# Glorot/Xavier uniform, as in tensor2tensor's Transformer; the paper does not state an init.
default_kernel_init = nn.initializers.xavier_uniform()


# ----------------------------------------------------------------------------- masks


def padding_mask(query_valid: jax.Array, key_valid: jax.Array) -> jax.Array:
  """[b, q] bool, [b, k] bool -> [b, 1, q, k]: a query may see every non-pad key.

  Queries at padding positions get all-False rows only where every key is padding; their outputs
  are never used (their loss weight is 0), so no special care is needed beyond a finite softmax.
  """
  del query_valid  # Padding queries produce ignored outputs; masking them changes nothing.
  return key_valid[:, None, None, :]


def causal_mask(length: int) -> jax.Array:
  """[1, 1, L, L]: position i attends to positions <= i (§3.2.3, decoder self-attention)."""
  idx = jnp.arange(length)
  return (idx[:, None] >= idx[None, :])[None, None]


def segment_mask(query_segments: jax.Array, key_segments: jax.Array) -> jax.Array:
  """[b, q], [b, k] int -> [b, 1, q, k]: packed sentences never attend across each other."""
  return (query_segments[:, :, None] == key_segments[:, None, :])[:, None]


def combine_masks(*masks: jax.Array | None) -> jax.Array | None:
  masks = [m for m in masks if m is not None]
  if not masks:
    return None
  return functools.reduce(jnp.logical_and, masks)


# ----------------------------------------------------------------------------- attention


def dot_product_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    mask: jax.Array | None,
    *,
    dropout_rng: jax.Array | None = None,
    dropout_rate: float = 0.0,
    deterministic: bool = True,
) -> jax.Array:
  """softmax(Q Kᵀ / √d_k) V — §3.2.1, Eq. 1, per head.

  query [b, q, h, d], key/value [b, k, h, d] -> [b, q, h, d]. The logits and softmax are computed
  in float32 whatever the compute dtype, so bf16 training keeps an exact-enough normalisation.
  """
  depth = query.shape[-1]
  query = query / jnp.sqrt(depth).astype(query.dtype)
  logits = jnp.einsum("bqhd,bkhd->bhqk", query, key, preferred_element_type=jnp.float32)  # [b,h,q,k]
  if mask is not None:
    # A large negative rather than -inf keeps fully-masked rows (padding queries) finite.
    logits = jnp.where(mask, logits, jnp.finfo(jnp.float32).min)
  weights = jax.nn.softmax(logits, axis=-1)  # [b, h, q, k], float32
  if not deterministic and dropout_rate > 0.0:
    keep = jax.random.bernoulli(dropout_rng, 1.0 - dropout_rate, weights.shape)
    weights = jnp.where(keep, weights / (1.0 - dropout_rate), 0.0)
  weights = weights.astype(value.dtype)
  return jnp.einsum("bhqk,bkhd->bqhd", weights, value)  # [b, q, h, d]


class MultiHeadAttention(nn.Module):
  """MultiHead(Q, K, V) = Concat(head_1..head_h) Wᴼ, head_i = Attention(Q W_iᵠ, K W_iᴷ, V W_iⱽ).

  §3.2.2. The projections carry no bias: the paper defines them as pure matrices.

  Decoding (`config.decode=True`) keeps a cache in the "cache" collection for the decoder:
    * self-attention appends this step's key/value at `cache_index` (a KV cache, so each step
      costs O(length) instead of re-running the prefix);
    * encoder-decoder attention projects the encoder output once, on the first call that passes
      `inputs_kv`, and later calls pass `inputs_kv=None` to reuse the cached keys/values.
  """

  config: TransformerConfig
  # "encoder" (self-attention, never cached), "causal" (decoder self-attention, KV cache when
  # decoding), "cross" (encoder-decoder attention, projected once when decoding).
  kind: str = "encoder"

  @nn.compact
  def __call__(
      self,
      inputs_q: jax.Array,  # [b, q, e]
      inputs_kv: jax.Array | None,  # [b, k, e]; None = cached cross-attention keys/values
      mask: jax.Array | None,  # [b | 1, 1, q, k] bool
  ) -> jax.Array:
    cfg = self.config
    head_dim = cfg.d_model // cfg.num_heads

    def projection(name, shape, axes, in_axis, out_axis):
      init = nn.initializers.xavier_uniform(in_axis=in_axis, out_axis=out_axis)
      kernel = self.param(name, nn.with_logical_partitioning(init, axes), shape, cfg.param_dtype)
      return jnp.asarray(kernel, cfg.dtype)

    qkv_shape = (cfg.d_model, cfg.num_heads, head_dim)
    qkv_axes = (sharding.EMBED, sharding.HEADS, sharding.KV)
    # W^Q, W^K, W^V of all heads as one [e, h, d] tensor each (fan-in e, fan-out h*d).
    w_query, w_key, w_value = (
        projection(name, qkv_shape, qkv_axes, 0, (1, 2)) for name in ("query", "key", "value")
    )
    query = jnp.einsum("bqe,ehd->bqhd", inputs_q.astype(cfg.dtype), w_query)  # [b, q, h, d]

    def project_kv():
      kv = inputs_kv.astype(cfg.dtype)
      return (
          jnp.einsum("bke,ehd->bkhd", kv, w_key),  # [b, k, h, d]
          jnp.einsum("bke,ehd->bkhd", kv, w_value),  # [b, k, h, d]
      )

    if not cfg.decode or self.kind == "encoder":
      key, value = project_kv()
    elif self.kind == "causal":
      key, value, mask = self._append_to_cache(*project_kv())
    else:
      key, value = self._cross_attention_cache(project_kv if inputs_kv is not None else None)

    query = nn.with_logical_constraint(
        query, (sharding.BATCH, sharding.LENGTH, sharding.HEADS, sharding.KV)
    )
    dropout_rng = None
    if not cfg.deterministic and cfg.attention_dropout_rate > 0.0:
      dropout_rng = self.make_rng("dropout")
    out = dot_product_attention(
        query,
        key,
        value,
        mask,
        dropout_rng=dropout_rng,
        dropout_rate=cfg.attention_dropout_rate,
        deterministic=cfg.deterministic,
    )  # [b, q, h, d]
    w_out = projection(
        "out", (cfg.num_heads, head_dim, cfg.d_model), (sharding.HEADS, sharding.KV, sharding.EMBED),
        (0, 1), 2,
    )  # W^O
    return jnp.einsum("bqhd,hde->bqe", out, w_out)  # [b, q, e]

  def _append_to_cache(self, key, value):
    """Writes one step's key/value [b, 1, h, d] into the cache; returns the whole cache + mask.

    The cache is created (zeros) by an `init` call whose decoder input has the full decoding
    length, which fixes its shape [b, max_len, h, d].
    """
    is_initialized = self.has_variable("cache", "cached_key")
    cached_key = self.variable("cache", "cached_key", jnp.zeros, key.shape, key.dtype)
    cached_value = self.variable("cache", "cached_value", jnp.zeros, value.shape, value.dtype)
    cache_index = self.variable("cache", "cache_index", lambda: jnp.array(0, jnp.int32))
    if not is_initialized:  # the init call: shapes only, no decoding step to take.
      return key, value, None
    batch, max_len, _, _ = cached_key.value.shape
    if key.shape[1] != 1:
      raise ValueError(f"cached decoding takes one token per step, got length {key.shape[1]}")
    index = cache_index.value
    cached_key.value = jax.lax.dynamic_update_slice(cached_key.value, key, (0, index, 0, 0))
    cached_value.value = jax.lax.dynamic_update_slice(cached_value.value, value, (0, index, 0, 0))
    cache_index.value = index + 1
    # Causal mask for one query: keys written so far (positions <= index).
    mask = (jnp.arange(max_len) <= index)[None, None, None, :]  # [1, 1, 1, max_len]
    return cached_key.value, cached_value.value, jnp.broadcast_to(mask, (batch, 1, 1, max_len))

  def _cross_attention_cache(self, project_kv):
    """Encoder-decoder keys/values, projected once per sentence and then read from the cache."""
    if project_kv is not None:
      key, value = project_kv()
      self.put_variable("cache", "cross_key", key)
      self.put_variable("cache", "cross_value", value)
      return key, value
    if not self.has_variable("cache", "cross_key"):
      raise ValueError("cross-attention cache is empty: the first decoding step must pass encoded")
    return self.get_variable("cache", "cross_key"), self.get_variable("cache", "cross_value")
