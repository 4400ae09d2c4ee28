"""Attention against hand-written numpy: Eq. 1 (§3.2.1), the masks, and multi-head (§3.2.2)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax.model.attention import (
    AttentionMask,
    MultiHeadAttention,
    dot_product_attention,
    segment_mask,
)
from transformer_jax.model.config import TransformerConfig

B, Q, K, H, D = 2, 3, 5, 2, 4  # batch, query length, key length, heads, head dim


def numpy_softmax(x):
  x = x - x.max(axis=-1, keepdims=True)
  e = np.exp(x)
  return e / e.sum(axis=-1, keepdims=True)


def numpy_attention(q, k, v, mask=None):
  """softmax(Q Kᵀ / √d_k) V for one head: q [Q, d], k [K, d], v [K, d_v], mask [Q, K] bool."""
  scores = q @ k.T / np.sqrt(q.shape[-1])  # [Q, K]
  if mask is not None:
    scores = np.where(mask, scores, -np.inf)
  return numpy_softmax(scores) @ v  # [Q, d_v]


def random_qkv(seed=0):
  rng = np.random.default_rng(seed)
  return (
      rng.standard_normal((B, Q, H, D)).astype(np.float32),
      rng.standard_normal((B, K, H, D)).astype(np.float32),
      rng.standard_normal((B, K, H, D)).astype(np.float32),
  )


def reference(q, k, v, mask=None):
  """Eq. 1 applied to each (batch, head) separately. mask [B, 1, Q, K] or None."""
  out = np.zeros_like(q, dtype=np.float64)
  for b in range(B):
    for h in range(H):
      m = None if mask is None else np.asarray(mask)[b, 0]
      out[b, :, h] = numpy_attention(
          q[b, :, h].astype(np.float64),
          k[b, :, h].astype(np.float64),
          v[b, :, h].astype(np.float64),
          m,
      )
  return out


def padding_mask(valid):
  return AttentionMask(key_valid=jnp.asarray(valid)).dense(Q)


def test_dot_product_attention_is_equation_1():
  q, k, v = random_qkv()
  np.testing.assert_allclose(dot_product_attention(q, k, v, None), reference(q, k, v), atol=1e-5)


def test_dot_product_attention_with_mask():
  q, k, v = random_qkv(1)
  valid = np.array([[True] * 5, [True, True, True, False, False]])
  extra = jnp.ones((B, 1, Q, K), bool).at[0, 0, 0, 4].set(False)
  mask = np.asarray(AttentionMask(key_valid=jnp.asarray(valid), extra=extra).dense(Q))
  np.testing.assert_allclose(
      dot_product_attention(q, k, v, mask), reference(q, k, v, mask), atol=1e-5
  )


def test_masked_keys_get_exactly_zero_weight():
  q, k, _ = random_qkv(2)
  # One-hot values (value j = e_j) make the output equal to the attention weights.
  value = np.broadcast_to(np.eye(K, dtype=np.float32)[None, :, None, :], (B, K, H, K))
  valid = np.array([[True, True, False, True, False], [True, False, False, False, False]])
  weights = np.asarray(dot_product_attention(q, k, value, padding_mask(valid)))
  assert weights.shape == (B, Q, H, K)  # [b, q, h, k]
  for b in range(B):
    assert np.all(weights[b, :, :, ~valid[b]] == 0.0)
    assert np.all(weights[b, :, :, valid[b]] > 0.0)
  np.testing.assert_allclose(weights.sum(-1), 1.0, atol=1e-6)
  np.testing.assert_array_equal(weights[1, :, :, 0], 1.0)  # a single visible key takes it all


def test_causal_mask():
  mask = AttentionMask(causal=True).dense(3)
  np.testing.assert_array_equal(mask[0, 0], [[1, 0, 0], [1, 1, 0], [1, 1, 1]])
  assert mask.shape == (1, 1, 3, 3)


def test_padding_mask():
  valid = jnp.array([[True, True, False], [True, False, False]])
  mask = padding_mask(valid)
  assert mask.shape == (2, 1, 1, 3)  # broadcasts over heads and queries
  np.testing.assert_array_equal(mask[:, 0, 0], valid)


def test_segment_mask():
  queries = jnp.array([[1, 1, 2, 0]])
  keys = jnp.array([[1, 2, 2]])
  mask = segment_mask(queries, keys)
  assert mask.shape == (1, 1, 4, 3)
  np.testing.assert_array_equal(mask[0, 0], [[1, 0, 0], [1, 0, 0], [0, 1, 1], [0, 0, 0]])


def test_dense_mask_combines_its_pieces():
  assert AttentionMask().dense(2) is None
  combined = AttentionMask(causal=True, extra=jnp.array([[[[True, False]]]])).dense(2)
  np.testing.assert_array_equal(combined[0, 0], [[1, 0], [1, 0]])
  valid = jnp.array([[True, True, False]])
  combined = AttentionMask(key_valid=valid, causal=True).dense(3)
  np.testing.assert_array_equal(combined[0, 0], [[1, 0, 0], [1, 1, 0], [1, 1, 0]])


@pytest.mark.parametrize("with_mask", [False, True])
def test_multi_head_attention_is_concat_of_heads_times_w_o(with_mask):
  """§3.2.2: MultiHead(Q, K, V) = Concat(head_1..head_h) Wᴼ,
  head_i = Attention(QW_iᵠ, KW_iᴷ, VW_iⱽ)."""
  config = TransformerConfig(
      vocab_size=10, d_model=8, num_heads=H, num_layers=1, d_ff=16, deterministic=True
  )
  rng = np.random.default_rng(3)
  x_q = rng.standard_normal((B, Q, 8)).astype(np.float32)
  x_kv = rng.standard_normal((B, K, 8)).astype(np.float32)
  mask = padding_mask([[True] * 5, [True, True, False, False, False]])
  mask = mask if with_mask else None
  module = MultiHeadAttention(config, kind="cross")
  # Random values on the module's own parameter tree (shapes via eval_shape: nothing compiled).
  shapes = nn.unbox(jax.eval_shape(module.init, jax.random.key(0), x_q, x_kv, mask)["params"])
  assert set(shapes) == {"query", "key", "value", "out"}  # §3.2.2: no biases
  params = jax.tree.map(lambda s: rng.standard_normal(s.shape).astype(np.float32) * 0.5, shapes)
  out = module.apply({"params": params}, x_q, x_kv, mask)  # [b, q, e]

  w_q, w_k, w_v = (np.asarray(params[n], np.float64) for n in ("query", "key", "value"))
  w_o = np.asarray(params["out"], np.float64).reshape(H * D, 8)  # [h*d, e], head-major rows
  expected = np.zeros((B, Q, 8))
  for b in range(B):
    m = None if mask is None else np.asarray(mask)[b, 0]
    heads = [
        numpy_attention(x_q[b] @ w_q[:, h], x_kv[b] @ w_k[:, h], x_kv[b] @ w_v[:, h], m)
        for h in range(H)
    ]  # h × [Q, d]
    expected[b] = np.concatenate(heads, axis=-1) @ w_o  # [Q, h*d] @ [h*d, e]
  np.testing.assert_allclose(out, expected, atol=1e-5)


@pytest.mark.slow  # ~6 s on 2 cores: .ci/run runs it after the default suite
def test_recorded_attention_weights_are_the_distributions_the_model_uses():
  """Applying with mutable intermediates records every layer's weights without changing the
  output: rows are distributions, padding keys get nothing, the decoder's self-attention is
  causal, and each kind has its shape."""
  from testing import random_params

  from transformer_jax.data.tokenizer import PAD_ID
  from transformer_jax.model.transformer import Transformer
  from transformer_jax.plot_attention import attention_weights

  config = TransformerConfig(
      vocab_size=20, d_model=16, num_heads=2, num_layers=2, d_ff=32, max_len=16, deterministic=True
  )
  params = random_params(config)
  source, target = [5, 6, 7, 8, 1], [9, 10, 11, 1]  # each ends with EOS
  maps = attention_weights(config, params, source, target)
  assert sorted(maps) == sorted(
      f"{stack}/layer_{i}/{kind}"
      for i in range(2)
      for stack, kind in [
          ("encoder", "self_attention"),
          ("decoder", "self_attention"),
          ("decoder", "cross_attention"),
      ]
  )
  assert maps["encoder/layer_1/self_attention"].shape == (2, 5, 5)
  assert maps["decoder/layer_0/cross_attention"].shape == (2, 4, 5)
  for weights in maps.values():
    np.testing.assert_allclose(weights.sum(-1), 1.0, atol=1e-5)
  causal = maps["decoder/layer_1/self_attention"]
  assert np.all(causal[:, np.triu_indices(4, k=1)[0], np.triu_indices(4, k=1)[1]] == 0)

  model = Transformer(config)
  inputs = np.asarray([source + [PAD_ID, PAD_ID]], np.int32)  # padded source
  decoder_inputs = np.asarray([[2, 9, 10, 11]], np.int32)
  plain = model.apply({"params": params}, inputs, decoder_inputs)
  recorded, state = model.apply(
      {"params": params}, inputs, decoder_inputs, mutable=["intermediates"]
  )
  np.testing.assert_allclose(recorded, plain, atol=1e-5)
  cross = state["intermediates"]["decoder"]["layer_0"]["cross_attention"]["attention_weights"][0]
  assert np.all(np.asarray(cross)[..., 5:] == 0)  # padding keys get no weight
