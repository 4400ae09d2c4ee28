"""The learning-rate schedule (§5.3, Eq. 3) and the Adam settings it was used with."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest

from transformer_jax.training.optim import make_optimizer, make_schedule, paper_schedule

D_MODEL, WARMUP = 512, 4000


def eq3(step, d_model=D_MODEL, warmup=WARMUP):
  """lrate = d_model^-0.5 · min(step_num^-0.5, step_num · warmup_steps^-1.5), in Python floats."""
  return d_model**-0.5 * min(step**-0.5, step * warmup**-1.5)


@pytest.mark.parametrize("step", [1, WARMUP // 2, WARMUP, 2 * WARMUP, 100_000])
def test_paper_schedule_is_equation_3(step):
  np.testing.assert_allclose(paper_schedule(step, D_MODEL, WARMUP), eq3(step), rtol=1e-6)


def test_known_values():
  # Peak of the base model: 512^-0.5 · 4000^-0.5 ≈ 7.0e-4.
  np.testing.assert_allclose(paper_schedule(WARMUP, D_MODEL, WARMUP), 6.98771e-4, rtol=1e-5)
  np.testing.assert_allclose(paper_schedule(1, D_MODEL, WARMUP), 512**-0.5 * 4000**-1.5, rtol=1e-6)


def test_peak_at_warmup_steps():
  steps = np.arange(1, 5 * WARMUP)
  lr = np.asarray(paper_schedule(steps, D_MODEL, WARMUP))
  assert steps[np.argmax(lr)] == WARMUP
  assert np.all(np.diff(lr[:WARMUP]) > 0)  # linear warm-up
  assert np.all(np.diff(lr[WARMUP:]) < 0)  # inverse square root decay


def test_step_zero_gives_zero():
  assert float(paper_schedule(0, D_MODEL, WARMUP)) == 0.0


def test_multiplier_scales_the_curve():
  steps = jnp.array([1, 100, WARMUP, 50_000])
  np.testing.assert_allclose(
      paper_schedule(steps, D_MODEL, WARMUP, multiplier=2.5),
      2.5 * paper_schedule(steps, D_MODEL, WARMUP),
      rtol=1e-6,
  )


def test_make_schedule_counts_from_zero():
  schedule = make_schedule(D_MODEL, WARMUP)
  for count in (0, 1, WARMUP - 1, 30_000):
    assert float(schedule(count)) == float(paper_schedule(count + 1, D_MODEL, WARMUP))
  assert float(schedule(0)) > 0.0  # the first update already moves the parameters


def test_cooldown_scales_eq3_linearly_to_zero_over_the_last_steps():
  num_steps, cooldown = 1000, 200
  schedule = make_schedule(D_MODEL, 100, 0.5, num_steps=num_steps, cooldown_steps=cooldown)
  for step in (1, 100, 500, 800):  # before the cool-down: Eq. 3 x multiplier, unchanged
    assert float(schedule(step - 1)) == pytest.approx(0.5 * eq3(step, warmup=100), rel=1e-6)
  for step in (801, 900, 999, 1000):  # the last 200 updates: x (num_steps - step + 1) / 200
    want = 0.5 * eq3(step, warmup=100) * (num_steps - step + 1) / cooldown
    assert float(schedule(step - 1)) == pytest.approx(want, rel=1e-5)
  assert float(schedule(num_steps)) == 0.0  # past the end: nothing
  plain = make_schedule(D_MODEL, 100, 0.5, num_steps=num_steps, cooldown_steps=0)
  assert float(plain(999)) == pytest.approx(0.5 * eq3(1000, warmup=100), rel=1e-6)


def hand_adam(grads, lrs, b1=0.9, b2=0.98, eps=1e-9):
  """Adam (Kingma & Ba) with bias correction, in float64; returns the update at each step."""
  m = v = np.zeros_like(grads[0], np.float64)
  updates = []
  for t, (g, lr) in enumerate(zip(grads, lrs), start=1):
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    updates.append(-lr * (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + eps))
  return updates


def test_make_optimizer_is_adam_with_paper_settings():
  # Gradients as small as eps and a sign change make ε = 1e-9 and β2 = 0.98 both visible.
  grads = [np.array([1e-9, 0.5, -2.0]), np.array([-3e-9, 0.1, 1.0]), np.array([2e-9, -0.4, 0.3])]
  schedule = make_schedule(64, 10)
  optimizer = make_optimizer(schedule)
  params = jnp.zeros(3)
  state = optimizer.init(params)
  reference = optax.adam(schedule, b1=0.9, b2=0.98, eps=1e-9)
  reference_state = reference.init(params)
  expected = hand_adam(grads, [float(schedule(i)) for i in range(3)])
  for g, want in zip(grads, expected):
    update, state = optimizer.update(jnp.asarray(g, jnp.float32), state, params)
    reference_update, reference_state = reference.update(
        jnp.asarray(g, jnp.float32), reference_state, params
    )
    np.testing.assert_allclose(update, want, rtol=1e-4)
    np.testing.assert_array_equal(update, reference_update)
  # Sanity: the defaults of optax.adam (β2 = 0.999, ε = 1e-8) would give a different first step.
  default_update, _ = optax.adam(schedule).update(
      jnp.asarray(grads[0], jnp.float32), optax.adam(schedule).init(params), params
  )
  assert not np.allclose(default_update, expected[0], rtol=1e-4)


def test_make_optimizer_clips_when_asked():
  # Adam is invariant to a constant gradient scale, so clipping shows only when the clip factor
  # changes between steps: the first gradient (norm 50) is clipped to norm 1, the second is not.
  grads = [np.array([30.0, 40.0]), np.array([0.3, -0.4])]
  clipped = [grads[0] / 50.0, grads[1]]
  optimizer = make_optimizer(lambda count: 1.0, grad_clip_norm=1.0)
  params = jnp.zeros(2)
  state = optimizer.init(params)
  for g, want in zip(grads, hand_adam(clipped, [1.0, 1.0])):
    update, state = optimizer.update(jnp.asarray(g, jnp.float32), state, params)
    np.testing.assert_allclose(update, want, rtol=1e-5)
  unclipped = hand_adam(grads, [1.0, 1.0])[1]
  assert not np.allclose(update, unclipped, rtol=1e-2)
