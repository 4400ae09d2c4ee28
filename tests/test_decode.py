"""Decoding: the KV-cached step equals the full forward pass; greedy search equals a naive loop.

Shapes match tests/test_model.py (batch 2, source 7, target 6), so in one pytest run the full
forward passes reuse the ops compiled there.
"""

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from testing import random_params
from variants import MODELS

from transformer_jax.data.tokenizer import BOS_ID, EOS_ID, PAD_ID
from transformer_jax.decoding.decoder import Decoder
from transformer_jax.decoding.search import greedy_search
from transformer_jax.model.transformer import Transformer, TransformerConfig

CONFIG = TransformerConfig(
    vocab_size=40, d_model=32, num_heads=4, num_layers=2, d_ff=64, max_len=32, deterministic=True
)
BATCH, SOURCE_LEN, TARGET_LEN = 2, 7, 6


def source(seed):
  inputs = np.random.default_rng(seed).integers(3, 40, size=(BATCH, SOURCE_LEN)).astype(np.int32)
  inputs[1, 4:] = PAD_ID  # the cross-attention cache must respect source padding
  return inputs


@pytest.mark.parametrize(
    "variant,name",
    [
        ({"norm_position": "post"}, "stock"),
        ({"norm_position": "pre"}, "stock"),
        ({"key_dim": 4, "value_dim": 12}, "stock"),
        ({"norm_position": "post"}, "alibi"),
    ],
    # d_k != d_v: Table 3 row (B)'s caches; alibi: a variant of attention (tests/variants.py)
    ids=["post", "pre", "dk4_dv12", "alibi"],
)
def test_cached_decoding_equals_full_forward(variant, name):
  config = CONFIG.replace(**variant)
  model = MODELS[name](config)
  params = random_params(config, model=MODELS[name])
  inputs = source(0)
  rng = np.random.default_rng(1)
  decoder_inputs = rng.integers(3, 40, size=(BATCH, TARGET_LEN)).astype(np.int32)  # no padding
  decoder_inputs[:, 0] = BOS_ID
  logits = model.apply({"params": params}, inputs, decoder_inputs)  # [b, t, v]
  expected = jax.nn.log_softmax(logits, axis=-1)

  decoder = Decoder(model)
  encoded = decoder.encode(params, inputs)  # [b, s, e]
  cache = decoder.init_cache(inputs, TARGET_LEN)
  for t in range(TARGET_LEN):
    # The encoder output goes in on the first step only; later steps read the cross-attention cache.
    log_probs, cache = decoder.step(
        params, cache, encoded if t == 0 else None, inputs, decoder_inputs[:, t], t
    )
    assert log_probs.shape == (BATCH, 40) and log_probs.dtype == jnp.float32
    np.testing.assert_allclose(log_probs, expected[:, t], atol=1e-5, err_msg=f"position {t}")
  indices = [n.index for n in flax.traverse_util.flatten_dict(cache).values() if not n.invariant]
  assert len(indices) == 2 and all(int(i) == TARGET_LEN for i in indices)  # one per layer


def naive_greedy(model, params, inputs, length):
  """Argmax decoding by re-running the full model on the prefix decoded so far.

  The prefix is held in a fixed [b, length] array whose tail is PAD: causality (test_model.py)
  makes position t blind to the tail, and the fixed shape keeps this loop from recompiling.
  """
  decoder_inputs = np.full((inputs.shape[0], length), PAD_ID, np.int32)
  decoder_inputs[:, 0] = BOS_ID
  out = np.full((inputs.shape[0], length), PAD_ID, np.int32)
  finished = np.zeros(inputs.shape[0], bool)
  for t in range(length):
    logits = model.apply({"params": params}, inputs, decoder_inputs)  # [b, length, v]
    token = np.argmax(logits[:, t], axis=-1)  # [b]
    out[:, t] = np.where(finished, PAD_ID, token)
    finished |= token == EOS_ID
    if t + 1 < length:
      decoder_inputs[:, t + 1] = token
  return out


@pytest.mark.slow  # ~6 s on 2 cores: .ci/run runs it after the default suite
def test_greedy_search_equals_naive_loop():
  # Untied output projection: with a shared embedding a random model tends to repeat its input
  # token forever, which would make the comparison vacuous.
  config = CONFIG.replace(share_embeddings=False)
  params = random_params(config, seed=3)
  model = Transformer(config)
  inputs = source(3)
  free_running = naive_greedy(model, params, inputs, TARGET_LEN)
  stop_after = free_running[0, 2]
  assert stop_after not in free_running[0, :2], "pick a seed whose greedy output varies"
  # Make EOS a slightly stronger copy of that token: row 0 now ends at position 2.
  kernel = params["output_projection"]["kernel"]  # [e, v]
  params["output_projection"]["kernel"] = kernel.at[:, EOS_ID].set(1.05 * kernel[:, stop_after])

  expected = naive_greedy(model, params, inputs, TARGET_LEN)
  np.testing.assert_array_equal(expected[0], [*free_running[0, :2], EOS_ID, PAD_ID, PAD_ID, PAD_ID])
  assert EOS_ID not in expected[1]  # row 1 runs to the end, past row 0's EOS
  out, steps = greedy_search(Decoder(Transformer(config)), params, inputs, TARGET_LEN)
  assert out.shape == (BATCH, TARGET_LEN) and out.dtype == jnp.int32
  assert int(steps) == TARGET_LEN  # row 1 never ends: every position is decoded
  np.testing.assert_array_equal(out, expected)
  for row in np.asarray(out):  # after EOS, only PAD
    if EOS_ID in row:
      assert np.all(row[list(row).index(EOS_ID) + 1 :] == PAD_ID)
