"""Attention through `jax.nn.dot_product_attention` equals the einsum reference.

On CPU the fused call runs with implementation="xla" (cuDNN needs an NVIDIA GPU): this checks the
translation of our masks into its arguments (key lengths, `is_causal`, a dense mask for packed
segments), which is what the cuDNN path shares. `attention_implementation`'s choices are checked
as a table, including the GPU cases, without a GPU.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax.kernels import attention_implementation, fused_dot_product_attention
from transformer_jax.model.attention import AttentionMask, dot_product_attention, segment_mask
from transformer_jax.model.config import TransformerConfig
from transformer_jax.model.transformer import Transformer

B, T, H, D = 3, 6, 2, 8  # batch, length, heads, head dim
CONFIG = TransformerConfig(
    vocab_size=40, d_model=32, num_heads=4, num_layers=1, d_ff=64, max_len=32, deterministic=True
)


def random_qkv(seed=0):
  rng = np.random.default_rng(seed)
  return tuple(jnp.asarray(rng.standard_normal((B, T, H, D)), jnp.float32) for _ in range(3))


KEY_VALID = jnp.asarray([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0], [1, 0, 0, 0, 0, 0]], bool)
SEGMENTS = jnp.asarray([[1, 1, 1, 2, 2, 2], [1, 1, 2, 2, 0, 0], [1, 0, 0, 0, 0, 0]], jnp.int32)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("packed", [False, True])
def test_fused_xla_equals_einsum(causal, packed):
  q, k, v = random_qkv()
  mask = AttentionMask(
      key_valid=KEY_VALID,
      extra=segment_mask(SEGMENTS, SEGMENTS) if packed else None,
      causal=causal,
  )
  expected = dot_product_attention(q, k, v, mask.dense(T))  # [b, q, h, d]
  got = fused_dot_product_attention(q, k, v, mask, implementation="xla")
  np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_fused_accepts_a_plain_dense_mask():
  q, k, v = random_qkv(1)
  dense = AttentionMask(key_valid=KEY_VALID, causal=True).dense(T)  # [b, 1, q, k]
  expected = dot_product_attention(q, k, v, dense)
  got = fused_dot_product_attention(q, k, v, dense, implementation="xla")
  np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_an_all_padding_row_stays_finite():
  """Fixed-shape eval batches end with all-PAD filler rows: key length 0 becomes 1, not NaN."""
  q, k, v = random_qkv(2)
  mask = AttentionMask(key_valid=jnp.zeros((B, T), bool))
  assert np.all(np.isfinite(fused_dot_product_attention(q, k, v, mask, implementation="xla")))


def example(packed: bool):
  rng = np.random.default_rng(0)
  inputs = rng.integers(3, 40, size=(B, 7)).astype(np.int32)
  inputs[1, 4:] = 0  # padding is trailing, as every batch this package builds
  decoder_inputs = rng.integers(3, 40, size=(B, T)).astype(np.int32)
  decoder_inputs[:, 0] = 1
  decoder_inputs[1, 3:] = 0
  inputs[2, :] = decoder_inputs[2, :] = 0  # an all-padding filler row, as in eval batches
  kwargs = {}
  if packed:  # two sentences in row 0
    kwargs = {
        "inputs_segmentation": jnp.asarray((inputs != 0) * np.array([1, 1, 1, 2, 2, 2, 2])),
        "targets_segmentation": jnp.asarray((decoder_inputs != 0) * np.array([1, 1, 1, 2, 2, 2])),
        "inputs_positions": jnp.asarray([[0, 1, 2, 0, 1, 2, 3]] * B),
        "targets_positions": jnp.asarray([[0, 1, 2, 0, 1, 2]] * B),
    }
  return inputs, decoder_inputs, kwargs


@pytest.mark.slow  # 10-60 s on 2 cores: .ci/run runs it after the default suite
def test_model_logits_and_gradients_agree_across_implementations():
  # Packed rows with trailing padding: every piece of the mask goes through the fused call (key
  # lengths, is_causal, and the segment mask as a dense mask). Unpacked: see the tests above.
  inputs, decoder_inputs, kwargs = example(packed=True)
  params = Transformer(CONFIG).init(jax.random.key(0), inputs, decoder_inputs, **kwargs)["params"]
  weights = jnp.asarray(decoder_inputs != 0, jnp.float32)[..., None]  # loss only on real tokens

  def loss_and_logits(params, impl):
    logits = Transformer(CONFIG.replace(attention_impl=impl)).apply(
        {"params": params}, inputs, decoder_inputs, **kwargs
    )
    return jnp.sum(jax.nn.log_softmax(logits) * weights), logits

  # Backend optimisations double XLA:CPU's compile time of this tiny program for nothing.
  grad_fn = jax.jit(
      jax.grad(loss_and_logits, has_aux=True),
      static_argnums=1,
      compiler_options={"xla_backend_optimization_level": 0},
  )
  grads_einsum, logits_einsum = grad_fn(params, "einsum")
  grads_xla, logits_xla = grad_fn(params, "xla")
  real = np.asarray(decoder_inputs != 0)  # padding positions' outputs are never used
  np.testing.assert_allclose(
      np.asarray(logits_xla)[real], np.asarray(logits_einsum)[real], rtol=1e-5, atol=1e-5
  )
  for g_xla, g_einsum in zip(jax.tree.leaves(grads_xla), jax.tree.leaves(grads_einsum)):
    # Summed (not averaged) loss: gradients reach ~50, so float32 noise is ~1e-5 absolute.
    np.testing.assert_allclose(g_xla, g_einsum, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "impl,kwargs,expected",
    [
        ("auto", dict(platform="cpu"), "einsum"),
        ("auto", dict(platform="tpu"), "einsum"),
        ("auto", dict(platform="gpu"), "cudnn"),
        ("auto", dict(platform="gpu", dtype=jnp.float32), "einsum"),  # cuDNN: half precision only
        ("auto", dict(platform="gpu", head_dim=12), "einsum"),  # head_dim % 8 != 0
        ("auto", dict(platform="gpu", head_dim=256), "einsum"),
        ("auto", dict(platform="gpu", dense_mask=True), "einsum"),  # packed segments
        ("auto", dict(platform="gpu", decode=True), "einsum"),
        ("auto", dict(platform="gpu", dropout=True), "einsum"),
        ("cudnn", dict(platform="gpu"), "cudnn"),
        ("cudnn", dict(platform="gpu", dense_mask=True), "cudnn"),  # as an additive bias
        ("cudnn", dict(platform="gpu", dropout=True), "einsum"),
        ("xla", dict(platform="gpu"), "xla"),
        ("xla", dict(platform="cpu", decode=True), "einsum"),
        ("einsum", dict(platform="gpu"), "einsum"),
    ],
)
def test_implementation_choice(impl, kwargs, expected):
  args = dict(dtype=jnp.bfloat16, head_dim=64, decode=False, dropout=False, dense_mask=False)
  assert attention_implementation(impl, **{**args, **kwargs}) == expected


def test_cudnn_where_it_cannot_run_fails_with_the_reason():
  args = dict(dtype=jnp.bfloat16, head_dim=64, decode=False, dropout=False, dense_mask=False)
  with pytest.raises(ValueError, match="NVIDIA GPU"):
    attention_implementation("cudnn", **args, platform="cpu")
  with pytest.raises(ValueError, match="float32"):
    attention_implementation("cudnn", **{**args, "dtype": jnp.float32}, platform="gpu")
  with pytest.raises(ValueError, match="attention_impl"):
    CONFIG.replace(attention_impl="flash")
