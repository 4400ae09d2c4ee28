"""Transformer: shapes and parameter trees, causality, padding and packing invariance, embeddings.

Parameters are random values on the tree `jax.eval_shape(model.init)` describes: nothing is compiled
for initialisation, and every `apply` runs op by op, so the many small configs share compiled ops.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from testing import random_params

from transformer_jax import kernels
from transformer_jax.data.tokenizer import BOS_ID, EOS_ID, PAD_ID
from transformer_jax.model.config import TransformerConfig
from transformer_jax.model.transformer import Embed, Transformer

CONFIG = TransformerConfig(
    vocab_size=40, d_model=32, num_heads=4, num_layers=2, d_ff=64, max_len=32, deterministic=True
)
BATCH, SOURCE_LEN, TARGET_LEN = 2, 7, 6


def random_tokens(shape, seed):
  """Random non-special tokens, [b, L]; BOS first on decoder inputs is the caller's business."""
  return np.random.default_rng(seed).integers(3, CONFIG.vocab_size, size=shape).astype(np.int32)


def example(seed=0):
  inputs = random_tokens((BATCH, SOURCE_LEN), seed)
  inputs[1, 4:] = PAD_ID  # row 1 is a shorter sentence
  decoder_inputs = random_tokens((BATCH, TARGET_LEN), seed + 1)
  decoder_inputs[:, 0] = BOS_ID
  return inputs, decoder_inputs


def param_shapes(config):
  inputs, decoder_inputs = example()
  variables = jax.eval_shape(Transformer(config).init, jax.random.key(0), inputs, decoder_inputs)
  return nn.unbox(variables["params"])


def logits_of(config, params, inputs, decoder_inputs, **kwargs):
  return Transformer(config).apply({"params": params}, inputs, decoder_inputs, **kwargs)


@pytest.fixture(scope="module")
def post_params():
  return random_params(CONFIG)


@pytest.fixture(scope="module")
def pre_params():
  return random_params(CONFIG.replace(norm_position="pre"))


# ----------------------------------------------------------------------------- shapes and trees


@pytest.mark.parametrize("norm_position", ["post", "pre"])
@pytest.mark.parametrize("share_embeddings", [True, False])
def test_logits_shape_dtype_and_param_tree(norm_position, share_embeddings):
  config = CONFIG.replace(norm_position=norm_position, share_embeddings=share_embeddings)
  params = random_params(config)
  if share_embeddings:
    assert {"shared_embedding", "encoder", "decoder"} == set(params)
  else:
    assert {
        "source_embedding",
        "target_embedding",
        "output_projection",
        "encoder",
        "decoder",
    } == set(params)
    assert params["output_projection"]["kernel"].shape == (32, 40)  # [e, v]
  # Pre-LN normalises the output of each stack; post-LN already ends every layer with a norm.
  for stack in ("encoder", "decoder"):
    assert ("final_norm" in params[stack]) == (norm_position == "pre")
  logits = logits_of(config, params, *example())
  assert logits.shape == (BATCH, TARGET_LEN, 40) and logits.dtype == jnp.float32
  assert np.all(np.isfinite(logits))


def test_num_decoder_layers():
  config = CONFIG.replace(num_layers=2, num_decoder_layers=3)
  assert config.decoder_layers == 3 and CONFIG.decoder_layers == 2
  shapes = param_shapes(config)
  assert sorted(k for k in shapes["encoder"] if k.startswith("layer_")) == ["layer_0", "layer_1"]
  assert sorted(k for k in shapes["decoder"] if k.startswith("layer_")) == [
      "layer_0",
      "layer_1",
      "layer_2",
  ]
  # Encoder layers have no cross-attention; decoder layers do.
  assert "cross_attention" not in shapes["encoder"]["layer_0"]
  assert "cross_attention" in shapes["decoder"]["layer_2"]


