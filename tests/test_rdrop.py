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
  np.testing.assert_array_equal(out[translation.RDROP_COPY], [1, 1, 1])
  # Part of the rows (translation.rdrop_rows): the first ⌊f b⌋, at least one, copied after all.
  batch = {"inputs": np.arange(40, dtype=np.int32).reshape(10, 4)}
  for fraction, copies in ((0.5, 5), (0.25, 2), (0.01, 1)):
    out = translation.double_batch(batch, fraction)
    np.testing.assert_array_equal(out["inputs"][:10], batch["inputs"])
    np.testing.assert_array_equal(out["inputs"][10:], batch["inputs"][:copies])
    assert out[translation.RDROP_COPY].shape == (copies,)
  # With A micro-batches, a multiple of A: micro-batch k (rows k, k + A, ...) holds its own pairs
  # followed by copies of its first ones.
  out = translation.double_batch(batch, 0.5, micro_batches=2)
  assert out[translation.RDROP_COPY].shape == (4,)
  for k in range(2):
    micro = np.asarray(out["inputs"][k::2])  # [7, 4]: 5 pairs, 2 copies
    np.testing.assert_array_equal(micro[:5], batch["inputs"][k::2])
    np.testing.assert_array_equal(micro[5:], batch["inputs"][k::2][:2])


def test_partial_copies_add_the_kl_of_the_copied_pairs_alone():
  """translation.rdrop_rows < 1 (a deviation): the cross entropy of all rows and copies, plus α
  times the symmetric KL of each copied pair (row i against row b + i) and of no other."""
  rng = np.random.default_rng(3)
  rows, copies, length, vocab, alpha = 4, 2, 5, 11, 5.0
  targets = rng.integers(3, vocab, (rows, length)).astype(np.int32)
  targets[1, 2:] = PAD_ID
  batch = translation.double_batch({"targets": targets}, copies / rows)
  logits = rng.normal(size=(rows + copies, length, vocab)).astype(np.float32)
  loss, _ = translation.rdrop_loss(jnp.asarray(logits), batch, 0.1, alpha)
  cross_entropy, _ = losses.sequence_loss(jnp.asarray(logits), batch, 0.1)
  kl = 0.0
  for i in range(copies):
    log_p, log_q = _log_softmax(logits[i]), _log_softmax(logits[rows + i])
    per_token = (np.exp(log_p) * (log_p - log_q) + np.exp(log_q) * (log_q - log_p)).sum(-1) / 2
    kl += float((per_token * (targets[i] != PAD_ID)).sum())
  np.testing.assert_allclose(float(loss), float(cross_entropy) + alpha * kl, rtol=1e-5)


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


def test_a_train_step_with_part_of_the_rows_copied_trains_on_those_copies():
  config, trainer, batch = _trainer(5.0, rdrop_rows=0.5)
  _, metrics = trainer.train_step(trainer.init_state(0), batch, jax.random.PRNGKey(2))
  real = batch["targets"] != PAD_ID
  # The batch's 8 rows and copies of its first 4.
  assert float(metrics["weight_sum"]) == int(real.sum()) + int(real[:4].sum())
  assert np.isfinite(float(metrics["loss_sum"]))


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"translation.rdrop_alpha": -1.0}, "translation.rdrop_alpha.*must be >= 0"),
        (
            {
                "translation.rdrop_alpha": 5.0,
                "model.dropout_rate": 0.0,
                "model.attention_dropout_rate": 0.0,
            },
            "translation.rdrop_alpha.*two dropout masks",
        ),
        ({"translation.rdrop_rows": 0.0}, r"translation.rdrop_rows.*must be in \(0, 1\]"),
        ({"translation.rdrop_rows": 1.5}, r"translation.rdrop_rows.*must be in \(0, 1\]"),
    ],
)
def test_a_wrong_alpha_or_rows_is_a_config_error_naming_the_key(overrides, message):
  config = config_lib.default_config()
  for key, value in overrides.items():
    section, name = key.split(".")
    config[section][name] = value
  with pytest.raises(config_lib.ConfigError, match=message):
    config_lib.validate(config)


@pytest.mark.slow  # ~20 s on 2 cores: .ci/run runs it after the default suite
@pytest.mark.parametrize("devices, accumulation, rows", [(8, 1, 1.0), (2, 4, 1.0), (2, 4, 0.5)])
def test_each_row_meets_its_own_copy_when_sharded_and_accumulated(devices, accumulation, rows):
  # Without dropout the copies are equal, so the KL term and its gradient vanish only if every
  # row is compared with its own copy: then the update is the plain loss's (all rows copied) or
  # that of α ~ 0 on the same copies (part of them), whatever the split.
  def trainer(alpha):
    config = tiny_train_config()
    config.model.dropout_rate = 0.0
    config.train.adam_eps = 1.0  # the update follows the gradient (test_train.py)
    config.train.lr_multiplier = 100.0
    config.train.grad_accum_steps = accumulation
    config.translation.rdrop_alpha = alpha  # not validated: R-Drop without dropout, on purpose
    config.translation.rdrop_rows = rows
    dataset = pipeline.load_dataset(config)
    return (
        train.Trainer.for_task(
            config, translation.TASK, dataset.tokenizer, devices=jax.devices()[:devices]
        ),
        dataset,
        config,
    )

  plain, dataset, config = trainer(0.0 if rows == 1.0 else 1e-12)
  rdrop, _, _ = trainer(5.0)
  batch = fixed_batch(dataset, config, rows=16)
  s_plain, s_rdrop = plain.init_state(0), rdrop.init_state(0)
  copies = 2 if rows == 1.0 else 1  # the weights of the plain trainer's batch, times this
  for _ in range(2):
    s_plain, m_plain = plain.train_step(s_plain, batch, jax.random.PRNGKey(0))
    s_rdrop, m_rdrop = rdrop.train_step(s_rdrop, batch, jax.random.PRNGKey(0))
    np.testing.assert_allclose(m_rdrop["weight_sum"], copies * m_plain["weight_sum"])
    np.testing.assert_allclose(m_rdrop["loss_sum"], copies * m_plain["loss_sum"], rtol=1e-5)
  for a, b in zip(jax.tree.leaves(s_plain.params), jax.tree.leaves(s_rdrop.params)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)
