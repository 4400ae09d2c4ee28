"""R-Drop of the translation task (translation.rdrop_alpha, off by default): each training batch
run twice under two dropout masks, the loss adding α times the copies' symmetric KL divergence."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_train import fixed_batch
from testing import tiny_train_config

from transformer_jax import config as config_lib
from transformer_jax.data import pipeline
from transformer_jax.model.config import PAD_ID
from transformer_jax.tasks import translation
from transformer_jax.training import losses, train


def _log_softmax(x):
  x = x - x.max(axis=-1, keepdims=True)
  return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def _doubled_logits_and_batch(rows=3, length=5, vocab=11, seed=0):
  rng = np.random.default_rng(seed)
  logits = rng.normal(size=(2 * rows, length, vocab)).astype(np.float32)  # [2b, t, v]
  targets = rng.integers(3, vocab, (rows, length)).astype(np.int32)  # [b, t]
  targets[0, 3:] = PAD_ID
  targets[2, 1:] = PAD_ID
  batch = translation.double_batch({"targets": targets})
  return logits, batch, targets


def test_the_loss_is_both_copies_cross_entropy_plus_alpha_times_their_symmetric_kl():
  logits, batch, targets = _doubled_logits_and_batch()
  rows = targets.shape[0]
  alpha, smoothing = 5.0, 0.1
  loss, metrics = translation.rdrop_loss(jnp.asarray(logits), batch, smoothing, alpha)
  cross_entropy, expected_metrics = losses.sequence_loss(jnp.asarray(logits), batch, smoothing)
  # KL(P || Q) = Σ_v P_v log(P_v / Q_v), per target token of the first copy, padding left out.
  p = np.exp(_log_softmax(logits[:rows].astype(np.float64)))  # [b, t, v]
  q = np.exp(_log_softmax(logits[rows:].astype(np.float64)))  # [b, t, v]
  kl_pq = (p * np.log(p / q)).sum(-1)  # [b, t]
  kl_qp = (q * np.log(q / p)).sum(-1)  # [b, t]
  mask = targets != PAD_ID
  expected = float(cross_entropy) + alpha * 0.5 * float(((kl_pq + kl_qp) * mask).sum())
  np.testing.assert_allclose(float(loss), expected, rtol=1e-5)
  assert float(loss) > float(cross_entropy) + 1.0  # the KL term is not negligible here
  # The tokens counted are both copies': the loss is divided by twice the pairs' tokens.
  assert float(metrics["weight_sum"]) == 2 * mask.sum()
  for key, value in expected_metrics.items():
    np.testing.assert_allclose(float(metrics[key]), float(value), rtol=1e-6)


def test_equal_copies_and_evaluation_batches_get_the_papers_loss():
  logits, batch, targets = _doubled_logits_and_batch(seed=1)
  rows = targets.shape[0]
  same = jnp.asarray(np.concatenate([logits[:rows], logits[:rows]]))
  loss, _ = translation.rdrop_loss(same, batch, 0.1, 5.0)
  np.testing.assert_allclose(float(loss), float(losses.sequence_loss(same, batch, 0.1)[0]), 1e-6)
  # An evaluation batch is not doubled: no copy key, the cross entropy alone.
  single = {"targets": targets}
  loss, _ = translation.rdrop_loss(jnp.asarray(logits[:rows]), single, 0.1, 5.0)
  expected, _ = losses.sequence_loss(jnp.asarray(logits[:rows]), single, 0.1)
  np.testing.assert_allclose(float(loss), float(expected), rtol=1e-6)


def test_double_batch_stacks_each_array_on_itself_and_marks_the_copies():
  batch = {"inputs": np.arange(12, dtype=np.int32).reshape(3, 4), "targets": np.ones((3, 4))}
  out = translation.double_batch(batch)
  for key, value in batch.items():
    np.testing.assert_array_equal(out[key][:3], value)
    np.testing.assert_array_equal(out[key][3:], value)
  np.testing.assert_array_equal(out[translation.RDROP_COPY], [0, 0, 0, 1, 1, 1])


def _trainer(alpha, **translation_overrides):
  config = tiny_train_config()
  config.model.dropout_rate = 0.3
  config.translation.rdrop_alpha = alpha
  for key, value in translation_overrides.items():
    config.translation[key] = value
  config_lib.validate(config)
  dataset = pipeline.load_dataset(config)
  trainer = train.Trainer.for_task(
      config, translation.TASK, dataset.tokenizer, devices=jax.devices()[:1]
  )
  batch = fixed_batch(dataset, config, rows=8)
  return config, trainer, batch


def test_a_train_step_sees_two_dropout_masks_of_each_pair():
  config, trainer, batch = _trainer(5.0, source_token_dropout=0.1)
  transform = translation.TASK.batch_transform(config, None)
  doubled = transform(batch, jax.random.PRNGKey(0))
  rows = batch["inputs"].shape[0]
  # Token dropout first, then the copies: both copies read the same pieces.
  np.testing.assert_array_equal(doubled["inputs"][:rows], doubled["inputs"][rows:])
  assert (np.asarray(doubled["inputs"][:rows]) != batch["inputs"]).any()
  state = trainer.init_state(0)
  model_kwargs = {k: doubled[k] for k in ("inputs", "decoder_inputs")}
  logits = trainer.train_model.apply(
      {"params": state.params}, **model_kwargs, rngs={"dropout": jax.random.PRNGKey(1)}
  )  # [2b, t, v]
  assert not np.allclose(logits[:rows], logits[rows:])  # two masks: R-Drop's two distributions
  logits = trainer.eval_model.apply({"params": state.params}, **model_kwargs)
  np.testing.assert_allclose(logits[:rows], logits[rows:], rtol=1e-5, atol=1e-5)
  # The jitted step trains on both copies: twice the batch's target tokens.
  _, metrics = trainer.train_step(state, batch, jax.random.PRNGKey(2))
  tokens = int((batch["targets"] != PAD_ID).sum())
  assert float(metrics["weight_sum"]) == 2 * tokens
  assert np.isfinite(float(metrics["loss_sum"]))
  # Off (the paper's): the task's loss and batches are the default ones.
  config.translation.rdrop_alpha = 0.0
  config.translation.source_token_dropout = 0.0
  assert translation.TASK.batch_transform(config, None) is None
  assert isinstance(translation.TASK.loss(config, None), functools.partial)
  assert translation.TASK.loss(config, None).func is losses.sequence_loss


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"translation.rdrop_alpha": -1.0}, "must be >= 0"),
        (
            {
                "translation.rdrop_alpha": 5.0,
                "model.dropout_rate": 0.0,
                "model.attention_dropout_rate": 0.0,
            },
            "two dropout masks",
        ),
    ],
)
def test_a_wrong_alpha_is_a_config_error_naming_the_key(overrides, message):
  config = config_lib.default_config()
  for key, value in overrides.items():
    section, name = key.split(".")
    config[section][name] = value
  with pytest.raises(config_lib.ConfigError, match=f"translation.rdrop_alpha.*{message}"):
    config_lib.validate(config)


@pytest.mark.slow  # ~20 s on 2 cores: .ci/run runs it after the default suite
@pytest.mark.parametrize("devices, accumulation", [(8, 1), (2, 4)])
def test_each_row_meets_its_own_copy_when_sharded_and_accumulated(devices, accumulation):
  # Without dropout the copies are equal, so the KL term and its gradient vanish only if every
  # row is compared with its own copy: then the update is the plain loss's, whatever the split.
  def trainer(alpha):
    config = tiny_train_config()
    config.model.dropout_rate = 0.0
    config.train.adam_eps = 1.0  # the update follows the gradient (test_train.py)
    config.train.lr_multiplier = 100.0
    config.train.grad_accum_steps = accumulation
    config.translation.rdrop_alpha = alpha  # not validated: R-Drop without dropout, on purpose
    dataset = pipeline.load_dataset(config)
    return (
        train.Trainer.for_task(
            config, translation.TASK, dataset.tokenizer, devices=jax.devices()[:devices]
        ),
        dataset,
        config,
    )

  plain, dataset, config = trainer(0.0)
  rdrop, _, _ = trainer(5.0)
  batch = fixed_batch(dataset, config, rows=16)
  s_plain, s_rdrop = plain.init_state(0), rdrop.init_state(0)
  for _ in range(2):
    s_plain, m_plain = plain.train_step(s_plain, batch, jax.random.PRNGKey(0))
    s_rdrop, m_rdrop = rdrop.train_step(s_rdrop, batch, jax.random.PRNGKey(0))
    np.testing.assert_allclose(m_rdrop["weight_sum"], 2 * m_plain["weight_sum"])
    np.testing.assert_allclose(m_rdrop["loss_sum"], 2 * m_plain["loss_sum"], rtol=1e-5)
  for a, b in zip(jax.tree.leaves(s_plain.params), jax.tree.leaves(s_rdrop.params)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)