def test_learned_positions_add_a_parameter(post_params):
  assert "positions" not in post_params["encoder"]  # sinusoidal: a constant table, no parameter
  config = CONFIG.replace(positional="learned")
  params = random_params(config)
  for stack in ("encoder", "decoder"):
    assert params[stack]["positions"]["position_embedding"].shape == (32, 32)  # [max_len, e]
  inputs, decoder_inputs = example()
  logits = logits_of(config, params, inputs, decoder_inputs)
  params["decoder"]["positions"]["position_embedding"] *= 0.0
  assert not np.allclose(logits_of(config, params, inputs, decoder_inputs), logits, atol=1e-3)


def test_parameter_count_of_tiny_model(post_params):
  # Embedding 40·32; per encoder layer 4 attention matrices 32·32 + FFN 32·64+64+64·32+32 + 2 norms;
  # per decoder layer one more attention block and norm.
  attention, ffn, norm = 4 * 32 * 32, 32 * 64 + 64 + 64 * 32 + 32, 2 * 32
  expected = 40 * 32 + 2 * (attention + ffn + 2 * norm) + 2 * (2 * attention + ffn + 3 * norm)
  assert sum(p.size for p in jax.tree.leaves(post_params)) == expected


# ----------------------------------------------------------------------------- invariants


@pytest.mark.parametrize("norm_position", ["post", "pre"])
def test_causality(norm_position, post_params, pre_params):
  """§3.2.3: changing decoder inputs after position t leaves the logits at positions <= t alone."""
  config = CONFIG.replace(norm_position=norm_position)
  params = post_params if norm_position == "post" else pre_params
  inputs, decoder_inputs = example()
  logits = logits_of(config, params, inputs, decoder_inputs)
  for t in (0, 2, 4):
    changed = decoder_inputs.copy()
    changed[:, t + 1 :] = random_tokens((BATCH, TARGET_LEN - t - 1), seed=10 + t)
    changed[1, -1] = PAD_ID  # padding later on must not leak backwards either
    new_logits = logits_of(config, params, inputs, changed)
    np.testing.assert_allclose(new_logits[:, : t + 1], logits[:, : t + 1], atol=1e-6)
    assert not np.allclose(new_logits[:, t + 1], logits[:, t + 1], atol=1e-3)


def test_source_padding_invariance(post_params):
  inputs, decoder_inputs = example()
  logits = logits_of(CONFIG, post_params, inputs, decoder_inputs)
  padded = np.pad(inputs, ((0, 0), (0, 3)), constant_values=PAD_ID)  # [b, s + 3]
  np.testing.assert_allclose(
      logits_of(CONFIG, post_params, padded, decoder_inputs), logits, atol=1e-5
  )
  # Padding is masked, not merely absent: a real token there does change the output.
  padded[0, -1] = 5
  assert not np.allclose(
      logits_of(CONFIG, post_params, padded, decoder_inputs)[0], logits[0], atol=1e-3
  )


