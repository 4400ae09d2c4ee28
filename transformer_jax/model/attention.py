"""Multi-head scaled dot-product attention (§3.2) and its masks.

Einsum letters used throughout:
  b batch, q query length, k key length, h heads, d head dim (d_k for queries and keys, d_v for
  values and outputs; both d_model / h unless the config sets them), e model dim (d_model).

Masks are boolean arrays broadcastable to [batch, heads, q_len, k_len]; True means "may attend".
The model passes them as an `AttentionMask` (key padding, causality and any other dense mask
kept apart), so that a fused kernel can take padding as key lengths and causality as a flag
instead of a dense [b, 1, q, k] array.

Implementations (`TransformerConfig.attention_impl`, chosen per call by `attention_implementation`):
  einsum  the reference: two einsums and a float32 softmax (`dot_product_attention`).
  xla     `jax.nn.dot_product_attention(implementation="xla")`: the same math through JAX's API.
  cudnn   `jax.nn.dot_product_attention(implementation="cudnn")`: cuDNN's fused (flash) kernel on
          NVIDIA GPUs, bfloat16/float16 only; padding as sequence lengths, causal as `is_causal`.
  auto    cudnn where it applies (GPU, half precision, head_dim % 8 == 0 and <= 128, no
          packed-segment mask), einsum elsewhere.
Every implementation falls back to einsum with attention dropout (no fused kernel here takes
it) and in decode mode (one query against the KV cache, masked by the write index); `auto` also
uses einsum when d_k != d_v (Table 3 row (B)), which `jax.nn.dot_product_attention` does not take.
"""

from __future__ import annotations

import functools

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp

from transformer_jax.model import config as config_lib
from transformer_jax.model.config import ATTENTION_IMPLS, TransformerConfig
from transformer_jax.model.kv_cache import CrossAttentionCache, SelfAttentionCache
from transformer_jax.parallel import sharding

# Glorot/Xavier uniform, as in tensor2tensor's Transformer; the paper does not state an init.
default_kernel_init = nn.initializers.xavier_uniform()


# ----------------------------------------------------------------------------- masks


def padding_mask(key_valid: jax.Array) -> jax.Array:
  """[b, k] bool -> [b, 1, 1, k]: every query may see every non-pad key.

  Queries are not masked: a query at a padding position produces an output that is never used
  (its loss weight is 0), so masking it would change nothing but the cost. A row whose keys are
  all padding (a filler row of a fixed-shape eval batch) stays finite in the softmax.
  """
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


@flax.struct.dataclass
class AttentionMask:
  """What each query may attend to, kept in the pieces fused attention kernels take.

  key_valid: [b, k] bool or None. False marks padding keys. The fused paths turn it into key
    lengths, `key_valid.sum(-1)`, which is right because padding is trailing in every batch this
    package builds (`data/batching.py`, `decode.py`); the einsum path uses it as it is.
  causal: query i attends to keys <= i (§3.2.3). Static: it selects a kernel.
  extra: [b | 1, 1, q, k] bool or None: any other mask (packed-sequence segment masks).
  bias: [b | 1, h, q, k] float or None: added to the logits before the mask (the encoder's
    relative positions, `TransformerConfig.relative_positions`); not a mask, but it travels with
    one to every layer.
  """

  key_valid: jax.Array | None = None
  extra: jax.Array | None = None
  bias: jax.Array | None = None
  causal: bool = flax.struct.field(pytree_node=False, default=False)

  def dense(self, query_length: int) -> jax.Array | None:
    """The whole mask as one boolean array broadcastable to [b, 1, q, k] (None: attend to all)."""
    return combine_masks(
        causal_mask(query_length) if self.causal else None,
        None if self.key_valid is None else padding_mask(self.key_valid),
        self.extra,
    )

  def key_lengths(self) -> jax.Array | None:
    """[b] int32 number of non-padding keys; at least 1, so an all-padding row (a filler row of
    a fixed-shape eval batch) stays finite in every kernel. Its outputs are never used."""
    if self.key_valid is None:
      return None
    return jnp.maximum(jnp.sum(self.key_valid, axis=-1, dtype=jnp.int32), 1)


# ----------------------------------------------------------------------------- attention


