"""The paper's learning-rate schedule (§5.3, Eq. 3) and the Adam optimizer it was used with."""

from __future__ import annotations

import jax.numpy as jnp
import optax


def paper_schedule(step, d_model: int, warmup_steps: int, multiplier: float = 1.0):
  """lrate = d_model^-0.5 · min(step^-0.5, step · warmup_steps^-1.5) — §5.3, Eq. 3.

  `step` counts from 1 (the first update), as in the paper; step 0 gives 0. Linear warm-up for
  `warmup_steps`, then decay proportional to the inverse square root of the step number.
  `multiplier` scales the whole curve (1.0 is the paper).
  """
  step = jnp.asarray(step, jnp.float32)
  safe = jnp.maximum(step, 1.0)
  lr = d_model**-0.5 * jnp.minimum(safe**-0.5, safe * warmup_steps**-1.5)
  return multiplier * jnp.where(step > 0, lr, 0.0)


def cooldown_factor(step, num_steps: int, cooldown_steps: int):
  """1 until the last `cooldown_steps` updates, then linear down to 1/cooldown_steps at the last.

  Not in the paper: a linear cool-down to zero at the end of a fixed budget of steps, on top of
  Eq. 3's warm-up and decay (on Multi30k it did not beat checkpoint averaging alone;
  docs/experiments.md).
  `cooldown_steps=0` keeps Eq. 3 unchanged. `step` counts from 1.
  """
  if cooldown_steps <= 0:
    return 1.0
  step = jnp.asarray(step, jnp.float32)
  return jnp.clip((num_steps - step + 1.0) / cooldown_steps, 0.0, 1.0)


def make_schedule(
    d_model: int,
    warmup_steps: int,
    multiplier: float = 1.0,
    num_steps: int = 0,
    cooldown_steps: int = 0,
) -> optax.Schedule:
  """Eq. 3 (times `multiplier`), with an optional linear cool-down over the last steps."""

  def schedule(count):
    step = count + 1  # Optax counts updates from 0; the paper counts from 1.
    return paper_schedule(step, d_model, warmup_steps, multiplier) * cooldown_factor(
        step, num_steps, cooldown_steps
    )

  return schedule


def make_optimizer(
    schedule: optax.Schedule,
    b1: float = 0.9,
    b2: float = 0.98,
    eps: float = 1e-9,
    grad_clip_norm: float = 0.0,
) -> optax.GradientTransformation:
  """Adam with β1 = 0.9, β2 = 0.98, ε = 1e-9 (§5.3). Clipping is off (0) unless asked for."""
  adam = optax.adam(learning_rate=schedule, b1=b1, b2=b2, eps=eps)
  if grad_clip_norm > 0.0:
    return optax.chain(optax.clip_by_global_norm(grad_clip_norm), adam)
  return adam