def test_packed_pairs_equal_pairs_run_alone(post_params):
  """Two sentence pairs packed in one row (segment ids, positions restarting at 0) = each alone.

  Row 0 packs pairs A and B; row 1 is pair C alone, which packing must not disturb either. The
  lone runs pad each pair to the packed shapes (padding invariance is tested above), so every call
  here has the same shapes as `example` and reuses its compiled ops.
  """
  pairs = {
      "a": ([11, 12, 13, EOS_ID], [BOS_ID, 21, 22]),
      "b": ([14, 15, EOS_ID], [BOS_ID, 23, 24]),
      "c": ([16, 17, 18, 19, EOS_ID], [BOS_ID, 25, 26, 27]),
  }

  def pack(rows, length):
    """rows: list of lists of sentences -> tokens, segment ids, positions; each [len(rows), L]."""
    tokens, segments, positions = (np.zeros((len(rows), length), np.int32) for _ in range(3))
    for r, sentences in enumerate(rows):
      start = 0
      for segment, sentence in enumerate(sentences, start=1):
        end = start + len(sentence)
        tokens[r, start:end], segments[r, start:end] = sentence, segment
        positions[r, start:end] = np.arange(len(sentence))
        start = end
    return tokens, segments, positions

  source = [[pairs["a"][0], pairs["b"][0]], [pairs["c"][0]]]
  target = [[pairs["a"][1], pairs["b"][1]], [pairs["c"][1]]]
  inputs, inputs_segmentation, inputs_positions = pack(source, SOURCE_LEN)
  decoder_inputs, targets_segmentation, targets_positions = pack(target, TARGET_LEN)
  packed = logits_of(
      CONFIG,
      post_params,
      inputs,
      decoder_inputs,
      inputs_positions=inputs_positions,
      targets_positions=targets_positions,
      inputs_segmentation=inputs_segmentation,
      targets_segmentation=targets_segmentation,
  )  # [2, t, v]

  alone_inputs, _, _ = pack([[pairs["a"][0]], [pairs["b"][0]]], SOURCE_LEN)
  alone_decoder_inputs, _, _ = pack([[pairs["a"][1]], [pairs["b"][1]]], TARGET_LEN)
  alone = logits_of(CONFIG, post_params, alone_inputs, alone_decoder_inputs)  # [2, t, v]
  np.testing.assert_allclose(packed[0, :3], alone[0, :3], atol=1e-5)  # pair A
  np.testing.assert_allclose(packed[0, 3:6], alone[1, :3], atol=1e-5)  # pair B
  unpacked = logits_of(
      CONFIG, post_params, inputs[1:2].repeat(2, 0), decoder_inputs[1:2].repeat(2, 0)
  )
  np.testing.assert_allclose(packed[1, :4], unpacked[0, :4], atol=1e-5)  # pair C
  # Without the segment masks the pairs would see each other.
  leaky = logits_of(
      CONFIG,
      post_params,
      inputs,
      decoder_inputs,
      inputs_positions=inputs_positions,
      targets_positions=targets_positions,
  )
  assert not np.allclose(leaky[0, 3:6], alone[1, :3], atol=1e-3)


# ----------------------------------------------------------------------------- relative positions


def test_relative_positions_add_a_clipped_offset_bias_to_the_encoders_logits():
  """relative_positions K: each encoder head's logits gain table[clip(k - q, -K, K) + K, head]
  (RelativePositions), one table for every layer: the attention weights of layer 0 are
  softmax(Q Kᵀ / √d_k + bias) over the non-padding keys, computed here from the parameters."""
  k_max = 2
  config = CONFIG.replace(relative_positions=k_max)
  params = random_params(config)
  table = np.asarray(params["encoder"]["relative_positions"]["bias"])
  assert table.shape == (2 * k_max + 1, config.num_heads)
  assert "relative_positions" not in params["decoder"]  # the encoder's attention only
  inputs, decoder_inputs = example()
  _, state = logits_of(config, params, inputs, decoder_inputs, mutable=["intermediates"])
  (weights,) = state["intermediates"]["encoder"]["layer_0"]["self_attention"]["attention_weights"]

  from transformer_jax.model.transformer import sinusoidal_positions

  embedding = np.asarray(params["shared_embedding"]["embedding"], np.float64)
  x = embedding[inputs] * np.sqrt(32.0) + sinusoidal_positions(32, 32)[:SOURCE_LEN]  # [b, s, e]
  attention = params["encoder"]["layer_0"]["self_attention"]
  q = np.einsum("bse,ehd->bshd", x, np.asarray(attention["query"]))  # [b, s, h, d]
  k = np.einsum("bse,ehd->bshd", x, np.asarray(attention["key"]))
  logits = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(8.0)  # [b, h, q, k]
  offset = np.clip(np.arange(SOURCE_LEN)[None, :] - np.arange(SOURCE_LEN)[:, None], -2, 2) + 2
  assert offset[0, 6] == 4 and offset[6, 0] == 0 and offset[3, 3] == 2  # [q, k]
  logits = logits + table[offset].transpose(2, 0, 1)[None]  # [h, q, k] per sentence
  logits = np.where((inputs != PAD_ID)[:, None, None, :], logits, -np.inf)
  expected = np.exp(logits - logits.max(-1, keepdims=True))
  expected /= expected.sum(-1, keepdims=True)
  np.testing.assert_allclose(weights, expected, rtol=1e-4, atol=1e-5)

  # A zero table is the model without it.
  zero = {**params, "encoder": {**params["encoder"], "relative_positions": {"bias": table * 0}}}
  encoder = {n: v for n, v in params["encoder"].items() if n != "relative_positions"}
  without = {**params, "encoder": encoder}
  np.testing.assert_allclose(
      logits_of(config, zero, inputs, decoder_inputs),
      logits_of(CONFIG, without, inputs, decoder_inputs),
      atol=1e-5,
  )


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(relative_positions=-1), "relative_positions=-1 must be >= 0"),
        # An encoder with relative positions alone: measured and not adopted (docs/experiments.md)
        (dict(positional="none", relative_positions=4), "expected 'sinusoidal' or 'learned'"),
    ],
)
def test_bad_relative_positions_are_refused(fields, message):
  with pytest.raises(ValueError, match=message):
    CONFIG.replace(**fields)


