"""Sharding on 8 fake CPU devices: every rule set and mesh trains like one device, parameters are
laid out as the rules say, and checkpoints restore across meshes.

Compilation dominates the run time, so the 1-device reference trains once (module fixture) and the
sharded trainers start from its initial state with `device_put` (one compile each); the 2-D case
also creates its parameters sharded through `Trainer.init_state`, as `run` does.
"""

import flax.linen as nn
import jax
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec
from testing import tiny_train_config

from transformer_jax import config as config_lib
from transformer_jax.data import batching, pipeline
from transformer_jax.parallel import sharding
from transformer_jax.runs import checkpoint
from transformer_jax.training import train

VOCAB = 200  # >= the synthetic tokenizer's 197 ids, and divisible by every tensor size below
STEPS = 2


def tiny_config(mesh=None, rules="data_parallel"):
  config = tiny_train_config()
  # A large Adam ε makes an update proportional to the gradient (not ~lr·sign(g)), so comparing
  # weights after a step compares gradients, without amplifying float32 reduction-order noise.
  config.train.adam_eps = 1.0
  config.train.lr_multiplier = 100.0
  if mesh is not None:
    config.mesh = {"data": 1, "fsdp": 1, "tensor": 1, **mesh}
  config.sharding_rules = rules
  config_lib.validate(config)
  return config


def make_trainer(config, devices=None):
  return train.Trainer(config, config_lib.model_config(config, VOCAB), devices=devices)


def to_numpy(tree):
  return jax.tree.map(np.asarray, jax.device_get(tree))


def assert_trees_close(a, b, rtol=1e-5, atol=1e-6):
  a_leaves, a_def = jax.tree.flatten(a)
  b_leaves, b_def = jax.tree.flatten(b)
  assert a_def == b_def
  for x, y in zip(a_leaves, b_leaves):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


@pytest.fixture(scope="module")
def reference():
  """One device: the initial state, the batch, and per-step metrics and states."""
  config = tiny_config()
  dataset = pipeline.load_dataset(config)
  batch = next(
      batching.BatchIterator(
          dataset.splits["train"].examples,
          seed=0,
          bucket_lengths=dataset.bucket_lengths(config.data),
          batch_size=16,
      )
  )
  trainer = make_trainer(config, devices=jax.devices()[:1])
  state = trainer.init_state(0)
  initial = to_numpy(state)
  metrics = []
  for _ in range(STEPS):
    state, m = trainer.train_step(state, batch, jax.random.PRNGKey(3))
    metrics.append(to_numpy(m))
  return {"initial": initial, "batch": batch, "metrics": metrics, "final": to_numpy(state)}


def shard_shape(x):
  return tuple(x.addressable_shards[0].data.shape)


# Shapes: query kernel [e=32, h=4, d=8], FFN wi [e=32, f=64], embedding [v=200, e=32],
# LayerNorm scale [e=32]. Expected per-device shard shapes under each (mesh, rules).
CASES = {
    "data_parallel": (
        {"data": 8},
        "data_parallel",
        {"query": (32, 4, 8), "wi": (32, 64), "embedding": (200, 32), "scale": (32,)},
    ),
    "fsdp": (
        {"fsdp": 8},
        "fsdp",
        {"query": (4, 4, 8), "wi": (4, 64), "embedding": (200, 4), "scale": (4,)},
    ),
    "tensor_parallel": (
        {"data": 2, "tensor": 4},
        "tensor_parallel",
        {"query": (32, 1, 8), "wi": (32, 16), "embedding": (50, 32), "scale": (32,)},
    ),
    "2d_data_fsdp_tensor": (
        {"data": 2, "fsdp": 2, "tensor": 2},
        "fsdp",
        {"query": (16, 2, 8), "wi": (16, 32), "embedding": (100, 16), "scale": (16,)},
    ),
}


def named_leaves(params):
  layer = params["encoder"]["layer_0"]
  return {
      "query": layer["self_attention"]["query"],
      "wi": layer["ffn"]["wi"]["kernel"],
      "embedding": params["shared_embedding"]["embedding"],
      "scale": layer["ffn_block"]["norm"]["scale"],
  }