def dot_product_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    mask: jax.Array | None,
    *,
    bias: jax.Array | None = None,
    dropout_rng: jax.Array | None = None,
    dropout_rate: float = 0.0,
    deterministic: bool = True,
    return_weights: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
  """softmax(Q Kᵀ / √d_k) V — §3.2.1, Eq. 1, per head; softmax(Q Kᵀ / √d_k + bias) V with a
  `bias` broadcastable to [b, h, q, k] (relative positions, a deviation).

  With `return_weights` also the attention weights [b, h, q, k] (float32, before dropout).

  query/key [b, q|k, h, d_k], value [b, k, h, d_v] -> [b, q, h, d_v]. The logits and softmax are
  computed in float32 whatever the compute dtype, so bf16 training keeps an exact-enough
  normalisation.
  """
  depth = query.shape[-1]
  query = query / jnp.sqrt(depth).astype(query.dtype)
  logits = jnp.einsum(
      "bqhd,bkhd->bhqk", query, key, preferred_element_type=jnp.float32
  )  # [b, h, q, k]
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
  weights = weights.astype(value.dtype)
  out = jnp.einsum("bhqk,bkhd->bqhd", weights, value)  # [b, q, h, d_v]
  return (out, probabilities) if return_weights else out


def cached_attention(
    query: jax.Array, key_t: jax.Array, value: jax.Array, mask: jax.Array | None
) -> tuple[jax.Array, jax.Array]:
  """Eq. 1 for decoding steps against a cache: softmax(Q Kᵀ / √d_k) V, per head.

  query [r, 1, h, d_k] with r = b * k rows (the k beams of each sentence, sentence-major, or
  k = 1), key_t [b, h, d_k, m], value [b, h, m, d_v], mask [b, k | 1, m] bool or None (every
  key) -> (out [r, 1, h, d_v], weights [b, h, k, m]): the cache holds one entry per sentence,
  so a sentence's k rows are k queries against it. The cache layouts make both products plain
  batched matmuls over (b, h): on a CPU the [b, m, h, d] layout cost a transposition of the
  whole cache per step and layer (~5x slower).
  """
  batch = key_t.shape[0]
  beams, rest = divmod(query.shape[0], batch)
  if rest or query.shape[1] != 1:
    raise ValueError(
        f"a decoding cache of batch {batch} cannot serve queries {query.shape[:2]}: "
        "expected [batch * beams, 1]"
    )
  depth = query.shape[-1]
  query = query.reshape((batch, beams) + query.shape[2:]) / jnp.sqrt(depth).astype(query.dtype)
  # Both products in the [batch..., rows, columns] form of a batched matmul, with the (small)
  # query and output transposed around them: an output in another order made XLA:CPU compute
  # the product transposed, without its fast matmul kernels (~3x slower per step).
  logits = jnp.einsum(
      "bhqd,bhdm->bhqm", query.transpose(0, 2, 1, 3), key_t, preferred_element_type=jnp.float32
  )  # [b, h, k, m]
  if mask is not None:
    logits = jnp.where(mask[:, None], logits, jnp.finfo(jnp.float32).min)
  weights = jax.nn.softmax(logits, axis=-1)  # [b, h, k, m], float32
  out = jnp.einsum("bhqm,bhmd->bhqd", weights.astype(value.dtype), value)  # [b, h, k, d_v]
  out = out.transpose(0, 2, 1, 3)  # [b, k, h, d_v]
  return out.reshape((batch * beams, 1) + out.shape[2:]), weights


def cudnn_unsupported_reason(dtype, head_dim: int, platform: str) -> str | None:
  """Why cuDNN's fused attention cannot run this call (None: it can). Checked before tracing
  the kernel, so `auto` falls back instead of failing inside jit."""
  if platform not in ("gpu", "cuda"):
    return f"cudnn attention needs an NVIDIA GPU; the default backend is {platform!r}"
  if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    return f"cudnn attention takes bfloat16/float16; model.dtype is {jnp.dtype(dtype).name}"
  if head_dim % 8 or head_dim > 128:
    return f"cudnn attention needs head_dim % 8 == 0 and <= 128; head_dim is {head_dim}"
  return None