# ----------------------------------------------------------------------------- embeddings


def test_shared_embedding_is_the_pre_softmax_projection(post_params):
  """§3.4: one matrix embeds source and target tokens and projects decoder outputs to logits."""
  embeddings = [
      p
      for path, p in jax.tree_util.tree_leaves_with_path(post_params)
      if "embedding" in jax.tree_util.keystr(path)
  ]
  assert len(embeddings) == 1 and embeddings[0].shape == (40, 32)  # [v, e]
  inputs, decoder_inputs = example()
  model = Transformer(CONFIG)

  def decoder_output(module, inputs, decoder_inputs):
    return module.decoder(module.encode(inputs), inputs, decoder_inputs)  # [b, t, e]

  y = model.apply({"params": post_params}, inputs, decoder_inputs, method=decoder_output)
  logits = logits_of(CONFIG, post_params, inputs, decoder_inputs)
  embedding = np.asarray(post_params["shared_embedding"]["embedding"])
  np.testing.assert_allclose(logits, np.asarray(y) @ embedding.T, atol=1e-5)


def test_embedding_is_scaled_by_sqrt_d_model():
  embedding = np.random.default_rng(0).standard_normal((40, 32)).astype(np.float32)
  tokens = np.array([[3, 0, 39], [7, 7, 1]])
  embedded = Embed(CONFIG).apply({"params": {"embedding": embedding}}, tokens)
  np.testing.assert_allclose(embedded, embedding[tokens] * np.sqrt(32.0), rtol=1e-6)


# ----------------------------------------------------------------------------- precision, modes


@pytest.mark.slow  # several compiles: .ci/run runs it after the default suite
def test_bfloat16_compute_with_float32_params(post_params):
  config = CONFIG.replace(dtype="bfloat16", param_dtype="float32")
  assert config.dtype == jnp.bfloat16
  shapes = param_shapes(config)
  assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(shapes))
  inputs, decoder_inputs = example()
  logits = logits_of(config, post_params, inputs, decoder_inputs)
  assert logits.dtype == jnp.float32 and np.all(np.isfinite(logits))
  reference = logits_of(CONFIG, post_params, inputs, decoder_inputs)
  # bf16 keeps ~3 significant digits; through 4 layers the logits (std ~1) move by a few 1e-2.
  np.testing.assert_allclose(logits, reference, atol=0.15)
  assert not np.array_equal(logits, reference)  # really computed in bf16