@pytest.mark.slow  # 10-60 s on 2 cores: .ci/run runs it after the default suite
@pytest.mark.parametrize("case", list(CASES))
def test_sharded_training_equals_one_device(case, reference):
  mesh, rules, expected_shards = CASES[case]
  trainer = make_trainer(tiny_config(mesh, rules))
  assert trainer.mesh.devices.size == 8
  if case == "2d_data_fsdp_tensor":
    # Parameters created already sharded (jit with out_shardings) equal the 1-device init.
    state = trainer.init_state(0)
    assert_trees_close(to_numpy(state), reference["initial"], rtol=0, atol=0)
  else:
    state = jax.device_put(reference["initial"], trainer.state_shardings)

  for step in range(STEPS):
    state, metrics = trainer.train_step(state, reference["batch"], jax.random.PRNGKey(3))
    expected = reference["metrics"][step]
    for key in ("loss_sum", "weight_sum", "grad_norm"):
      np.testing.assert_allclose(metrics[key], expected[key], rtol=1e-5, err_msg=key)
  assert_trees_close(to_numpy(state.params), reference["final"].params)
  assert_trees_close(to_numpy(state.opt_state), reference["final"].opt_state)

  # The arrays the step returns are laid out as the rules say: parameters and Adam's moments
  # (ZeRO-style under FSDP rules) alike.
  adam_mu = state.opt_state[0].mu
  for name, leaf in named_leaves(state.params).items():
    assert shard_shape(leaf) == expected_shards[name], (name, leaf.sharding.spec)
  for name, leaf in named_leaves(adam_mu).items():
    assert shard_shape(leaf) == expected_shards[name], (name, leaf.sharding.spec)
  assert len(state.params["shared_embedding"]["embedding"].sharding.device_set) == 8


def test_rule_sets_map_logical_axes():
  assert set(sharding.RULES) == {"data_parallel", "fsdp", "tensor_parallel"}
  tp = dict(sharding.TENSOR_PARALLEL_RULES)
  assert tp[sharding.EMBED] is None
  assert tp[sharding.HEADS] == tp[sharding.MLP] == tp[sharding.VOCAB] == "tensor"
  fsdp = dict(sharding.FSDP_RULES)
  assert fsdp[sharding.EMBED] == "fsdp" and fsdp[sharding.HEADS] == "tensor"
  for rules in sharding.RULES.values():
    assert dict(rules)[sharding.BATCH] == ("data", "fsdp")
    assert dict(rules)[sharding.LAYERS] is None  # scanned layers: every device holds all
  # An activation [batch, length, embed] under FSDP rules: the batch rule claims fsdp first.
  assert nn.logical_to_mesh_axes(
      (sharding.BATCH, sharding.LENGTH, sharding.EMBED), sharding.FSDP_RULES
  ) == PartitionSpec(("data", "fsdp"), None, None)


def test_dimensions_that_do_not_divide_are_replicated():
  mesh = Mesh(np.asarray(jax.devices()).reshape(1, 2, 4), sharding.MESH_AXES)
  abstract = {
      "odd_vocab": nn.LogicallyPartitioned(
          jax.ShapeDtypeStruct((197, 32), np.float32), (sharding.VOCAB, sharding.EMBED)
      ),
      "even_vocab": nn.LogicallyPartitioned(
          jax.ShapeDtypeStruct((200, 32), np.float32), (sharding.VOCAB, sharding.EMBED)
      ),
      "count": jax.ShapeDtypeStruct((), np.int32),
  }
  shardings = sharding.logical_to_shardings(abstract, mesh, sharding.FSDP_RULES)
  assert shardings["odd_vocab"].spec == PartitionSpec(None, "fsdp")
  assert shardings["even_vocab"].spec == PartitionSpec("tensor", "fsdp")
  assert shardings["count"].spec == PartitionSpec()


@pytest.mark.slow  # 5-10 s on 2 cores: .ci/run runs it after the default suite
def test_checkpoint_saved_under_fsdp_restores_on_other_meshes(reference, tmp_path):
  saver = make_trainer(tiny_config({"fsdp": 8}, "fsdp"))
  state = jax.device_put(reference["final"], saver.state_shardings)
  assert shard_shape(state.params["shared_embedding"]["embedding"]) == (200, 4)
  manager = checkpoint.make_manager(str(tmp_path), keep=1, save_every=1)
  checkpoint.save(manager, 2, state, {"epoch": 0, "batch": 2, "num_examples": 400}, force=True)
  manager.wait_until_finished()

  for mesh, rules, devices in [
      ({}, "data_parallel", jax.devices()[:1]),
      ({"data": 8}, "data_parallel", None),
      ({"data": 2, "tensor": 4}, "tensor_parallel", None),
  ]:
    target = make_trainer(tiny_config(mesh, rules), devices=devices)
    restored, data_state = checkpoint.restore(manager, target.abstract_state())
    assert data_state == {"epoch": 0, "batch": 2, "num_examples": 400}
    assert_trees_close(to_numpy(restored), reference["final"], rtol=0, atol=0)
    embedding = restored.params["shared_embedding"]["embedding"]
    assert embedding.sharding == target.state_shardings.params["shared_embedding"]["embedding"]
  manager.close()


def test_unknown_rules_fail_naming_the_key():
  config = tiny_config()
  config.sharding_rules = "zero3"
  with pytest.raises(config_lib.ConfigError, match="sharding_rules"):
    config_lib.validate(config)