def attention_implementation(
    impl: str,
    *,
    dtype,
    head_dim: int,
    decode: bool,
    dropout: bool,
    dense_mask: bool,
    platform: str | None = None,
    value_dim: int | None = None,
) -> str:
  """Resolves `attention_impl` for one call to 'einsum', 'xla' or 'cudnn' (see module docstring).

  `dense_mask`: the mask has a part only a dense array expresses (packed segments, a logit bias,
  or a caller's plain boolean mask). cuDNN then takes it as an additive bias, which `auto` does
  not choose.
  `head_dim` is d_k; `value_dim` is d_v when it differs (None: the same).
  """
  if impl not in ATTENTION_IMPLS:
    raise ValueError(f"attention_impl={impl!r}; expected one of {ATTENTION_IMPLS}")
  if impl == "einsum" or decode or dropout:
    return "einsum"
  if value_dim is not None and value_dim != head_dim:
    if impl != "auto":
      raise ValueError(
          f"attention_impl={impl!r} needs d_k == d_v (jax.nn.dot_product_attention); they are "
          f"{head_dim} and {value_dim}: use 'auto' or 'einsum'"
      )
    return "einsum"
  if impl == "xla":
    return "xla"
  platform = jax.default_backend() if platform is None else platform
  reason = cudnn_unsupported_reason(dtype, head_dim, platform)
  if impl == "cudnn":
    if reason:
      raise ValueError(f"attention_impl='cudnn': {reason}; use 'auto', 'xla' or 'einsum'")
    return "cudnn"
  return "einsum" if reason or dense_mask else "cudnn"


def fused_dot_product_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    mask: AttentionMask | jax.Array | None,
    *,
    implementation: str,
) -> jax.Array:
  """Eq. 1 through `jax.nn.dot_product_attention` ('xla' or 'cudnn').

  query [b, q, h, d], key/value [b, k, h, d] -> [b, q, h, d]. Padding goes in as key lengths and
  causality as `is_causal`, so cuDNN builds neither mask in memory; only `mask.extra` (or a plain
  boolean array) is passed densely.
  """
  if isinstance(mask, AttentionMask):
    dense, causal, key_lengths = mask.extra, mask.causal, mask.key_lengths()
    bias = mask.bias
  else:
    dense, causal, key_lengths, bias = mask, False, None, None
  if dense is not None:
    dense = jnp.broadcast_to(dense, (dense.shape[0], 1, query.shape[1], key.shape[1]))
  return jax.nn.dot_product_attention(
      query,
      key,
      value,
      bias=None if bias is None else bias.astype(query.dtype),
      mask=dense,
      is_causal=causal,
      key_value_seq_lengths=key_lengths,
      implementation=implementation,
  )  # [b, q, h, d]