def test_bfloat16_matmuls_round_their_inputs_and_sum_in_float32(post_params):
  """`matmul_dtype` bfloat16 (a decoding deviation): each layer matmul is the float32 matmul of
  its inputs rounded to bf16 (a product of two bf16 numbers is exact in float32, so only the
  order of the sums may differ), with float32 outputs; everything else stays float32."""
  config = CONFIG.replace(matmul_dtype="bfloat16")
  assert config.matmul_dtype == jnp.bfloat16 and config.dtype == jnp.float32
  rng = np.random.default_rng(0)
  x = rng.normal(size=(2, 3, 32)).astype(np.float32)
  w = rng.normal(size=(32, 4, 8)).astype(np.float32)
  rounded = lambda a: np.asarray(jnp.asarray(a, jnp.bfloat16).astype(jnp.float32))  # noqa: E731
  expected = np.einsum("bqe,ehd->bqhd", rounded(x), rounded(w))
  got = kernels.einsum(config, "bqe,ehd->bqhd", x, w)
  assert got.dtype == jnp.float32
  np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
  assert np.abs(got - np.einsum("bqe,ehd->bqhd", x, w)).max() > 1e-3  # really rounded
  dense = nn.Dense(8, dot_general=kernels.dot_general(config))
  kernel = rng.normal(size=(32, 8)).astype(np.float32)
  out = dense.apply({"params": {"kernel": kernel, "bias": np.zeros(8, np.float32)}}, x)
  assert out.dtype == jnp.float32
  np.testing.assert_allclose(out, rounded(x) @ rounded(kernel), rtol=1e-5, atol=1e-5)
  assert kernels.dot_general(CONFIG) is None  # the default: flax's own
  inputs, decoder_inputs = example()
  logits = logits_of(config, post_params, inputs, decoder_inputs)
  reference = logits_of(CONFIG, post_params, inputs, decoder_inputs)
  assert logits.dtype == jnp.float32
  np.testing.assert_allclose(logits, reference, atol=0.1)
  assert not np.array_equal(logits, reference)
  # float32 matmuls asked for by name are the default's, to the bit.
  same = logits_of(CONFIG.replace(matmul_dtype="float32"), post_params, inputs, decoder_inputs)
  np.testing.assert_array_equal(same, reference)


