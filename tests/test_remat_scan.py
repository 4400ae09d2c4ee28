"""`remat_policy` and `scan_layers` change how the layer stacks run, never what they compute:
same loss, same gradients; scanned parameters shard and decode like unrolled ones."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from testing import random_params
from variants import MODELS

from configs import quickstart
from transformer_jax import config as config_lib
from transformer_jax.decoding.decoder import Decoder
from transformer_jax.model.config import TransformerConfig
from transformer_jax.model.transformer import Transformer
from transformer_jax.parallel.layer_params import stack_layer_params, unstack_layer_params
from transformer_jax.training import train

CONFIG = TransformerConfig(
    vocab_size=40, d_model=32, num_heads=4, num_layers=2, d_ff=64, max_len=32, dropout_rate=0.1
)
B, S, T = 2, 7, 6


def example():
  rng = np.random.default_rng(0)
  inputs = rng.integers(3, 40, size=(B, S)).astype(np.int32)
  inputs[1, 4:] = 0
  decoder_inputs = rng.integers(3, 40, size=(B, T)).astype(np.int32)
  decoder_inputs[:, 0] = 1
  decoder_inputs[1, 5:] = 0
  return inputs, decoder_inputs


# XLA:CPU's backend optimisations double the compile time of these tiny programs for nothing.
FAST_COMPILE = {"xla_backend_optimization_level": 0}


@functools.partial(jax.jit, static_argnums=0, compiler_options=FAST_COMPILE)
def loss_and_grads(config, params, rng):
  inputs, decoder_inputs = example()
  weights = jnp.asarray(decoder_inputs != 0, jnp.float32)[..., None]

  def loss(params):
    logits = Transformer(config).apply(
        {"params": params}, inputs, decoder_inputs, rngs={"dropout": rng}
    )
    return -jnp.sum(jax.nn.log_softmax(logits) * weights)

  return jax.value_and_grad(loss)(params)


@pytest.fixture(scope="module")
def params():
  """Random values on the parameter tree (LayerNorm scales near 1); eval_shape compiles nothing."""
  shapes = nn.unbox(jax.eval_shape(Transformer(CONFIG).init, jax.random.key(0), *example()))
  rng = np.random.default_rng(0)

  def fill(path, x):
    value = 0.2 * rng.standard_normal(x.shape) + (path[-1].key == "scale")
    return jnp.asarray(value, x.dtype)

  return jax.tree_util.tree_map_with_path(fill, shapes["params"])


def assert_close(a, b, rtol=1e-5, atol=1e-4):
  # Summed loss: gradients reach ~10, so float32 reassociation noise is ~1e-5 absolute.
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(x, y, rtol=rtol, atol=atol)


@pytest.mark.slow  # 10-60 s on 2 cores: .ci/run runs it after the default suite
def test_remat_keeps_loss_and_gradients(params):
  # Dropout on: the recomputed forward pass must draw the same masks. ("full" runs with scan in
  # the next test; one policy here keeps the compile count down.)
  rng = jax.random.key(7)
  loss, grads = loss_and_grads(CONFIG, params, rng)
  config = CONFIG.replace(remat_policy="dots_no_batch")
  loss_remat, grads_remat = loss_and_grads(config, params, rng)
  np.testing.assert_allclose(loss_remat, loss, rtol=1e-6)
  assert_close(grads_remat, grads)


@pytest.mark.slow  # 10-60 s on 2 cores: .ci/run runs it after the default suite
def test_scan_keeps_loss_and_gradients(params):
  # Deterministic: a scanned stack draws its dropout keys per layer differently.
  config = CONFIG.replace(deterministic=True)
  stacked = stack_layer_params(params)
  assert stacked["encoder"]["layers"]["ffn"]["wi"]["kernel"].shape == (2, 32, 64)  # [n, e, f]
  assert_close(unstack_layer_params(stacked), params, rtol=0, atol=0)
  rng = jax.random.key(0)
  loss, grads = loss_and_grads(config, params, rng)
  for scanned in (
      config.replace(scan_layers=True),
      config.replace(scan_layers=True, remat_policy="full"),
  ):
    loss_scan, grads_scan = loss_and_grads(scanned, stacked, rng)
    np.testing.assert_allclose(loss_scan, loss, rtol=1e-6)
    assert_close(grads_scan, stack_layer_params(grads))


def test_scanned_init_has_the_stacked_tree_with_a_layers_axis():
  config = CONFIG.replace(scan_layers=True)
  boxed = jax.eval_shape(Transformer(config).init, jax.random.key(0), *example())["params"]
  kernel = boxed["decoder"]["layers"]["self_attention"]["query"]
  assert kernel.names == ("layers", "embed", "heads", "kv")
  assert kernel.value.shape == (2, 32, 4, 8)
  unrolled = jax.eval_shape(Transformer(CONFIG).init, jax.random.key(0), *example())["params"]
  shapes = lambda tree: jax.tree.map(lambda x: x.shape, nn.unbox(tree))  # noqa: E731
  assert shapes(boxed) == shapes(jax.eval_shape(stack_layer_params, nn.unbox(unrolled)))


def test_scanned_parameters_shard_with_the_layers_axis_replicated():
  config = quickstart.get_config("smoke")
  config.model.update(d_model=32, num_heads=4, num_layers=2, d_ff=64, max_len=32, scan_layers=True)
  config.mesh = {"data": 1, "fsdp": 4, "tensor": 2}
  config.sharding_rules = "fsdp"
  trainer = train.Trainer(config, config_lib.model_config(config, 200))  # nothing compiled
  query = trainer.state_shardings.params["encoder"]["layers"]["self_attention"]["query"]
  assert query.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor", None)
  abstract = trainer.abstract_state().params["encoder"]["layers"]["self_attention"]["query"]
  assert abstract.shape == (2, 32, 4, 8) and abstract.sharding == query


@pytest.mark.slow  # 5-10 s on 2 cores: .ci/run runs it after the default suite
@pytest.mark.parametrize("name", list(MODELS))  # the paper's model, a variant (tests/variants.py)
def test_scanned_model_decodes_with_per_layer_caches(params, name):
  """Cached decoding of a scanned model equals its own full forward pass, and the cache keeps
  the unrolled layout (keys [b, h, d, n] per layer, one beam slot) that beam search writes into."""
  config = CONFIG.replace(scan_layers=True, deterministic=True)
  model = MODELS[name](config)
  if name != "stock":  # the variant's own parameters
    params = random_params(CONFIG, model=MODELS[name])
  stacked = stack_layer_params(params)
  inputs, decoder_inputs = example()
  full = model.apply({"params": stacked}, inputs, decoder_inputs)  # [b, t, v]

  decoder = Decoder(model)
  step = jax.jit(decoder.step, compiler_options=FAST_COMPILE)
  cache = decoder.init_cache(jnp.asarray(inputs), T)
  layer_caches = cache["decoder"]
  assert sorted(k for k in layer_caches if k.startswith("layer")) == ["layer_0", "layer_1"]
  assert layer_caches["layer_1"]["self_attention"]["kv_cache"]["state"].key.shape == (B, 4, 8, T)
  encoded = decoder.encode(stacked, jnp.asarray(inputs))
  unrolled = decoder.unrolled(stacked)  # a scanned stack decodes unrolled
  for t in range(3):
    log_probs, cache = step(
        unrolled, cache, encoded if t == 0 else None, jnp.asarray(inputs),
        jnp.asarray(decoder_inputs[:, t]), t,
    )  # fmt: skip
    np.testing.assert_allclose(log_probs, jax.nn.log_softmax(full[:, t]), rtol=1e-5, atol=1e-5)


def test_bad_remat_policy_names_the_field():
  with pytest.raises(ValueError, match="remat_policy"):
    CONFIG.replace(remat_policy="some")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_output_projection_gradient_equals_autodiff(dtype):
  """The pre-softmax projection's custom backward (a layout choice) is JAX's own gradient."""
  from transformer_jax.kernels import output_projection as _output_projection

  keys = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(keys[0], (2, 3, 8)).astype(dtype)  # [b, t, e]
  embedding = jax.random.normal(keys[1], (11, 8)).astype(dtype)  # [v, e]
  w = jax.random.normal(keys[2], (2, 3, 11))

  def reference(x, embedding):
    return jnp.einsum("bte,ve->btv", x, embedding, preferred_element_type=jnp.float32)

  def loss(fn):
    return lambda x, embedding: jnp.sum(fn(x, embedding) * w)

  np.testing.assert_array_equal(_output_projection(x, embedding), reference(x, embedding))
  for got, want in zip(
      jax.grad(loss(_output_projection), (0, 1))(x, embedding),
      jax.grad(loss(reference), (0, 1))(x, embedding),
  ):
    assert got.dtype == want.dtype == dtype
    # The same products, summed in another order: float32 rounding (or one bfloat16 ulp) apart.
    tol = 1e-5 if dtype == jnp.float32 else 1e-2
    np.testing.assert_allclose(
        np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tol, atol=tol
    )