class MultiHeadAttention(nn.Module):
  """MultiHead(Q, K, V) = Concat(head_1..head_h) Wᴼ, head_i = Attention(Q W_iᵠ, K W_iᴷ, V W_iⱽ).

  §3.2.2. The projections carry no bias: the paper defines them as pure matrices. In decode mode
  (`config.decode`) the decoder's attention reads its keys and values from a cache
  (kv_cache.py): self-attention appends each step's to a `SelfAttentionCache` (`cache_slots`:
  a beam search's slot table), encoder-decoder attention projects `inputs_kv` once into a
  `CrossAttentionCache` and later steps pass `inputs_kv=None`.
  """

  config: TransformerConfig
  # "encoder" (self-attention, never cached), "causal" (decoder self-attention), "cross"
  # (encoder-decoder attention).
  kind: str = "encoder"

  @nn.compact
  def __call__(
      self,
      inputs_q: jax.Array,  # [b, q, e]
      inputs_kv: jax.Array | None,  # [b, k, e]; None = cached cross-attention keys/values
      mask: AttentionMask | jax.Array | None,  # or a dense [b | 1, 1, q, k] bool array
      cache_slots: jax.Array | None = None,  # decoding, beam search: [b, beams, n] int32
  ) -> jax.Array:
    cfg = self.config
    key_dim, value_dim = cfg.head_key_dim, cfg.head_value_dim  # d_k, d_v (§3.2.2)
    query = self._project("query", inputs_q, key_dim)  # [b, q, h, d_k]
    key = value = None
    if inputs_kv is not None:
      key = self._project("key", inputs_kv, key_dim)  # [b, k, h, d_k]
      value = self._project("value", inputs_kv, value_dim)  # [b, k, h, d_v]
    cached = cfg.decode and self.kind != "encoder"
    if cached and not self.is_initializing():
      return self._output_projection(self._decode_step(query, key, value, mask, cache_slots))
    if cached:  # the init call of decode mode: creates the cache (shapes only)
      cache = SelfAttentionCache if self.kind == "causal" else CrossAttentionCache
      cache(name="kv_cache")(key, value)
      mask = None if self.kind == "causal" else mask
    return self._output_projection(self._attend(query, key, value, mask))

  def _attend(self, query, key, value, mask) -> jax.Array:
    """Eq. 1 by the configured implementation -> [b, q, h, d_v]."""
    cfg = self.config
    query = nn.with_logical_constraint(
        query, (sharding.BATCH, sharding.LENGTH, sharding.HEADS, sharding.KV)
    )
    dropout = not cfg.deterministic and cfg.attention_dropout_rate > 0.0
    impl = attention_implementation(
        cfg.attention_impl,
        dtype=cfg.dtype,
        head_dim=cfg.head_key_dim,
        value_dim=cfg.head_value_dim,
        decode=cfg.decode,
        dropout=dropout,
        dense_mask=mask is not None
        and (
            not isinstance(mask, AttentionMask) or mask.extra is not None or mask.bias is not None
        ),
    )
    # Applying with mutable=["intermediates"] records every layer's attention weights
    # [b, h, q, k] as "attention_weights" (for figures, transformer_jax/plot_attention.py);
    # only the einsum path has them. Otherwise sow is never reached and costs nothing.
    capture = self.is_mutable_collection("intermediates")
    if impl != "einsum" and not capture:
      return fused_dot_product_attention(query, key, value, mask, implementation=impl)
    bias = None
    if isinstance(mask, AttentionMask):
      mask, bias = mask.dense(query.shape[1]), mask.bias
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

  def _decode_step(self, query, key, value, mask, slots) -> jax.Array:
    """One decoding step against the cache: query [r, 1, h, d_k] -> [r, 1, h, d_v]."""
    if self.kind == "causal":
      key_t, value, attend = SelfAttentionCache(name="kv_cache")(key, value, slots)
    else:
      key_t, value = CrossAttentionCache(name="kv_cache")(key, value)
      valid = mask.key_valid if isinstance(mask, AttentionMask) else None
      attend = None if valid is None else valid[:, None, :]  # [b, 1, s]
    out, weights = cached_attention(query, key_t, value, attend)
    if self.is_mutable_collection("intermediates"):
      self.sow("intermediates", "attention_weights", weights)
    return out

  def _project(self, name: str, x: jax.Array, head_dim: int) -> jax.Array:
    """x [b, q, e] @ W [e, h, d] -> [b, q, h, d]: W^Q, W^K or W^V of all heads (fan-in e, fan-out
    h*d), Glorot-uniform, in cfg.dtype."""
    cfg = self.config
    axes = (sharding.EMBED, sharding.HEADS, sharding.KV)
    shape = (cfg.d_model, cfg.num_heads, head_dim)
    kernel = self._kernel(name, shape, axes, 0, (1, 2))
    return config_lib.einsum(cfg, "bqe,ehd->bqhd", x.astype(cfg.dtype), kernel)

  def _kernel(self, name, shape, axes, in_axis, out_axis) -> jax.Array:
    cfg = self.config
    init = nn.initializers.xavier_uniform(in_axis=in_axis, out_axis=out_axis)
    kernel = self.param(name, nn.with_logical_partitioning(init, axes), shape, cfg.param_dtype)
    return jnp.asarray(kernel, cfg.dtype)

  def _output_projection(self, out: jax.Array) -> jax.Array:
    """Concat(head_1..head_h) Wᴼ: out [b, q, h, d_v] -> [b, q, e]."""
    cfg = self.config
    w_out = self._kernel(
        "out",
        (cfg.num_heads, cfg.head_value_dim, cfg.d_model),
        (sharding.HEADS, sharding.KV, sharding.EMBED),
        (0, 1),
        2,
    )  # W^O [h, d_v, e]
    return config_lib.einsum(cfg, "bqhd,hde->bqe", out, w_out)  # [b, q, e]