def test_bfloat16_matmuls_backward_rounds_the_output_gradient_too():
  """In training, `matmul_dtype` bfloat16 also rounds each matmul's output gradient to bf16, so
  both backward matmuls multiply bf16 operands and sum in float32 (kernels.rounded_einsum): the
  gradients are those of the float32 products of the rounded operands and gradient."""
  config = CONFIG.replace(matmul_dtype="bfloat16")
  rng = np.random.default_rng(1)
  rounded = lambda a: np.asarray(jnp.asarray(a, jnp.bfloat16).astype(jnp.float32))  # noqa: E731
  x = rng.normal(size=(2, 3, 32)).astype(np.float32)
  w = rng.normal(size=(32, 4, 8)).astype(np.float32)
  g = rng.normal(size=(2, 3, 4, 8)).astype(np.float32)
  project = lambda x, w: kernels.einsum(config, "bqe,ehd->bqhd", x, w)  # noqa: E731
  dx, dw = jax.jit(lambda x, w, g: jax.vjp(project, x, w)[1](g))(x, w, jnp.asarray(g))
  assert dx.dtype == dw.dtype == jnp.float32
  np.testing.assert_allclose(
      dx, np.einsum("bqhd,ehd->bqe", rounded(g), rounded(w)), rtol=1e-5, atol=1e-5
  )
  np.testing.assert_allclose(
      dw, np.einsum("bqe,bqhd->ehd", rounded(x), rounded(g)), rtol=1e-5, atol=1e-5
  )
  # JAX's own rule would multiply the unrounded gradient: really rounded here.
  assert np.abs(dx - np.einsum("bqhd,ehd->bqe", g, rounded(w))).max() > 1e-3
  # A Dense over a [2, 3, 32] input, and the shared pre-softmax projection.
  dense = nn.Dense(8, dot_general=kernels.dot_general(config))
  kernel = rng.normal(size=(32, 8)).astype(np.float32)
  g = rng.normal(size=(2, 3, 8)).astype(np.float32)
  apply = lambda x, k: dense.apply({"params": {"kernel": k, "bias": np.zeros(8, np.float32)}}, x)  # noqa: E731
  dx, dk = jax.vjp(apply, x, kernel)[1](jnp.asarray(g))
  np.testing.assert_allclose(dx, rounded(g) @ rounded(kernel).T, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(
      dk, np.einsum("bqi,bqo->io", rounded(x), rounded(g)), rtol=1e-5, atol=1e-5
  )
  embedding = rng.normal(size=(11, 32)).astype(np.float32)
  g = rng.normal(size=(2, 3, 11)).astype(np.float32)
  project = lambda x, e: kernels.output_projection(x, e, jnp.bfloat16)  # noqa: E731
  logits = project(x, embedding)
  np.testing.assert_allclose(logits, rounded(x) @ rounded(embedding).T, rtol=1e-5, atol=1e-5)
  # Compiled, as in a train step (XLA:CPU refuses some bf16 products that eager mode runs).
  dx, de = jax.jit(lambda x, e, g: jax.vjp(project, x, e)[1](g))(x, embedding, jnp.asarray(g))
  np.testing.assert_allclose(dx, rounded(g) @ rounded(embedding), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(
      de, np.einsum("btv,bte->ve", rounded(g), rounded(x)), rtol=1e-5, atol=1e-5
  )


def test_bfloat16_matmuls_train_close_to_float32(post_params):
  """The whole model's loss gradient with `matmul_dtype` bfloat16 (a training deviation for
  speed) is the float32 one up to bf16 rounding, for every parameter. (Through this random
  model's 4 layers, rounding the forward matmuls alone moves the deepest gradients by ~11% in
  norm; rounding their output gradients too adds ~0.2%.)"""
  inputs, decoder_inputs = example()
  targets = random_tokens((BATCH, TARGET_LEN), 7)

  def loss(config):
    def fn(params):
      logits = logits_of(config, params, inputs, decoder_inputs)
      return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1))

    return jax.jit(jax.value_and_grad(fn))(post_params)  # compiled, as in a train step

  value, grads = loss(CONFIG.replace(matmul_dtype="bfloat16"))
  reference, reference_grads = loss(CONFIG)
  assert abs(float(value) - float(reference)) < 1e-2 * abs(float(reference))
  errors = jax.tree.map(
      lambda got, want: float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want)),
      grads,
      reference_grads,
  )
  assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads))
  assert max(jax.tree.leaves(errors)) < 0.2, errors
  assert np.median(jax.tree.leaves(errors)) < 0.06, errors
  assert min(jax.tree.leaves(errors)) > 0.0  # really rounded


@pytest.mark.parametrize(
    "change, field",
    [
        (dict(d_model=30), "d_model"),
        (dict(positional="foo"), "positional"),
        (dict(norm_position="mid"), "norm_position"),
        (dict(dropout_rate=1.5), "dropout_rate"),
        (dict(dtype="float64"), "dtype"),
    ],
)
def test_config_validation_names_the_field(change, field):
  with pytest.raises(ValueError, match=field):
    CONFIG.replace(**change)


def test_dropout_active_only_when_not_deterministic(post_params):
  inputs, decoder_inputs = example()
  train = CONFIG.replace(deterministic=False, dropout_rate=0.1)

  def run(config, seed):
    return Transformer(config).apply(
        {"params": post_params}, inputs, decoder_inputs, rngs={"dropout": jax.random.key(seed)}
    )

  first, second = run(train, 1), run(train, 2)
  assert not np.allclose(first, second, atol=1e-3)
  np.testing.assert_array_equal(run(train, 1), first)  # same rng, same mask
  evaluation = train.replace(deterministic=True)
  np.testing.assert_array_equal(run(evaluation, 1), run(evaluation, 2))
  np.testing.assert_allclose(
      run(evaluation, 1), logits_of(CONFIG, post_params, inputs, decoder_inputs), atol=1e-6
  )
