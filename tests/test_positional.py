"""Sinusoidal positional encodings (§3.5) against the paper's formula and its rotation property."""

import math

import numpy as np

from transformer_jax.model.transformer import sinusoidal_positions

MAX_LEN, D_MODEL = 64, 16


def test_matches_formula_of_section_3_5():
  table = sinusoidal_positions(MAX_LEN, D_MODEL)
  assert table.shape == (MAX_LEN, D_MODEL) and table.dtype == np.float32
  # PE(pos, 2i) = sin(pos / 10000^(2i/d_model)), PE(pos, 2i+1) = cos(pos / 10000^(2i/d_model)).
  for pos in (0, 1, 7, 63):
    for i in range(D_MODEL // 2):
      angle = pos / 10000 ** (2 * i / D_MODEL)
      assert math.isclose(table[pos, 2 * i], math.sin(angle), abs_tol=1e-6)
      assert math.isclose(table[pos, 2 * i + 1], math.cos(angle), abs_tol=1e-6)
  # Position 0: sin(0) = 0 on even dimensions, cos(0) = 1 on odd ones.
  np.testing.assert_array_equal(table[0, 0::2], 0.0)
  np.testing.assert_array_equal(table[0, 1::2], 1.0)


def test_offset_is_a_linear_function_of_the_encoding():
  """§3.5: "for any fixed offset k, PE(pos+k) can be represented as a linear function of PE(pos)".

  The map is a rotation of each (sin, cos) pair by the angle k·ω_i; it depends on k only, so one
  matrix must carry every position to the position k later.
  """
  k = 5
  table = sinusoidal_positions(MAX_LEN, D_MODEL).astype(np.float64)
  rotation = np.zeros((D_MODEL, D_MODEL))
  for i in range(D_MODEL // 2):
    theta = k / 10000 ** (2 * i / D_MODEL)
    c, s = math.cos(theta), math.sin(theta)
    # sin(a + θ) = sin a cos θ + cos a sin θ;  cos(a + θ) = cos a cos θ - sin a sin θ.
    rotation[2 * i, 2 * i], rotation[2 * i, 2 * i + 1] = c, s
    rotation[2 * i + 1, 2 * i], rotation[2 * i + 1, 2 * i + 1] = -s, c
  predicted = table[:-k] @ rotation.T  # [MAX_LEN - k, d_model]
  np.testing.assert_allclose(predicted, table[k:], atol=1e-5)
